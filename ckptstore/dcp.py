"""PyTorch Distributed Checkpoint (DCP) storage backend on top of a ckptstore store.

``StoreWriter`` / ``StoreReader`` implement DCP's ``StorageWriter`` / ``StorageReader`` so that
``torch.distributed.checkpoint.save / async_save / load`` write and read the ckptstore format:
content-addressed, verified chunks, one index per rank and a commit manifest of kind ``dcp``
that also references the pickled DCP ``Metadata``. DCP's planner does the rest (deduplication of
replicated items, resharding of DTensor / ShardedTensor state at load time).

A save goes through these calls (all ranks unless noted)::

    reset                (only when DCP is given a checkpoint_id) this save's step, or a store
                         URI that replaces the store
    prepare_global_plan  (coordinator) pick the step (this save's, else the writer's ``step``,
                         else the next free one: after the latest committed step and after
                         every step this writer planned) and a fresh attempt id; hand both
                         to every rank in SavePlan.storage_data
    stage                (dcp.async_save only, on the caller's thread) copy the state's tensors
                         into the writer's pooled staging buffer and hand DCP that copy
    write_data           pending marker -> resolve + stage the items -> chunks -> rank index;
                         each WriteResult carries (rank, tensor index) plus the index's ObjectRef
    finish               (coordinator) pickle the Metadata, write it, commit the manifest (the
                         step becomes visible), delete the ranks' pending markers, retention

Each DCP item becomes one entry of its rank's index: ``RankIndex.items`` maps the item's storage
key (``fqn`` or ``fqn@o0,o1,...`` for a shard at offset ``(o0, o1, ...)``) to its position in
``RankIndex.tensors``. Non-tensor items (``BYTE_IO``, pickled by DCP) are stored as ``uint8``
tensors of shape ``[n]`` in the same chunks. ``Metadata.storage_data`` maps each DCP
``MetadataIndex`` to the ``(rank, tensor index)`` pair that locates it.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import logging
import os
import pickle
import threading
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckptstore.engine import SaveEngine, Staged, open_store
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    StepExistsError,
    UnsupportedStateError,
)
from ckptstore.format import (
    KIND_DCP,
    Manifest,
    ObjectRef,
    RankIndex,
    check_step,
    commit_key,
    dcp_metadata_key,
    list_steps,
    load_manifest,
    load_rank_index,
    object_ref,
    read_object,
    resolve_step,
)
from ckptstore.leases import DEFAULT_TTL_S, Lease
from ckptstore.pipeline import (
    PipelineConfig,
    chunks_holding,
    parse_dtype,
    read_tensors,
)
from ckptstore.store import Store

logger = logging.getLogger(__name__)

__all__ = ["StoreWriter", "StoreReader", "load_full_state_dict", "storage_key"]

# Metadata.version as written by torch's own FileSystemWriter (the DCP layout version we mimic).
_DCP_VERSION = "1.0.0"
# How long stage() waits for the previous async save to hand the staging buffer back.
_STAGING_WAIT_S = 60.0


def storage_key(index: MetadataIndex) -> str:
    """The key of a DCP item in ``RankIndex.items``: ``fqn``, or ``fqn@o0,o1`` for a shard."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _open_store(
    uri: str | os.PathLike,
    storage_options: dict[str, Any] | None,
    max_concurrency: int,
    timeout_s: float,
) -> Store:
    return open_store(
        uri,
        storage_options=storage_options,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
    )


def _validate_uri(checkpoint_id: str | os.PathLike) -> bool:
    try:
        fsspec.core.url_to_fs(os.fspath(checkpoint_id))
    except Exception:  # noqa: BLE001 - any failure means "not ours to handle"
        return False
    return True


def _valid_checkpoint_id(checkpoint_id: Any) -> bool:
    """A step (an ``int`` or a ``str`` of digits) or a URI fsspec resolves."""
    try:
        if _checkpoint_step(checkpoint_id) is not None:
            return True
    except (TypeError, ValueError):
        return False
    return _validate_uri(checkpoint_id)


