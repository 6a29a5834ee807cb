"""Reads over replicas of one dataset: healthy replicas first, failover, benching, hedged reads.

A read's first attempt goes to a healthy replica at random, weighted by speed and load (the
inverse of its latency, the median of its last ``latency_window`` reads, times one plus its reads
in flight). A replica is benched (ejected: sent no reads) for ``bench_s`` after
``bench_after_errors`` consecutive errors, or when its latency exceeds ``bench_slow_factor``
times the best other healthy replica's (at most ``max_benched_slow`` of the replicas at once,
the slowest: one benched at a lower latency goes back to full traffic when a slower one turns up).
The median judges what a typical read costs: a replica slow on every read is benched within
``bench_min_samples`` reads, while a few slow reads on a healthy one, which hedging cuts, do not
bench it. After its bench it is on probation: one
first attempt in every ``1 / probation_share``; ``recover_after`` good probation reads in a row
restore it, a slow or failed one benches it again for twice as long (up to ``max_bench_s``).
An error or a timeout fails over to another replica at once. When a read has not completed
after the hedge delay (the p96.5 of recent first attempts of its size class, outliers left out;
learnt within the first reads), a duplicate goes to the best healthy replica if the hedge
budget allows (the store's
:class:`~ckptstore.store.Hedger` decides when and whether; this set decides where); the first
answer wins and the others are cancelled: not started if still queued, otherwise their result
is discarded. Every attempt is bounded by the replica Store's per-attempt deadline and the whole
read by ``read_deadline_s``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptstore.errors import ObjectNotFoundError, StorageError, StorageTimeoutError
from ckptstore.store import Hedger, RetryPolicy, Store
from loaders.config import ReplicaConfig
from loaders.errors import (
    ReadFailedError,
    ReadTimeoutError,
    ReplicaMismatchError,
    ShardCorruptError,
    ShardNotFoundError,
    UnknownFormatError,
)
from loaders.metrics import ReadStats, ReplicaStats

logger = logging.getLogger(__name__)

R = TypeVar("R")

_NAMED = 50  # shards named at most in one warning line


def replica_retry_policy(config: ReplicaConfig) -> RetryPolicy:
    """One attempt per replica request (the replica set fails over itself), under its deadline."""
    return RetryPolicy(attempts=1, timeout_s=config.attempt_timeout_s)


class _Replica:
    def __init__(self, store: Store, config: ReplicaConfig) -> None:
        self.store = store
        self.name = store.uri
        self.stats = ReplicaStats(store.uri)
        self.recent: deque[float] = deque(maxlen=config.latency_window)
        self.latency = math.inf  # median of recent: what a typical read costs (inf: unknown)
        self.samples = 0
        self.inflight = 0
        self.consecutive_errors = 0
        self.benched = False  # benched until benched_until, then on probation until recovered
        self.benched_slow = False  # benched for its latency rather than for errors
        self.benched_until = 0.0
        self.benched_latency = 0.0  # its latency when benched for being slow
        self.bench_s = config.bench_s
        self.probation_ok = 0
        self.probe_due = 0  # the first attempt (counted by the set) from which it may be probed

    def measured(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.latency = statistics.median(self.recent)
        self.samples += 1

    def forget(self) -> None:
        self.recent.clear()
        self.latency = math.inf
        self.samples = 0

    def score(self) -> float:
        return self.latency * (1 + self.inflight)


@dataclass(eq=False)
class _Attempt:
    """One request of a read to one replica, settled (accounted for) once: at its end, or at
    ``deadline``, when the read (or, for a loser still running after its read returned, the
    next read) gives it up."""

    replica: _Replica
    hedge: bool
    deadline: float
    launched: float
    what: str
    settled: bool = False


class ReplicaSet:
    """Several stores holding the same objects, read as one.

    ``missing`` maps a shard key to the URIs of replicas known to lack it (what
    :meth:`find_shards` found); reads of that key skip them."""

    def __init__(
        self,
        replicas: Sequence[str | os.PathLike | Store],
        *,
        config: ReplicaConfig | None = None,
        storage_options: dict[str, Any] | None = None,
        missing: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        if isinstance(replicas, (str, os.PathLike, Store)):
            replicas = [replicas]
        if not replicas:
            raise ValueError("a dataset needs at least one replica URI")
        self.config = config or ReplicaConfig()
        policy = replica_retry_policy(self.config)
        stores = [
            r if isinstance(r, Store) else Store(r, storage_options=storage_options, retry=policy)
            for r in replicas
        ]
        names = [s.uri for s in stores]
        if len(set(names)) != len(names):
            raise ValueError(f"replica URIs repeat: {names}")
        self._replicas = [_Replica(s, self.config) for s in stores]
        self._lock = threading.Lock()
        self._random = random.Random()
        self._firsts = 0  # first attempts of reads so far (the clock of probation)
        self._orphans: list[_Attempt] = []  # losers of returned reads, still running
        self.hedger = Hedger(self.config.hedge_policy())
        self.stats = ReadStats()
        self.missing: dict[str, frozenset[str]] = {
            key: frozenset(uris) for key, uris in (missing or {}).items()
        }

    @property
    def uris(self) -> list[str]:
        return [r.name for r in self._replicas]

    def __len__(self) -> int:
        return len(self._replicas)

    # -- choosing a replica -----------------------------------------------------------------

    def _choose(
        self, exclude: Sequence[_Replica], *, first: bool, hedge: bool = False
    ) -> _Replica | None:
        """A replica for a read's ``first`` attempt (a healthy one at random, weighted by speed
        and load, or a replica on probation whose turn it is), or for a hedge or failover (the
        best healthy one). A replica on its bench only when no other is left, never for a
        hedge."""
        now = time.monotonic()
        share = round(1 / self.config.probation_share)
        with self._lock:
            candidates = [r for r in self._replicas if r not in exclude]
            if not candidates:
                return None
            if first:
                self._firsts += 1
            healthy = [r for r in candidates if not r.benched]
            probation = [r for r in candidates if r.benched and r.benched_until <= now]
            due = [r for r in probation if r.inflight == 0 and self._firsts >= r.probe_due]
            if first and due:
                choice = due[0]
                choice.probe_due = self._firsts + share
            elif healthy:
                choice = self._pick(healthy) if first else min(healthy, key=_Replica.score)
            elif probation:
                choice = min(probation, key=_Replica.score)
            elif hedge:
                return None
            else:
                choice = min(candidates, key=lambda r: r.benched_until)
            choice.inflight += 1
            return choice

    def _pick(self, healthy: list[_Replica]) -> _Replica:
        idle_unmeasured = [r for r in healthy if not r.samples and not r.inflight]
        if idle_unmeasured:
            return idle_unmeasured[0]
        healthy = [r for r in healthy if r.samples] or healthy
        if not healthy[0].samples:  # none measured yet, all busy
            return min(healthy, key=lambda r: r.inflight)
        weights = [1 / r.score() for r in healthy]
        return self._random.choices(healthy, weights)[0]

    def _finished(
        self, r: _Replica, seconds: float, nbytes: int, error: BaseException | None, *, read: bool
    ):
        """Account an attempt on ``r``; the latencies of data reads (``read``), not of metadata
        requests, judge its health."""
        cfg = self.config
        benched_for: str | None = None
        displaced: _Replica | None = None
        recovered = False
        with self._lock:
            r.inflight -= 1
            now = time.monotonic()
            on_probation = r.benched and r.benched_until <= now
            others = [o.latency for o in self._replicas if o is not r and not o.benched]
            best = min(others, default=math.inf)
            if error is None:
                r.consecutive_errors = 0
            if error is None and read and (on_probation or not r.benched):
                r.measured(seconds)
                if on_probation:
                    if seconds <= max(cfg.bench_slow_factor * best, best + cfg.bench_slow_margin_s):
                        r.probation_ok += 1
                        if r.probation_ok >= cfg.recover_after:
                            self._restore(r)
                            recovered = True
                    else:
                        benched_for = f"a probation read took {seconds * 1e3:.1f} ms"
                        self._bench(r, now, slow=True)
                elif (
                    not r.benched
                    and r.samples >= cfg.bench_min_samples
                    and r.latency
                    > max(cfg.bench_slow_factor * best, best + cfg.bench_slow_margin_s)
                    and (self._may_bench_slow() or (displaced := self._displace_for(r)))
                ):
                    benched_for = (
                        f"latency {r.latency * 1e3:.1f} ms is {r.latency / best:.1f}x the best "
                        "healthy replica's"
                    )
                    self._bench(r, now, slow=True)
            elif error is not None:
                r.consecutive_errors += 1
                if on_probation or (
                    not r.benched and r.consecutive_errors >= cfg.bench_after_errors
                ):
                    benched_for = f"after {r.consecutive_errors} consecutive errors ({error})"
                    self._bench(r, now, slow=False)
            bench_s = r.benched_until - now
        if error is None:
            r.stats.record_latency(seconds)
            r.stats.add(bytes=nbytes)
        else:
            r.stats.add(errors=1)
        if benched_for is not None:
            r.stats.add(benched=1)
            logger.warning("replica %s benched for %.1fs: %s", r.name, bench_s, benched_for)
        if recovered:
            logger.info("replica %s recovered: back to full traffic", r.name)
        if displaced is not None:
            logger.info(
                "replica %s back to full traffic: %s is slower and takes its place on the bench",
                displaced.name,
                r.name,
            )

    def _may_bench_slow(self) -> bool:
        n = len(self._replicas)
        share = self.config.max_benched_slow
        cap = max(1, math.floor(n * share)) if share > 0 else 0
        return n > 1 and sum(r.benched and r.benched_slow for r in self._replicas) < cap

    def _displace_for(self, r: _Replica) -> _Replica | None:
        """With as many replicas benched for latency as may be, the one benched at the lowest
        latency if ``r`` is slower: it goes back to full traffic so that ``r`` takes its place
        (a stall that benched a healthy replica must not keep a slow one serving)."""
        if not self.config.max_benched_slow:
            return None
        benched = [o for o in self._replicas if o.benched and o.benched_slow]
        faster = min(benched, key=lambda o: o.benched_latency, default=None)
        if faster is None or faster.benched_latency >= r.latency:
            return None
        self._restore(faster)
        return faster

    def _bench(self, r: _Replica, now: float, *, slow: bool) -> None:
        r.benched = True
        r.benched_slow = slow
        r.benched_latency = r.latency
        r.benched_until = now + r.bench_s
        r.bench_s = min(r.bench_s * 2, self.config.max_bench_s)
        r.probation_ok = 0
        r.probe_due = self._firsts
        r.forget()  # probation measures it afresh

    def _restore(self, r: _Replica) -> None:
        r.benched = r.benched_slow = False
        r.bench_s = self.config.bench_s
        r.probation_ok = 0

    def _start(
        self,
        r: _Replica,
        fn: Callable[[Store], Any],
        post: Callable[[Any, str], Any] | None,
        primary_nbytes: int | None,
        read: bool,
        nbytes: int,
        is_hedge: bool,
        what: str,
    ) -> tuple[Future, _Attempt]:
        """Run ``fn(store)`` on replica ``r`` in a thread of its store, then ``post(result,
        replica)`` (a decode that may find the bytes corrupt); the outcome updates r's
        statistics, unless the read gave the attempt up at its deadline first. The latency of a
        read's first attempt (``primary_nbytes`` given), won or not, feeds the hedge delay,
        timed from here as the read's hedge timer is (a hand-over to a busy thread counts in
        both)."""
        launched = time.monotonic()
        # A data read runs in this thread with no deadline of the store's own (in_thread):
        # the read gives it up at the deadline the store would have set.
        bound = launched + r.store.retry.deadline_s(nbytes) if read else math.inf
        a = _Attempt(r, is_hedge, bound, launched, what)

        def answered(data: Any, t0: float, seconds: float) -> None:
            if self._settle(a):
                nbytes = len(data) if isinstance(data, (bytes, memoryview)) else 0
                self._finished(r, seconds, nbytes, None, read=read)
                if primary_nbytes is not None:
                    self.hedger.record(primary_nbytes, t0 + seconds - launched)

        def attempt() -> Any:
            r.stats.add(requests=1)
            t0 = time.monotonic()
            try:
                data = fn(r.store)
                seconds = time.monotonic() - t0
                out = post(data, r.name) if post is not None else data
            except UnknownFormatError:
                # Raised by post, never by a store request: good bytes in a format not read
                # here, which is no fault of the replica's.
                answered(data, t0, seconds)
                raise
            except BaseException as exc:
                if self._settle(a):
                    self._finished(r, time.monotonic() - t0, 0, exc, read=read)
                raise
            answered(data, t0, seconds)
            return out

        future = r.store.submit(attempt)

        def on_cancel(f: Future) -> None:
            if f.cancelled() and self._settle(a):
                with self._lock:
                    r.inflight -= 1

        future.add_done_callback(on_cancel)
        return future, a

    def _sweep_orphans(self, now: float) -> None:
        """Give up the losers of earlier reads that are past their deadline: a hung one counts
        as its replica's error and stops holding a slot in flight, as a store attempt would."""
        with self._lock:
            due = [a for a in self._orphans if a.settled or now >= a.deadline]
            if due:
                self._orphans = [a for a in self._orphans if not (a.settled or now >= a.deadline)]
        for a in due:
            self._expire(a, now)

    def _settle(self, a: _Attempt) -> bool:
        """Whether the caller is first to account for attempt ``a`` (its end, or its deadline)."""
        with self._lock:
            first, a.settled = not a.settled, True
            return first

    def _expire(self, a: _Attempt, now: float) -> StorageTimeoutError | None:
        """Give up attempt ``a`` at its deadline (it runs on, ignored): counted as an error of
        its replica, like a Store attempt past its deadline; None if it ended first."""
        if not self._settle(a):
            return None
        r = a.replica
        error = StorageTimeoutError(
            f"read {a.what} from {r.name}: no answer within {now - a.launched:.1f}s"
        )
        self._finished(r, now - a.launched, 0, error, read=True)
        logger.warning("replica %s: %s", r.name, error, extra={"loaders_attempt_timeout": True})
        return error

    # -- reads ------------------------------------------------------------------------------

    def read(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        *,
        decode: Callable[[bytes, str], Any] | None = None,
        size_hint: int = 0,
        view: bool = False,
    ) -> Any:
        """The bytes of ``key`` (or ``[start, end)`` of it) from whichever replica answers first,
        passed through ``decode(data, replica)`` when given. A decode error (corrupt bytes) counts
        as that replica's error and fails over to another replica. With ``view`` the data may be
        a read-only buffer instead of bytes: on a local replica, a memory map of the file's pages
        (``Store.get_view``)."""
        what = key if start is None else f"{key}[{start}:{end}]"
        nbytes = (end - (start or 0)) if end is not None else size_hint
        get = Store.get_view if view else Store.get
        return self._hedged(
            what,
            nbytes,
            lambda store: get(store, key, start, end, in_thread=True),
            decode,
            hedge=True,
            count=True,
            key=key,
        )

    def call(self, what: str, fn: Callable[[Store], R]) -> R:
        """``fn(store)`` on the best replica, failing over on errors (never hedged)."""
        return self._hedged(what, 0, fn, None, hedge=False, count=False)

    def size(self, key: str) -> int:
        """The size of ``key`` on the best replica not known to lack it (never hedged)."""
        return self._hedged(
            f"size {key}", 0, lambda store: store.size(key), None, hedge=False, count=False, key=key
        )

    def _hedged(
        self,
        what: str,
        nbytes: int,
        fn: Callable[[Store], Any],
        post: Callable[[Any, str], Any] | None,
        *,
        hedge: bool,
        count: bool,
        key: str | None = None,
    ) -> Any:
        cfg = self.config
        t0 = time.monotonic()
        if self._orphans:
            self._sweep_orphans(t0)
        deadline = t0 + cfg.read_deadline_s
        lacking = self.missing.get(key, frozenset()) if key is not None else frozenset()
        gone: list[_Replica] = [r for r in self._replicas if r.name in lacking]
        if len(gone) == len(self._replicas):
            self.stats.add(failed=1)
            raise ShardNotFoundError(
                f"{what} is missing from every replica ({', '.join(self.uris)})"
            )
        hedge = hedge and cfg.hedge and cfg.max_hedges > 0 and len(self._replicas) - len(gone) > 1
        if hedge:
            self.hedger.admit()
        pending: dict[Future, _Attempt] = {}
        tried: list[_Replica] = []
        errors: list[str] = []
        last_exc: BaseException | None = None
        attempts = hedges = 0

        def launch(is_hedge: bool, reserve: float = 0.0) -> bool:
            """Start an attempt; a hedge only with a replica free for it and a budget token."""
            busy = [a.replica for a in pending.values()] + gone
            initial = not tried
            r = self._choose(
                busy + [t for t in tried if t not in busy], first=initial, hedge=is_hedge
            )
            if r is None and not is_hedge:
                r = self._choose(busy, first=False)  # every replica tried: retry one not in flight
            if r is None:
                return False
            if is_hedge and not self.hedger.try_hedge("get", reserve=reserve):
                with self._lock:
                    r.inflight -= 1
                return False
            tried.append(r)
            if is_hedge:
                r.stats.add(hedges_fired=1)
            first = nbytes if hedge and initial and not r.benched else None
            future, attempt = self._start(r, fn, post, first, count, nbytes, is_hedge, what)
            pending[future] = attempt
            return True

        launch(False)
        attempts = 1
        next_hedge = t0 + self.hedger.delay_s(nbytes) if hedge else math.inf
        # Until the delay is learnt, a read looks again now and then so that it hedges at the
        # learnt delay as soon as one is known, not at the initial guess.
        guessing = hedge and not self.hedger.learnt(nbytes)
        poll = cfg.hedge_initial_delay_s / 8
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    self.stats.add(failed=1)
                    raise ReadTimeoutError(
                        f"read {what}: no replica answered within {cfg.read_deadline_s:.1f}s "
                        f"(tried {', '.join(r.name for r in tried)})"
                    )
                if guessing and not hedges:
                    if self.hedger.learnt(nbytes):
                        guessing = False
                        next_hedge = t0 + self.hedger.delay_s(nbytes)
                        continue
                    wake = min(deadline, next_hedge, now + poll)
                else:
                    wake = min(deadline, next_hedge)
                wake = min([wake, *(a.deadline for a in pending.values())])
                done, _ = wait(list(pending), timeout=wake - now, return_when=FIRST_COMPLETED)
                for future in done:
                    a = pending.pop(future)
                    r, is_hedge = a.replica, a.hedge
                    exc = future.exception()
                    if exc is None:
                        data = future.result()
                        elapsed = time.monotonic() - t0
                        r.stats.add(wins=1, hedges_won=int(is_hedge))
                        if is_hedge:
                            self.hedger.won("get")
                        if count:
                            self.stats.latency.record(elapsed)
                            self.stats.add(reads=1)
                        return data
                    if isinstance(exc, UnknownFormatError):
                        self.stats.add(failed=1)
                        raise exc  # every replica holds the same bytes: no failover
                    if isinstance(exc, (ObjectNotFoundError, FileNotFoundError)):
                        gone.append(r)
                    errors.append(f"{r.name}: {exc}")
                    last_exc = exc
                    if isinstance(exc, ShardCorruptError):
                        # Bad bytes on one replica stay bad: its owner must hear of it.
                        r.stats.add(corrupt=1)
                        logger.warning("replica %s returned corrupt data: %s", r.name, exc)
                    else:
                        logger.debug("read %s failed on %s: %s", what, r.name, exc)
                expired = False
                now = time.monotonic()
                for future, a in list(pending.items()):
                    if now >= a.deadline and (error := self._expire(a, now)):
                        del pending[future]
                        errors.append(f"{a.replica.name}: {error}")
                        last_exc, expired = error, True
                if (done or expired) and not pending:
                    if len(set(gone)) == len(self._replicas):
                        self.stats.add(failed=1)
                        raise ShardNotFoundError(
                            f"{what} is missing from every replica ({', '.join(self.uris)})"
                        )
                    if attempts >= cfg.max_attempts or (
                        isinstance(last_exc, ShardCorruptError)
                        and len(set(tried) | set(gone)) == len(self)
                    ):
                        self.stats.add(failed=1)
                        if isinstance(last_exc, ShardCorruptError):
                            raise ShardCorruptError(
                                f"{last_exc} (and on every other replica tried)"
                                if len(self) > 1
                                else str(last_exc)
                            ) from last_exc
                        raise ReadFailedError(
                            f"read {what} failed after {attempts} attempts: {'; '.join(errors[-3:])}"
                        ) from last_exc
                    if not launch(False):
                        self.stats.add(failed=1)
                        raise ReadFailedError(f"read {what} failed: {'; '.join(errors[-3:])}")
                    attempts += 1
                    self.stats.add(failovers=1)
                if now >= next_hedge or time.monotonic() >= next_hedge:
                    spare = len(pending) + len(set(gone)) < len(self._replicas)
                    reserve = cfg.hedge_burst / 2 if hedges else 0.0
                    delay = self.hedger.delay_s(nbytes)
                    if hedges >= cfg.max_hedges:
                        next_hedge = math.inf
                    elif spare and launch(True, reserve):
                        hedges += 1
                        self.stats.add(hedges=1)
                        next_hedge = time.monotonic() + delay
                    else:
                        # No token or no free replica yet: a first hedge looks again soon, a
                        # later one (doubly slow, often with every healthy replica tried) after
                        # another delay, not in a loop of wake-ups for the rest of the read.
                        self.stats.add(hedges_refused=1)
                        next_hedge = time.monotonic() + (delay if hedges else delay / 4)
        finally:
            orphans = []
            for future, a in pending.items():
                if future.cancel():
                    a.replica.stats.add(cancelled=1)
                else:
                    a.replica.stats.add(discarded=1)
                    if a.deadline < math.inf:
                        orphans.append(a)
            if orphans:
                with self._lock:
                    self._orphans.extend(orphans)

    # -- whole-dataset checks ---------------------------------------------------------------

    def read_same(self, key: str) -> bytes:
        """``key`` from every replica; :class:`ReplicaMismatchError` if any two differ."""
        first = self.read(key)
        if len(self._replicas) > 1 and self.config.verify_replicas:
            for r in self._replicas:
                try:
                    other = r.store.get(key)
                except ObjectNotFoundError as exc:
                    raise ReplicaMismatchError(f"replica {r.name} lacks {key}") from exc
                except StorageError as exc:
                    logger.warning("replica %s not verified, unreachable: %s", r.name, exc)
                    continue
                if other != first:
                    raise ReplicaMismatchError(
                        f"replica {r.name} holds a different {key} than the others "
                        f"({len(other)} vs {len(first)} bytes)"
                    )
        return first

    def find_shards(
        self, keys: Sequence[str] | None = None, *, suffix: str | tuple[str, ...] = ""
    ) -> dict[str, int]:
        """The dataset's shards and their sizes, in dataset order, asked of every replica.

        ``keys`` is the declared shard list (the authority): a key no replica holds raises
        :class:`ShardNotFoundError`. Without it every replica is listed and the shard set is
        the union of the keys ending in ``suffix`` (or any of a tuple of them), sorted (a shard missing from every replica
        cannot be seen that way: declare the list). A replica lacking shards that others hold
        gets one WARNING naming them and is not read for them (:attr:`missing`); sizes that
        differ between replicas raise :class:`ReplicaMismatchError`. An unreachable replica
        is skipped with a warning. With ``verify_replicas`` off, declared keys are not asked
        of every replica (only listings are compared) and sizes come from one replica each.
        """
        verify = self.config.verify_replicas
        if keys is not None and not verify:
            return dict(zip(keys, self._sizes(keys)))
        with ThreadPoolExecutor(len(self._replicas)) as pool:
            found = list(pool.map(lambda r: self._survey(r, keys, suffix, verify), self._replicas))
        answered = {r: f for r, f in zip(self._replicas, found) if isinstance(f, dict)}
        if not answered:
            raise ReadFailedError(
                f"no replica answered a listing or size request: {found[-1]}"
            ) from found[-1]
        if keys is None:
            keys = sorted(set().union(*answered.values()))
        tried = ", ".join(r.name for r in answered)
        down = [r.name for r in self._replicas if r not in answered]
        sizes: dict[str, int | None] = {}
        for key in keys:
            have = [(r, f[key]) for r, f in answered.items() if key in f]
            if not have:
                raise ShardNotFoundError(
                    f"shard {key} is missing from every replica (tried {tried}"
                    + (f"; unreachable: {', '.join(down)})" if down else ")")
                )
            (first, size), *others = have
            for r, got in others:
                if got is not None and size is not None and got != size:
                    raise ReplicaMismatchError(
                        f"shard {key} is {got} bytes on replica {r.name}, {size} on replica "
                        f"{first.name}: replicas differ"
                    )
            sizes[key] = size
        lacking: dict[str, set[str]] = {}
        for r, f in answered.items():
            absent = [key for key in keys if key not in f]
            if absent:
                shown = ", ".join(absent[:_NAMED]) + (
                    f" (+{len(absent) - _NAMED} more)" if len(absent) > _NAMED else ""
                )
                logger.warning(
                    "replica %s lacks %d of %d shards, read from the other replicas: %s",
                    r.name,
                    len(absent),
                    len(keys),
                    shown,
                )
                for key in absent:
                    lacking.setdefault(key, set()).add(r.name)
        for key, uris in lacking.items():
            self.missing[key] = self.missing.get(key, frozenset()) | uris
        unknown = [key for key, size in sizes.items() if size is None]
        asked = dict(zip(unknown, self._sizes(unknown)))
        return {key: asked[key] if size is None else size for key, size in sizes.items()}

    def _sizes(self, keys: Sequence[str]) -> list[int]:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(self.size, keys))

    @staticmethod
    def _survey(
        r: _Replica, keys: Sequence[str] | None, suffix: str | tuple[str, ...], sizes: bool
    ) -> dict[str, int | None] | StorageError:
        """Replica ``r``'s shards (``keys`` it holds, or its listing) with their sizes (None
        when not ``sizes``), or the error that made it unreachable."""
        try:
            if keys is None:
                keys = [k for k in r.store.list("") if k.endswith(suffix)]
                if not sizes:
                    return dict.fromkeys(keys)

            def size(key: str) -> int:
                try:
                    return r.store.size(key)
                except ObjectNotFoundError:
                    return -1

            got = list(r.store.map(size, keys, max_concurrency=16))
        except StorageError as exc:
            logger.warning("replica %s not checked, unreachable: %s", r.name, exc)
            return exc
        return {key: n for key, n in zip(keys, got) if n >= 0}

    def check_sizes(self, sizes: dict[str, int]) -> None:
        """Every replica holds each key with the expected size, else one clear error."""
        if not self.config.verify_replicas:
            return
        keys = list(sizes)
        for r in self._replicas:

            def size(key: str, store: Store = r.store) -> int:
                try:
                    return store.size(key)
                except ObjectNotFoundError:
                    return -1

            try:
                got_sizes = list(r.store.map(size, keys, max_concurrency=16))
            except StorageError as exc:  # down now: its reads are still checked when decoded
                logger.warning("replica %s not verified, unreachable: %s", r.name, exc)
                continue
            for key, got in zip(keys, got_sizes):
                if got < 0:
                    raise ShardNotFoundError(f"shard {key} is missing from replica {r.name}")
                if got != sizes[key]:
                    raise ReplicaMismatchError(
                        f"shard {key} is {got} bytes on replica {r.name}, expected {sizes[key]}: "
                        "replicas differ"
                    )

    def replica_stats(self) -> dict[str, ReplicaStats]:
        return {r.name: r.stats for r in self._replicas}

    def health(self) -> dict[str, str]:
        """Each replica's state: ``healthy``, ``benched`` (sent no reads) or ``probation`` (a
        share of first attempts)."""
        now = time.monotonic()
        states = {}
        for r in self._replicas:
            if not r.benched:
                states[r.name] = "healthy"
            else:
                states[r.name] = "benched" if r.benched_until > now else "probation"
        return states

    def metrics(self) -> dict[str, Any]:
        health = self.health()
        return {
            "reads": self.stats.as_dict(),
            "hedge_tokens": self.hedger.tokens,
            "hedge_delay_s": self.hedger.delays(),
            "replicas": {
                r.name: {**r.stats.as_dict(), "health": health[r.name]} for r in self._replicas
            },
        }
