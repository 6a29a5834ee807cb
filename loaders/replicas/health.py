"""Replica health: each replica's latency and errors, which of them are benched, and which one a
read's attempt goes to.

A read's first attempt goes to a healthy replica at random, weighted by speed and load (the
inverse of its latency, the median of its last ``latency_window`` reads, times one plus its reads
in flight). A replica is benched (ejected: sent no reads) for ``bench_s`` after
``bench_after_errors`` consecutive errors, or when its latency exceeds ``bench_slow_factor``
times the best other healthy replica's (at most ``max_benched_slow`` of the replicas at once,
the slowest: one benched at a lower latency goes back to full traffic when a slower one turns up).
The median judges what a typical read costs: a replica slow on every read is benched within
``bench_min_samples`` reads, while a few slow reads on a healthy one, which hedging cuts, do not
bench it. After its bench it is on probation: one first attempt in every ``1 / probation_share``;
``recover_after`` good probation reads in a row restore it, a slow or failed one benches it again
for twice as long (up to ``max_bench_s``).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence

from ckptstore.store import Store
from loaders.config import ReplicaConfig
from loaders.metrics import ReplicaStats

# The replica set's one logger, "loaders.replicas" (what users and ckptbench filter on).
logger = logging.getLogger(__package__)


class Replica:
    """One replica's store, figures and health."""

    def __init__(self, store: Store, config: ReplicaConfig, name: str | None = None) -> None:
        self.store = store
        self.name = name or store.uri
        self.stats = ReplicaStats(self.name)
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


