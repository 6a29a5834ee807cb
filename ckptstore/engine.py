"""The save engine behind ``Checkpointer`` and the DCP ``StoreWriter``: one set of stages, their
bounds and the commit protocol, in the order a save walks them::

    stage       tensors -> layout -> a pooled (pinned, with CUDA) staging buffer  (caller)
    begin       the rank's save lease, once no gc sweeps                  (commit.begin_save)
    write       chunks hashed, deduplicated, encoded, put (encode_threads at once); entries
    index       the rank's index, put once
    commit      the lease still held -> the manifest, once               (commit.commit_step)
    retain      keep_last under a gc lease                                   (commit.retain)

The front-ends decide *when* each stage runs (a background thread for ``Checkpointer``, DCP's
``prepare_global_plan`` / ``write_data`` / ``finish`` for the writer) and how ranks exchange
their index references; what each stage does is here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.commit import DEFAULT_GC_WAIT_S, begin_save, commit_step, retain
from ckptstore.format import (
    ChunkInfo,
    Manifest,
    ObjectRef,
    RankIndex,
    TensorEntry,
    encode_rank_index,
    object_ref,
    rank_index_key,
)
from ckptstore.leases import DEFAULT_TTL_S, Lease
from ckptstore.pipeline import (
    ChunkLayout,
    CompressionGovernor,
    PipelineConfig,
    plan_layout,
    tensor_entries,
    write_chunks,
)
from ckptstore.staging import StagedCopy, Stager, StagingPool
from ckptstore.store import RetryPolicy, Store


def open_store(
    uri: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
    max_concurrency: int = 16,
    thread_nice: int = 0,
) -> Store:
    """The store a front-end opens for ``uri``: every request ends within ``timeout_s``."""
    return Store(
        uri,
        storage_options=storage_options,
        retry=RetryPolicy.within(timeout_s),
        max_concurrency=max_concurrency,
        thread_nice=thread_nice,
    )


@dataclass
class Staged:
    """Tensors copied into a staging buffer (the copy may still run: ``copy.wait()``)."""

    buffer: torch.Tensor
    layout: ChunkLayout
    copy: StagedCopy
    pooled: bool  # the buffer goes back to the engine's pool once written


class SaveEngine:
    """The stages of a save and their bounds (see the module docstring).

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

    # -- stage ------------------------------------------------------------------------------

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

    def stage_unpooled(self, tensors: list[torch.Tensor]) -> Staged:
        """Copy ``tensors`` into a buffer of their own (freed with the ``Staged``)."""
        layout = plan_layout(tensors, self.config)
        buffer = torch.empty(
            max(layout.total_bytes, 1), dtype=torch.uint8, pin_memory=self.pool.pin_memory
        )
        return Staged(buffer, layout, self.stager.copy(buffer, tensors, layout.offsets), False)

    def release(self, staged: Staged) -> None:
        if staged.pooled:
            self.pool.release(staged.buffer)

    # -- begin, write, index ----------------------------------------------------------------

    def begin(self, store: Store, *, step: int, attempt: str, rank: int, kind: str) -> Lease:
        return begin_save(
            store,
            step=step,
            attempt=attempt,
            rank=rank,
            kind=kind,
            ttl_s=self.lease_ttl_s,
            gc_wait_s=self.gc_wait_s,
        )

    def write(
        self, store: Store, buffer: torch.Tensor, layout: ChunkLayout, tensors: list[Any]
    ) -> tuple[list[TensorEntry], dict[str, ChunkInfo]]:
        """Put the chunks of ``layout`` (slices of ``buffer``, whose copy is done); the entries
        of ``tensors`` (laid out at ``layout.offsets``) and the chunks written or found."""
        digests, chunks = write_chunks(
            store,
            buffer.numpy(),
            layout,
            self.config,
            hedged=self.hedge_uploads,
            governor=self.governor,
        )
        return tensor_entries(tensors, layout, digests), chunks

    def put_index(self, store: Store, *, step: int, attempt: str, index: RankIndex) -> ObjectRef:
        data = encode_rank_index(index)
        key = rank_index_key(step, attempt, index.rank)
        store.put(key, data)
        return object_ref(key, data)

    # -- commit, retain ---------------------------------------------------------------------

    def commit(self, store: Store, manifest: Manifest, lease: Lease | None) -> None:
        """Write the manifest, unless the lease was lost (a gc may have swept meanwhile)."""
        if lease is not None:
            lease.check()
        commit_step(store, manifest)

    def retain(self, store: Store, *, attempt: str) -> None:
        retain(store, keep_last=self.keep_last, attempt=attempt, ttl_s=self.lease_ttl_s)
