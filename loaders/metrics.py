"""Counters and latency histograms of the loader: per replica, per read, for the consumer and
for the cache, and the reports that carry them out of DataLoader worker processes.

Every stats object pickles (its counts and histograms travel as data) and merges into another
of its kind: counts add up, histograms merge, high-water marks take the maximum.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ckptstore import telemetry
from ckptstore.store.processes import machine_tag, pid_gone
from ckptstore.telemetry import Counts
from ckptstore.telemetry.latency import LatencyHistogram

logger = logging.getLogger(__name__)


def _count(name: str) -> property:
    def get(self: _Stats) -> float:
        return self.counts[name]

    def set(self: _Stats, value: float) -> None:
        self.counts.set(name, value)

    return property(get, set, doc=f"The count {name!r} (in ``counts``).")


class _Stats:
    """Counts (``_COUNTS``, in ``counts``, each readable as an attribute), high-water marks
    (``_MAXIMA``) and latency histograms (``_HISTOGRAMS``) that pickle and merge.

    The process-wide series a kind feeds (``_series``) are attached to its counts once it
    records in this process: a copy that only carries figures (a worker's report) feeds none.
    """

    _COUNTS: tuple[str, ...] = ()
    _MAXIMA: tuple[str, ...] = ()
    _HISTOGRAMS: tuple[str, ...] = ()

    def __init_subclass__(cls) -> None:
        for name in cls._COUNTS:
            setattr(cls, name, _count(name))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attached = False
        self.counts = Counts()
        for name in self._MAXIMA:
            setattr(self, name, 0)
        for name in self._HISTOGRAMS:
            setattr(self, name, LatencyHistogram())

    def _series(
        self,
    ) -> list[tuple[telemetry.Counter, Callable[[Hashable], telemetry.Labels | None]]]:
        """The process-wide counters these counts feed, each with its labels of a count's name
        (which must not refer to ``self``)."""
        return []

    def add(self, **counts: float) -> None:
        """Add these counts, all at once."""
        if not self._attached:
            with self._lock:
                if not self._attached:
                    for series, labels_of in self._series():
                        series.attach(self, self.counts, labels_of)
                    self._attached = True
        self.counts.add_many(counts)

    def _counts(self) -> dict[str, Any]:
        counts = self.counts.snapshot()
        out = {name: counts.get(name, 0) for name in self._COUNTS}
        with self._lock:
            return out | {name: getattr(self, name) for name in self._MAXIMA}

    def merge(self, other: _Stats) -> None:
        """Add ``other``'s figures (of the same kind) to these."""
        self.counts.merge(other.counts)
        theirs = other._counts()
        with self._lock:
            for name in self._MAXIMA:
                setattr(self, name, max(getattr(self, name), theirs[name]))
        for name in self._HISTOGRAMS:
            getattr(self, name).merge(getattr(other, name))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_attached"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._attached = False


class ReplicaStats(_Stats):
    """What one replica was asked and how it answered. Thread-safe."""

    _COUNTS = (
        "requests",
        "bytes",
        "errors",
        "corrupt",
        "wins",
        "hedges_fired",
        "hedges_won",
        "cancelled",
        "discarded",
        "benched",
    )
    _HISTOGRAMS = ("latency",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _series(self) -> list:
        hedges = {f"hedges_{result}": (self.name, result) for result in ("fired", "won")}
        return [(telemetry.loader_hedges_total, hedges.get)]

    def record_latency(self, seconds: float) -> None:
        """One attempt on this replica answered after ``seconds``."""
        self.latency.record(seconds)
        telemetry.loader_read_seconds.observe(seconds, replica=self.name)

    def median_latency(self) -> float | None:
        """The median of this replica's answered attempts; None when none answered."""
        answered = self.latency.summary()
        return answered["p50_s"] if answered["count"] else None

    def as_dict(self) -> dict[str, Any]:
        """The latencies are of answered attempts: ``answered`` of them; with none (a replica
        that hung or failed every time) they are ``None``, not a 0 that reads as fast."""
        out = self._counts()
        lat = self.latency.summary()
        timed = lat["count"] > 0
        out["answered"] = lat["count"]
        out.update({k: lat[k] if timed else None for k in ("p50_s", "p90_s", "p99_s", "max_s")})
        return out


class ReadStats(_Stats):
    """End-to-end reads (over every attempt and hedge) of one replica set. Thread-safe."""

    _COUNTS = ("reads", "failed", "hedges", "hedges_refused", "failovers")
    _HISTOGRAMS = ("latency",)

    def _series(self) -> list:
        return [(telemetry.loader_failovers_total, {"failovers": ()}.get)]

    def as_dict(self) -> dict[str, Any]:
        return self._counts() | self.latency.summary()


class ConsumerStats(_Stats):
    """How long the consumer waited for data, and how much the prefetch window held. Updated
    from the consumer's thread only (its fields directly)."""

    _COUNTS = ("samples", "bytes_read", "waits", "wait_s")
    _MAXIMA = ("max_resident_bytes", "max_inflight_reads")
    _HISTOGRAMS = ("wait",)

    def __init__(self) -> None:
        super().__init__()
        self.wait_s = 0.0

    def as_dict(self) -> dict[str, Any]:
        return self._counts() | {"wait_p99_s": self.wait.percentile_s(99)}


class CacheStats(_Stats):
    """What this process's reads got from the cache. Thread-safe."""

    _COUNTS = (
        "hits",
        "misses",
        "fills",
        "evictions",
        "corrupt",
        "skipped",
        "errors",
        "bytes_hit",
        "bytes_filled",
    )

    def as_dict(self) -> dict[str, int]:
        return self._counts()


# -- reports of reader processes --------------------------------------------------------------


@dataclass
class Carried:
    """What a pass's DataLoader workers start from (each a new process whose replicas would
    start afresh), as the last pass's workers, or the dataset's open, left them: the replicas
    benched or on probation, each replica's median read latency, and the hedge's recent
    first-attempt latencies per size class (a new worker hedges at the learnt delay from its
    first read, not at the initial guess until it measured its own)."""

    benched: frozenset[str] = frozenset()
    latencies: dict[str, float] = field(default_factory=dict)
    hedge: dict[int, list[float]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.benched or self.latencies or self.hedge)


_CARRIED_HEDGE_SAMPLES = 512  # per size class, over every worker of a pass


@dataclass
class ReaderReport:
    """What one reading process (a DataLoader worker, or the main process) read in one pass
    over the data, from its start: picklable, merged by :class:`ReaderReports`."""

    consumer: ConsumerStats
    reads: ReadStats
    replicas: dict[str, ReplicaStats]
    health: dict[str, str]
    cache: CacheStats | None = None
    final: bool = False
    hedge: dict[int, list[float]] = field(default_factory=dict)  # Hedger.samples()

    def merge(self, other: ReaderReport) -> None:
        self.consumer.merge(other.consumer)
        self.reads.merge(other.reads)
        for uri, stats in other.replicas.items():
            self.replicas.setdefault(uri, ReplicaStats(uri)).merge(stats)
        if other.cache is not None:
            self.cache = self.cache or CacheStats()
            self.cache.merge(other.cache)


_REPORTS_PREFIX = "loaders-reports-"


def _reports_directory() -> str:
    """A new private directory named after this machine and process; those of processes of
    this machine that are gone (a SIGKILL runs no cleanup) are removed first."""
    root, tag = tempfile.gettempdir(), machine_tag()
    try:
        names = os.listdir(root) if tag else []  # another container's /tmp: nothing judged
    except OSError:
        names = []
    ours = re.compile(re.escape(f"{_REPORTS_PREFIX}{tag}-") + r"([0-9]{1,10})-.*")
    for name in names:
        match = ours.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:  # not ours to look at
            continue
        if pid_gone(int(match[1])):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_REPORTS_PREFIX}{tag or 'host'}-{os.getpid()}-")


@dataclass
class ReaderReports:
    """A private directory where DataLoader workers leave their latest :class:`ReaderReport`
    (one file per pass and worker, replaced atomically), and the sum of them all.

    A worker's final report (its pass ended, its reads in flight too) is folded into the
    running total and its file removed; a worker killed before its end counts with its last
    report, read again at each :meth:`collect`."""

    directory: str = field(default_factory=lambda: _reports_directory())
    _total: ReaderReport | None = None
    _newest_pass: int = -1
    _health: dict[str, dict[str, str]] = field(default_factory=dict)
    _hedge: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    @staticmethod
    def write(directory: str, pass_number: int, worker: int, report: ReaderReport) -> None:
        """Leave ``report`` for the training process: the latest of ``worker`` in that pass.
        Figures are never worth a failed read: a report that cannot be written (the directory
        gone with its loader, a full disk) is skipped."""
        path = os.path.join(directory, f"pass{pass_number:08d}-worker{worker:04d}.report")
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "wb") as f:
                pickle.dump(report, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except OSError as exc:
            logger.debug("loader figures not reported to %s: %s", directory, exc)

    def collect(self) -> tuple[ReaderReport | None, dict[str, dict[str, int]]]:
        """The sum of every report so far, and per replica how many workers of the newest pass
        last saw it in each health state."""
        with self._lock:
            try:
                names = sorted(n for n in os.listdir(self.directory) if n.endswith(".report"))
            except FileNotFoundError:
                names = []
            total = self.merged(None, self._total) if self._total is not None else None
            for name in names:
                path = os.path.join(self.directory, name)
                try:
                    with open(path, "rb") as f:
                        report = pickle.load(f)
                except (FileNotFoundError, EOFError, pickle.UnpicklingError):
                    continue  # replaced while read: the next collect sees the new one
                pass_number = int(name[len("pass") : name.index("-")])
                if pass_number > self._newest_pass:
                    self._newest_pass, self._health, self._hedge = pass_number, {}, {}
                if pass_number == self._newest_pass:
                    self._health[name] = report.health
                    self._hedge[name] = report.hedge
                if report.final:
                    os.unlink(path)
                    self._total = self.merged(self._total, report)
                total = self.merged(total, report)
            health: dict[str, dict[str, int]] = {}
            for seen in self._health.values():
                for uri, state in seen.items():
                    states = health.setdefault(uri, {})
                    states[state] = states.get(state, 0) + 1
            return total, health

    def carried(self) -> Carried:
        """What the next pass's workers start from: the replicas that a worker of the newest
        pass last saw benched or on probation (a replica benched wrongly is back within its
        bench and probation, one slow or failing costs every new worker its first reads),
        each replica's median read latency over every pass so far, and the newest pass's
        workers' hedge latencies."""
        total, health = self.collect()
        benched = frozenset(
            uri for uri, seen in health.items() if seen.get("healthy", 0) < sum(seen.values())
        )
        replicas = total.replicas if total is not None else {}
        latencies = {uri: stats.median_latency() for uri, stats in replicas.items()}
        latencies = {uri: p50 for uri, p50 in latencies.items() if p50 is not None}
        if benched:
            logger.info(
                "replica(s) %s start the next pass benched, as the last pass's workers left them",
                ", ".join(sorted(benched)),
            )
        hedge: dict[int, list[float]] = {}
        with self._lock:
            for samples in self._hedge.values():
                for cls, seconds in samples.items():
                    hedge.setdefault(cls, []).extend(seconds)
        hedge = {cls: seconds[-_CARRIED_HEDGE_SAMPLES:] for cls, seconds in hedge.items()}
        return Carried(benched, latencies, hedge)

    @staticmethod
    def merged(into: ReaderReport | None, report: ReaderReport) -> ReaderReport:
        """``into`` with ``report`` added (a copy of ``report`` when ``into`` is None)."""
        if into is None:
            return pickle.loads(pickle.dumps(report))
        into.merge(report)
        return into
