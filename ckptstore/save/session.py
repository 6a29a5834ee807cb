"""One save, as every front-end walks it::

    begin      the rank's save lease, once no gc sweeps             (protocol.begin_save)
    write      a rank's chunks hashed, deduplicated, encoded, put (encode_threads at once)
    index      the rank's index built and put once; what it wrote, for the committing rank
    commit     (one rank) the lease still held -> the manifest, once (protocol.commit_step)
    release    every rank that took a lease, once the commit's outcome is known
    retain     (one rank) keep_last under a gc lease                   (protocol.retain)

The front-ends decide *when* each step runs (``Checkpointer``'s background thread; DCP's
``prepare_global_plan`` / ``write_data`` / ``finish``) and how ranks hand their
``RankWritten`` to the committing rank (gloo objects; DCP's write results). Every
``RankIndex`` and ``Manifest`` a save writes is built here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.format import (
    ChunkInfo,
    Manifest,
    ObjectRef,
    RankIndex,
    TensorEntry,
    dcp_metadata_key,
    encode_rank_index,
    object_ref,
    rank_index_key,
)
from ckptstore.leases import Lease
from ckptstore.pipeline import ChunkLayout, tensor_entries, write_chunks
from ckptstore.save.engine import SaveEngine
from ckptstore.save.protocol import begin_save, commit_step, retain
from ckptstore.store import Store
from ckptstore.tree import tensor_indexes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankWritten:
    """What one rank hands the committing rank: its index and its chunks' sizes."""

    rank: int
    index: ObjectRef
    chunk_bytes: dict[str, tuple[int, int]]  # digest -> (raw, stored)


class SaveSession:
    """One save of ``step`` (``attempt``) of ``kind`` to ``store`` (see the module docstring).

    A rank that takes no lease (DCP's ranks other than the coordinator, whose lease covers
    them) writes through a session on which ``begin`` is never called."""

    def __init__(
        self, engine: SaveEngine, store: Store, *, step: int, attempt: str, kind: str
    ) -> None:
        self.engine = engine
        self.store = store
        self.step = step
        self.attempt = attempt
        self.kind = kind
        self.lease: Lease | None = None

    def begin(self, rank: int) -> SaveSession:
        """Take the save lease: from here until ``release()`` no gc deletes a chunk, so chunks
        found stored may be referenced instead of written again."""
        engine = self.engine
        self.lease = begin_save(
            self.store,
            step=self.step,
            attempt=self.attempt,
            rank=rank,
            kind=self.kind,
            ttl_s=engine.lease_ttl_s,
            gc_wait_s=engine.gc_wait_s,
        )
        return self

    def write(
        self, buffer: torch.Tensor, layout: ChunkLayout, tensors: list[Any]
    ) -> tuple[list[TensorEntry], dict[str, ChunkInfo]]:
        """Put the chunks of ``layout`` (slices of ``buffer``, whose copy is done); the entries
        of ``tensors`` (laid out at ``layout.offsets``) and the chunks written or found."""
        engine = self.engine
        digests, chunks = write_chunks(
            self.store,
            buffer.numpy(),
            layout,
            engine.config,
            hedged=engine.hedge_uploads,
            governor=engine.governor,
        )
        return tensor_entries(tensors, layout, digests), chunks

    def put_index(
        self,
        rank: int,
        entries: list[TensorEntry],
        chunks: dict[str, ChunkInfo],
        *,
        tree: Any = None,
        items: dict[str, int] | None = None,
    ) -> RankWritten:
        """Put the rank's index: a state save's ``tree`` (numpy arrays marked in their
        entries) or a DCP save's ``items``. Fails if this session's lease lapsed."""
        if tree is not None:
            for i, was_numpy in tensor_indexes(tree).items():
                entries[i].numpy = was_numpy
        index = RankIndex(rank=rank, tensors=entries, chunks=chunks, tree=tree, items=items)
        data = encode_rank_index(index)
        key = rank_index_key(self.step, self.attempt, rank)
        self.store.put(key, data)
        if self.lease is not None:
            self.lease.check()
        sizes = {digest: (c.raw, c.stored) for digest, c in chunks.items()}
        return RankWritten(rank, object_ref(key, data), sizes)

    def commit(
        self,
        ranks: list[RankWritten],
        *,
        world_size: int,
        user: dict | None = None,
        dcp_metadata: bytes | None = None,
    ) -> Manifest:
        """Write the step's manifest over ``ranks`` (and DCP's ``dcp_metadata``, put first),
        unless the lease was lost (a gc may have swept meanwhile). A chunk written by several
        ranks counts once in the byte totals."""
        metadata_ref = None
        if dcp_metadata is not None:
            key = dcp_metadata_key(self.step, self.attempt)
            self.store.put(key, dcp_metadata)
            metadata_ref = object_ref(key, dcp_metadata)
        unique: dict[str, tuple[int, int]] = {}
        for written in ranks:
            unique.update(written.chunk_bytes)
        manifest = Manifest(
            step=self.step,
            attempt=self.attempt,
            kind=self.kind,
            world_size=world_size,
            ranks=[w.index for w in sorted(ranks, key=lambda w: w.rank)],
            dcp_metadata=metadata_ref,
            raw_bytes=sum(raw for raw, _ in unique.values()),
            stored_bytes=sum(stored for _, stored in unique.values()),
            user=user or {},
        )
        if self.lease is not None:
            self.lease.check()
        commit_step(self.store, manifest)
        logger.info(
            "committed %s step %d to %s (%d ranks, %d bytes raw, %d stored)",
            self.kind,
            self.step,
            self.store.uri,
            world_size,
            manifest.raw_bytes,
            manifest.stored_bytes,
        )
        return manifest

    def release(self) -> None:
        """Give the lease up once every put that may still land has (a manifest put abandoned
        at its deadline must not find its chunks swept)."""
        if self.lease is not None:
            self.lease.release_when_settled(0.0)
            self.lease = None

    def retain(self) -> None:
        retain(
            self.store,
            keep_last=self.engine.keep_last,
            attempt=self.attempt,
            ttl_s=self.engine.lease_ttl_s,
        )
