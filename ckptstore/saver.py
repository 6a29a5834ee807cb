"""The Checkpointer's save worker: a thread that persists each staged save in order (to the
local tiers first with tiers, else the durable store, every rank together), resolves its
handle, and reports each failure once (``raise_failure``).

A failed save's error is reported once: by its ``handle.wait()``; if nobody waited for it, by the
next ``wait()``, ``save()`` (that step is then not saved) or ``close()`` of the Checkpointer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore import telemetry
from ckptstore.errors import CheckpointError, StepExistsError, same_kind
from ckptstore.format import KIND_STATE
from ckptstore.health import StepHealth
from ckptstore.peer import PeerReplicas, replica_meta
from ckptstore.save import RankWritten, SaveEngine, SaveSession, Staged
from ckptstore.save.collective import save_collective
from ckptstore.save.once import OneRound
from ckptstore.store import Store, set_thread_nice
from ckptstore.tiers.drain import DrainJob, DrainQueue
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.policy import DurableCadence
from ckptstore.tiers.saving import TierSaver, durable_holds

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
        self.health: StepHealth | None = None
        """Once committed: the step's health over every rank (``ckptstore.health``), as its
        commit judged it (with tiers, every rank's local copy: NaN and Inf); None before and
        for a skipped save."""
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

    def result(self, timeout: float | None = None) -> None:
        """``wait(timeout)`` under ``concurrent.futures.Future``'s name (what DCP's
        ``async_save`` returns), so code written for that waits on a save here alike."""
        self.wait(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    @property
    def committed(self) -> bool:
        """Done and stored: not failed, not an unhealthy save that ``HealthPolicy(
        on_unhealthy="skip")`` left out, not skipped while busy."""
        if not self.done() or self.skipped or self.exception() is not None:
            return False
        return self.health is None or self.health.committed

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save is done (committed, skipped or failed), on the
        thread that finished it (at once if it is done already)."""
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "pending")
        return f"SaveHandle(step={self.step}, {state})"


@dataclass
class SaveJob:
    """One save, staged, on its way to the worker."""

    step: int
    attempt: str
    tree: Any
    tensors: list[TensorMeta]
    numpy: set[int]  # which tensors were numpy arrays
    staged: Staged
    user: dict
    handle: SaveHandle
    durable: bool = True  # also committed to durable storage (always, without tiers)
    wait_durable: bool = False  # with tiers: the handle is done once durable (after SIGTERM)
    released: bool = False  # its staging memory is back in the pool
    before: SaveHandle | None = None  # the save queued before it (wait()'s, if it is cancelled)
    # Who decided its fate first: the worker ("taken") or an interrupted save() ("cancelled").
    _fate: str | None = field(default=None, repr=False, compare=False)
    _fate_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def decide(self, fate: str) -> bool:
        """Whether ``fate`` is this job's: the first to decide wins."""
        with self._fate_lock:
            if self._fate is None:
                self._fate = fate
            return self._fate == fate


@dataclass
class TensorMeta:
    """What tensor_entries needs of a tensor once its bytes are staged."""

    dtype: torch.dtype
    shape: torch.Size
    nbytes: int

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize


