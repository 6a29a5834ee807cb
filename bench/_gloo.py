"""A gloo process group of ranks on this machine, over loopback (the bench's process ranks)."""

from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_loopback_group(rank: int, world: int, port: int, *, timeout_s: float) -> None:
    """Join the gloo group of ``world`` ranks rendezvousing on 127.0.0.1:``port``, one
    intra-op thread per rank (many ranks share few cores)."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
