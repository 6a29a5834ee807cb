"""The high-level API for training loops: ``Checkpointer(uri).save(step, state)``.

One save goes through these stages; only the first runs on the caller's thread::

    stage    flatten the state, lay tensors out, copy them into a pooled host buffer
    ---- save() returns here; the rest runs on the checkpointer's background thread ----
    encode   hash each chunk, skip it if stored, byte-group + zstd it   (encode_threads)
    put      write-once upload of new chunks, then the rank's index     (store concurrency)
    commit   ranks exchange index refs; rank 0 writes the manifest last, then applies retention

Errors of the background stages are raised by ``handle.wait()``, ``wait()`` and the next
``save()``. With ``torch.distributed`` initialised, every rank calls ``save`` with the same step;
each writes its own chunks and index and rank 0 commits once all have succeeded.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptstore.errors import (
    CheckpointError,
    ObjectExistsError,
    StepExistsError,
    UnsupportedStateError,
)
from ckptstore.format import (
    KIND_STATE,
    Manifest,
    RankIndex,
    check_step,
    commit_key,
    encode_manifest,
    encode_rank_index,
    list_steps,
    load_manifest,
    load_rank_index,
    object_ref,
    pending_key,
    rank_index_key,
    resolve_step,
)
from ckptstore.hedge import Hedger
from ckptstore.peer import PeerReplicas, replica_meta, tensors_from_replica
from ckptstore.pipeline import (
    CompressionGovernor,
    PipelineConfig,
    parse_dtype,
    plan_layout,
    read_tensors,
    tensor_entries,
    write_chunks,
)
from ckptstore.retention import collect
from ckptstore.staging import Stager, StagingPool
from ckptstore.state import finish_load, flatten, plan_load, tensor_indexes
from ckptstore.store import RetryPolicy, Store, niced, set_thread_nice

logger = logging.getLogger(__name__)


class SaveHandle:
    """A save in progress. ``wait()`` blocks until it is committed and re-raises its error."""

    def __init__(self, step: int, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._future: Future[None] = Future()
        if skipped:
            self._future.set_result(None)

    def wait(self, timeout_s: float | None = None) -> None:
        self._future.result(timeout=timeout_s)

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "pending")
        return f"SaveHandle(step={self.step}, {state})"


@dataclass
class _Job:
    step: int
    attempt: str
    tree: Any
    tensors: list[torch.Tensor]
    layout: Any
    staged: Any
    user: dict
    handle: SaveHandle


class _Group:
    """Coordination of ranks on a dedicated gloo group, so the background thread's
    collectives never interleave with the training loop's."""

    def __init__(self, process_group: Any, timeout_s: float) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.group = None
        if self.active and self.world_size > 1:
            from datetime import timedelta

            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            self.group = dist.new_group(
                ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s)
            )
        self.active = self.group is not None

    def broadcast(self, value: Any) -> Any:
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        if not self.active:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out


