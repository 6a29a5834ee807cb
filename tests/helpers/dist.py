"""Run a test body on several ranks of a real gloo process group (spawned processes, loopback)."""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, world: int, port: int, args: tuple) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without interpreter finalization. A gloo worker thread may still
    # be dropping a finished collective whose tensors need the GIL; once finalization has begun,
    # CPython ends such a thread with pthread_exit, and the unwind through torch's C++ frames
    # calls std::terminate (SIGABRT after the test passed; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks of one gloo group; fails the test if any
    rank fails or they have not all finished within ``timeout_s``."""
    ctx = mp.spawn(_rank_main, args=(fn, world, free_port(), args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world}-rank test did not finish within {timeout_s:.0f}s")


def gathered(value):
    """Every rank's ``value``, in rank order (a collective: every rank of the group calls it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
