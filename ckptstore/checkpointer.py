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
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any

from ckptstore import telemetry
from ckptstore.catalog import list_steps, load_manifest, store_nearby
from ckptstore.errors import CheckpointError, CheckpointNotFoundError, one_line
from ckptstore.exit_status import fail_at_exit
from ckptstore.format import (
    RESERVED_USER_KEY_PREFIX,
    Manifest,
    check_step,
    check_user_metadata,
)
from ckptstore.health import StepHealth, find_healthy, resumable_steps
from ckptstore.loading import StateLoader
from ckptstore.options import (
    EncodingOptions,
    HealthPolicy,
    PreemptionOptions,
    ReadOptions,
    RetentionOptions,
    StagingOptions,
    StorageOptions,
    TierOptions,
    resolve,
)
from ckptstore.peer import PeerReplicas
from ckptstore.preemption import SigtermGuard
from ckptstore.save import SaveEngine, Staged
from ckptstore.saver import SaveHandle, SaveJob, SaveWorker, TensorMeta
from ckptstore.shared_read import (
    ExchangeStats,
)
from ckptstore.state import flatten
from ckptstore.store import Store, niced, open_store
from ckptstore.tiers.group import RankGroup as _Group
from ckptstore.tiers.group import front_end_group, refuse_options_apart
from ckptstore.tiers.open_step import newest_planned_step
from ckptstore.tiers.policy import TierPolicy
from ckptstore.tiers.restore import LoadReport
from ckptstore.tiers.saving import Tiers, open_tiers
from ckptstore.tiers.transfer import TransferStats, wait_written

logger = logging.getLogger(__name__)