class Checkpointer:
    """Asynchronous, verified, deduplicated checkpoints of a training state in ``uri``.

    Args:
        uri: where the checkpoints live: a path, ``file://``, ``memory://``, ``s3://b/prefix``.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        keep_last: after each commit keep only the newest this many steps (None: keep all).
        compression: ``"auto"`` (byte-grouping + zstd for as long as compressing a chunk is
            faster than uploading what it saves), ``"zstd"`` (always), ``"zstd:N"``, ``"none"``.
        chunk_bytes: large tensors are cut into chunks of this size (default 32 MiB); small
            ones are packed.
        staging_budget_bytes: host memory for staged copies (None: one buffer, state-sized).
        when_busy: a save requested while the previous one still holds the staging memory
            ``"wait"``s for it, or is ``"skip"``ped with a warning.
        encode_threads: chunks hashed/encoded/uploaded at once (default: cores, at least 4).
        max_concurrency: storage requests in flight at once.
        timeout_s: deadline of one storage request (large transfers get more).
        hedge_uploads: duplicate slow chunk uploads (default: on for remote stores).
        staging: ``"host"`` (staged copies in this process's memory), or ``"peer"``: each rank
            also sends its staged state to a guard rank one node over, which keeps the latest
            replica; ``load`` takes a rank's state from its guard when the guard holds the step
            asked for (verified), else from storage. Needs ``torch.distributed``.
        ranks_per_node: for ``staging="peer"``: the guard of rank r is r + ranks_per_node
            (default: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1).
        process_group: the ranks that save together (default: the whole world, if any).
        store: use this :class:`Store` instead of opening ``uri`` (e.g. with fault injection).
        background_nice: added to the nice value of the threads that encode and upload (and of
            the store's threads, when the checkpointer opens the store), so that where the
            training loop's own threads need the cores they get them first and saves take
            longer (Linux; 0, the default, leaves priorities alone).
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        compression: str | int | None = "auto",
        chunk_bytes: int | None = None,
        staging_budget_bytes: int | None = None,
        when_busy: str = "wait",
        encode_threads: int | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 60.0,
        hedge_uploads: bool | None = None,
        staging: str = "host",
        ranks_per_node: int | None = None,
        process_group: Any = None,
        store: Store | None = None,
        background_nice: int = 0,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        if staging not in ("host", "peer"):
            raise ValueError(f"staging must be 'host' or 'peer', got {staging!r}")
        if not 0 <= background_nice <= 19:
            raise ValueError(f"background_nice must be within [0, 19], got {background_nice}")
        self.store = store or Store(
            uri,
            storage_options=storage_options,
            retry=RetryPolicy(timeout_s=timeout_s),
            max_concurrency=max_concurrency,
            thread_nice=background_nice,
        )
        self._save_thread_nice = niced(background_nice)
        self.keep_last = keep_last
        self.when_busy = when_busy
        if hedge_uploads is None:
            hedge_uploads = not self.store.is_local  # a duplicate local write rarely helps
        self.hedger = Hedger() if hedge_uploads else None
        self.config = PipelineConfig.from_args(
            chunk_bytes=chunk_bytes,
            compression=compression,
            encode_threads=encode_threads,
        )
        self.governor = CompressionGovernor() if self.config.codec.adaptive else None
        self.pool = StagingPool(
            budget_bytes=staging_budget_bytes, pin_memory=torch.cuda.is_available()
        )
        self._stager = Stager()
        self._group = _Group(process_group, timeout_s=max(timeout_s * 10, 600.0))
        self.rank = self._group.rank
        if self._group.active and when_busy == "skip":
            raise ValueError(
                "when_busy='skip' is single-process only: ranks could disagree "
                "on which saves to skip"
            )
        self._peers = None
        if staging == "peer":
            if not self._group.active:
                raise ValueError("staging='peer' needs torch.distributed with 2 or more ranks")
            if ranks_per_node is None:
                ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if ranks_per_node >= self._group.world_size:
                ranks_per_node = 1  # one node: the next rank guards
            self._peers = PeerReplicas(self._group.group, ranks_per_node=ranks_per_node)
        self.last_load_source: str | None = None
        self._session = self._group.broadcast(uuid.uuid4().hex[:12])
        self._saves = 0
        self.skipped_saves = 0
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self._last: SaveHandle | None = None
        self._worker = threading.Thread(target=self._run, name="ckptstore-save", daemon=True)
        self._worker.start()
        self._closed = False
        # A script that ends right after save() must not lose that save.
        atexit.register(self._close_at_exit)

    # -- public API ---------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: dict | None = None) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        self._raise_background_error()
        check_step(step)
        t0 = time.perf_counter()
        tree, tensors = flatten(state)
        user = json.loads(json.dumps(metadata or {}))
        layout = plan_layout(tensors, self.config)
        buffer = self.pool.acquire(layout.total_bytes, block=self.when_busy == "wait")
        self._saves += 1
        if buffer is None:
            self.skipped_saves += 1
            logger.warning(
                "rank %d: skipping save of step %d: the previous save is still persisting",
                self.rank,
                step,
            )
            return SaveHandle(step, skipped=True)
        staged = self._stager.copy(buffer, tensors, layout.offsets)
        handle = SaveHandle(step)
        attempt = f"{self._session}-{self._saves:06d}"
        meta = [_TensorMeta(t.dtype, t.shape, t.numel() * t.element_size()) for t in tensors]
        self._jobs.put(_Job(step, attempt, tree, meta, layout, staged, user, handle))
        self._last = handle
        logger.debug("rank %d: step %d staged in %.3fs", self.rank, step, time.perf_counter() - t0)
        return handle

    def wait(self) -> None:
        """Block until every save so far is committed; raise the first background error."""
        if self._last is not None:
            self._last._future.exception()  # blocks until the last save is done
        self._raise_background_error()

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list_steps(self.store)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, state: Any, step: int | str = "latest") -> int:
        """Load ``step`` into ``state`` in place (tensors copied into, stateful objects
        given ``load_state_dict``); returns the step loaded."""
        chosen: Any = None
        if self.rank == 0:
            try:
                chosen = resolve_step(self.store, step)
            except CheckpointError as exc:
                chosen = exc
        chosen = self._group.broadcast(chosen)
        if isinstance(chosen, BaseException):
            raise chosen
        manifest = load_manifest(self.store, chosen)
        if manifest.kind != KIND_STATE:
            raise UnsupportedStateError(
                f"step {chosen} in {self.store.uri} was saved through DCP; load it with "
                "torch.distributed.checkpoint.load(..., storage_reader=ckptstore.dcp.StoreReader(...))"
            )
        if manifest.world_size != self._group.world_size:
            raise UnsupportedStateError(
                f"step {chosen} was saved by {manifest.world_size} rank(s), loading with "
                f"{self._group.world_size}: resharding is done through ckptstore.dcp"
            )
        if self._peers is not None:
            replica = self._peers.fetch(chosen)
            if replica is not None:
                buffer, meta = replica
                tensors = tensors_from_replica(buffer, meta)
                loader = plan_load(
                    state, meta["tree"], lambda i: (tensors[i].dtype, list(tensors[i].shape))
                )
                kinds = tensor_indexes(meta["tree"])
                for i, dest in loader.dests.items():
                    dest.copy_(tensors[i])
                    tensors[i] = dest
                values = {i: (t.numpy() if kinds[i] else t) for i, t in tensors.items()}
                finish_load(loader, state, meta["tree"], values)
                self.last_load_source = "peer"
                logger.info("rank %d: loaded step %d from its guard's memory", self.rank, chosen)
                return chosen
        index = load_rank_index(self.store, manifest, self.rank)

        def describe(i: int):
            entry = index.tensors[i]
            return parse_dtype(entry.dtype), entry.shape

        loader = plan_load(state, index.tree, describe)
        kinds = tensor_indexes(index.tree)
        loaded = read_tensors(
            self.store, index, {i: loader.dests.get(i) for i in kinds}, self.config
        )
        values = {i: (t.numpy() if kinds[i] else t) for i, t in loaded.items()}
        finish_load(loader, state, index.tree, values)
        self.last_load_source = "storage"
        logger.info("rank %d: loaded step %d from %s", self.rank, chosen, self.store.uri)
        return chosen

    def close(self) -> None:
        """Wait for pending saves and stop the background thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._jobs.put(None)
        self._worker.join()
        self._raise_background_error()

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nothing is left to raise to at exit
            logger.error("rank %d: a save to %s failed at exit: %s", self.rank, self.store.uri, exc)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background ---------------------------------------------------------------------------

    def _raise_background_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        set_thread_nice(self._save_thread_nice)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._persist(job)
                job.handle._future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - surfaced at wait() and save()
                logger.error("rank %d: save of step %d failed: %s", self.rank, job.step, exc)
                if self._error is None:
                    self._error = exc
                job.handle._future.set_exception(exc)

    def _persist(self, job: _Job) -> None:
        store = self.store
        marker = pending_key(job.step, job.attempt, self.rank)
        ref: Any
        try:
            try:
                job.staged.wait()
                if self._peers is not None:
                    meta = replica_meta(job.tensors, job.layout.offsets, job.tree)
                    self._peers.exchange(job.step, job.staged.buffer, meta)
                store.put(marker, self._marker(job))
                digests, chunks = write_chunks(
                    store,
                    job.staged.buffer.numpy(),
                    job.layout,
                    self.config,
                    self.hedger,
                    self.governor,
                )
            finally:
                self.pool.release(job.staged.buffer)
            index = RankIndex(
                rank=self.rank,
                tensors=tensor_entries(job.tensors, job.layout, digests),
                chunks=chunks,
                tree=job.tree,
            )
            for i, was_numpy in tensor_indexes(job.tree).items():
                index.tensors[i].numpy = was_numpy
            data = encode_rank_index(index)
            key = rank_index_key(job.step, job.attempt, self.rank)
            store.put(key, data)
            sizes = {d: (c.raw, c.stored) for d, c in chunks.items()}
            ref = (object_ref(key, data), sizes)
        except BaseException as exc:  # noqa: BLE001 - every rank must still reach the gather
            ref = exc
        refs = self._group.gather(ref)
        outcome: Any = None
        if self.rank == 0:
            failed = [(r, e) for r, e in enumerate(refs) if isinstance(e, BaseException)]
            if failed:
                rank, error = failed[0]
                outcome = CheckpointError(f"step {job.step}: rank {rank} failed: {error}")
                outcome.__cause__ = error
            else:
                outcome = self._commit(job, refs)
        outcome = self._group.broadcast(outcome)
        try:
            store.delete(marker)
        except CheckpointError as exc:
            logger.warning("rank %d: could not delete %s: %s", self.rank, marker, exc)
        if isinstance(ref, BaseException):
            raise ref
        if isinstance(outcome, BaseException):
            raise outcome

    def _marker(self, job: _Job) -> bytes:
        return json.dumps(
            {
                "step": job.step,
                "attempt": job.attempt,
                "rank": self.rank,
                "created_at": time.time(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
        ).encode()

    def _commit(self, job: _Job, refs: list) -> BaseException | None:
        unique: dict[str, tuple[int, int]] = {}
        for _, sizes in refs:
            unique.update(sizes)
        manifest = Manifest(
            step=job.step,
            attempt=job.attempt,
            kind=KIND_STATE,
            world_size=self._group.world_size,
            ranks=[r[0] for r in refs],
            raw_bytes=sum(raw for raw, _ in unique.values()),
            stored_bytes=sum(stored for _, stored in unique.values()),
            user=job.user,
        )
        try:
            self.store.put(commit_key(job.step), encode_manifest(manifest), verify_readback=True)
        except ObjectExistsError:
            return StepExistsError(
                f"step {job.step} is already committed in {self.store.uri} (by another writer "
                "or an earlier run); steps are write-once"
            )
        except BaseException as exc:  # noqa: BLE001 - reported to every rank
            return exc
        logger.info(
            "rank 0: committed step %d to %s (%d bytes raw, %d stored)",
            job.step,
            self.store.uri,
            manifest.raw_bytes,
            manifest.stored_bytes,
        )
        if self.keep_last is not None:
            try:
                collect(self.store, keep_last=self.keep_last, ignore_attempts={job.attempt})
            except BaseException as exc:  # noqa: BLE001 - the step is committed; gc can wait
                logger.warning(
                    "retention in %s failed (will retry next save): %s", self.store.uri, exc
                )
        return None


@dataclass
class _TensorMeta:
    """What tensor_entries needs of a tensor once its bytes are staged."""

    dtype: torch.dtype
    shape: torch.Size
    nbytes: int

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize
