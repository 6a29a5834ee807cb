"""The high-level API for training loops: ``Checkpointer(uri).save(step, state)``.

One save goes through these stages; only the first runs on the caller's thread::

    stage    flatten the state, lay tensors out, copy them into a pooled host buffer
    ---- save() returns here; the rest runs on the checkpointer's background thread ----
    encode   hash each chunk, skip it if stored, byte-group + zstd it   (encode_threads)
    put      write-once upload of new chunks, then the rank's index     (store concurrency)
    commit   ranks exchange index refs; rank 0 writes the manifest last, then applies retention

Rank 0 holds the save's one lease from before any rank looks for stored chunks until the step's
commit is decided, so garbage collection never deletes a chunk the save reuses; it alone lists
the committed steps, and hands each rank where its own index of the latest one is
(``ckptstore.save``).

A failed save's error is reported once: by its ``handle.wait()``; if nobody waited for it, by the
next ``wait()``, ``save()`` (that step is then not saved) or ``close()``. After that the
Checkpointer saves again. With ``torch.distributed`` initialised, every rank calls ``save`` with the same step;
each writes its own chunks and index and rank 0 commits once all have succeeded.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore import telemetry
from ckptstore.catalog import list_steps
from ckptstore.errors import CheckpointError
from ckptstore.format import KIND_STATE, check_step
from ckptstore.leases import DEFAULT_TTL_S
from ckptstore.loading import StateLoader
from ckptstore.peer import PeerReplicas, replica_meta
from ckptstore.preemption import SigtermGuard
from ckptstore.save import (
    DEFAULT_GC_WAIT_S,
    RankWritten,
    SaveEngine,
    SaveSession,
    Staged,
    check_background_nice,
)
from ckptstore.save.collective import save_collective
from ckptstore.shared_read import DEFAULT_BUDGET_BYTES, ExchangeStats
from ckptstore.state import flatten
from ckptstore.store import Store, niced, open_store, set_thread_nice
from ckptstore.tiers.drain import DrainJob, DrainQueue
from ckptstore.tiers.group import RankGroup as _Group
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import (
    DEFAULT_LOCAL_KEEP_LAST,
    DEFAULT_PEER_BUDGET_BYTES,
    TierPolicy,
    Topology,
    node_identity,
    store_identity,
)
from ckptstore.tiers.restore import LoadReport
from ckptstore.tiers.saving import TierSaver
from ckptstore.tiers.transfer import TransferStats

logger = logging.getLogger(__name__)


class SaveHandle:
    """A save in progress. ``wait()`` blocks until it is committed and re-raises its error."""

    def __init__(self, step: int, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._future: Future[None] = Future()
        self.durable: Future[None] | None = None
        """With tiers (``local_dir``): done once the step is committed to durable storage, or
        failed with the error that kept it from there; None for a save not bound for it
        (known from ``save()``; after SIGTERM on another rank a save may become bound for it
        once ``wait()`` returns). ``wait()`` returns once the step is committed to the first
        tier that took it."""
        self._reported = False  # its error reached the caller: not raised again by save()
        if skipped:
            self._future.set_result(None)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the save is committed (``TimeoutError`` after ``timeout_s``); raise its
        error if it failed."""
        error = self._future.exception(timeout=timeout_s)
        if error is not None:
            self._reported = True
            raise error

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
    tensors: list[_TensorMeta]
    numpy: set[int]  # which tensors were numpy arrays
    staged: Staged
    user: dict
    handle: SaveHandle
    durable: bool = True  # also committed to durable storage (always, without tiers)
    wait_durable: bool = False  # with tiers: the handle is done once durable (after SIGTERM)


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
        timeout_s: deadline of one storage request, its retries included (large transfers get
            1 s more per 2 MiB): a store that never answers fails the call after about this long.
        hedge_uploads: duplicate slow chunk uploads (default: on for remote stores).
        staging: where ``save()`` copies the state before it returns. ``"host"`` (default):
            into a pooled host buffer (pinned with an accelerator;
            the loop's stream waits for that device-to-host copy). ``"device"``: into a pooled
            buffer on the state's device (the loop's stream waits only for that
            device-to-device copy), copied to a pooled host buffer in the background; a state
            over the device budget is staged through the host, with one log line. ``"auto"``:
            like ``"device"`` for a state on an accelerator that fits the device budget, else
            like ``"host"`` (the default once the CUDA tests have run on a GPU: until then, device
            staging is opt-in). ``"peer"``:
            host staging, and each rank also sends its staged state to a guard rank one node
            over, which keeps the latest replica; ``load`` takes a rank's state from its guard
            when the guard holds the step asked for (verified), else from storage. Needs
            ``torch.distributed``.
        device_staging_budget_bytes: device memory for device staging buffers (None: one
            buffer, used while the state fits half of the device's free memory).
        ranks_per_node: for ``staging="peer"``: the guard of rank r is r + ranks_per_node
            (default: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1).
        process_group: the ranks that save together (default: the whole world, if any).
        no_dist: this process saves and loads alone, as rank 0 of 1, even under
            ``torch.distributed`` (as DCP's ``no_dist``): for a state every rank holds whole,
            saved by one rank (Lightning's DDP) and loaded by each rank on its own.
        store: use this :class:`Store` instead of opening ``uri`` (e.g. with fault injection).
        background_nice: added to the nice value of the threads that encode and upload (and of
            the store's threads, when the checkpointer opens the store), so that where the
            training loop's own threads need the cores they get them first and saves take
            longer (Linux; 0, the default, leaves priorities alone).
        lease_ttl_s: a save in flight renews its lease every ``lease_ttl_s / 4``; a lease not
            renewed for ``lease_ttl_s`` marks a dead writer, whose leftovers gc then removes.
            A save whose lease could not be renewed for half of it is not committed.
        gc_wait_s: how long a save waits for a garbage collection of the store to finish
            before failing.
        handle_sigterm: install a SIGTERM handler (main thread only): on SIGTERM
            ``preempted`` becomes true, pending saves finish within ``sigterm_grace_s``, one
            log line per save says committed or abandoned, then the process exits as SIGTERM
            would have (after the handler installed before ours). A loop that reads
            ``preempted`` may save its current step and leave first (``ckptstore.preemption``).
        sigterm_grace_s: how long pending saves may take after SIGTERM.
        shared_read_budget_bytes: with ``torch.distributed``, a chunk that several ranks load
            (replicated state) is fetched by one of them and sent to the others over the
            process group, in rounds of at most this many bytes (a larger chunk alone): the
            memory a load takes beyond its tensors (``ckptstore.shared_read``). 0: every rank
            reads all its chunks from storage.
        local_dir: tiers (docs/FORMAT.md, "Tiers"): a node-local directory (a RAM disk such as
            ``/dev/shm/run7`` survives a process crash, an NVMe path a reboot) to which every
            save is committed first, each rank into ``local_dir/job-<j>/rank-<r>/``; ``wait()`` of a
            save returns once every rank's copy is committed there (a rank that cannot write
            it sends the save to ``uri`` instead, with one warning). ``load`` then takes the
            newest save every rank can get from some tier, each rank from its own copy, a
            peer's, or ``uri``, whichever verifies first. ``steps()``/``latest()`` list ``uri``.
        peer_copies: each rank's copy is also sent, after the local commit and over the
            process group (never through storage), to the ranks at its position on the next K
            nodes, which keep it in their ``local_dir``: a replaced node restores from them.
            Needs K + 1 nodes.
        durable_every: the first save and every M-th after it also go to ``uri``, drained in a
            background thread from the local copies (the loop never waits for it);
            ``handle.durable`` is done once the step is committed there. After SIGTERM
            (``handle_sigterm``) every save goes to ``uri`` and its handle waits for that.
        node_rank: this rank's node, for ``peer_copies`` (default: torchrun's ``GROUP_RANK``,
            else ``rank // LOCAL_WORLD_SIZE``, else the host name).
        local_keep_last: retention of each store in ``local_dir`` (a step still to be drained
            is kept); ``keep_last`` stays the retention of ``uri``.
        peer_budget_bytes: a peer copy moves chunks in rounds of at most this many bytes per
            transfer (a larger chunk alone); a rank holds one round buffer per transfer it
            takes part in (2K with ``peer_copies=K``).
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
        timeout_s: float = 30.0,
        hedge_uploads: bool | None = None,
        staging: str = "host",
        device_staging_budget_bytes: int | None = None,
        ranks_per_node: int | None = None,
        process_group: Any = None,
        no_dist: bool = False,
        store: Store | None = None,
        background_nice: int = 0,
        lease_ttl_s: float = DEFAULT_TTL_S,
        gc_wait_s: float = DEFAULT_GC_WAIT_S,
        handle_sigterm: bool = False,
        sigterm_grace_s: float = 25.0,
        shared_read_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        local_dir: str | os.PathLike | None = None,
        peer_copies: int = 0,
        durable_every: int = 1,
        node_rank: int | None = None,
        local_keep_last: int = DEFAULT_LOCAL_KEEP_LAST,
        peer_budget_bytes: int = DEFAULT_PEER_BUDGET_BYTES,
    ) -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        if staging not in ("auto", "device", "host", "peer"):
            raise ValueError(f"staging must be 'auto', 'device', 'host' or 'peer', got {staging!r}")
        check_background_nice(background_nice)
        if shared_read_budget_bytes < 0:
            raise ValueError(
                f"shared_read_budget_bytes must be >= 0, got {shared_read_budget_bytes}"
            )
        self.shared_read_budget_bytes = shared_read_budget_bytes
        if handle_sigterm:
            SigtermGuard.check_installable(sigterm_grace_s)
        self._policy = TierPolicy.build(
            local_dir,
            peer_copies=peer_copies,
            durable_every=durable_every,
            local_keep_last=local_keep_last,
            peer_budget_bytes=peer_budget_bytes,
        )
        if self._policy is not None and staging == "peer":
            raise ValueError("staging='peer' and local_dir are two ways of peer copies: pick one")
        self.store = store or open_store(
            uri,
            storage_options=storage_options,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            thread_nice=background_nice,
        )
        self._save_thread_nice = niced(background_nice)
        self.when_busy = when_busy
        if hedge_uploads is None:
            hedge_uploads = not self.store.is_local  # a duplicate local write rarely helps
        self.engine = SaveEngine(
            chunk_bytes=chunk_bytes,
            compression=compression,
            encode_threads=encode_threads,
            hedge_uploads=hedge_uploads,
            staging_budget_bytes=staging_budget_bytes,
            keep_last=keep_last,
            lease_ttl_s=lease_ttl_s,
            gc_wait_s=gc_wait_s,
            staging="host" if staging == "peer" else staging,
            device_staging_budget_bytes=device_staging_budget_bytes,
        )
        # The other ranks wait in a collective while rank 0 waits for a gc (up to gc_wait_s).
        group_timeout_s = max(timeout_s * 20, 600.0) + gc_wait_s
        self._group = _Group(process_group, timeout_s=group_timeout_s, no_dist=no_dist)
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
        self._local: LocalTier | None = None
        self._topology: Topology | None = None
        self._drains: DrainQueue | None = None
        self._tiers: TierSaver | None = None
        self.last_peer_copy: TransferStats | None = None
        self.last_load = LoadReport()
        if self._policy is not None:
            self._local = LocalTier(
                self._policy,
                self.engine,
                rank=self.rank,
                world_size=self._group.world_size,
                durable_uri=store_identity(self.store),
                timeout_s=timeout_s,
                thread_nice=background_nice,
            )
            if self._policy.peer_copies:
                if not self._group.active:
                    raise ValueError("peer_copies needs torch.distributed with 2 or more nodes")
                nodes = self._group.gather(node_identity(node_rank, self.rank))
                self._topology = Topology.build(nodes, self._policy.peer_copies)
            self._tiers = TierSaver(
                self._policy,
                self._local,
                self._group,
                self._topology,
                durable_uri=self.store.uri,
            )
            # Drains run collectives of their own while the save thread runs the next save's.
            self._drains = DrainQueue(
                local=self._local,
                group=_Group(process_group, timeout_s=group_timeout_s, no_dist=no_dist),
                store=self.store,
                thread_nice=self._save_thread_nice,
            )
        self.last_load_source: str | None = None
        self.last_load_left_out: list[str] = []
        self.last_load_exchange: ExchangeStats | None = None  # chunks shared with other ranks
        self._loader = StateLoader(
            self.store,
            self._group,
            self.engine.config,
            shared_read_budget_bytes=shared_read_budget_bytes,
            peers=self._peers,
            local=self._local,
            topology=self._topology,
        )
        self._session = self._group.broadcast(uuid.uuid4().hex[:12])
        self._saves = 0
        self.skipped_saves = 0
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._failed: list[SaveHandle] = []  # failed saves whose error may not be reported yet
        self._failed_lock = threading.Lock()
        self._last: SaveHandle | None = None
        self._closed_event = threading.Event()
        self._sigterm = (
            SigtermGuard(
                grace_s=sigterm_grace_s,
                ckpt=f"rank {self.rank} checkpointer of {self.store.uri}",
                closed=self._closed_event,
            )
            if handle_sigterm
            else None
        )
        self._worker = threading.Thread(target=self._run, name="ckptstore-save", daemon=True)
        self._worker.start()
        self._closed = False
        # A script that ends right after save() must not lose that save. Threading's exit hooks
        # run before atexit's, last registered first: this one runs while concurrent.futures
        # still accepts work (s3fs resolves hosts through an executor).
        this = weakref.ref(self)
        threading._register_atexit(lambda: (c := this()) is not None and c._close_at_exit())

    # -- public API ---------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: dict | None = None) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        check_step(step)
        self._raise_background_error(f"step {step} was not saved")
        t0 = time.perf_counter()
        tree, tensors, numpy = flatten(state)
        user = json.loads(json.dumps(metadata or {}))
        staged = self.engine.stage(tensors, block=self.when_busy == "wait", rank=self.rank)
        self._saves += 1
        if staged is None:
            self.skipped_saves += 1
            telemetry.saves_total.inc(frontend="checkpointer", outcome="skipped")
            telemetry.save_blocked_seconds.observe(
                time.perf_counter() - t0, frontend="checkpointer"
            )
            logger.warning(
                "rank %d: skipping save of step %d: the previous save is still persisting",
                self.rank,
                step,
            )
            return SaveHandle(step, skipped=True)
        handle = SaveHandle(step)
        attempt = f"{self._session}-{self._saves:06d}"
        meta = [_TensorMeta(t.dtype, t.shape, t.numel() * t.element_size()) for t in tensors]
        # After SIGTERM a node may not come back: a save then goes to durable storage too, and
        # its handle (which the SIGTERM grace waits for) is done once it is there.
        preempted = self._sigterm is not None and self._sigterm.signalled.is_set()
        durable = (
            self._policy is None
            or self._policy.is_durable(self._saves - self.skipped_saves)
            or preempted
        )
        if self._policy is not None and durable:
            handle.durable = Future()
        self._jobs.put(
            _Job(step, attempt, tree, meta, numpy, staged, user, handle, durable, preempted)
        )
        self._last = handle
        if self._sigterm is not None:
            self._sigterm.watch(handle)
        blocked = time.perf_counter() - t0
        telemetry.save_blocked_seconds.observe(blocked, frontend="checkpointer")
        logger.debug("rank %d: step %d staged in %.3fs", self.rank, step, blocked)
        return handle

    def reserve(self, state_or_nbytes: Any) -> Future[None]:
        """Allocate the host staging memory for saves of ``state_or_nbytes`` (a state as
        ``save`` takes it, or a byte count) ahead, on a background thread, a bounded slab at
        a time (pinned with an accelerator), so that the first save does not allocate it on
        the loop's thread. Returns a future, done once the memory is reserved (its error
        re-raised by ``result()``); a save started before waits for it instead of allocating
        a second buffer."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if isinstance(state_or_nbytes, int) and not isinstance(state_or_nbytes, bool):
            nbytes = state_or_nbytes
        else:
            nbytes = self.engine.staged_bytes(flatten(state_or_nbytes)[1])
        return self.engine.reserve(nbytes)

    def wait(self) -> None:
        """Block until every save so far is committed; raise the error of the first failed
        save that no ``wait()`` raised yet."""
        if self._last is not None:
            self._last._future.exception()  # blocks until the last save is done
        if self._drains is not None:
            self._drains.wait()  # and its drain to durable storage
        self._raise_background_error()
        self._raise_drain_error()

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (``handle_sigterm=True``): save the current step and
        leave the loop; the process then exits as SIGTERM would have once the Checkpointer
        closes (at the latest ``sigterm_grace_s`` after the signal)."""
        if self._sigterm is None:
            return False
        if not self._sigterm.signalled.is_set():
            self._sigterm.aware = True
        return self._sigterm.signalled.is_set()

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list_steps(self.store)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(
        self, state: Any, step: int | str = "latest", *, fallback: bool = False, strict: bool = True
    ) -> int:
        """Load ``step`` into ``state`` in place (tensors copied into, stateful objects
        given ``load_state_dict``); returns the step loaded.

        With ``fallback=True`` (``step`` must be ``"latest"``) a committed step that cannot be
        loaded because it is corrupt or misses objects (``CheckpointCorruptError`` or
        ``CheckpointNotFoundError``, also when raised as ``PartialLoadError``) is skipped, with
        one warning naming it and why, and the next older committed step is tried. If none
        loads, the error names every step and why (``CheckpointNotFoundError`` when each missed
        objects, else ``CheckpointCorruptError``). Any other error (a state that does not match
        the checkpoint, storage that cannot be reached) is raised at once, as without fallback.

        With ``torch.distributed`` initialised every rank calls ``load`` and the ranks agree on
        the outcome: a step is loaded only if it loads on every rank; otherwise every rank
        raises (naming the ranks that failed and why) or, with fallback, every rank goes on to
        the same older step.

        A failed load: tensors are filled in place as their chunks arrive, each chunk once its
        hash checked out; non-tensor values are set and ``load_state_dict`` called only after
        every tensor of the step loaded, on every rank. A load that fails before any byte
        reached the state raises its error and leaves the state untouched; one that fails after
        raises ``PartialLoadError``, whose ``written`` names the tensors that received bytes
        (each may hold a mix of two steps) while nothing else was changed: load again (with
        ``fallback=True`` an older step overwrites them) or rebuild the state before going on.
        (Verifying every chunk before writing any would take a second state-sized buffer or a
        second read of every chunk.)

        ``strict=False`` loads the part of the step the state asks for: saved keys that the
        state's dicts do not have are left out and not read, and keys of the state that the
        step lacks are left alone; a module loads the parameters both have (with ``strict``, a
        module whose keys differ from the step's is refused before any I/O); ``last_load_left_out`` lists both
        (``load({"model": model}, strict=False)`` from a step that also holds the optimizer).
        """
        self._loader.peers = self._peers  # the replicas it guards now (a restarted rank's)
        try:
            return self._loader.load(state, step, fallback=fallback, strict=strict)
        finally:
            loader = self._loader
            self.last_load, self.last_load_source = loader.last_load, loader.last_load_source
            self.last_load_left_out = loader.last_load_left_out
            self.last_load_exchange = loader.last_load_exchange

    def verify(self, step: int | str = "latest") -> None:
        """Re-check ``step`` (``"all"``: every committed step) in full, as ``ckptstore verify``
        does: every object read back and every chunk re-hashed. Raises
        :class:`CheckpointCorruptError` (or :class:`CheckpointNotFoundError` when objects are
        only missing) naming each problem; returns quietly when all is intact."""
        self._loader.verify(step)

    def close(self) -> None:
        """Wait for pending saves and stop the background thread."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
        if self._drains is not None:
            self._drains.close()
        self.engine.close()
        self._closed_event.set()
        try:
            self._raise_drain_error()
        except CheckpointError as exc:
            drain_error: CheckpointError | None = exc
        else:
            drain_error = None
        if self._sigterm is not None:
            if self._sigterm.signalled.is_set():
                self._sigterm.report()  # the process ends at exit, as SIGTERM would have
            else:
                self._sigterm.uninstall()
        self._raise_background_error()
        if drain_error is not None:
            raise drain_error

    def _close_at_exit(self) -> None:
        if self._closed:
            return
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nothing is left to raise to at exit
            logger.error("rank %d: a save to %s failed at exit: %s", self.rank, self.store.uri, exc)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background ---------------------------------------------------------------------------

    def _raise_background_error(self, consequence: str | None = None) -> None:
        """Raise the error of the first failed save whose error no ``wait()`` has raised yet;
        every such save counts as reported from here on, so it is raised once."""
        with self._failed_lock:
            unreported = [h for h in self._failed if not h._reported]
            self._failed.clear()
            for handle in unreported:
                handle._reported = True
        if not unreported:
            return
        first, error = unreported[0], unreported[0].exception()
        others = [h.step for h in unreported[1:]]
        also = f" (the saves of steps {', '.join(map(str, others))} failed too)" if others else ""
        if consequence is None and not also:
            raise error
        kind = type(error) if isinstance(error, CheckpointError) else CheckpointError
        lead = f"{consequence}: the" if consequence else "The"
        try:
            raised = kind(f"{lead} save of step {first.step} failed: {error}{also}")
        except Exception:  # noqa: BLE001 - an error class with another signature
            raised = CheckpointError(f"{lead} save of step {first.step} failed: {error}{also}")
        raise raised from error

    def _raise_drain_error(self) -> None:
        if self._drains is not None:
            self._drains.raise_failures()

    def _run(self) -> None:
        set_thread_nice(self._save_thread_nice)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self._persist(job)
                telemetry.save_persist_seconds.observe(
                    time.perf_counter() - t0, frontend="checkpointer"
                )
                telemetry.saves_total.inc(frontend="checkpointer", outcome="committed")
                job.handle._future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - surfaced at wait() and save()
                telemetry.saves_total.inc(frontend="checkpointer", outcome="failed")
                # Reported once, to the caller (wait(), the next save() or close()): here only
                # the moment it failed, for logs at INFO.
                logger.info(
                    "rank %d: save of step %d failed (raised at the next wait, save or close): %s",
                    self.rank,
                    job.step,
                    exc,
                )
                with self._failed_lock:
                    self._failed.append(job.handle)
                job.handle._future.set_exception(exc)
                durable = job.handle.durable
                if durable is not None and not durable.done():
                    durable.set_exception(exc)

    def _persist(self, job: _Job) -> None:
        if self._local is not None and self._persist_local(job):
            self._after_local(job)
            return
        session = SaveSession(
            self.engine, self.store, step=job.step, attempt=job.attempt, kind=KIND_STATE
        )
        save_collective(
            session,
            self._group,
            lambda latest: self._write_rank(session, job, latest),
            user=lambda: job.user,
        )
        if self._local is not None:  # a tiered save that went to durable storage directly
            job.handle.durable = job.handle.durable or Future()
            job.handle.durable.set_result(None)

    # -- tiers ----------------------------------------------------------------------------------

    def _persist_local(self, job: _Job) -> bool:
        """Commit the step to every rank's local tier; False (the staged state still held, for
        a save to durable storage instead) if a rank could not."""
        assert self._tiers is not None

        def write(session: SaveSession) -> RankWritten:
            job.staged.copy.wait()
            entries, chunks = session.write(job.staged.buffer, job.staged.layout, job.tensors)
            return session.put_index(0, entries, chunks, tree=job.tree, numpy=job.numpy)

        done = self._tiers.commit_local(
            step=job.step,
            attempt=job.attempt,
            kind=KIND_STATE,
            write=write,
            user=job.user,
            payload=(job.durable, job.wait_durable),
        )
        # SIGTERM may reach one node only: the ranks agree on whether the step goes durable.
        job.durable = any(d for d, _ in done.payloads)
        job.wait_durable = any(w for _, w in done.payloads)
        if done.written is None:
            return False
        self.engine.release(job.staged)
        return True

    def _after_local(self, job: _Job) -> None:
        """A step committed to the local tier: copies to peers, then a drain to durable storage
        if the step is bound for it."""
        assert self._tiers is not None
        self._tiers.copy_to_peers(job.step, job.attempt)
        self.last_peer_copy = self._tiers.last_peer_copy
        if job.durable:
            assert self._drains is not None
            future: Future[None] = job.handle.durable or Future()  # another rank's SIGTERM
            job.handle.durable = future
            self._drains.put(
                DrainJob(job.step, job.attempt, KIND_STATE, future, keep=job.wait_durable)
            )
            if job.wait_durable:
                future.result()  # its error fails the save: it is not durable

    def _write_rank(self, session: SaveSession, job: _Job, latest: Any) -> RankWritten:
        """This rank's chunks and index under rank 0's lease (``save_collective``)."""
        staged = job.staged
        try:
            staged.copy.wait()
            if self._peers is not None:  # collective: before a failed begin is raised
                meta = replica_meta(job.tensors, staged.layout.offsets, job.tree)
                self._peers.exchange(job.step, staged.buffer, meta)
            if isinstance(latest, BaseException):
                raise latest
            session.learn(self.rank, latest)
            entries, chunks = session.write(staged.buffer, staged.layout, job.tensors)
        finally:
            self.engine.release(staged)
        return session.put_index(self.rank, entries, chunks, tree=job.tree, numpy=job.numpy)


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