class SaveWorker:
    """The thread that persists a Checkpointer's saves, in the order ``put`` queued them."""

    def __init__(
        self,
        *,
        engine: SaveEngine,
        store: Store,
        group: RankGroup,
        tiers: TierSaver | None,
        drains: DrainQueue | None,
        cadence: DurableCadence | None,
        peers: PeerReplicas | None,
        thread_nice: int | None,
        keep_alive: Any = None,
    ) -> None:
        # The Checkpointer whose exit hook (a weak reference) closes this worker: kept alive by
        # the save thread until ``close``, so a script that drops it loses no save at exit.
        self._keep_alive = keep_alive
        self.engine = engine
        self.store = store
        self._group = group
        self.rank = group.rank
        self._tiers = tiers
        self._drains = drains
        self._cadence = cadence
        self._peers = peers
        self._thread_nice = thread_nice
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self._failed: list[SaveHandle] = []  # failed saves whose error may not be reported yet
        self._failed_lock = threading.Lock()
        self.last: SaveHandle | None = None
        self.last_health: StepHealth | None = None  # of the last save committed
        self.last_peer_copy = None
        self._thread = threading.Thread(target=self._run, name="ckptstore-save", daemon=True)
        self._thread.start()

    def put(self, job: SaveJob) -> None:
        job.before = self.last
        self.last = job.handle
        self._jobs.put(job)

    def cancel(self, job: SaveJob, why: BaseException) -> None:
        """A save interrupted (Ctrl-C) before it returned its handle: its staging memory back
        to the pool unless the worker took the job already (it then runs to its end)."""
        if not job.decide("cancelled"):
            return
        if self.last is job.handle:  # wait() waits for the save before it
            self.last = job.before
        job.released = True
        self.engine.abandon(job.staged)
        if self._cadence is not None and job.durable:  # the next save goes in its place
            self._cadence.missed()
        error = CheckpointError(f"step {job.step} was not saved: save() was interrupted ({why!r})")
        for future in (job.handle._future, job.handle.durable):
            if future is not None and not future.done():
                future.set_exception(error)

    def wait(self) -> None:
        """Block until the last save queued is over (committed or failed)."""
        if self.last is not None:
            self.last._future.exception()

    def close(self) -> None:
        """Persist what is queued, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()
        self._keep_alive = None

    def raise_failure(self, consequence: str | None = None) -> None:
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
        lead = f"{consequence}: the" if consequence else "The"
        named = same_kind(error, f"{lead} save of step {first.step} failed: {error}{also}")
        if consequence is None and not also and _names_its_step(error, named, first.step):
            raise error
        raise named from error

    def _run(self) -> None:
        set_thread_nice(self._thread_nice)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.decide("taken"):  # its save() was interrupted: cancel() released it
                continue
            t0 = time.perf_counter()
            try:
                with self._group.calling("save()"):
                    self._persist(job)
                telemetry.save_persist_seconds.observe(
                    time.perf_counter() - t0, frontend="checkpointer"
                )
                telemetry.saves_total.inc(frontend="checkpointer", outcome="committed")
                if job.handle.health is not None:
                    self.last_health = job.handle.health
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
                self._release(job)  # a failed save's staging memory: the next save needs it
                with self._failed_lock:
                    self._failed.append(job.handle)
                job.handle._future.set_exception(exc)
                if self._cadence is not None and job.durable:
                    self._cadence.missed()
                durable = job.handle.durable
                if durable is not None and not durable.done():
                    durable.set_exception(exc)

    def _persist(self, job: SaveJob) -> None:
        if self._tiers is not None and self._persist_local(job):
            if job.handle.health is None or job.handle.health.committed:
                self._after_local(job)
                return
            # Skipped (unhealthy): stored nowhere, nothing to drain; a later save goes to
            # durable storage in its place.
            if job.durable and self._cadence is not None:
                self._cadence.missed()
            if job.handle.durable is not None:
                job.handle.durable.set_result(None)
            return
        session = SaveSession(
            self.engine, self.store, step=job.step, attempt=job.attempt, kind=KIND_STATE
        )
        job.handle.health = save_collective(
            session,
            self._group,
            lambda latest: self._write_rank(session, job, latest),
            user=lambda: job.user,
        )
        if self._tiers is not None:  # a tiered save that went to durable storage directly
            job.handle.durable = job.handle.durable or Future()
            job.handle.durable.set_result(None)
            if self._cadence is not None and (
                job.handle.health is None or job.handle.health.committed
            ):
                self._cadence.stored(job.step, local_only=False)

    # -- tiers ----------------------------------------------------------------------------------

    def _persist_local(self, job: SaveJob) -> bool:
        """Commit the step to every rank's local tier (or skip it everywhere: an unhealthy step
        under ``HealthPolicy(on_unhealthy="skip")``); False (the staged state still held, for
        a save to durable storage instead) if a rank could not."""
        assert self._tiers is not None

        def write(session: SaveSession) -> RankWritten:
            job.staged.copy.wait()
            entries, chunks = session.write(
                job.staged.buffer, job.staged.layout, job.tensors, health=job.staged.health
            )
            return session.put_index(0, entries, chunks, tree=job.tree, numpy=job.numpy)

        done = self._tiers.commit_local(
            step=job.step,
            attempt=job.attempt,
            kind=KIND_STATE,
            write=write,
            user=job.user,
            payload=(job.durable, job.wait_durable),
            fatal=self._durable_holds(job.step, job.durable),
        )
        # SIGTERM may reach one node only: the ranks agree on whether the step goes durable.
        job.durable = any(d for d, _ in done.payloads)
        job.wait_durable = any(w for _, w in done.payloads)
        if done.written is None and not done.skipped:
            return False
        job.handle.health = done.health
        self._release(job)
        return True

    def _durable_holds(self, step: int, bound: bool) -> CheckpointError | None:
        """Rank 0: the error of a tiered save of a step the durable store holds (a rollback,
        or a second job on the store), as a durable save would meet it at its commit: a
        restore prefers the durable save of a step, so the local one would never load."""
        if self.rank != 0:
            return None
        assert self._tiers is not None
        try:
            if not durable_holds(self.store, step, self._tiers.local, bound):
                return None
        except CheckpointError as exc:  # not asked since a load: every rank fails the save
            return exc
        return StepExistsError(
            f"step {step} is already committed in {self.store.uri}; steps are write-once (a "
            "rollback or a second job on this store: save into a new store, or number on "
            "from its newest step)"
        )

    def _release(self, job: SaveJob) -> None:
        if not job.released:
            job.released = True
            self.engine.release(job.staged)

    def _after_local(self, job: SaveJob) -> None:
        """A step committed to the local tier: copies to peers, then a drain to durable storage
        if the step is bound for it."""
        assert self._tiers is not None
        copy = self._tiers.copy_to_peers(job.step, job.attempt, drain=job.durable)
        self.last_peer_copy = self._tiers.last_peer_copy
        if self._cadence is not None:  # job.durable as the ranks agreed
            self._cadence.stored(job.step, local_only=not job.durable)
        if job.durable:
            assert self._drains is not None
            future: Future[None] = job.handle.durable or Future()  # another rank's SIGTERM
            job.handle.durable = future
            self._drains.put(
                DrainJob(
                    job.step,
                    job.attempt,
                    KIND_STATE,
                    future,
                    keep=job.wait_durable,
                    copy=copy,  # as committed, and its lease
                )
            )
            if job.wait_durable:
                future.result()  # its error fails the save: it is not durable

    def _write_rank(self, session: SaveSession, job: SaveJob, latest: Any) -> RankWritten:
        """This rank's chunks and index under rank 0's lease (``save_collective``). A rank
        that fails before its chunks' exchange still takes part in it, with its error."""
        staged = job.staged
        round_ = OneRound(self._group, session.attempt)
        try:
            staged.copy.wait()
            if self._peers is not None:  # collective: before a failed begin is raised
                meta = replica_meta(job.tensors, staged.layout.offsets, job.tree)
                self._peers.exchange(job.step, staged.buffer, meta)
            if isinstance(latest, BaseException):
                raise latest
            session.learn(self.rank, latest)
            entries, chunks = session.write(
                staged.buffer, staged.layout, job.tensors, health=staged.health, group=round_
            )
        except BaseException as exc:
            round_.finish(exc)
            raise
        finally:
            self._release(job)
        return session.put_index(self.rank, entries, chunks, tree=job.tree, numpy=job.numpy)


def _names_its_step(error: BaseException, named: BaseException, step: int) -> bool:
    """Whether ``error`` names the step it failed (as most of a save's do), or could not be
    named as it without changing its class (``same_kind`` fell back)."""
    return f"step {step}" in str(error) or type(named) is not type(error)