def _checkpoint_step(checkpoint_id: Any) -> int | None:
    """The step a DCP ``checkpoint_id`` names for ``StoreWriter``, or None for a store URI.

    An ``int`` or a ``str`` of ASCII digits (``"1000"``) is a step; any other ``str`` or
    ``os.PathLike`` is a store URI (name a local directory called ``1000`` as ``"./1000"`` or
    ``Path("1000")``). Anything else, or a step out of range, is a ``ValueError``."""
    if isinstance(checkpoint_id, str):
        if checkpoint_id.isascii() and checkpoint_id.isdigit():
            return check_step(int(checkpoint_id))
        return None
    if isinstance(checkpoint_id, os.PathLike):
        return None
    return check_step(checkpoint_id)  # an int (bools and negative ints are refused)


@dataclass(frozen=True)
class _SaveTarget:
    """What the coordinator decided for one save; travels in ``SavePlan.storage_data``."""

    step: int
    attempt: str


@dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data`` as it crosses from a rank to the coordinator.

    ``finish`` keeps only ``(rank, tensor)`` in the persisted Metadata; the index reference and
    byte counts are for the manifest.
    """

    step: int
    attempt: str
    rank: int
    tensor: int
    index_ref: ObjectRef
    raw_bytes: int
    stored_bytes: int


class StoreWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` that commits a ckptstore step of kind ``dcp``.

    Use as ``dcp.save(state, storage_writer=StoreWriter("s3://bucket/run"))`` (or ``async_save``).
    It is also DCP's ``AsyncStager``: ``dcp.async_save`` stages through ``stage()``, one copy into
    a staging buffer allocated once and reused (pinned, filled on a side stream, with CUDA), and
    the background save encodes from that buffer without copying again. A second ``async_save``
    waits in ``stage()`` while the previous one still holds the buffer. Keep one writer for
    every save of a run: back-to-back ``async_save`` calls need not wait for each other's
    futures, and each save can name its own step.

    The step of each save is, in this order:

    * the ``checkpoint_id`` given to ``dcp.save`` / ``dcp.async_save`` when it is an ``int`` or
      a ``str`` of digits: ``dcp.async_save(sd, storage_writer=writer, checkpoint_id=1000)``
      commits step 1000 in the writer's store (a ``checkpoint_id`` applies to that save only);
    * else the writer's ``step`` (the constructor argument; an attribute);
    * else the next free step: the latest committed step + 1, and after every step this
      writer has planned, so saves still in flight get distinct increasing steps (0 in an
      empty store). The coordinator decides, so every rank agrees.

    Any other ``checkpoint_id`` (a ``str`` that is not all digits, or an ``os.PathLike``) is a
    store URI, as for torch's own writers: it replaces the writer's store, and the step is
    chosen as if no ``checkpoint_id`` were given. A local directory named ``1000`` is therefore
    passed as ``"./1000"`` or ``Path("1000")``. Steps are write-once: saving a committed step
    fails with ``StepExistsError`` (wrapped by DCP in a ``CheckpointException``) and leaves
    the committed step untouched.

    Args:
        uri: the store (local path, ``file://``, ``memory://``, ``s3://bucket/prefix``, ...).
        step: the step of every save that names none through its ``checkpoint_id``; ``None``
            (the default) means the next free step. Saves without a ``checkpoint_id`` on a
            writer with a fixed ``step`` all target that step, so only the first can commit.
        compression / chunk_bytes / encode_threads: how chunks are cut and encoded (see
            ``PipelineConfig``); ``"auto"`` compresses while that is faster than storing the
            bytes it saves, as ``Checkpointer`` does.
        keep_last: after a commit, the coordinator keeps this many newest steps and sweeps
            unreferenced objects (``retention.collect``); ``None`` keeps everything.
        store: an already open ``Store`` (then ``uri`` only names it and ``storage_options``
            is ignored).

    After a save, ``saved_step`` holds the step written (on every rank). ``use_collectives=False``
    is refused: one manifest commits all ranks, so the ranks must coordinate. DCP plan caching
    (``DefaultSavePlanner(enable_plan_caching=True)``) is refused too: a cached plan would carry
    the previous save's step.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        compression: str | int | None = "auto",
        chunk_bytes: int | None = None,
        encode_threads: int | None = None,
        keep_last: int | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 30.0,
        store: Store | None = None,
        lease_ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        super().__init__()
        self._leases: dict[str, Lease] = {}  # coordinator: by attempt, until its commit
        if step is not None:
            check_step(step)
        self.step = step
        self.storage_options = storage_options
        self._max_concurrency = max_concurrency
        self._timeout_s = timeout_s
        self.store = store or _open_store(uri, storage_options, max_concurrency, timeout_s)
        self.engine = SaveEngine(
            chunk_bytes=chunk_bytes,
            compression=compression,
            encode_threads=encode_threads,
            hedge_uploads=not self.store.is_local,
            keep_last=keep_last,
            lease_ttl_s=lease_ttl_s,
        )
        self._staged: dict[int, _Staged] = {}  # by the staging buffer's data_ptr
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self._target: _SaveTarget | None = None
        self.saved_step: int | None = None
        # The step a save's checkpoint_id named, set by reset() and taken by the same save's
        # prepare_global_plan. DCP calls both on the thread running that save (each async_save
        # has a thread of its own), so overlapping saves cannot take each other's step.
        self._requested = threading.local()
        # Per store URI, the highest step this writer planned (coordinator): a step=None save
        # goes after it even while the save that planned it has not committed yet.
        self._planned: dict[str, int] = {}
        self._plan_lock = threading.Lock()

    # -- AsyncStager (dcp.async_save) --------------------------------------------------------

    _synchronize_after_execute = False  # stage() returns a finished (or device-fenced) copy

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict over a copy of its tensors in the writer's staging buffer.

        Plain tensors and DTensors (their local shards) are copied; other values are kept as
        they are, as DCP's own stager does. A state holding other tensor subclasses
        (ShardedTensor) is staged by DCP's ``DefaultStager`` instead."""
        leaves: list[torch.Tensor] = []
        if not _collect_tensors(state_dict, leaves):
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                return stager.stage(state_dict)
            finally:
                stager.close()
        copied = self.engine.stage(leaves, block=False)
        if copied is None:
            gc.collect()  # a failed save's staged state may be waiting in a reference cycle
            copied = self.engine.stage(leaves, timeout_s=_STAGING_WAIT_S)
        if copied is None:
            logger.warning(
                "rank %d: the previous async save still holds the staging buffer after %.0fs; "
                "staging this one in a new buffer",
                self.rank,
                _STAGING_WAIT_S,
            )
            copied = self.engine.stage_unpooled(leaves)
        staged = _Staged(copied, self.engine, self._staged)
        self._staged[copied.buffer.data_ptr()] = staged
        out = _StagedState(_replace_tensors(state_dict, iter(copied.copy.views)))
        # write_data hands the buffer back once it is written; a save that fails before, or a
        # rank left with nothing to write, hands it back when DCP lets go of the staged state.
        weakref.finalize(out, staged.release)
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage()`` returns once the copy is done or fenced."""

    def close(self) -> None:
        """Nothing to release: the staging buffer goes with the writer."""

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: int | str | os.PathLike | None = None) -> None:
        """Start a new save. DCP calls this only when given a ``checkpoint_id``: an ``int`` or a
        ``str`` of digits is this save's step (same store); another ``str`` or an
        ``os.PathLike`` is a store URI that replaces the current store."""
        try:
            step = None if checkpoint_id is None else _checkpoint_step(checkpoint_id)
        except ValueError as exc:
            raise ValueError(
                f"StoreWriter: checkpoint_id {checkpoint_id!r} is neither a step (an int or a "
                f"string of digits) nor a store URI: {exc}"
            ) from None
        if (
            step is None
            and checkpoint_id is not None
            and os.fspath(checkpoint_id) != self.store.uri
        ):
            self.store = _open_store(
                checkpoint_id, self.storage_options, self._max_concurrency, self._timeout_s
            )
        self._requested.step = step
        self._requested.store = self.store
        self._requested.fresh = True
        self.save_id = uuid.uuid4().hex
        self._target = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: int | str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is a step (an ``int`` or a ``str`` of digits) or a URI
        fsspec can resolve to a filesystem."""
        return _valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        """The store's URI (DCP logs it); the step of the last save is ``saved_step``."""
        return self.store.uri

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._save_store().uri, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "ckptstore.dcp.StoreWriter needs use_collectives=True: one manifest commits "
                "every rank's data"
            )
        self.is_coordinator = is_coordinator
        if not getattr(self._requested, "fresh", False):
            # No reset() for this save: a step named by an earlier save on this thread that
            # failed before planning must not carry over.
            self._requested.step = None
            self._requested.store = None
        self._requested.fresh = False
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # This save's checkpoint_id step (taken, so a later save that names none on this
        # thread does not inherit it), else the writer's fixed step, else the next free one.
        step = getattr(self._requested, "step", None)
        self._requested.step = None
        if step is None:
            step = self.step
        uri = self._save_store().uri
        with self._plan_lock:
            if step is None:
                steps = list_steps(self._save_store())
                step = max(steps[-1] + 1 if steps else 0, self._planned.get(uri, -1) + 1)
            elif self._save_store().exists(commit_key(step)):
                raise StepExistsError(
                    f"step {step} is already committed in {uri}; steps are write-once"
                )
            self._planned[uri] = max(step, self._planned.get(uri, -1))
        target = _SaveTarget(step=step, attempt=uuid.uuid4().hex)
        self._target = target
        self._begin_lease(target)
        logger.debug(
            "rank %d: DCP save to %s as step %d, attempt %s",
            self.rank,
            self._save_store().uri,
            step,
            target.attempt,
        )
        return [dataclasses.replace(p, storage_data=target) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target = plan.storage_data
        if not isinstance(target, _SaveTarget):
            raise RuntimeError(
                "SavePlan.storage_data was not set by StoreWriter.prepare_global_plan "
                f"(got {type(target).__name__}); was the plan cached from another writer?"
            )
        if self._save_store().exists(commit_key(target.step)):
            self._release_lease(target.attempt)  # on the coordinator: it will not commit
            raise StepExistsError(
                f"rank {self.rank}: step {target.step} is already committed in {self._save_store().uri} "
                "(another writer, or another save naming the same step, committed it "
                "meanwhile; or DCP plan caching reused an old "
                "plan: enable_plan_caching is not supported by StoreWriter)"
            )
        self._target = target
        results = self._write(plan.items, planner, target) if plan.items else []
        self.saved_step = target.step
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._save_store()
        storage_data: dict[MetadataIndex, tuple[int, int]] = {}
        refs: dict[int, _Written] = {}
        for rank_results in results:
            for wr in rank_results:
                loc = wr.storage_data
                assert isinstance(loc, _Written), f"unexpected storage_data {loc!r}"
                storage_data[wr.index] = (loc.rank, loc.tensor)
                refs.setdefault(loc.rank, loc)
        # The results say which save they belong to, so a writer shared by overlapping
        # async saves still commits each one under its own step.
        targets = {_SaveTarget(w.step, w.attempt) for w in refs.values()}
        assert len(targets) <= 1, f"ranks wrote different saves: {targets}"
        target = targets.pop() if targets else self._target
        assert target is not None, "finish() before prepare_global_plan()"
        try:
            metadata.version = _DCP_VERSION
            metadata.storage_data = storage_data
            metadata.storage_meta = StorageMeta(checkpoint_id=store.uri, save_id=target.attempt)
            blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
            meta_key = dcp_metadata_key(target.step, target.attempt)
            store.put(meta_key, blob)
            manifest = Manifest(
                step=target.step,
                attempt=target.attempt,
                kind=KIND_DCP,
                world_size=len(results),
                ranks=[refs[r].index_ref for r in sorted(refs)],
                dcp_metadata=object_ref(meta_key, blob),
                raw_bytes=sum(w.raw_bytes for w in refs.values()),
                stored_bytes=sum(w.stored_bytes for w in refs.values()),
            )
            self.engine.commit(store, manifest, self._leases.get(target.attempt))
        finally:
            self._release_lease(target.attempt)
        logger.info(
            "rank %d: committed DCP step %d to %s (%d ranks, %d bytes raw, %d stored)",
            self.rank,
            target.step,
            store.uri,
            len(results),
            manifest.raw_bytes,
            manifest.stored_bytes,
        )
        self.saved_step = target.step
        self.engine.retain(store, attempt=target.attempt)

    def _save_store(self) -> Store:
        """The store of the save running on this thread: the one its ``reset()`` named, so an
        overlapping save that switches stores cannot redirect this one; else ``self.store``."""
        return getattr(self._requested, "store", None) or self.store

    # -- the save lease (coordinator) --------------------------------------------------------

    def _begin_lease(self, target: _SaveTarget) -> None:
        """Take the save's lease before any rank looks for stored chunks (prepare_global_plan
        runs before DCP hands the ranks their plans); it covers every rank until the commit.
        A save that fails on another rank never reaches ``finish``: its lease is held until
        this process ends, which delays sweeps but never endangers a step."""
        self._leases[target.attempt] = self.engine.begin(
            self._save_store(),
            step=target.step,
            attempt=target.attempt,
            rank=self.rank,
            kind=KIND_DCP,
        )

    def _release_lease(self, attempt: str) -> None:
        lease = self._leases.pop(attempt, None)
        if lease is not None:
            lease.release_when_settled(0.0)  # a late manifest put must not find its chunks gone

    # -- internals --------------------------------------------------------------------------

    def _write(
        self, items: list[WriteItem], planner: SavePlanner, target: _SaveTarget
    ) -> list[WriteResult]:
        store, rank = self._save_store(), self.rank
        try:
            tensors = [_resolve(item, planner) for item in items]
            staged = self._take_staged(tensors)
            entries, chunks = (
                self._write_staged(staged, tensors)
                if staged is not None
                else self._write_copied(tensors)
            )
            index = RankIndex(
                rank=rank,
                tensors=entries,
                chunks=chunks,
                items={storage_key(item.index): i for i, item in enumerate(items)},
            )
            ref = self.engine.put_index(
                store, step=target.step, attempt=target.attempt, index=index
            )
        except BaseException:
            self._release_lease(target.attempt)  # on the coordinator: it will not commit
            raise
        raw = sum(c.raw for c in chunks.values())
        stored = sum(c.stored for c in chunks.values())
        logger.debug(
            "rank %d: wrote %d DCP items of step %d (%d chunks)",
            rank,
            len(items),
            target.step,
            len(chunks),
        )
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=t.numel() * t.element_size(),
                storage_data=_Written(target.step, target.attempt, rank, i, ref, raw, stored),
            )
            for i, (item, t) in enumerate(zip(items, tensors))
        ]

    def _write_copied(self, tensors: list[torch.Tensor], *, pooled: bool = True):
        """Copy ``tensors`` into a staging buffer (the pool's, if ``pooled`` and one is free)
        and write its chunks; (entries, chunks)."""
        engine = self.engine
        copied = engine.stage(tensors, block=False) if pooled else None
        if pooled and copied is None:
            gc.collect()  # a failed async save's staged state may hold the buffer in a cycle
            copied = engine.stage(tensors, block=False)
        if copied is None:
            # The pool saves allocations; with its buffer still held (a caller keeping a failed
            # async save's error alive) waiting could be forever: use a buffer of this save's.
            copied = engine.stage_unpooled(tensors)
        try:
            copied.copy.wait()
            return engine.write(self._save_store(), copied.buffer, copied.layout, tensors)
        finally:
            engine.release(copied)

    def _take_staged(self, tensors: list[torch.Tensor]) -> _Staged | None:
        """The staging of ``stage()`` these tensors live in, if any (it is this save's)."""
        for t in tensors:
            if t.numel():
                found = self._staged.pop(t.untyped_storage().data_ptr(), None)
                if found is not None:
                    return found
        return None

    def _write_staged(self, staged: _Staged, tensors: list[torch.Tensor]):
        """Write the chunks of ``staged`` that hold ``tensors`` (and any tensor not in it,
        such as DCP's pickled values, through a buffer of its own); (entries, chunks)."""
        copied = staged.copied
        base, size = copied.buffer.data_ptr(), copied.buffer.numel()
        inside, outside = [], []
        for i, t in enumerate(tensors):
            n = t.numel() * t.element_size()
            offset = t.data_ptr() - base
            in_buffer = (
                n > 0
                and t.is_contiguous()
                and 0 <= offset
                and offset + n <= size
                and t.untyped_storage().data_ptr() == copied.buffer.untyped_storage().data_ptr()
            )
            (inside if in_buffer else outside).append((i, offset))
        mine = [tensors[i] for i, _ in inside]
        try:
            copied.copy.wait()
            layout = chunks_holding(
                copied.layout,
                [(offset, t.numel() * t.element_size()) for (_, offset), t in zip(inside, mine)],
            )
            found, chunks = self.engine.write(self._save_store(), copied.buffer, layout, mine)
        finally:
            staged.release()
        entries: list = [None] * len(tensors)
        for (i, _), entry in zip(inside, found):
            entries[i] = entry
        if outside:
            rest = [tensors[i] for i, _ in outside]
            rest_entries, rest_chunks = self._write_copied(rest, pooled=False)
            for (i, _), entry in zip(outside, rest_entries):
                entries[i] = entry
            chunks = {**chunks, **rest_chunks}
        return entries, chunks


