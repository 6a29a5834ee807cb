"""What stays the same from save to save: how chunks are cut and encoded, and the staging pool
tensors are copied into before a save writes them (``SaveSession`` walks one save)."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ckptstore.leases import DEFAULT_TTL_S
from ckptstore.pipeline import ChunkLayout, CompressionGovernor, PipelineConfig, plan_layout
from ckptstore.staging import StagedCopy, Stager, StagingPool

logger = logging.getLogger(__name__)

DEFAULT_GC_WAIT_S = 600.0


def check_background_nice(background_nice: int) -> None:
    if not 0 <= background_nice <= 19:
        raise ValueError(f"background_nice must be within [0, 19], got {background_nice}")


@dataclass
class Staged:
    """Tensors copied into a staging buffer (the copy may still run: ``copy.wait()``)."""

    buffer: torch.Tensor
    layout: ChunkLayout
    copy: StagedCopy
    pooled: bool  # the buffer goes back to the engine's pool once written


class SaveEngine:
    """The settings every save of a front-end shares, and its staging pool.

    Args:
        chunk_bytes / compression / encode_threads: how chunks are cut, encoded and how many
            are in flight (``PipelineConfig``); ``"auto"`` compression is governed chunk by
            chunk (``CompressionGovernor``).
        hedge_uploads: duplicate slow chunk puts (the store's hedging, ``Store.hedger``).
        staging_budget_bytes: host memory for staging buffers (None: one, state-sized).
        keep_last: retention after each commit (None: keep everything).
        lease_ttl_s / gc_wait_s: the save lease's ttl, and how long a save waits for a gc.
    """

    def __init__(
        self,
        *,
        chunk_bytes: int | None = None,
        compression: str | int | None = "auto",
        encode_threads: int | None = None,
        hedge_uploads: bool = False,
        staging_budget_bytes: int | None = None,
        keep_last: int | None = None,
        lease_ttl_s: float = DEFAULT_TTL_S,
        gc_wait_s: float = DEFAULT_GC_WAIT_S,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if lease_ttl_s <= 0 or gc_wait_s < 0:
            raise ValueError("lease_ttl_s must be > 0 and gc_wait_s >= 0")
        self.config = PipelineConfig.from_args(
            chunk_bytes=chunk_bytes, compression=compression, encode_threads=encode_threads
        )
        self.governor = CompressionGovernor() if self.config.codec.adaptive else None
        self.hedge_uploads = hedge_uploads
        self.pool = StagingPool(
            budget_bytes=staging_budget_bytes, pin_memory=torch.cuda.is_available()
        )
        self.stager = Stager()
        self.keep_last = keep_last
        self.lease_ttl_s = lease_ttl_s
        self.gc_wait_s = gc_wait_s

    def stage(
        self, tensors: list[torch.Tensor], *, block: bool = True, timeout_s: float | None = None
    ) -> Staged | None:
        """Copy ``tensors`` into a pooled buffer; None when none is free (``block=False``, or
        after ``timeout_s``)."""
        layout = plan_layout(tensors, self.config)
        buffer = self.pool.acquire(layout.total_bytes, block=block, timeout_s=timeout_s)
        if buffer is None:
            return None
        return Staged(buffer, layout, self.stager.copy(buffer, tensors, layout.offsets), True)

    def stage_somewhere(
        self, tensors: list[torch.Tensor], *, wait_s: float, rank: int, pooled: bool = True
    ) -> Staged:
        """Copy ``tensors`` into a pooled buffer, waiting up to ``wait_s`` for one, else into a
        buffer of their own: a buffer still held by a failed save (its error kept alive by a
        caller) must not stall this save forever. ``pooled=False`` goes there directly."""
        copied = self.stage(tensors, block=False) if pooled else None
        if pooled and copied is None:
            gc.collect()  # a failed save's staged state may be waiting in a reference cycle
            copied = self.stage(tensors, block=wait_s > 0, timeout_s=wait_s)
            if copied is None and wait_s > 0:
                logger.warning(
                    "rank %d: the previous save still holds the staging buffer after %.0fs; "
                    "staging this one in a new buffer",
                    rank,
                    wait_s,
                )
        return copied or self._stage_unpooled(tensors)

    def _stage_unpooled(self, tensors: list[torch.Tensor]) -> Staged:
        layout = plan_layout(tensors, self.config)
        buffer = torch.empty(
            max(layout.total_bytes, 1), dtype=torch.uint8, pin_memory=self.pool.pin_memory
        )
        return Staged(buffer, layout, self.stager.copy(buffer, tensors, layout.offsets), False)

    def release(self, staged: Staged) -> None:
        if staged.pooled:
            self.pool.release(staged.buffer)