class ReplicaHealth:
    """The replicas of one set, judged by the attempts they served: :meth:`choose` picks one for
    an attempt (counted in flight), :meth:`finished` or :meth:`release` ends it."""

    def __init__(self, stores: Sequence[Store], config: ReplicaConfig) -> None:
        self.config = config
        uris = [s.uri for s in stores]  # a URI on two endpoints is named with its endpoint
        self.replicas = [
            Replica(s, config, s.uri if uris.count(s.uri) == 1 else f"{s.uri} at {s.endpoint}")
            for s in stores
        ]
        self._lock = threading.Lock()
        self._random = random.Random()
        self._firsts = 0  # first attempts of reads so far (the clock of probation)

    def choose(
        self, exclude: Sequence[Replica], *, first: bool, hedge: bool = False
    ) -> Replica | None:
        """A replica for a read's ``first`` attempt (a healthy one at random, weighted by speed
        and load, or a replica on probation whose turn it is), or for a hedge or failover (the
        best healthy one). A replica on its bench only when no other is left, never for a
        hedge."""
        now = time.monotonic()
        share = round(1 / self.config.probation_share)
        with self._lock:
            candidates = [r for r in self.replicas if r not in exclude]
            if not candidates:
                return None
            if first:
                self._firsts += 1
            healthy = [r for r in candidates if not r.benched]
            if hedge:  # a replica measured too slow to win the race is not asked to run it
                healthy = [r for r in healthy if not self._measured_slow(r)]
            probation = [r for r in candidates if r.benched and r.benched_until <= now]
            due = [r for r in probation if r.inflight == 0 and self._firsts >= r.probe_due]
            if first and due:
                choice = due[0]
                choice.probe_due = self._firsts + share
            elif healthy:
                choice = self._pick(healthy) if first else min(healthy, key=Replica.score)
            elif hedge:  # a replica on probation is probed by first attempts, not raced
                return None
            elif probation:
                choice = min(probation, key=Replica.score)
            else:
                choice = min(candidates, key=lambda r: r.benched_until)
            choice.inflight += 1
            return choice

    def release(self, r: Replica) -> None:
        """``r`` was chosen for an attempt that never ran."""
        with self._lock:
            r.inflight -= 1

    def _pick(self, healthy: list[Replica]) -> Replica:
        idle_unmeasured = [r for r in healthy if not r.samples and not r.inflight]
        if idle_unmeasured:
            return idle_unmeasured[0]
        healthy = [r for r in healthy if r.samples] or healthy
        if not healthy[0].samples:  # none measured yet, all busy
            return min(healthy, key=lambda r: r.inflight)
        weights = [1 / r.score() for r in healthy]
        return self._random.choices(healthy, weights)[0]

    def finished(
        self, r: Replica, seconds: float, nbytes: int, error: BaseException | None, *, read: bool
    ) -> None:
        """Account an attempt on ``r``; the latencies of data reads (``read``), not of metadata
        requests, judge its health."""
        cfg = self.config
        benched_for: str | None = None
        displaced: Replica | None = None
        recovered = False
        with self._lock:
            r.inflight -= 1
            now = time.monotonic()
            on_probation = r.benched and r.benched_until <= now
            others = [o.latency for o in self.replicas if o is not r and not o.benched]
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
                else:
                    benched_for, displaced = self._judge_latency(r, now, best)
            elif error is not None:
                r.consecutive_errors += 1
                if on_probation or (
                    not r.benched and r.consecutive_errors >= cfg.bench_after_errors
                ):
                    benched_for = f"after {r.consecutive_errors} consecutive errors ({error})"
                    self._bench(r, now, slow=False)
            bench_s = r.benched_until - now
        if error is None:
            if read:
                r.stats.record_latency(seconds)
            r.stats.add(bytes=nbytes)
        else:
            r.stats.add(errors=1)
        self._tell(r, benched_for, bench_s, displaced)
        if recovered:
            logger.info("replica %s recovered: back to full traffic", r.name)

    def outrun(self, r: Replica, seconds: float) -> None:
        """An attempt on ``r`` still running ``seconds`` after it started when an attempt that
        started after it, on another replica, answered its read: a bound below its latency,
        measured as a read's. A replica that never answers (each read of its own won by a hedge,
        none given up at its deadline yet) is so measured slow, not unknown: no hedge goes to
        it, and once it has ``bench_min_samples`` it is judged by the latency rule (a stall
        that several reads in flight saw moves its median no more than one slow read)."""
        with self._lock:
            if r.benched:
                return
            r.measured(seconds)
            now = time.monotonic()
            others = [o.latency for o in self.replicas if o is not r and not o.benched]
            benched_for, displaced = self._judge_latency(r, now, min(others, default=math.inf))
            bench_s = r.benched_until - now
        self._tell(r, benched_for, bench_s, displaced)

    def _measured_slow(self, r: Replica) -> bool:
        """(under the lock) Whether ``r``'s latency, measured, is past the bench threshold
        against the best other healthy replica's."""
        cfg = self.config
        best = min(
            (o.latency for o in self.replicas if o is not r and not o.benched), default=math.inf
        )
        slow = r.latency > max(cfg.bench_slow_factor * best, best + cfg.bench_slow_margin_s)
        return r.samples > 0 and slow

    def _judge_latency(
        self, r: Replica, now: float, best: float
    ) -> tuple[str | None, Replica | None]:
        """(under the lock) Bench healthy ``r`` if its latency is too far above ``best``: why,
        and the replica that went back to full traffic in its place, if any."""
        cfg = self.config
        displaced = None
        if (
            not r.benched
            and r.samples >= cfg.bench_min_samples
            and r.latency > max(cfg.bench_slow_factor * best, best + cfg.bench_slow_margin_s)
            and (self._may_bench_slow() or (displaced := self._displace_for(r)))
        ):
            why = f"latency {r.latency * 1e3:.1f} ms is {r.latency / best:.1f}x the best healthy"
            self._bench(r, now, slow=True)  # forgets the latency: said above first
            return why + " replica's", displaced
        return None, displaced

    def _tell(
        self, r: Replica, benched_for: str | None, bench_s: float, displaced: Replica | None
    ) -> None:
        if benched_for is not None:
            r.stats.add(benched=1)
            logger.warning("replica %s benched for %.1fs: %s", r.name, bench_s, benched_for)
        if displaced is not None:
            logger.info(
                "replica %s back to full traffic: %s is slower and takes its place on the bench",
                displaced.name,
                r.name,
            )

    def unreachable(self, r: Replica, error: BaseException, why: str = "unreachable") -> None:
        """``r`` did not answer a request of the dataset's opening (its survey), or holds an object
        unsafe to read (``why`` says which): benched now,
        so that the requests after it (headers, the first reads) go to the replicas that did,
        rather than each waiting for its deadline until errors bench it."""
        with self._lock:
            if r.benched:
                return
            r.consecutive_errors += 1
            self._bench(r, time.monotonic(), slow=False)
            bench_s = r.benched_until - time.monotonic()
        r.stats.add(requests=1, errors=1, benched=1)  # the request that failed was one
        logger.warning(
            "replica %s benched for %.1fs: %s as the dataset opened (%s)",
            r.name,
            bench_s,
            why,
            error,
        )

    def _may_bench_slow(self) -> bool:
        n = len(self.replicas)
        share = self.config.max_benched_slow
        cap = max(1, math.floor(n * share)) if share > 0 else 0
        return n > 1 and sum(r.benched and r.benched_slow for r in self.replicas) < cap

    def _displace_for(self, r: Replica) -> Replica | None:
        """With as many replicas benched for latency as may be, the one benched at the lowest
        latency if ``r`` is slower: it goes back to full traffic so that ``r`` takes its place
        (a stall that benched a healthy replica must not keep a slow one serving)."""
        if not self.config.max_benched_slow:
            return None
        benched = [o for o in self.replicas if o.benched and o.benched_slow]
        faster = min(benched, key=lambda o: o.benched_latency, default=None)
        if faster is None or faster.benched_latency >= r.latency:
            return None
        self._restore(faster)
        return faster

    def _bench(self, r: Replica, now: float, *, slow: bool) -> None:
        r.benched = True
        r.benched_slow = slow
        r.benched_latency = r.latency
        r.benched_until = now + r.bench_s
        r.bench_s = min(r.bench_s * 2, self.config.max_bench_s)
        r.probation_ok = 0
        r.probe_due = self._firsts
        r.forget()  # probation measures it afresh

    def _restore(self, r: Replica) -> None:
        r.benched = r.benched_slow = False
        r.bench_s = self.config.bench_s
        r.probation_ok = 0

    def start_as(self, benched: frozenset[str], latencies: dict[str, float]) -> None:
        """Start where the last pass's workers left off (a worker's replicas start afresh): the
        replicas named in ``benched`` start their bench now (probation after it, as any; never
        every replica), the others' latency at the median ``latencies`` gives (one sample), so
        that a pass's first reads go neither to a replica known to be bad nor to one at
        random."""
        now = time.monotonic()
        with self._lock:
            bench = [r for r in self.replicas if r.name in benched]
            for r in self.replicas:
                if r in bench and len(bench) < len(self.replicas):
                    self._bench(r, now, slow=False)
                elif (seconds := latencies.get(r.name)) is not None:
                    r.measured(seconds)

    def states(self) -> dict[str, str]:
        """Each replica's state: ``healthy``, ``benched`` (sent no reads) or ``probation`` (a
        share of first attempts)."""
        now = time.monotonic()
        states = {}
        for r in self.replicas:
            if not r.benched:
                states[r.name] = "healthy"
            else:
                states[r.name] = "benched" if r.benched_until > now else "probation"
        return states