class Checkpointer:
    """Asynchronous, verified, deduplicated checkpoints of a training state in ``uri``.

    Args:
        uri: where the checkpoints live: a path, ``file://``, ``memory://``, ``s3://b/prefix``.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        keep_last: after each commit keep only the newest this many steps (None: keep all).
        storage, encoding, staging, retention, tiers, reads, preemption, health: option objects of
            ``ckptstore.options`` (each field documented there), the same ones
            ``ckptstore.dcp.StoreWriter``/``StoreReader`` take; ``staging="device"`` is short
            for ``StagingOptions(mode="device")``. With ``tiers=TierOptions(local_dir=...)``
            every save is committed to node-local storage first (``wait()`` returns once
            every rank's copy is there; a rank that cannot write it sends the save to ``uri``,
            one warning), copied to peers (``peer_copies``) and drained to ``uri`` every
            ``durable_every`` saves (``handle.durable``); ``load`` takes the newest save every
            rank can get, each rank from its own copy, a peer's, or ``uri``, whichever verifies
            first (docs/FORMAT.md, "Tiers"). ``steps()`` lists ``uri``; ``latest()`` takes every
            tier (collective), the step ``load`` would take.
            ``health=HealthPolicy(...)`` (docs/FORMAT.md, "Health"): every save records each
            floating tensor's NaN and Inf counts and sum of squares; ``handle.health`` and
            ``last_save`` tell a committed step's health; ``steps``, ``latest`` and ``load``
            take ``healthy=True``.
        on_unhealthy: short for ``HealthPolicy(on_unhealthy=...)``: an unhealthy save is
            ``"save"``d (one warning naming its worst tensors), ``"skip"``ped or ``"raise"``s.
        process_group: the ranks that save together (default: the whole world, if any).
        no_dist: this process saves and loads alone, as rank 0 of 1, even under
            ``torch.distributed`` (as DCP's ``no_dist``): for a state every rank holds whole,
            saved by one rank (Lightning's DDP) and loaded by each rank on its own.
        **deprecated: the flat keywords of earlier releases (``compression=``,
            ``local_dir=``, ...), folded into their option object with a
            ``DeprecationWarning``.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        storage: StorageOptions | None = None,
        encoding: EncodingOptions | None = None,
        staging: StagingOptions | str | None = None,
        retention: RetentionOptions | None = None,
        tiers: TierOptions | None = None,
        reads: ReadOptions | None = None,
        preemption: PreemptionOptions | None = None,
        health: HealthPolicy | None = None,
        on_unhealthy: str | None = None,
        process_group: Any = None,
        no_dist: bool = False,
        **deprecated: Any,
    ) -> None:
        if on_unhealthy is not None:
            health = dataclasses.replace(health or HealthPolicy(), on_unhealthy=on_unhealthy)
        given = dict(
            storage=storage,
            encoding=encoding,
            staging=staging,
            retention=retention,
            tiers=tiers,
            reads=reads,
            preemption=preemption,
            health=health,
        )
        o = resolve("Checkpointer", given, deprecated)
        self.options = o
        self.shared_read_budget_bytes = o["reads"].shared_read_budget_bytes
        if o["preemption"].handle_sigterm:
            SigtermGuard.check_installable(o["preemption"].sigterm_grace_s)
        self._policy = _tier_policy(o)
        self.store = o["storage"].store or _open_store(uri, storage_options, o["storage"])
        self._save_thread_nice = niced(o["storage"].background_nice)
        self.when_busy = o["staging"].when_busy
        self.engine = SaveEngine.build(o, keep_last=keep_last, store=self.store)
        self._group = self._rank_group(process_group, no_dist)
        self.rank = self._group.rank
        refuse_options_apart(self._group, _collective_options(o, self._policy))
        if self._group.active and self.when_busy == "skip":
            raise ValueError(
                "when_busy='skip' is single-process only: ranks could disagree "
                "on which saves to skip"
            )
        peer_staging = o["staging"].mode == "peer"
        self._peers = _peer_replicas(o["staging"], self._group) if peer_staging else None
        self.last_load = LoadReport()
        self._tiers = self._open_tiers(process_group, no_dist)
        self._cadence = self._tiers.cadence if self._tiers else None
        self._local = self._tiers.local if self._tiers else None
        self._topology = self._tiers.topology if self._tiers else None
        self._drains = self._tiers.drains if self._tiers else None
        self.last_load_source: str | None = None
        self.last_load_left_out: list[str] = []
        self.last_load_exchange: ExchangeStats | None = None  # chunks shared with other ranks
        self._loader = self._state_loader()
        with self._group.calling("Checkpointer()"):
            self._session = self._group.broadcast(uuid.uuid4().hex[:12])
        self._saves = 0
        self.skipped_saves = 0
        self._closed_event = threading.Event()
        self._sigterm = self._sigterm_guard()
        self._saver = self._save_worker()
        self._closed = False
        self._nearby_looked = False  # latest(): a store near a mistyped path, looked for once
        # A script that ends right after save() must not lose that save. Threading's exit hooks
        # run before atexit's, last registered first: this one runs while concurrent.futures
        # still accepts work (s3fs resolves hosts through an executor).
        this = weakref.ref(self)
        threading._register_atexit(lambda: (c := this()) is not None and c._close_at_exit())

    def _rank_group(self, process_group: Any, no_dist: bool) -> _Group:
        """A group of ``process_group``'s ranks whose collectives wait as long as a save may
        make them; a rank lost before an exchange, or ranks in different calls, end every
        rank's save and load within ``lost_rank_timeout_s`` (with tiers, a rank lost within
        one and the drains too)."""
        return front_end_group(
            self.options["storage"],
            tiered=self._policy is not None,
            gc_wait_s=self.options["retention"].gc_wait_s,
            process_group=process_group,
            no_dist=no_dist,
        )

    def _open_tiers(self, process_group: Any, no_dist: bool) -> Tiers | None:
        """This rank's tiers (``tiers.saving.open_tiers``), None without a ``local_dir``."""
        if self._policy is None:
            return None
        drain_group = self._rank_group(process_group, no_dist)
        return open_tiers(
            self._policy,
            self.engine,
            self._group,
            self.store,
            node_rank=self.options["tiers"].node_rank,
            drain_group=drain_group,  # drains run collectives while the next save does
            timeout_s=self.options["storage"].timeout_s,
            thread_nice=self.options["storage"].background_nice,
            keep_alive=self,
        )

    def _state_loader(self) -> StateLoader:
        return StateLoader(
            self.store,
            self._group,
            dataclasses.replace(
                self.engine.config, read_concurrency=self.options["reads"].read_concurrency
            ),
            shared_read_budget_bytes=self.shared_read_budget_bytes,
            peers=self._peers,
            local=self._local,
            topology=self._topology,
        )

    def _sigterm_guard(self) -> SigtermGuard | None:
        preemption = self.options["preemption"]
        if not preemption.handle_sigterm:
            return None
        return SigtermGuard(
            grace_s=preemption.sigterm_grace_s,
            ckpt=f"rank {self.rank} checkpointer of {self.store.uri}",
            closed=self._closed_event,
        )

    def _save_worker(self) -> SaveWorker:
        return SaveWorker(
            engine=self.engine,
            store=self.store,
            group=self._group,
            tiers=self._tiers.saver if self._tiers else None,
            drains=self._drains,
            cadence=self._cadence,
            peers=self._peers,
            thread_nice=self._save_thread_nice,
            keep_alive=self,  # its exit hook finishes the saves of a Checkpointer let go
        )

    @property
    def last_save(self) -> StepHealth | None:
        """The health of the last save committed (``handle.health`` of that save)."""
        return self._saver.last_health

    @property
    def last_peer_copy(self) -> TransferStats | None:
        """What this rank moved in the last save's peer copies (tiers with ``peer_copies``)."""
        return self._saver.last_peer_copy

    # -- public API ---------------------------------------------------------------------------

    def durable_next(self) -> None:
        """With tiers: the next save is committed to durable storage too, whatever
        ``durable_every`` says (a job's last save: its local copies alone may go with the
        nodes). Every rank calls it before the same save. Without tiers every save is."""
        if self._cadence is not None:
            self._cadence.ask()

    def save(self, step: int, state: Any, *, metadata: dict | None = None) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background.
        ``metadata``, a dict of JSON values (at most 1 MiB as JSON; keys starting with
        "ckptstore" are reserved), is recorded in the step's manifest: ``metadata(step)``,
        ``ckptstore inspect``."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        check_step(step)
        self._saver.raise_failure(f"step {step} was not saved")
        t0 = time.perf_counter()
        tree, tensors, numpy = flatten(state)
        user = check_user_metadata(metadata)
        staged: Staged | None = None
        job: SaveJob | None = None
        durable = False  # whether this save took the cadence's durable turn
        try:  # a Ctrl-C from here on hands the staging memory back: the next save needs it
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
            meta = [TensorMeta(t.dtype, t.shape, t.numel() * t.element_size()) for t in tensors]
            # After SIGTERM a node may not come back: a save then goes to durable storage too, and
            # its handle (which the SIGTERM grace waits for) is done once it is there.
            preempted = self._sigterm is not None and self._sigterm.signalled.is_set()
            durable = self._cadence is None or self._cadence.next_save() or preempted
            if self._policy is not None and durable:
                handle.durable = Future()
            job = SaveJob(
                step, attempt, tree, meta, numpy, staged, user, handle, durable, preempted
            )
            self._saver.put(job)
            if self._sigterm is not None:
                self._sigterm.watch(handle)
        except BaseException as exc:
            if job is not None:
                self._saver.cancel(job, exc)
            elif staged is not None:
                self.engine.abandon(staged)
                if durable and self._cadence is not None:  # its durable turn goes to the next
                    self._cadence.missed()
            raise
        blocked = time.perf_counter() - t0
        telemetry.save_blocked_seconds.observe(blocked, frontend="checkpointer")
        logger.debug("rank %d: step %d staged in %.3fs", self.rank, step, blocked)
        return handle

    def reserve(self, state_or_nbytes: Any) -> Future[None]:
        """Allocate the host staging memory for saves of ``state_or_nbytes`` (a state as
        ``save`` takes it, or a byte count) ahead, on a background thread, a bounded slab at
        a time (pinned with an accelerator), so that the first save does not allocate it on
        the loop's thread. Given a state that its saves stage on its device
        (``staging="device"``, or ``"auto"`` with a device budget: without one, ``"auto"``
        stages its first save through the host), the device buffer is allocated too, before
        this returns. Returns a
        future, done once the host memory is reserved (its error re-raised by ``result()``);
        a save started before waits for it instead of allocating a second buffer."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if isinstance(state_or_nbytes, int) and not isinstance(state_or_nbytes, bool):
            return self.engine.reserve(state_or_nbytes)
        tensors = flatten(state_or_nbytes)[1]
        return self.engine.reserve(self.engine.staged_bytes(tensors), tensors, rank=self.rank)

    def wait(self) -> None:
        """Block until every save so far is committed; raise the error of the first failed
        save that no ``wait()`` raised yet."""
        self._saver.wait()
        if self._drains is not None:
            self._drains.wait()  # and its drain to durable storage
        self._saver.raise_failure()
        if self._drains is not None:
            self._drains.raise_failures()

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

    def steps(self, *, healthy: bool = False) -> list[int]:
        """Committed steps, ascending; with ``healthy``, only those whose manifest records
        them healthy (docs/FORMAT.md, "Health": not "unhealthy", not "unknown")."""
        steps = list_steps(self.store)
        if healthy:
            return sorted(find_healthy(self.store, steps)[0])
        return steps

    def latest(self, *, healthy: bool = False) -> int | None:
        """The step a load of ``"latest"`` takes (with ``healthy``, the newest healthy one), or
        None when there is none: nothing to resume. Committed steps of which none is healthy
        raise ``NoHealthyStepError`` with ``healthy``, not None. With tiers it is the newest
        save every rank can get from any tier, local-only ones included, and collective: every
        rank calls it, as a load. Without tiers each rank lists the store itself: where another
        process may commit into the same store meanwhile, take rank 0's answer (broadcast it)
        so that the ranks do not go different ways. None where a store lies just above or
        below this local path is one warning naming it."""
        if self._local is not None:
            self._saver.wait()  # its collectives and the plan's share a group: one at a time
            with self._group.calling("latest()"):
                step = newest_planned_step(self.store, self._local, self._group, healthy)
        else:
            step = self._newest_durable(healthy)
        if step is None and not self._nearby_looked:
            self._nearby_looked = True
            if nearby := store_nearby(self.store):
                logger.warning("no committed checkpoint in %s%s", self.store.uri, nearby)
        return step

    def _newest_durable(self, healthy: bool) -> int | None:
        steps, _ = resumable_steps(self.store, healthy=healthy, limit=1)
        return steps[0] if steps else None

    def load(
        self,
        state: Any,
        step: int | str = "latest",
        *,
        fallback: bool = False,
        strict: bool = True,
        healthy: bool = False,
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

        ``healthy=True`` loads the newest *healthy* step (docs/FORMAT.md, "Health"): each newer
        step passed over (unhealthy, or of unknown health) is named once in a warning with
        why; with ``fallback=True`` a healthy step that does not load goes on to the next
        older healthy one; an explicit ``step`` that is not healthy raises
        ``UnhealthyStepError``; no healthy step at all is ``CheckpointNotFoundError``.

        A save still in flight on this rank is finished (committed or failed) first.

        ``strict=False`` loads the part of the step the state asks for: saved keys that the
        state's dicts do not have are left out and not read, and keys of the state that the
        step lacks are left alone; a module loads the parameters both have (with ``strict``, a
        module whose keys differ from the step's is refused before any I/O); ``last_load_left_out`` lists both
        (``load({"model": model}, strict=False)`` from a step that also holds the optimizer).
        """
        self._loader.peers = self._peers  # the replicas it guards now (a restarted rank's)
        # Saves in flight run collectives on the load's group: the load's would interleave with
        # theirs (other ranks pairing them otherwise). Their errors stay for wait() and save().
        self._saver.wait()
        try:
            with self._group.calling("load()"):
                return self._loader.load(
                    state, step, fallback=fallback, strict=strict, healthy=healthy
                )
        finally:
            loader = self._loader
            self.last_load, self.last_load_source = loader.last_load, loader.last_load_source
            self.last_load_left_out = loader.last_load_left_out
            self.last_load_exchange = loader.last_load_exchange

    def metadata(self, step: int) -> dict:
        """The ``metadata`` saved with ``step`` (``save(step, state, metadata=...)``), read
        from its manifest in the store, or with tiers, where the store does not hold the step
        (committed to the local tier alone), from this rank's copy of it;
        ``CheckpointNotFoundError`` where neither holds it."""
        try:
            manifest = load_manifest(self.store, check_step(step))
        except CheckpointNotFoundError as missing:
            if self._local is None:
                raise
            manifest = self._local_manifest(step, missing)
        user = manifest.user
        return {k: v for k, v in user.items() if not k.startswith(RESERVED_USER_KEY_PREFIX)}

    def _local_manifest(self, step: int, missing: CheckpointNotFoundError) -> Manifest:
        assert self._local is not None
        try:
            manifest = load_manifest(self._local.store(self.rank), step)
        except CheckpointNotFoundError:
            manifest = None
        if manifest is None or not self._local.belongs(manifest, self.rank):
            raise CheckpointNotFoundError(
                f"{one_line(missing)}; nor does this rank's local tier hold a copy of it"
            ) from None
        return manifest

    def verify(self, step: int | str = "latest") -> None:
        """Re-check ``step`` (``"all"``: every committed step) in full, as ``ckptstore verify``
        does: every object read back and every chunk re-hashed. Raises
        :class:`CheckpointCorruptError` naming each problem (:class:`CheckpointNotFoundError`
        when objects are only missing, :class:`PickledValueRefusedError` when values are only
        stored pickled, :class:`StorageError` when only the reads failed, which says nothing of
        the checkpoint); returns quietly when all is intact."""
        self._loader.verify(step)

    def close(self) -> None:
        """Wait for pending saves and stop the background thread."""
        if self._closed:
            return
        self._closed = True
        self._saver.close()
        if self._cadence is not None and self._policy is not None:
            say = self.rank == 0
            self._cadence.warn_if_last_local(say, str(self._policy.local_dir), self.store.uri)
        self._group.leave("close()")  # a rank still waiting in latest() or load() is told
        wait_written()  # a copy a load repaired, written in the background
        if self._drains is not None:
            self._drains.close()
        self.engine.close()
        self._closed_event.set()
        try:
            if self._drains is not None:
                self._drains.raise_failures()
        except CheckpointError as exc:
            drain_error: CheckpointError | None = exc
        else:
            drain_error = None
        if self._sigterm is not None:
            if self._sigterm.signalled.is_set():
                self._sigterm.report()  # the process ends at exit, as SIGTERM would have
            else:
                self._sigterm.uninstall()
        self._saver.raise_failure()
        if drain_error is not None:
            raise drain_error

    def _close_at_exit(self) -> None:
        if self._closed:
            return
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nothing is left to raise to at exit
            logger.error("rank %d: a save to %s failed at exit: %s", self.rank, self.store.uri, exc)
            fail_at_exit()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if error is None:
            self.close()
            return
        try:  # the block's own error goes on; a save that failed too is logged, not raised
            self.close()
        except Exception as exc:  # noqa: BLE001
            logger.error("Checkpointer closed after an error in its block: %s", one_line(exc))