class _Staged:
    """What ``StoreWriter.stage()`` copied, until its save has written it."""

    def __init__(self, copied: Staged, engine: SaveEngine, registry: dict[int, _Staged]) -> None:
        self.copied = copied
        self._engine = engine
        self._registry = registry
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        """Hand the buffer back (once; later calls do nothing)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        key = self.copied.buffer.data_ptr()
        if self._registry.get(key) is self:
            del self._registry[key]
        self._engine.release(self.copied)


class _StagedState(dict):
    """The state dict ``stage()`` returns (a dict that can be weakly referenced)."""


def _collect_tensors(obj: Any, out: list[torch.Tensor]) -> bool:
    """Append the tensors (local shards of DTensors) of a state dict to ``out``, in a fixed
    order; False if it holds a tensor subclass ``stage()`` cannot rebuild."""
    if isinstance(obj, dict):
        return all(_collect_tensors(v, out) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_collect_tensors(v, out) for v in obj)
    if isinstance(obj, DTensor):
        out.append(obj.to_local().detach())
        return True
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return False
        out.append(obj.detach())
    return True


def _replace_tensors(obj: Any, views) -> Any:
    """``obj`` with its tensors replaced, in ``_collect_tensors`` order, by ``views``."""
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_tensors(v, views) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replace_tensors(v, views) for v in obj)
    if isinstance(obj, DTensor):
        # Not DTensor.from_local: it would move the local copy back to the mesh's device.
        return DTensor(next(views), obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        return next(views)
    return obj


def _resolve(item: WriteItem, planner: SavePlanner) -> torch.Tensor:
    """The bytes DCP wants written for ``item``, as a tensor (uint8 ``[n]`` for BYTE_IO)."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if isinstance(data, io.BytesIO):
            raw = data.getvalue()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            raise UnsupportedStateError(
                f"DCP item {item.index.fqn!r}: BYTE_IO data is {type(data).__name__}, "
                "expected io.BytesIO"
            )
        if not raw:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if not isinstance(data, torch.Tensor):
        raise UnsupportedStateError(
            f"DCP item {item.index.fqn!r}: expected a tensor, got {type(data).__name__}"
        )
    return data.detach()


