"""One save, as every front-end walks it: the commit protocol::

    begin      the rank's save lease, once no gc sweeps (leases.py): from here until release
               no gc deletes a chunk, so chunks found stored may be referenced, not rewritten;
               then the chunks of the rank's index in the latest committed step, read under
               the lease: the chunks this save knows are stored
    write      a rank's chunks hashed, deduplicated, encoded, put (encode_threads at once): a
               known chunk costs no request, an unknown one a single exclusive-create put
    index      the rank's index built and put once; what it wrote, for the committing rank
    commit     (one rank) the lease still held -> the manifest written once; an ambiguous
               outcome is read back
    release    every rank that took a lease, once the commit's outcome is known
    retain     (one rank) keep_last under a gc lease

A crash anywhere leaves the previous steps intact and the new one invisible or complete; a
dead rank's lease goes stale after its ttl and the next gc removes what it left.

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

from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    FormatVersionError,
    ObjectNotFoundError,
    StepExistsError,
    StorageError,
)
from ckptstore.format import (
    ChunkInfo,
    Manifest,
    ObjectRef,
    RankIndex,
    TensorEntry,
    commit_key,
    dcp_metadata_key,
    encode_manifest,
    encode_rank_index,
    object_ref,
    rank_index_key,
)
from ckptstore.leases import SAVE, Lease, wait_for_gc
from ckptstore.pipeline import ChunkLayout, tensor_entries, write_chunks
from ckptstore.retention import collect
from ckptstore.save.engine import SaveEngine
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
    them) writes through a session on which ``begin`` is never called: it knows no chunks
    (``known`` stays None) and asks the store for each chunk's size before putting it, as
    it read nothing under a lease of its own (docs/FORMAT.md, "Known chunks")."""

    def __init__(
        self, engine: SaveEngine, store: Store, *, step: int, attempt: str, kind: str
    ) -> None:
        self.engine = engine
        self.store = store
        self.step = step
        self.attempt = attempt
        self.kind = kind
        self.lease: Lease | None = None
        self.known: dict[str, ChunkInfo] | None = None
        """Chunks this save may reference without asking the store (set by ``begin``): those
        of the rank's index in the latest committed step, and those this save wrote."""

    def begin(self, rank: int) -> SaveSession:
        """Take the rank's save lease and wait while a gc sweeps: from here until
        ``release()`` no gc deletes a chunk, so chunks found stored may be referenced instead
        of written again. Then read which chunks the latest committed step's index of
        ``rank`` holds: they are stored, and stay so under the lease."""
        lease = Lease(
            self.store,
            SAVE,
            f"{self.step:020d}-{self.attempt}-{rank:05d}",
            ttl_s=self.engine.lease_ttl_s,
            info={"step": self.step, "attempt": self.attempt, "rank": rank, "save_kind": self.kind},
        ).acquire()
        try:
            wait_for_gc(
                self.store,
                timeout_s=self.engine.gc_wait_s,
                what=f"rank {rank}: save of step {self.step}",
            )
            self.known = self._chunks_of_latest_step(rank)
        except BaseException:
            lease.release()
            raise
        self.lease = lease
        return self

    def _chunks_of_latest_step(self, rank: int) -> dict[str, ChunkInfo]:
        """The chunks of ``rank``'s index in the newest committed step (read under this
        save's lease: none of them is deleted before ``release``); none if there is no such
        index or it cannot be read (then each chunk is put, and one found stored is kept)."""
        steps = list_steps(self.store)
        if not steps:
            return {}
        try:
            manifest = load_manifest(self.store, steps[-1])
            return dict(load_rank_index(self.store, manifest, rank).chunks)
        except (CheckpointNotFoundError, CheckpointCorruptError, FormatVersionError) as exc:
            logger.info(
                "rank %d: save of step %d knows no stored chunks (step %d: %s)",
                rank,
                self.step,
                steps[-1],
                exc,
            )
            return {}

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
            known=self.known,
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
        data = encode_manifest(manifest)
        if self.lease is not None:
            self.lease.check()
        self._put_manifest(manifest.step, data)
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

    def _put_manifest(self, step: int, data: bytes, *, settle_timeout_s: float = 60.0) -> None:
        """Make the step visible by writing its manifest, once.

        :class:`StepExistsError` if another writer committed the step first. When the put
        fails ambiguously (a timeout, a lost answer), the manifest is read back once every
        abandoned put has ended: ours in place means committed; absent means not committed
        (the put's error is raised); unreadable is :class:`CommitUnknownError`."""
        store, key = self.store, commit_key(step)
        try:
            # Read back only where exclusive create is not enforced: elsewhere a put that
            # returned is the commit, and a read-back could find the step already retained away.
            store.put(key, data)
            return
        except StorageError as exc:  # ObjectExistsError included: a retry may find its own put
            error = exc
        if not store.settle(settle_timeout_s):
            raise CommitUnknownError(
                f"step {step}: writing {store.url(key)} failed ({error}) and the put may "
                f"still land; run `ckptstore ls {store.uri}` to see whether it is committed"
            ) from error
        try:
            found = store.get(key)
        except ObjectNotFoundError:
            raise StorageError(f"step {step} not committed: {error}") from error
        except CheckpointError as exc:
            raise CommitUnknownError(
                f"step {step}: writing {store.url(key)} failed ({error}) and reading it back "
                f"failed ({exc}); run `ckptstore ls {store.uri}` to see whether it is committed"
            ) from error
        if found == data:
            logger.warning(
                "step %d: the commit reported an error (%s) but its manifest is in place: "
                "committed",
                step,
                error,
            )
            return
        raise StepExistsError(
            f"step {step} is already committed in {store.uri} (by another writer or an "
            "earlier run); steps are write-once"
        ) from error

    def retain(self) -> None:
        """Apply ``keep_last`` after a commit; a failure is logged (the next save retries)."""
        if self.engine.keep_last is None:
            return
        try:
            collect(
                self.store,
                keep_last=self.engine.keep_last,
                ignore_attempts={self.attempt},
                lease_ttl_s=self.engine.lease_ttl_s,
            )
        except CheckpointError as exc:
            logger.warning(
                "retention in %s failed (will retry after the next save): %s", self.store.uri, exc
            )