def _collective_options(o: dict[str, Any], policy: TierPolicy | None) -> dict[str, Any]:
    """The options every rank of a job must share: each decides which exchanges it joins."""
    tiered = policy.collective_options() if policy is not None else {}
    return {
        "local_dir (set or not)": policy is not None,
        "TierOptions.peer_copies": tiered.get("TierOptions.peer_copies"),
        "TierOptions.durable_every": tiered.get("TierOptions.durable_every"),
        "StagingOptions.mode 'peer'": o["staging"].mode == "peer",
    }


def _tier_policy(o: dict[str, Any]) -> TierPolicy | None:
    """The tier policy of the options ``o``, None without a ``local_dir``; refused with peer
    staging, the other way of peer copies."""
    policy = o["tiers"].policy()
    if policy is not None and o["staging"].mode == "peer":
        raise ValueError("staging='peer' and local_dir are two ways of peer copies: pick one")
    return policy


def _open_store(
    uri: str | os.PathLike, storage_options: dict[str, Any] | None, storage: StorageOptions
) -> Store:
    return open_store(
        uri,
        storage_options=storage_options,
        timeout_s=storage.timeout_s,
        max_concurrency=storage.max_concurrency,
        thread_nice=storage.background_nice,
    )


def _peer_replicas(staging: StagingOptions, group: _Group) -> PeerReplicas:
    """``staging="peer"``: each rank's staged state also in the memory of a rank one node over."""
    if not group.active:
        raise ValueError("staging='peer' needs torch.distributed with 2 or more ranks")
    ranks_per_node = staging.ranks_per_node
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks_per_node >= group.world_size:
        ranks_per_node = 1  # one node: the next rank guards
    return PeerReplicas(group.group, ranks_per_node=ranks_per_node)