class StoreReader(StorageReader):
    """DCP ``StorageReader`` for steps committed by :class:`StoreWriter`.

    Use as ``dcp.load(state, storage_reader=StoreReader("s3://bucket/run", step=7))``. Every
    chunk is hash-verified before its bytes reach a tensor; DCP's planner reshards (a step saved
    by N ranks loads into M ranks, or into one process with ``no_dist=True``).

    Args:
        uri: the store. A ``checkpoint_id`` passed to ``dcp.load`` is a store URI too.
        step: the step to load, or ``"latest"``. The step is resolved once per load (at the
            first ``read_metadata``); if ranks resolve different steps (one was committed while
            they started) the load fails clearly: pass an explicit step to avoid that.
        read_concurrency: chunks fetched and decoded at once.
        read_batch_bytes: stored items are read in batches of about this many bytes, which
            bounds the temporary memory of a load.
        store: an already open ``Store``.

    Steps saved by ``ckptstore.Checkpointer`` (kind ``state``) are refused with
    ``UnsupportedStateError``: load them with ``Checkpointer.load``.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        step: int | str = "latest",
        storage_options: dict[str, Any] | None = None,
        read_concurrency: int = 8,
        read_batch_bytes: int = 1 << 30,
        max_concurrency: int = 16,
        timeout_s: float = 30.0,
        store: Store | None = None,
    ) -> None:
        super().__init__()
        if read_batch_bytes < 1:
            raise ValueError(f"read_batch_bytes must be >= 1, got {read_batch_bytes}")
        if isinstance(step, str):
            if step != "latest" and not step.isdigit():
                raise ValueError(f"step must be an integer or 'latest', got {step!r}")
        else:
            check_step(step)
        self.step = step
        self.storage_options = storage_options
        self._max_concurrency = max_concurrency
        self._timeout_s = timeout_s
        self.store = store or _open_store(uri, storage_options, max_concurrency, timeout_s)
        self.config = PipelineConfig(read_concurrency=read_concurrency)
        self.read_batch_bytes = read_batch_bytes
        self.rank = 0
        self.load_id = uuid.uuid4().hex
        self.manifest: Manifest | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._indexes: dict[int, RankIndex] = {}

    # -- StorageReader ----------------------------------------------------------------------

    def reset(self, checkpoint_id: int | str | os.PathLike | None = None) -> None:
        """Start a new load. A ``checkpoint_id`` that is an ``int`` or a ``str`` of digits is the
        step to load (same store); any other is a store URI that replaces the current one."""
        step = None if checkpoint_id is None else _checkpoint_step(checkpoint_id)
        if step is not None:
            self.step = step
        elif checkpoint_id is not None and os.fspath(checkpoint_id) != self.store.uri:
            self.store = _open_store(
                checkpoint_id, self.storage_options, self._max_concurrency, self._timeout_s
            )
        self.load_id = uuid.uuid4().hex
        self.manifest = None
        self.storage_data = {}
        self._indexes = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: int | str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is a step or a URI fsspec can resolve to a filesystem."""
        return _valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return self.store.uri

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if "rank" in kwargs:
            # DCP's fallback to rank-local metadata after the global read failed: there is none.
            raise CheckpointError(f"{self.store.uri} has no rank-local DCP metadata")
        self.manifest = None  # each load resolves "latest" afresh
        self._indexes = {}
        manifest = self._load_manifest()
        assert manifest.dcp_metadata is not None
        blob = read_object(self.store, manifest.dcp_metadata, "DCP metadata")
        try:
            metadata = pickle.loads(blob)
        except Exception as exc:
            raise CheckpointCorruptError(
                f"DCP metadata {self.store.url(manifest.dcp_metadata.key)} does not unpickle: {exc}"
            ) from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(
                f"DCP metadata of step {manifest.step}: found {type(metadata).__name__}"
            )
        meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self.store.uri, save_id=meta.save_id, load_id=self.load_id
        )
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointCorruptError(
                f"DCP metadata in {self.store.uri} has no storage_data (not written by StoreWriter)"
            )
        self.storage_data = metadata.storage_data
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        manifest = self._load_manifest()
        chosen = (manifest.step, manifest.attempt)
        return [dataclasses.replace(p, storage_data=chosen) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self._load_manifest()
        if plan.storage_data is not None and tuple(plan.storage_data) != (
            manifest.step,
            manifest.attempt,
        ):
            raise CheckpointError(
                f"rank {self.rank} resolved step {manifest.step} of {self.store.uri} but the "
                f"coordinator resolved step {plan.storage_data[0]} (a step was committed during "
                "the load); pass StoreReader(step=N) explicitly"
            )
        batch: list[ReadItem] = []
        batch_bytes = 0
        seen: set[tuple[int, int]] = set()
        for item in plan.items:
            loc = self._locate(item.storage_index)
            if loc not in seen:
                nbytes = self._index(loc[0]).tensors[loc[1]].nbytes
                if batch and batch_bytes + nbytes > self.read_batch_bytes:
                    self._read_batch(batch, planner)
                    batch, batch_bytes, seen = [], 0, set()
                seen.add(loc)
                batch_bytes += nbytes
            batch.append(item)
        if batch:
            self._read_batch(batch, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # -- internals --------------------------------------------------------------------------

    def _load_manifest(self) -> Manifest:
        if self.manifest is not None:
            return self.manifest
        step = resolve_step(self.store, self.step)
        manifest = load_manifest(self.store, step)
        if manifest.kind != KIND_DCP or manifest.dcp_metadata is None:
            raise UnsupportedStateError(
                f"step {step} in {self.store.uri} was saved by ckptstore.Checkpointer "
                f"(kind {manifest.kind!r}), not through DCP; load it with Checkpointer.load"
            )
        self.manifest = manifest
        logger.debug("rank %d: DCP load of step %d from %s", self.rank, step, self.store.uri)
        return manifest

    def _index(self, rank: int) -> RankIndex:
        index = self._indexes.get(rank)
        if index is None:
            index = load_rank_index(self.store, self._load_manifest(), rank)
            self._indexes[rank] = index
        return index

    def _locate(self, storage_index: MetadataIndex) -> tuple[int, int]:
        try:
            rank, tensor = self.storage_data[storage_index]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"DCP item {storage_key(storage_index)!r} has no location in the metadata of "
                f"{self.store.uri}"
            ) from exc
        index = self._index(rank)
        key = storage_key(storage_index)
        if index.items is None or index.items.get(key) != tensor or tensor >= len(index.tensors):
            raise CheckpointCorruptError(
                f"DCP item {key!r}: the index of rank {rank} does not hold it at {tensor}"
            )
        return rank, tensor

    def _read_batch(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Read the stored items ``items`` need (each chunk once) and hand them to DCP."""
        locs = [self._locate(item.storage_index) for item in items]
        uses = Counter(locs)
        slots: dict[tuple[int, int], int] = {}
        merged = RankIndex(rank=-1, tensors=[], chunks={})
        for loc in uses:
            index = self._index(loc[0])
            entry = index.tensors[loc[1]]
            slots[loc] = len(merged.tensors)
            merged.tensors.append(entry)
            for seg in entry.segments:
                if seg.chunk in index.chunks:
                    merged.chunks.setdefault(seg.chunk, index.chunks[seg.chunk])
        # A stored tensor read whole, once, into a destination of its dtype and shape is
        # decoded straight into it; every other one goes through a temporary and is narrowed.
        wanted: dict[int, torch.Tensor | None] = {slot: None for slot in slots.values()}
        dests: dict[int, torch.Tensor] = {}
        for pos, item in enumerate(items):
            if item.type == LoadItemType.BYTE_IO:
                continue
            dest = planner.resolve_tensor(item).detach()
            dests[pos] = dest
            entry = merged.tensors[slots[locs[pos]]]
            if (
                uses[locs[pos]] == 1
                and not any(item.storage_offsets)
                and list(item.lengths) == entry.shape
                and list(dest.shape) == entry.shape
                and dest.dtype == parse_dtype(entry.dtype)
            ):
                wanted[slots[locs[pos]]] = dest
        loaded = read_tensors(self.store, merged, wanted, self.config)
        for pos, item in enumerate(items):
            slot = slots[locs[pos]]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(loaded[slot].numpy().tobytes()))
                continue
            dest = dests[pos]
            if wanted[slot] is not dest:
                source = narrow_tensor_by_index(loaded[slot], item.storage_offsets, item.lengths)
                if dest.size() != source.size():
                    raise UnsupportedStateError(
                        f"DCP item {storage_key(item.storage_index)!r}: destination shape "
                        f"{tuple(dest.size())} does not match the stored {tuple(source.size())}"
                    )
                dest.copy_(source)
            planner.commit_tensor(item, dest)


def load_full_state_dict(store: Store, step: int) -> dict[str, Any]:
    """The whole state of DCP step ``step`` as a nested dict of full tensors and objects.

    Runs in this process alone (no process group needed): sharded tensors are assembled from
    every rank's pieces, like torch's ``dcp_to_torch_save``.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = StoreReader(store.uri, step=check_step(step), store=store)
    reader.read_metadata()  # raises missing / wrong-kind / corrupt metadata errors unwrapped
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
        if len(errors) == 1 and isinstance(errors[0], CheckpointError):
            raise errors[0] from None
        raise
    return state
