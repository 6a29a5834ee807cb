"""Peer-memory staging: every rank keeps the latest staged state of one other rank.

Rank r sends its staged buffer to its *guard*, ``(r + ranks_per_node) % world`` — by default the
same local rank one node over, so one node's failure never loses both a state and its replica —
and guards the replica of its *ward*, ``(r - ranks_per_node) % world``. A rank that lost its state
(a process restarted into a surviving group) gets it back from its guard, hash-verified, without
reading object storage. Replicas live in host memory with gloo (one extra copy of the ward's
state per rank); with NCCL the same calls would move device tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptstore.codec import hash_bytes

logger = logging.getLogger(__name__)


def guard_of(rank: int, world_size: int, ranks_per_node: int = 1) -> int:
    """The rank that keeps ``rank``'s replica."""
    if world_size < 2:
        raise ValueError("peer staging needs at least 2 ranks")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return (rank + ranks_per_node) % world_size


def ward_of(rank: int, world_size: int, ranks_per_node: int = 1) -> int:
    """The rank whose replica ``rank`` keeps."""
    guard_of(rank, world_size, ranks_per_node)
    return (rank - ranks_per_node) % world_size


@dataclass
class Replica:
    step: int
    meta: Any
    digest: str
    buffer: torch.Tensor  # uint8, exactly the staged bytes


class PeerReplicas:
    """Exchange and fetch replicas over ``group`` (every call is collective over it)."""

    def __init__(self, group: Any, *, ranks_per_node: int = 1) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.guard = guard_of(self.rank, self.world_size, ranks_per_node)
        self.ward = ward_of(self.rank, self.world_size, ranks_per_node)
        self.held: Replica | None = None
        self._spare: torch.Tensor | None = None  # receive buffer reused across steps

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def exchange(self, step: int, buffer: torch.Tensor, meta: Any) -> None:
        """Send this rank's staged ``buffer`` (and JSON-able ``meta``) to its guard and keep
        the ward's. The replica of an older step is replaced."""
        digest = hash_bytes(buffer.numpy()) if buffer.numel() else hash_bytes(b"")
        headers = self._gather(
            {"step": step, "meta": meta, "digest": digest, "nbytes": buffer.numel()}
        )
        incoming = headers[self.ward]
        n = incoming["nbytes"]
        spare = self._spare
        if spare is None or spare.numel() < n:
            spare = torch.empty(max(n, 1), dtype=torch.uint8)
        target = spare[:n]
        requests = []
        if n:
            requests.append(dist.irecv(target, src=self._global(self.ward), group=self.group))
        if buffer.numel():
            requests.append(
                dist.isend(buffer.contiguous(), dst=self._global(self.guard), group=self.group)
            )
        for request in requests:
            request.wait()
        # The previous replica's buffer becomes the next spare.
        self._spare = self.held.buffer if self.held is not None else None
        if self._spare is not None and self._spare.data_ptr() == spare.data_ptr():
            self._spare = None
        self.held = Replica(step, incoming["meta"], incoming["digest"], target)
        logger.debug(
            "rank %d: holds rank %d's replica of step %d (%d bytes)", self.rank, self.ward, step, n
        )

    def fetch(self, step: int) -> tuple[torch.Tensor, Any] | None:
        """This rank's own replica of ``step`` from its guard, verified; None if the guard
        has none, has another step, or its bytes do not hash right."""
        held = self.held
        offers = self._gather(
            {"step": held.step, "nbytes": held.buffer.numel(), "digest": held.digest}
            if held is not None
            else None
        )
        requests = []
        if held is not None and held.step == step and held.buffer.numel():
            requests.append(dist.isend(held.buffer, dst=self._global(self.ward), group=self.group))
        offer = offers[self.guard]
        received = None
        if offer is not None and offer["step"] == step:
            received = torch.empty(offer["nbytes"], dtype=torch.uint8)
            if offer["nbytes"]:
                requests.append(
                    dist.irecv(received, src=self._global(self.guard), group=self.group)
                )
        for request in requests:
            request.wait()
        metas = self._gather(held.meta if held is not None and held.step == step else None)
        if received is None:
            logger.info(
                "rank %d: guard %d holds no replica of step %d", self.rank, self.guard, step
            )
            return None
        actual = hash_bytes(received.numpy()) if received.numel() else hash_bytes(b"")
        if actual != offer["digest"]:
            logger.warning(
                "rank %d: replica of step %d from guard %d fails its xxh3 check; "
                "falling back to storage",
                self.rank,
                step,
                self.guard,
            )
            return None
        return received, metas[self.guard]


def replica_meta(tensors: list, offsets: list[int], tree: Any) -> dict:
    """What a ward needs to rebuild its tensors from the staged bytes."""
    return {
        "tree": tree,
        "tensors": [
            [str(t.dtype).removeprefix("torch."), list(t.shape), off]
            for t, off in zip(tensors, offsets)
        ],
    }


def tensors_from_replica(buffer: torch.Tensor, meta: dict) -> dict[int, torch.Tensor]:
    """Copies of the tensors in a replica (the replica buffer is reused by later exchanges)."""
    out = {}
    for i, (dtype_name, shape, offset) in enumerate(meta["tensors"]):
        dtype = getattr(torch, dtype_name)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[i] = buffer[offset : offset + n].view(dtype).view(shape).clone()
    return out
