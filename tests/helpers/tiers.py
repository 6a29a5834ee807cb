"""The tier tests' ranks: 4 ranks as 2 nodes, each rank's state per step, its Checkpointer with
a local tier, and saving steps on every rank (a function ``run_ranks`` spawns)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ckptstore import Checkpointer, EncodingOptions, StorageOptions, TierOptions
from ckptstore.store import Store
from tests.helpers.dist import gathered

RANKS_PER_NODE = 2


ENCODING = EncodingOptions(chunk_bytes=1 << 16, compression="zstd")
STORAGE = StorageOptions(timeout_s=20.0)


def rank_state(rank: int, step: int) -> dict:
    """``rank``'s state at ``step``: private weights, a tensor every rank shares, a frozen one."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "w": torch.randn(64, 1024, generator=g),  # 4 chunks
        "shared": torch.full((256,), float(step)),  # the same on every rank
        "frozen": torch.arange(16384, dtype=torch.float32),  # the same at every step
        "step": step,
    }


def copies_dir(local_dir: Path, rank: int) -> Path:
    """The store of ``rank``'s copies in ``local_dir`` (one job per test)."""
    (found,) = Path(local_dir).glob(f"job-*/rank-{rank:05d}")
    return found


def blank_state() -> dict:
    """A zeroed ``rank_state`` to load into."""
    return {
        "w": torch.zeros(64, 1024),
        "shared": torch.zeros(256),
        "frozen": torch.zeros(16384),
        "step": -1,
    }


# ``root / "durable"`` is durable storage, ``root / f"node{n}"`` node n's local tier.
# ``tiers``: more ``TierOptions`` fields (``peer_copies=``, ``durable_every=``, ...).
def tier_checkpointer(
    root: Path,
    rank: int,
    store: Store | None = None,
    encoding: EncodingOptions = ENCODING,
    **tiers,
) -> Checkpointer:
    node = rank // RANKS_PER_NODE
    return Checkpointer(
        root / "durable",
        tiers=TierOptions(local_dir=root / f"node{node}", node_rank=node, **tiers),
        storage=dataclasses.replace(STORAGE, store=store),
        encoding=encoding,
    )


def save_steps(rank: int, world: int, root: str, steps: list[int], kw: dict) -> None:
    """On every rank (``run_ranks``): save ``steps``. ``kw``: ``tier_checkpointer``'s keywords, and
    ``abandon`` (leave as a crash would) and ``report`` (a file for rank 0 to write the peer
    copies' figures into)."""
    abandon = kw.pop("abandon", False)
    report = kw.pop("report", None)
    ckpt = tier_checkpointer(Path(root), rank, **kw)
    copies = []
    for step in steps:
        ckpt.save(step, rank_state(rank, step)).wait()
        if ckpt.last_peer_copy is not None:
            stats = ckpt.last_peer_copy
            copies.append(
                [
                    stats.buffer_bytes,
                    stats.chunks_sent,
                    stats.chunks_already_held,
                    stats.chunks_from_node,
                    stats.rounds_in_flight,
                ]
            )
    ckpt.wait()  # drains too
    if report is not None:
        reports = gathered(copies)
        if rank == 0:
            Path(report).write_text(json.dumps(reports))
    if abandon:
        dist.barrier()
        os._exit(0)  # a crash: no close, leases left behind
    ckpt.close()


def index_doc(store_dir: Path, step: int) -> dict:
    """Rank 0's index of ``step`` in the store at ``store_dir``, as JSON."""
    manifest = json.loads((store_dir / "commits" / f"{step:020d}.json").read_text())
    return json.loads((store_dir / manifest["ranks"][0]["key"]).read_text())
