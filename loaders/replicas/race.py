"""Requests over the replicas: every request fails over, a data read is also raced (hedged).

An error or a timeout fails over to another replica at once (:meth:`ReplicaReads.call`, and a
read with no second replica to hedge on). When a data read has not completed after the hedge
delay (the p96.5 of recent first attempts of its size class, outliers left out; learnt within
the first reads), a duplicate goes to the best healthy replica if the hedge budget allows (the
store's :class:`~ckptstore.store.Hedger` decides when and whether, :mod:`.health` where); the
first answer wins and the others are cancelled: not started if still queued, otherwise their
result is discarded. Every attempt is bounded by the replica Store's per-attempt deadline and the
whole request by ``read_deadline_s``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import ObjectNotFoundError, StorageTimeoutError
from ckptstore.store import Hedger, Store
from loaders.config import ReplicaConfig
from loaders.errors import (
    ReadFailedError,
    ReadTimeoutError,
    ShardCorruptError,
    ShardNotFoundError,
    ShardTooLargeError,
    UnknownFormatError,
)
from loaders.metrics import ReadStats
from loaders.replicas.health import Replica, ReplicaHealth

logger = logging.getLogger(__package__)  # "loaders.replicas", as health's

Fetch = Callable[[Store], Any]
Decode = Callable[[Any, str], Any]


@dataclass(eq=False)
class _Attempt:
    """One request of a read to one replica, settled (accounted for) once: at its end, or at
    ``deadline``, when the read (or, for a loser still running after its read returned, the
    next read) gives it up."""

    replica: Replica
    hedge: bool
    deadline: float
    launched: float
    what: str
    settled: bool = False
    allowed_s: float = math.inf  # the time it is given, again after a stall of this process


_TOLD_MAX = 10_000  # damages remembered for warnings: a bound, not a policy
# A heartbeat thread ticks every TICK_S; a gap of over STALL_S between two ticks is a stall of
# this process (swapping, a scheduler's pause, a stopped job): an attempt whose time ran out
# over a stall gets its time again rather than being charged to its replica.
TICK_S = 0.05
STALL_S = 0.25


class _Heartbeat:
    """The stalls of this process, seen by a daemon thread (one per process: started again in
    a forked DataLoader worker, where the parent's thread does not run)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stalls: deque[tuple[float, float]] = deque(maxlen=64)  # (from, to), monotonic
        self.ticked = math.inf  # the heartbeat's last tick
        self.pid = 0

    def ensure(self) -> None:
        if self.pid != os.getpid():
            with self.lock:
                if self.pid != os.getpid():
                    self.pid = os.getpid()
                    self.stalls.clear()
                    self.ticked = time.monotonic()
                    threading.Thread(
                        target=self._tick, name="loaders-heartbeat", daemon=True
                    ).start()

    def _tick(self) -> None:
        self.ticked = time.monotonic()
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            with self.lock:
                if now - self.ticked > STALL_S:
                    self.stalls.append((self.ticked, now))
                self.ticked = now

    def since(self, start: float) -> bool:
        """Whether the process stalled after ``start``: a stall seen, or one the heartbeat has
        not yet woken from (the thread asking may run first after it)."""
        with self.lock:
            unseen = time.monotonic() - self.ticked > STALL_S
            return unseen or any(end > start for _, end in self.stalls)


_HEARTBEAT = _Heartbeat()
os.register_at_fork(after_in_child=_HEARTBEAT.__init__)  # the child starts its own


class ReplicaReads:
    """The requests of one replica set: :meth:`read` for data, :meth:`call` for anything else.
    Keeps the losers of earlier reads still running, to give them up at their deadline."""

    def __init__(
        self, health: ReplicaHealth, hedger: Hedger, stats: ReadStats, config: ReplicaConfig
    ) -> None:
        self.health = health
        self.hedger = hedger
        self.stats = stats
        self.config = config
        self._lock = threading.Lock()
        self._orphans: list[_Attempt] = []  # losers of returned reads, still running
        self._told: set[str] = set()  # corrupt data already warned of (replica and what)

    @staticmethod
    def stalled_over(a: _Attempt) -> bool:
        """Whether the process stalled within attempt ``a``'s time (since it was last given
        it); if so ``a`` is given its whole time again from now."""
        if not _HEARTBEAT.since(a.deadline - a.allowed_s):
            return False
        a.deadline = time.monotonic() + a.allowed_s
        return True

    def tell_corrupt(self, replica: Replica, exc: BaseException) -> None:
        """One WARNING per replica and damage (the reads of a window that meet the same bad
        block say it once), later ones at DEBUG."""
        line = f"replica {replica.name} returned corrupt data: {exc}"
        with self._lock:
            first = line not in self._told
            if first and len(self._told) < _TOLD_MAX:
                self._told.add(line)
        logger.log(logging.WARNING if first else logging.DEBUG, "%s", line)

    def read(
        self, what: str, nbytes: int, fn: Fetch, decode: Decode | None, gone: Sequence[Replica]
    ) -> Any:
        """``decode(fn(store), replica)`` of the first replica to answer, not asking those
        ``gone`` (known to lack it): raced when a second replica is left to hedge on, else
        failed over only. Counted as a read; its latencies judge each replica's health."""
        cfg = self.config
        raced = cfg.hedge and cfg.max_hedges > 0 and len(self.health.replicas) - len(gone) > 1
        request = _Request(self, what, nbytes, fn, decode, gone, read=True, raced=raced)
        return self._race(request) if raced else self._failover(request)

    def call(self, what: str, fn: Fetch, gone: Sequence[Replica]) -> Any:
        """``fn(store)`` on the best replica not ``gone``, failing over on errors; never
        hedged, not counted as a read."""
        return self._failover(_Request(self, what, 0, fn, None, gone, read=False, raced=False))

    @staticmethod
    def _failover(request: _Request) -> Any:
        try:
            request.launch()
            while True:
                won, data = request.step(math.inf)
                if won:
                    return data
        finally:
            request.close()

    def _race(self, request: _Request) -> Any:
        cfg, hedger, nbytes = self.config, self.hedger, request.nbytes
        hedger.admit()
        try:
            request.launch()
            hedges = 0
            next_hedge = request.t0 + hedger.delay_s(nbytes)
            # Until the delay is learnt, a read looks again now and then so that it hedges at
            # the learnt delay as soon as one is known, not at the initial guess.
            guessing = not hedger.learnt(nbytes)
            poll = cfg.hedge_initial_delay_s / 8
            while True:
                until = next_hedge
                if guessing and not hedges:
                    if hedger.learnt(nbytes):
                        guessing = False
                        next_hedge = request.t0 + hedger.delay_s(nbytes)
                        continue
                    until = min(next_hedge, time.monotonic() + poll)
                won, data = request.step(until)
                if won:
                    return data
                if time.monotonic() < next_hedge:
                    continue
                spare = len(request.pending) + len(set(request.gone)) < len(self.health.replicas)
                reserve = cfg.hedge_burst / 2 if hedges else 0.0
                delay = hedger.delay_s(nbytes)
                if hedges >= cfg.max_hedges:
                    next_hedge = math.inf
                elif spare and request.hedge(reserve):
                    hedges += 1
                    self.stats.add(hedges=1)
                    next_hedge = time.monotonic() + delay
                else:
                    # No token or no free replica yet: a first hedge looks again soon, a later
                    # one (doubly slow, often with every healthy replica tried) after another
                    # delay, not in a loop of wake-ups for the rest of the read.
                    self.stats.add(hedges_refused=1)
                    next_hedge = time.monotonic() + (delay if hedges else delay / 4)
        finally:
            request.close()

    # -- attempts past their deadline ---------------------------------------------------------

    def sweep_orphans(self, now: float) -> None:
        """Give up the losers of earlier reads that are past their deadline: a hung one counts
        as its replica's error and stops holding a slot in flight, as a store attempt would."""
        if not self._orphans:
            return
        with self._lock:
            due = [a for a in self._orphans if a.settled or now >= a.deadline]
            if due:
                self._orphans = [a for a in self._orphans if not (a.settled or now >= a.deadline)]
        again = [a for a in due if not a.settled and self.stalled_over(a)]
        if again:
            self.adopt(again)
        for a in due:
            if a not in again:
                self.expire(a, now)

    def adopt(self, orphans: list[_Attempt]) -> None:
        with self._lock:
            self._orphans.extend(orphans)

    def settle(self, a: _Attempt) -> bool:
        """Whether the caller is first to account for attempt ``a`` (its end, or its deadline)."""
        with self._lock:
            first, a.settled = not a.settled, True
            return first

    def expire(self, a: _Attempt, now: float) -> StorageTimeoutError | None:
        """Give up attempt ``a`` at its deadline (it runs on, ignored): counted as an error of
        its replica, like a Store attempt past its deadline; None if it ended first."""
        if not self.settle(a):
            return None
        r = a.replica
        error = StorageTimeoutError(
            f"read {a.what} from {r.name}: no answer within {now - a.launched:.1f}s"
        )
        self.health.finished(r, now - a.launched, 0, error, read=True)
        logger.warning("replica %s: %s", r.name, error, extra={"loaders_attempt_timeout": True})
        return error


class _Request:
    """One request over the replicas: its attempts (in flight, tried, and the replicas found to
    lack its object) and its failovers, until one attempt answers or the request fails."""

    def __init__(
        self,
        reads: ReplicaReads,
        what: str,
        nbytes: int,
        fn: Fetch,
        decode: Decode | None,
        gone: Sequence[Replica],
        *,
        read: bool,
        raced: bool,
    ) -> None:
        self.reads, self.what, self.nbytes, self.fn, self.decode = reads, what, nbytes, fn, decode
        self.read, self.raced = read, raced
        _HEARTBEAT.ensure()
        self.t0 = time.monotonic()
        reads.sweep_orphans(self.t0)
        self.deadline = self.t0 + reads.config.read_deadline_s
        self.gone = list(gone)
        self.pending: dict[Future, _Attempt] = {}
        self.tried: list[Replica] = []
        self.errors: list[str] = []
        self.last_exc: BaseException | None = None
        self.attempts = 0
        self.won_launched: float | None = None  # when the attempt that answered started
        self.closed = False  # the read returned or failed: answers after are not decoded
        if len(self.gone) == len(reads.health.replicas):
            self._missing_everywhere()

    def _missing_everywhere(self) -> None:
        self.reads.stats.add(failed=1)
        uris = ", ".join(r.name for r in self.reads.health.replicas)
        raise ShardNotFoundError(f"{self.what} is missing from every replica ({uris})")

    def _exclude(self) -> list[Replica]:
        busy = [a.replica for a in self.pending.values()] + self.gone
        return busy + [t for t in self.tried if t not in busy]

    def launch(self) -> bool:
        """Start the first attempt, or a failover: to a replica not tried yet, else to one not
        in flight."""
        health = self.reads.health
        first = not self.tried
        r = health.choose(self._exclude(), first=first)
        if r is None:
            busy = [a.replica for a in self.pending.values()] + self.gone
            r = health.choose(busy, first=False)
        if r is None:
            return False
        self.attempts += 1
        self._start(r, hedge=False, primary=first)
        return True

    def hedge(self, reserve: float) -> bool:
        """Start a hedge, given a replica free for it and a token of the hedge budget (taken
        while more than ``reserve`` are left)."""
        r = self.reads.health.choose(self._exclude(), first=False, hedge=True)
        if r is None:
            return False
        if not self.reads.hedger.try_hedge("get", reserve=reserve):
            self.reads.health.release(r)
            return False
        r.stats.add(hedges_fired=1)
        self._start(r, hedge=True, primary=False)
        return True

    def _start(self, r: Replica, *, hedge: bool, primary: bool) -> None:
        """Run ``fn(store)`` on replica ``r`` in a thread of its store, then ``decode(result,
        replica)`` (which may find the bytes corrupt); the outcome updates r's health, unless
        the request gave the attempt up at its deadline first. The latency of a raced read's
        first attempt (``primary``), won or not, feeds the hedge delay, timed from here as the
        read's hedge timer is (a hand-over to a busy thread counts in both)."""
        reads, fn, decode, read = self.reads, self.fn, self.decode, self.read
        record = self.nbytes if self.raced and primary and not r.benched else None
        self.tried.append(r)
        launched = time.monotonic()
        # A data read runs in this thread with no deadline of the store's own (in_thread):
        # the read gives it up at the deadline the store would have set.
        bound = launched + r.store.retry.deadline_s(self.nbytes) if read else math.inf
        a = _Attempt(r, hedge, bound, launched, self.what, allowed_s=bound - launched)

        def answered(data: Any, t0: float, seconds: float) -> None:
            if reads.settle(a):
                nbytes = len(data) if isinstance(data, (bytes, memoryview)) else 0
                reads.health.finished(r, seconds, nbytes, None, read=read)
                if record is not None:
                    reads.hedger.record(record, t0 + seconds - launched)

        def attempt() -> Any:
            r.stats.add(requests=1)
            t0 = time.monotonic()
            try:
                data = fn(r.store)
                seconds = time.monotonic() - t0
                if decode is not None and (self.closed or a.settled):
                    # Given up at its deadline, or the read is over (another replica won, or it
                    # failed): decoding it would only spend a core a later read needs. Not
                    # decoded, it is not judged either (bytes unchecked are no good answer),
                    # as a cancelled attempt is not; a loser's lag was counted as it lost, and
                    # a first attempt's latency still teaches the hedge delay.
                    if reads.settle(a):
                        reads.health.release(r)
                        if record is not None:
                            reads.hedger.record(record, t0 + seconds - launched)
                    return None
                out = decode(data, r.name) if decode is not None else data
            except (UnknownFormatError, ShardTooLargeError):
                # Raised by decode, never by a store request: good bytes in a format not read
                # here, or past a bound of the dataset's, which is no fault of the replica's.
                answered(data, t0, seconds)
                raise
            except BaseException as exc:
                if reads.settle(a):
                    reads.health.finished(r, time.monotonic() - t0, 0, exc, read=read)
                raise
            answered(data, t0, seconds)
            return out

        future = r.store.submit(attempt)

        def on_cancel(f: Future) -> None:
            if f.cancelled() and reads.settle(a):
                reads.health.release(r)

        future.add_done_callback(on_cancel)
        self.pending[future] = a

    def step(self, until: float) -> tuple[bool, Any]:
        """Wait until an attempt ends, a deadline passes or ``until``: ``(True, data)`` when
        one answered; a failed one fails over (:class:`ReadFailedError` and the like when no
        replica is left to try)."""
        stats, cfg = self.reads.stats, self.reads.config
        now = time.monotonic()
        if now >= self.deadline:
            stats.add(failed=1)
            raise ReadTimeoutError(
                f"read {self.what}: no replica answered within {cfg.read_deadline_s:.1f}s "
                f"(tried {', '.join(dict.fromkeys(r.name for r in self.tried))})"
            )
        wake = min([until, self.deadline, *(a.deadline for a in self.pending.values())])
        done, _ = wait(list(self.pending), timeout=wake - now, return_when=FIRST_COMPLETED)
        for future in done:
            a = self.pending.pop(future)
            exc = future.exception()
            if exc is None:
                return True, self._won(a, future.result())
            self._lost(a, exc)
        expired = self._expire_due()
        if (done or expired) and not self.pending:
            self._fail_over()
        return False, None

    def _won(self, a: _Attempt, data: Any) -> Any:
        elapsed = time.monotonic() - self.t0
        self.won_launched = a.launched
        if a.hedge:
            self.reads.hedger.won("get")
        if self.read:  # a metadata request (a header, a size) is no read: wins add up to reads
            a.replica.stats.add(wins=1, hedges_won=int(a.hedge))
            self.reads.stats.latency.record(elapsed)
            self.reads.stats.add(reads=1)
        return data

    def _lost(self, a: _Attempt, exc: BaseException) -> None:
        r = a.replica
        if isinstance(exc, ShardTooLargeError):
            self.reads.stats.add(failed=1)
            raise exc  # a bound of the dataset's, the same on every replica: no failover
        # An unknown format is the dataset's where every replica holds it, but one replica's
        # damaged bytes (a tar whose first block was overwritten) look the same: the others
        # are asked first (_fail_over).
        if isinstance(exc, (ObjectNotFoundError, FileNotFoundError)):
            self.gone.append(r)
        self.errors.append(f"{r.name}: {exc}")
        self.last_exc = exc
        if isinstance(exc, ShardCorruptError):
            # Bad bytes on one replica stay bad: its owner must hear of it.
            r.stats.add(corrupt=1)
            self.reads.tell_corrupt(r, exc)
        else:
            logger.debug("read %s failed on %s: %s", self.what, r.name, exc)

    def _expire_due(self) -> bool:
        """Give up the attempts past their deadline, but one whose time ran out over a stall of
        this process (it gets its time again: no replica's fault); whether there were any."""
        expired = False
        now = time.monotonic()
        for future, a in list(self.pending.items()):
            if now < a.deadline or self.reads.stalled_over(a):
                continue
            if error := self.reads.expire(a, now):
                del self.pending[future]
                self.errors.append(f"{a.replica.name}: {error}")
                self.last_exc, expired = error, True
        return expired

    def _fail_over(self) -> None:
        """Every attempt so far failed: start another, or raise why the request failed."""
        stats, n = self.reads.stats, len(self.reads.health.replicas)
        if len(set(self.gone)) == n:
            self._missing_everywhere()
        last = self.last_exc
        asked_all = len(set(self.tried) | set(self.gone)) == n
        # Bytes that fail their check, or look like another format, on every replica asked
        # stay so: asking again is no use.
        settled = asked_all and isinstance(last, (ShardCorruptError, UnknownFormatError))
        exhausted = self.attempts >= self.reads.config.max_attempts or settled
        if exhausted or not self.launch():
            stats.add(failed=1)
            raise self._failure(last, n, exhausted)
        stats.add(failovers=1)

    def _failure(self, last: BaseException | None, n: int, exhausted: bool) -> BaseException:
        if isinstance(last, UnknownFormatError):
            return last  # as every replica it was read from held it
        if exhausted and isinstance(last, ShardCorruptError):
            if n == 1:
                return last
            tried = ", ".join(dict.fromkeys(r.name for r in self.tried))
            error = ShardCorruptError(
                f"{self.what}: no replica holds bytes that verify (tried {tried}); last: {last}"
            )
        elif exhausted:
            error = ReadFailedError(
                f"read {self.what} failed after {self.attempts} attempts: {self._reasons()}"
            )
        else:
            return ReadFailedError(f"read {self.what} failed: {self._reasons()}")
        error.__cause__ = last
        return error

    def _reasons(self) -> str:
        """The last three distinct errors, each once (the same reason from every attempt, no
        credentials say, was repeated three times)."""
        return "; ".join(list(dict.fromkeys(reversed(self.errors)))[:3][::-1])

    def close(self) -> None:
        """Cancel the attempts still queued; the ones running are discarded, and given up at
        their deadline by a later request."""
        self.closed = True
        orphans = []
        now = time.monotonic()
        for future, a in self.pending.items():
            if future.cancel():
                a.replica.stats.add(cancelled=1)
            else:
                a.replica.stats.add(discarded=1)
                won = self.won_launched
                if self.read and won is not None and a.launched < won and not a.settled:
                    self.reads.health.outrun(a.replica, now - a.launched)
                if a.deadline < math.inf:
                    orphans.append(a)
        if orphans:
            self.reads.adopt(orphans)
