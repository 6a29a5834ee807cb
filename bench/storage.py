"""``ckptbench storage``: a load generator for any store the storage layer reaches.

Every request goes through :class:`ckptstore.store.Store` (the code path the checkpointer and the
loader use), optionally wrapped in the fault injector (:mod:`ckptstore.faults`). Three modes:

- ``steady``: writers put objects drawn from a size mix while readers get whole objects written
  earlier in the run; closed loop, one request in flight per worker.
- ``burst``: background readers issue small paced reads; after ``baseline_s`` every writer starts
  at once and writes ``checkpoint_bytes`` of objects (``queue_depth`` puts in flight each, through
  ``Store.map``), then the readers go on for ``after_s``. Read latency is reported before, during
  and after the burst.
- ``read``: ranged gets over objects written in a setup step (or existing objects under
  ``read_prefix``, which are never written or deleted).

Latencies go to HDR histograms (:class:`ckptstore.metrics.LatencyHistogram`) of successful
requests, retries included in their latency; failed requests are counted by error type. Retries
are counted by a filter on the ``ckptstore.store`` logger, which logs one warning per failed
attempt in the calling thread: a thread-local flag attributes each warning to the request being
timed. Everything the bench writes lies under ``ckptbench-<random>/`` and is deleted at the end,
by key, unless ``keep`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import sys
import threading
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from bench.report import (
    check_output_file,
    format_bytes,
    format_rate,
    format_seconds,
    parse_bytes,
    print_json,
    table,
)
from ckptstore.metrics import LatencyHistogram
from ckptstore.store import RetryPolicy, Store
from ckptstore.testing.faults import ALL_OPS, Faults, parse_latency, with_faults

logger = logging.getLogger(__name__)

MODES = ("steady", "burst", "read")
DEFAULT_SIZES = {"steady": "4KiB:0.7,1MiB:0.25,16MiB:0.05", "burst": "4MiB", "read": "4MiB"}
DEFAULT_WRITERS = {"steady": 4, "burst": 8, "read": 0}
DEFAULT_READERS = {"steady": 4, "burst": 1, "read": 4}
DEFAULT_READ_BYTES = {"steady": 0, "burst": 4 * 2**10, "read": 2**20}
DEFAULT_DURATION_S = {"steady": 5.0, "burst": 30.0, "read": 5.0}
# Points kept for the read-latency time series of a plot (percentiles come from histograms).
MAX_TIMELINE_POINTS = 200_000
_STORE_LOGGER = "ckptstore.store"


def parse_sizes(spec: str) -> list[tuple[int, float]]:
    """``"4KiB:0.7,1MiB:0.25,16MiB:0.05"`` -> [(4096, 0.7), ...]; weights are normalised."""
    items: list[tuple[int, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        size_text, _, weight_text = part.partition(":")
        try:
            size = parse_bytes(size_text)
        except ValueError:
            raise ValueError(
                f"bad --sizes {spec!r}: {size_text.strip()!r} is not a size of at least one byte "
                "(such as 4096, 4KiB, 16MiB)"
            ) from None
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ValueError(f"bad weight {weight_text!r} in --sizes {spec!r}") from None
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"bad weight {weight_text!r} in --sizes {spec!r}: must be > 0")
        items.append((size, weight))
    if not items:
        raise ValueError(
            f"bad --sizes {spec!r}: expected SIZE[:WEIGHT],... such as 4KiB:0.7,1MiB:0.3"
        )
    total = sum(w for _, w in items)
    return [(s, w / total) for s, w in items]


@dataclass(kw_only=True)
class StorageBenchConfig:
    """One ``ckptbench storage`` run. ``None`` fields take the mode's default."""

    uri: str
    """The store under test; the bench works under ``<uri>/ckptbench-<random>/``."""
    mode: str = "steady"
    """``steady``, ``burst`` or ``read``."""
    writers: int | None = None
    """Concurrent writers (burst: ranks writing a checkpoint at once)."""
    readers: int | None = None
    """Concurrent readers (burst: background readers of small objects)."""
    sizes: list[tuple[int, float]] | None = None
    """Object-size mix: (size_bytes, weight) pairs."""
    count: int | None = None
    """steady / read: stop after this many requests."""
    duration_s: float | None = None
    """steady / read: stop after this long; burst: the most the burst may take."""
    max_write_bytes: int = 512 * 2**20
    """steady: stop once this much has been written (memory:// keeps it all in RAM)."""
    checkpoint_bytes: int = 32 * 2**20
    """burst: bytes each writer writes."""
    queue_depth: int = 4
    """burst: puts in flight per writer."""
    read_bytes: int | None = None
    """burst: size of the background small reads; read: size of each ranged get."""
    read_interval_s: float = 0.002
    """burst: pause between a background reader's reads (0: back to back)."""
    baseline_s: float = 1.0
    """burst: background reads before the burst starts."""
    after_s: float = 1.0
    """burst: background reads after the burst ends."""
    objects: int = 16
    """read: objects written in the setup step; burst: small objects for background reads."""
    read_prefix: str | None = None
    """read: read existing objects under this prefix instead of writing any."""
    faults: Faults | None = None
    """Faults injected into the store under test (setup and cleanup run without them)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    storage_options: dict[str, Any] | None = None
    seed: int | None = None
    keep: bool = False
    """Leave what the bench wrote in place."""
    progress: bool = False
    """A tqdm progress bar on stderr."""
    verbose_retries: bool = False
    """Let the store's per-attempt retry warnings through (they are counted either way)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: expected one of {', '.join(MODES)}")
        self.writers = DEFAULT_WRITERS[self.mode] if self.writers is None else self.writers
        self.readers = DEFAULT_READERS[self.mode] if self.readers is None else self.readers
        if self.sizes is None:
            self.sizes = parse_sizes(DEFAULT_SIZES[self.mode])
        if self.read_bytes is None:
            self.read_bytes = DEFAULT_READ_BYTES[self.mode]
        if self.duration_s is None and (self.count is None or self.mode == "burst"):
            self.duration_s = DEFAULT_DURATION_S[self.mode]
        if not self.sizes or any(size < 1 or weight <= 0 for size, weight in self.sizes):
            raise ValueError(f"sizes must be (size_bytes >= 1, weight > 0) pairs, got {self.sizes}")
        for name in ("max_write_bytes", "checkpoint_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 byte")
        for name in ("writers", "readers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("count", "objects", "queue_depth"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("duration_s", "read_interval_s", "baseline_s", "after_s"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"--duration-s must be > 0, got {self.duration_s}")
        if self.mode == "steady" and self.writers + self.readers == 0:
            raise ValueError("steady mode needs at least one writer or reader")
        if self.mode == "burst":
            if self.writers < 1:
                raise ValueError("burst mode needs at least one writer")
            if self.count is not None:
                raise ValueError("--count does not apply to burst mode (use --checkpoint-bytes)")
        if self.mode == "read":
            if self.readers < 1:
                raise ValueError("read mode needs at least one reader")
            if self.writers:
                raise ValueError("read mode has no writers (use steady for a put/get mix)")
        if self.read_prefix is not None and self.mode != "read":
            raise ValueError("--read-prefix applies to read mode only")


# -- counters ----------------------------------------------------------------------------------


class _OpStats:
    """One worker's figures for one operation; merged at the end of the run."""

    def __init__(self) -> None:
        self.hist = LatencyHistogram()
        self.ops = 0
        self.bytes = 0
        self.errors: Counter[str] = Counter()
        self.first_error: str | None = None

    def merge(self, other: _OpStats) -> None:
        self.hist.merge(other.hist)
        self.ops += other.ops
        self.bytes += other.bytes
        self.errors.update(other.errors)
        self.first_error = self.first_error or other.first_error

    def to_dict(self, elapsed_s: float, *, retries: int = 0) -> dict[str, Any]:
        """The figures, with ``retries`` (attempts after a failed one) from the store."""
        summary = self.hist.summary()
        return {
            "ops": self.ops,
            "bytes": self.bytes,
            "ops_s": self.ops / elapsed_s if elapsed_s > 0 else 0.0,
            "throughput_bytes_s": self.bytes / elapsed_s if elapsed_s > 0 else 0.0,
            "mean_s": summary["mean_s"],
            "p50_s": summary["p50_s"],
            "p90_s": summary["p90_s"],
            "p99_s": summary["p99_s"],
            "p999_s": summary["p999_s"],
            "max_s": summary["max_s"],
            "errors": sum(self.errors.values()),
            "errors_by_type": dict(self.errors),
            "retries": retries,
        }


@contextlib.contextmanager
def _quiet_retries(show: bool) -> Iterator[None]:
    """Unless ``show``, drop the store's warning per failed attempt (marked ``ckptstore_retry``):
    the run reports the totals from the store's counters instead."""
    store_logger = logging.getLogger(_STORE_LOGGER)

    def drop(record: logging.LogRecord) -> bool:
        return show or not getattr(record, "ckptstore_retry", False)

    store_logger.addFilter(drop)
    try:
        yield
    finally:
        store_logger.removeFilter(drop)


def _error_name(exc: BaseException) -> str:
    """``StorageError`` or, when it wraps another error, ``StorageError(InjectedFaultError)``."""
    name = type(exc).__name__
    cause = exc.__cause__
    if cause is not None and type(cause).__name__ != name:
        return f"{name}({type(cause).__name__})"
    return name


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- the bench ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Timeline:
    """Background-read samples for the burst plot: start time since the run began, latency."""

    t_s: array = field(default_factory=lambda: array("d"))
    latency_s: array = field(default_factory=lambda: array("d"))
    dropped: int = 0


class StorageBench:
    """Runs one :class:`StorageBenchConfig` and returns its result as a JSON-ready dict."""

    def __init__(self, config: StorageBenchConfig) -> None:
        self.config = config
        self.prefix = f"ckptbench-{uuid.uuid4().hex[:12]}"
        # The store under test, and a plain one for setup and cleanup.
        self.store = with_faults(
            Store(config.uri, storage_options=config.storage_options, retry=config.retry),
            config.faults,
        )
        self.admin = Store(config.uri, storage_options=config.storage_options, retry=config.retry)
        self._stop = threading.Event()
        self._stop_reason = ""
        self._lock = threading.Lock()
        self._taken = 0
        self._written_budget = 0
        self._attempted: list[str] = []  # every key a put was attempted on (list.append is atomic)
        self._readable: list[tuple[str, int]] = []  # (key, size) that readers may get
        self._stats: list[tuple[str, _OpStats]] = []
        self._t0 = 0.0
        max_size = max(s for s, _ in config.sizes)
        self._payload = memoryview(os.urandom(max(max_size, config.read_bytes or 0, 1)))
        self._progress_ops = 0

    # -- budget -----------------------------------------------------------------------------

    def _finish(self, reason: str) -> None:
        with self._lock:
            if not self._stop.is_set():
                self._stop_reason = reason
                self._stop.set()

    def _take(self, write_bytes: int = 0) -> bool:
        """Reserve one request (and ``write_bytes`` of the write budget) if the run goes on."""
        cfg = self.config
        with self._lock:
            if self._stop.is_set():
                return False
            if cfg.count is not None and self._taken >= cfg.count:
                self._stop_reason = "count"
                self._stop.set()
                return False
            if write_bytes and self._written_budget + write_bytes > cfg.max_write_bytes:
                self._stop_reason = "max_write_bytes"
                self._stop.set()
                return False
            self._taken += 1
            self._written_budget += write_bytes
            return True

    def _new_stats(self, op: str) -> _OpStats:
        stats = _OpStats()
        with self._lock:
            self._stats.append((op, stats))
        return stats

    # -- timed requests ---------------------------------------------------------------------

    def _timed(self, stats: _OpStats, fn: Callable[[], int]) -> float | None:
        """Run one request; record its latency and bytes, or its error. Returns the latency."""
        start = time.perf_counter()
        try:
            nbytes = fn()
        except Exception as exc:  # noqa: BLE001 - counted by type, the run goes on
            stats.errors[_error_name(exc)] += 1
            if stats.first_error is None:
                stats.first_error = _first_line(exc)
            logger.debug("request failed: %s", exc)
            return None
        latency = time.perf_counter() - start
        stats.hist.record(latency)
        stats.ops += 1
        stats.bytes += nbytes
        self._progress_ops += 1
        return latency

    def _put(self, stats: _OpStats, key: str, size: int) -> float | None:
        self._attempted.append(key)

        def put() -> int:
            self.store.put(key, self._payload[:size])
            self._readable.append((key, size))
            return size

        return self._timed(stats, put)

    def _get(self, stats: _OpStats, key: str, start: int | None = None, end: int | None = None):
        return self._timed(stats, lambda: len(self.store.get(key, start, end)))

    # -- workers ----------------------------------------------------------------------------

    def _steady_writer(self, index: int, go: threading.Event) -> None:
        rng = random.Random(None if self.config.seed is None else self.config.seed * 1000 + index)
        sizes, weights = zip(*self.config.sizes)
        stats = self._new_stats("put")
        go.wait()
        for seq in range(sys.maxsize):
            size = rng.choices(sizes, weights)[0]
            if not self._take(size):
                return
            self._put(stats, f"{self.prefix}/w{index:03d}-{seq:09d}", size)

    def _steady_reader(self, index: int, go: threading.Event) -> None:
        rng = random.Random(None if self.config.seed is None else self.config.seed * 1000 - index)
        stats = self._new_stats("get")
        go.wait()
        while self._take():
            key, _ = self._readable[rng.randrange(len(self._readable))]
            self._get(stats, key)

    def _range_reader(self, index: int, go: threading.Event) -> None:
        rng = random.Random(None if self.config.seed is None else self.config.seed * 1000 - index)
        stats = self._new_stats("get")
        go.wait()
        while self._take():
            key, size = self._readable[rng.randrange(len(self._readable))]
            length = min(self.config.read_bytes, size)
            start = rng.randrange(size - length + 1)
            self._get(stats, key, start, start + length)

    # -- setup and cleanup ------------------------------------------------------------------

    def _probe(self) -> None:
        """Fail now, with one clear line, if the store cannot be written, read and listed."""
        key = f"{self.prefix}/probe"
        self._attempted.append(key)
        try:
            self.admin.put(key, b"ckptbench probe")
            try:
                if self.admin.get(key) != b"ckptbench probe":
                    raise OSError("read back different bytes")
                self.admin.list(self.prefix)
            finally:
                self.admin.delete(key)
        except OSError as exc:
            cause = exc.__cause__
            why = ""
            if cause is not None and _first_line(cause).lower() not in str(exc).lower():
                why = f" ({_first_line(cause)})"
            raise type(exc)(
                f"store {self.config.uri!r} is not usable: {_first_line(exc)}{why}"
            ) from exc

    def _seed(self, count: int, sizes: list[int]) -> None:
        """Write ``count`` objects, untimed and without faults, for readers to read."""
        rng = random.Random(self.config.seed)
        items = [(f"{self.prefix}/seed-{i:06d}", rng.choice(sizes)) for i in range(count)]
        self._attempted.extend(key for key, _ in items)

        def put(item: tuple[str, int]) -> None:
            self.admin.put(item[0], self._payload[: item[1]])

        for _ in self.admin.map(put, items):
            pass
        self._readable.extend(items)

    def _existing(self, prefix: str) -> None:
        keys = self.admin.list(prefix)[:10_000]
        if not keys:
            raise ValueError(f"--read-prefix {prefix!r}: no objects under {self.config.uri}")
        sizes = list(self.admin.map(self.admin.size, keys))
        self._readable.extend((k, s) for k, s in zip(keys, sizes) if s > 0)
        if not self._readable:
            raise ValueError(f"--read-prefix {prefix!r}: every object there is empty")

    def cleanup(self) -> dict[str, int]:
        """Delete the keys this run attempted to write (only those, only under its prefix)."""
        if self.config.faults is not None:
            self.config.faults.release()  # hung puts finish now rather than after cleanup
        mine = set(self._attempted)
        assert all(k.startswith(self.prefix + "/") for k in mine)
        deleted = 0
        for attempt in range(2):
            present = [k for k in self.admin.list(self.prefix) if k in mine]
            if not present:
                break
            if attempt:
                logger.info("cleanup: %d objects appeared late (abandoned requests)", len(present))
            for _ in self.admin.map(self.admin.delete, present):
                pass
            deleted += len(present)
        left = self.admin.list(self.prefix)
        if left:
            logger.warning(
                "cleanup: %d objects left under %s", len(left), self.admin.url(self.prefix)
            )
        elif self.admin.is_local:
            self._remove_empty_dirs()
        return {"deleted": deleted, "left": len(left)}

    def _remove_empty_dirs(self) -> None:
        """Local disk: the run's now empty ``ckptbench-<random>/`` directory (and any empty
        directory below it). ``rmdir`` removes only empty ones: nothing else can go."""
        top = self.admin.path(self.prefix)
        for dirpath, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(dirpath)
            except OSError as exc:  # not empty (something appeared meanwhile), or gone
                logger.info("cleanup: %s not removed: %s", dirpath, exc)

    # -- runs -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cfg = self.config
        started = datetime.now(timezone.utc)
        result: dict[str, Any] = {}
        if cfg.read_prefix is None:
            self._probe()
        else:
            self.admin.check_reachable()
        cleanup = None
        with _quiet_retries(cfg.verbose_retries):
            try:
                if cfg.mode == "steady":
                    result = self._run_steady()
                elif cfg.mode == "burst":
                    result = self._run_burst()
                else:
                    result = self._run_read()
            except BaseException:
                if not cfg.keep and cfg.read_prefix is None:
                    try:
                        self.cleanup()
                    except Exception as exc:  # noqa: BLE001 - the first error is the one to see
                        logger.warning("cleanup after a failed run failed too: %s", exc)
                raise
        if not cfg.keep and cfg.read_prefix is None:
            cleanup = self.cleanup()
        head = {
            "bench": "storage",
            "mode": cfg.mode,
            "uri": cfg.uri,
            "prefix": self.prefix,
            "date": started.isoformat(timespec="seconds"),
            "writers": cfg.writers,
            "readers": cfg.readers,
            "sizes": [{"size_bytes": s, "weight": round(w, 6)} for s, w in cfg.sizes],
        }
        result = head | result
        if cfg.faults is not None:
            result["faults"] = {
                "injected": dict(cfg.faults.counts),
                "latency": str(cfg.faults.latency) if cfg.faults.latency else None,
                "error_rate": cfg.faults.error_rate,
                "slow_rate": cfg.faults.slow_rate,
                "hang_rate": cfg.faults.hang_rate,
            }
        result["cleanup"] = cleanup if cleanup is not None else {"kept": True}
        return result

    def _workers(self, targets: list[Callable[[int, threading.Event], None]]) -> float:
        """Start one thread per target, run until they stop; return the elapsed seconds."""
        cfg = self.config
        go = threading.Event()
        threads = [
            threading.Thread(
                target=t, args=(i, go), name=f"ckptbench-{t.__name__[1:]}-{i}", daemon=True
            )
            for i, t in enumerate(targets)
        ]
        for thread in threads:
            thread.start()
        with self._progress(total=cfg.count, unit="op") as bar:
            self._t0 = time.perf_counter()
            go.set()
            deadline = self._t0 + cfg.duration_s if cfg.duration_s is not None else math.inf
            while any(t.is_alive() for t in threads):
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self._finish("duration")
                    break
                if self._stop.wait(min(0.2, remaining)):
                    break
                bar.update(self._progress_ops - bar.n)
            self._finish(self._stop_reason or "done")
            elapsed = self._join(threads)
            bar.update(self._progress_ops - bar.n)
        return elapsed

    def _join(self, threads: list[threading.Thread]) -> float:
        """Wait for workers to finish their current request; bounded by the retry policy."""
        if self.config.faults is not None:
            self.config.faults.release()
        policy = self.config.retry
        max_size = max(s for s, _ in self.config.sizes)
        limit_s = policy.attempts * (policy.deadline_s(max_size) + policy.max_delay_s)
        end = time.perf_counter() + limit_s
        for thread in threads:
            thread.join(max(0.0, end - time.perf_counter()))
        elapsed = time.perf_counter() - self._t0
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            logger.warning("%d workers still in a request after %.0fs; abandoned", stuck, limit_s)
        return elapsed

    @contextlib.contextmanager
    def _progress(self, *, total: float | None, unit: str) -> Iterator[Any]:
        from tqdm import tqdm

        bar = tqdm(
            total=total,
            unit=unit,
            disable=not self.config.progress,
            file=sys.stderr,
            desc=f"storage {self.config.mode}",
            leave=False,
        )
        try:
            yield bar
        finally:
            bar.close()

    def _merged(self, op: str) -> _OpStats:
        total = _OpStats()
        for name, stats in self._stats:
            if name == op:
                total.merge(stats)
        return total

    def _ops_result(self, elapsed_s: float, ops: tuple[str, ...] = ("put", "get")):
        self._merged_stats = {op: self._merged(op) for op in ops}
        out = {op: self._op_result(op, elapsed_s) for op in ops}
        for op, s in self._merged_stats.items():
            if s.first_error:
                out[op]["first_error"] = s.first_error
        return out

    def _op_result(self, op: str, elapsed_s: float) -> dict[str, Any]:
        retries = self.store.counters.snapshot()["retries"].get(op, 0)
        return self._merged_stats[op].to_dict(elapsed_s, retries=retries)

    def _run_steady(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.readers:
            self._seed(max(16, 2 * cfg.readers), [s for s, _ in cfg.sizes])
        targets = [self._steady_writer] * cfg.writers + [self._steady_reader] * cfg.readers
        elapsed = self._workers(targets)
        return {"duration_s": elapsed, "stop_reason": self._stop_reason} | self._ops_result(elapsed)

    def _run_read(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.read_prefix is not None:
            self._existing(cfg.read_prefix)
        else:
            self._seed(cfg.objects, [s for s, _ in cfg.sizes])
        elapsed = self._workers([self._range_reader] * cfg.readers)
        return {
            "duration_s": elapsed,
            "stop_reason": self._stop_reason,
            "read_bytes": cfg.read_bytes,
            "objects": len(self._readable),
        } | self._ops_result(elapsed, ("get",))

    def _run_burst(self) -> dict[str, Any]:
        cfg = self.config
        self._seed(cfg.objects, [cfg.read_bytes])
        small = list(self._readable)
        phases = {name: LatencyHistogram() for name in ("before", "during", "after")}
        timeline = _Timeline()
        marks: dict[str, float] = {}  # burst_start / burst_end, seconds since t0
        readers_stop = threading.Event()
        go_writers = threading.Event()
        done_writers = [0.0] * cfg.writers
        written = [0] * cfg.writers

        def reader(index: int) -> None:
            rng = random.Random(None if cfg.seed is None else cfg.seed * 1000 - index)
            stats = self._new_stats("get")
            while not readers_stop.is_set():
                key, _ = small[rng.randrange(len(small))]
                start = time.perf_counter() - self._t0
                latency = self._get(stats, key)
                if latency is not None:
                    begin, end = marks.get("burst_start"), marks.get("burst_end")
                    if begin is None or start < begin:
                        phase = "before"
                    elif end is None or start < end:
                        phase = "during"
                    else:
                        phase = "after"
                    phases[phase].record(latency)
                    if len(timeline.t_s) < MAX_TIMELINE_POINTS:
                        timeline.t_s.append(start)
                        timeline.latency_s.append(latency)
                    else:
                        timeline.dropped += 1
                if cfg.read_interval_s:
                    readers_stop.wait(cfg.read_interval_s)

        def writer(index: int) -> None:
            rng = random.Random(None if cfg.seed is None else cfg.seed * 1000 + index)
            sizes, weights = zip(*cfg.sizes)
            plan: list[tuple[int, int]] = []
            remaining = cfg.checkpoint_bytes
            while remaining > 0:
                size = min(rng.choices(sizes, weights)[0], remaining)
                plan.append((len(plan), size))
                remaining -= size
            stats = self._new_stats("put")

            def put_one(item: tuple[int, int]) -> None:
                seq, size = item
                if self._stop.is_set():
                    return
                if self._put(stats, f"{self.prefix}/rank{index:05d}-{seq:06d}", size) is not None:
                    written[index] += size

            go_writers.wait()
            for _ in self.store.map(put_one, plan, max_concurrency=cfg.queue_depth):
                pass
            done_writers[index] = time.perf_counter() - self._t0

        readers = [
            threading.Thread(target=reader, args=(i,), name=f"ckptbench-bg-reader-{i}", daemon=True)
            for i in range(cfg.readers)
        ]
        writers = [
            threading.Thread(target=writer, args=(i,), name=f"ckptbench-writer-{i}", daemon=True)
            for i in range(cfg.writers)
        ]
        total_bytes = cfg.checkpoint_bytes * cfg.writers
        with self._progress(total=total_bytes, unit="B") as bar:
            bar.unit_scale = True
            self._t0 = time.perf_counter()
            for thread in readers + writers:
                thread.start()
            readers_stop.wait(cfg.baseline_s)  # nothing sets it yet: a bounded pause
            marks["burst_start"] = time.perf_counter() - self._t0
            go_writers.set()
            deadline = time.perf_counter() + cfg.duration_s
            while any(t.is_alive() for t in writers):
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self._finish("duration")
                    break
                self._stop.wait(min(0.2, remaining))
                bar.update(sum(written) - bar.n)
            truncated = self._stop.is_set()
            self._finish(self._stop_reason or "done")
            self._join(writers)
            marks["burst_end"] = time.perf_counter() - self._t0
            bar.update(sum(written) - bar.n)
            readers_stop.wait(cfg.after_s)
            readers_stop.set()
            elapsed = self._join(readers)
        burst_s = marks["burst_end"] - marks["burst_start"]
        result = self._ops_result(burst_s)
        # Reads ran for the whole run, not only the burst: rate them over the run.
        result["get"] = self._op_result("get", elapsed) | (
            {"first_error": self._merged_stats["get"].first_error}
            if self._merged_stats["get"].first_error
            else {}
        )
        read_phases = {name: h.summary() for name, h in phases.items()}
        before_p99 = read_phases["before"]["p99_s"]
        burst = {
            "writers": cfg.writers,
            "checkpoint_bytes": cfg.checkpoint_bytes,
            "bytes_written": sum(written),
            "burst_s": burst_s,
            "write_throughput_bytes_s": sum(written) / burst_s if burst_s > 0 else 0.0,
            "truncated": truncated,
            "start_s": marks["burst_start"],
            "end_s": marks["burst_end"],
            "read_bytes": cfg.read_bytes,
            "read": read_phases,
            "read_p99_during_over_before": (
                read_phases["during"]["p99_s"] / before_p99 if before_p99 > 0 else None
            ),
        }
        self._timeline = timeline
        self._phases = phases
        return {"duration_s": elapsed, "stop_reason": self._stop_reason} | result | {"burst": burst}


# -- output ------------------------------------------------------------------------------------


def print_table(result: dict[str, Any], out=None) -> None:
    out = out or sys.stdout
    print(
        f"ckptbench storage {result['mode']} on {result['uri']} "
        f"({result['writers']} writers, {result['readers']} readers, "
        f"{format_seconds(result['duration_s'])}, stopped by {result['stop_reason']})",
        file=out,
    )
    rows = []
    for op in ("put", "get"):
        if op not in result:
            continue
        r = result[op]
        idle = result["writers" if op == "put" else "readers"] == 0
        if idle and not r["ops"] and not r["errors"]:
            continue
        rows.append(
            [op, r["ops"], f"{r['ops_s']:.0f}", format_rate(r["throughput_bytes_s"])]
            + [format_seconds(r[k]) for k in ("p50_s", "p90_s", "p99_s", "p999_s", "max_s")]
            + [r["errors"], r["retries"]]
        )
    table(
        [
            "op",
            "ops",
            "ops/s",
            "throughput",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "errors",
            "retries",
        ],
        rows,
        out=out,
    )
    for op in ("put", "get"):
        if op in result and result[op]["errors_by_type"]:
            kinds = ", ".join(f"{k}: {v}" for k, v in result[op]["errors_by_type"].items())
            print(f"{op} errors: {kinds}", file=out)
    burst = result.get("burst")
    if burst:
        print(
            f"\nburst: {burst['writers']} writers x {format_bytes(burst['checkpoint_bytes'])} "
            f"in {format_seconds(burst['burst_s'])} = "
            f"{format_rate(burst['write_throughput_bytes_s'])}"
            + (" (truncated by --duration-s)" if burst["truncated"] else ""),
            file=out,
        )
        rows = [
            [phase, s["count"]]
            + [format_seconds(s[k]) for k in ("p50_s", "p90_s", "p99_s", "p999_s", "max_s")]
            for phase, s in burst["read"].items()
        ]
        print(f"background reads of {format_bytes(burst['read_bytes'])}:", file=out)
        table(["phase", "reads", "p50", "p90", "p99", "p99.9", "max"], rows, out=out)
        ratio = burst["read_p99_during_over_before"]
        if ratio is not None:
            print(f"read p99 during / before the burst: {ratio:.2f}x", file=out)
    if "faults" in result:
        injected = ", ".join(f"{k}: {v}" for k, v in sorted(result["faults"]["injected"].items()))
        print(f"injected: {injected or 'nothing'}", file=out)
    cleanup = result.get("cleanup", {})
    if cleanup.get("kept"):
        print(f"kept {result['uri'].rstrip('/')}/{result['prefix']}/", file=out)
    elif cleanup:
        print(f"cleanup: deleted {cleanup['deleted']} objects, {cleanup['left']} left", file=out)


def _cdf_points(hist: LatencyHistogram) -> tuple[list[float], list[float]]:
    """(latency_s, fraction) pairs from the histogram, dense in the tail."""
    fractions = [q / 1000 for q in range(1, 1000)]
    fractions += [1 - 10 ** (-k / 20) for k in range(61, 101)]  # 0.999 .. 0.99999
    return [hist.percentile_s(f * 100) for f in fractions], fractions


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install 'ckptstore[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(bench: StorageBench, result: dict[str, Any], path: str) -> None:
    """Latency CDFs per operation; for burst, background read latency over time as well."""
    plt = _require_matplotlib()
    burst = result.get("burst")
    ncols = 2 if burst else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.6), squeeze=False)
    ax = axes[0][0]
    curves = {op: s.hist for op, s in bench._merged_stats.items() if s.ops}
    if burst:
        curves = {"put (burst)": curves.get("put")} if "put" in curves else {}
        curves |= {f"get {name}": h for name, h in bench._phases.items() if h.count}
    for label, hist in curves.items():
        xs, ys = _cdf_points(hist)
        ax.step(xs, ys, where="post", label=f"{label} (n={hist.count})")
    ax.set_xscale("log")
    ax.set_yscale("logit")
    ax.set_ylim(0.001, 0.99999)
    ticks = [0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999, 0.99999]
    ax.set_yticks(ticks, [f"p{100 * t:.5g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("percentile")
    ax.set_title("latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if burst:
        import numpy as np

        ax = axes[0][1]
        t = np.frombuffer(bench._timeline.t_s, dtype=np.float64)
        lat = np.frombuffer(bench._timeline.latency_s, dtype=np.float64)
        ax.scatter(t, lat, s=3, alpha=0.35, color="tab:blue", label="read", linewidths=0)
        if len(t):
            width = max(0.05, (t.max() - t.min()) / 60)
            edges = np.arange(t.min(), t.max() + width, width)
            idx = np.digitize(t, edges)
            centers, p99 = [], []
            for b in np.unique(idx):
                sel = lat[idx == b]
                if len(sel) >= 5:
                    centers.append(edges[b - 1] + width / 2)
                    p99.append(np.percentile(sel, 99))
            ax.plot(centers, p99, color="tab:red", lw=1.5, label=f"p99 per {width:.2g} s")
        ax.axvspan(
            burst["start_s"],
            burst["end_s"],
            color="tab:orange",
            alpha=0.2,
            label=f"burst: {burst['writers']} writers",
        )
        ax.set_yscale("log")
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("read latency (s)")
        ax.set_title(f"{format_bytes(burst['read_bytes'])} reads during a checkpoint burst")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"ckptbench storage {result['mode']}: {result['uri']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line ------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "storage",
        help="load-generate against a store: steady put/get, checkpoint bursts, ranged reads",
        description="Load generator for any store ckptstore reaches (local path, memory://, "
        "s3://...), through the same storage layer the checkpointer uses. Works under a fresh "
        "ckptbench-<random>/ prefix and deletes what it wrote.",
    )
    p.add_argument(
        "--uri", required=True, help="store URI: a path, memory://..., s3://bucket/prefix"
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="steady",
        help="steady: mixed put/get; burst: all writers write a checkpoint at once while "
        "a background reader measures read latency; read: ranged gets (default steady)",
    )
    p.add_argument("--writers", type=int, help="concurrent writers (steady 4, burst 8)")
    p.add_argument("--readers", type=int, help="concurrent readers (steady 4, burst 1, read 4)")
    p.add_argument(
        "--sizes",
        help="object-size mix SIZE[:WEIGHT],... "
        f"(steady {DEFAULT_SIZES['steady']}; burst and read {DEFAULT_SIZES['burst']})",
    )
    p.add_argument("--count", type=int, help="steady/read: stop after this many requests")
    p.add_argument(
        "--duration-s",
        type=float,
        help="steady/read: stop after this long (default "
        "5 unless --count); burst: cap on the burst (default 30)",
    )
    p.add_argument(
        "--max-write-bytes",
        default="512MiB",
        help="steady: stop after writing this much (default 512MiB)",
    )
    p.add_argument(
        "--checkpoint-bytes",
        default="32MiB",
        help="burst: bytes each writer writes (default 32MiB)",
    )
    p.add_argument("--queue-depth", type=int, default=4, help="burst: puts in flight per writer")
    p.add_argument(
        "--read-bytes", help="burst: background read size (4KiB); read: range size (1MiB)"
    )
    p.add_argument(
        "--read-interval-s",
        type=float,
        default=0.002,
        help="burst: pause between background reads (default 0.002)",
    )
    p.add_argument("--baseline-s", type=float, default=1.0, help="burst: reads before the burst")
    p.add_argument("--after-s", type=float, default=1.0, help="burst: reads after the burst")
    p.add_argument(
        "--objects",
        type=int,
        default=16,
        help="read: objects to write and read; burst: small objects read in background",
    )
    p.add_argument(
        "--read-prefix",
        help="read: read the existing objects under this prefix (nothing is written or deleted)",
    )
    faults = p.add_argument_group("fault injection (into the store under test)")
    faults.add_argument(
        "--latency",
        default="none",
        help="added latency: none, fixed:S or lognormal:MEDIAN_S[:SIGMA]",
    )
    faults.add_argument(
        "--error-rate",
        type=float,
        default=0.0,
        help="fraction of requests failing with a transient error",
    )
    faults.add_argument("--slow-rate", type=float, default=0.0, help="fraction of slow requests")
    faults.add_argument(
        "--slow-factor",
        type=float,
        default=20.0,
        help="a slow request takes this many times the median latency",
    )
    faults.add_argument(
        "--hang-rate", type=float, default=0.0, help="fraction of requests that hang"
    )
    faults.add_argument("--hang-s", type=float, default=3600.0, help="how long a hang lasts")
    faults.add_argument(
        "--fault-ops", default="put,get", help="operations faults apply to (default put,get)"
    )
    retry = p.add_argument_group("retries")
    retry.add_argument(
        "--attempts",
        type=int,
        default=RetryPolicy.attempts,
        help="attempts per request (default %(default)s)",
    )
    retry.add_argument(
        "--timeout-s",
        type=float,
        default=RetryPolicy.timeout_s,
        help="deadline of one attempt (default %(default)s)",
    )
    p.add_argument("--seed", type=int, help="seed for sizes, keys and faults")
    p.add_argument("--keep", action="store_true", help="do not delete what the bench wrote")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write latency CDFs (and the burst timeline) here")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> StorageBenchConfig:
    latency = parse_latency(args.latency)
    fault_ops = frozenset(op.strip() for op in args.fault_ops.split(",") if op.strip())
    unknown = fault_ops - ALL_OPS
    if unknown:
        raise ValueError(f"--fault-ops: unknown operations {sorted(unknown)}")
    for name in ("error_rate", "slow_rate", "hang_rate"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be within 0 and 1, got {value}")
    if args.hang_s <= 0 or args.slow_factor < 0:
        raise ValueError("--hang-s must be > 0 and --slow-factor >= 0")
    inject = latency is not None or args.error_rate or args.slow_rate or args.hang_rate
    faults = (
        Faults(
            latency=latency,
            error_rate=args.error_rate,
            slow_rate=args.slow_rate,
            slow_factor=args.slow_factor,
            hang_rate=args.hang_rate,
            hang_s=args.hang_s,
            ops=fault_ops,
            seed=args.seed,
        )
        if inject
        else None
    )
    return StorageBenchConfig(
        uri=args.uri,
        mode=args.mode,
        writers=args.writers,
        readers=args.readers,
        sizes=parse_sizes(args.sizes) if args.sizes else None,
        count=args.count,
        duration_s=args.duration_s,
        max_write_bytes=parse_bytes(args.max_write_bytes, what="--max-write-bytes"),
        checkpoint_bytes=parse_bytes(args.checkpoint_bytes, what="--checkpoint-bytes"),
        queue_depth=args.queue_depth,
        read_bytes=parse_bytes(args.read_bytes, what="--read-bytes") if args.read_bytes else None,
        read_interval_s=args.read_interval_s,
        baseline_s=args.baseline_s,
        after_s=args.after_s,
        objects=args.objects,
        read_prefix=args.read_prefix,
        faults=faults,
        retry=RetryPolicy(attempts=args.attempts, timeout_s=args.timeout_s),
        seed=args.seed,
        keep=args.keep,
        progress=sys.stderr.isatty(),
        verbose_retries=getattr(args, "verbose", False),
    )


def run(args: argparse.Namespace) -> int:
    if args.plot:  # fail before the run, not after it
        check_output_file(args.plot, flag="--plot")
    config = config_from_args(args)
    if args.plot:
        _require_matplotlib()
    bench = StorageBench(config)
    result = bench.run()
    if args.plot:
        plot(bench, result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print_json(result)
    else:
        print_table(result)
        if args.plot:
            print(f"plot: {args.plot}")
    ops = sum(result[op]["ops"] for op in ("put", "get") if op in result)
    errors = sum(result[op]["errors"] for op in ("put", "get") if op in result)
    if ops == 0 and errors:
        first = next(
            result[op].get("first_error")
            for op in ("put", "get")
            if op in result and result[op]["errors"]
        )
        print(f"ckptbench storage: error: every request failed, first: {first}", file=sys.stderr)
        return 1
    return 0
