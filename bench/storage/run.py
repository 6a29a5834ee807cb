"""The storage bench: workers, timed requests, setup, cleanup, and the steady and read modes
(the burst mode is :mod:`bench.storage.burst`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

from bench.faults import with_faults
from bench.storage.burst import run_burst
from bench.storage.config import StorageBenchConfig, apportion
from bench.storage.stats import (
    _error_name,
    _first_line,
    _OpStats,
    failed_requests,
    retry_records,
)
from ckptstore.errors import StorageError, one_line
from ckptstore.store import Store

logger = logging.getLogger("bench.storage")


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
                stats.first_error_s = time.perf_counter() - self._t0
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
            # not the last attempt's own timeout again, which the error already counts
            same = type(cause) is type(exc)
            if (
                cause is not None
                and not same
                and _first_line(cause).lower() not in str(exc).lower()
            ):
                why = f" ({_first_line(cause)})"
            raise type(exc)(
                f"store {self.config.uri!r} is not usable: {_first_line(exc)}{why}"
            ) from exc

    def _seed(self, count: int, sizes: list[tuple[int, float]]) -> None:
        """Write ``count`` objects, untimed and without faults, for readers to read: as many of
        each size as its weight in the mix asks (a uniform pick among the sizes made the gets
        of a mix of mostly small objects read mostly large ones)."""
        items = [(f"{self.prefix}/seed-{i:06d}", s) for i, s in enumerate(apportion(sizes, count))]
        self._attempted.extend(key for key, _ in items)

        def put(item: tuple[str, int]) -> None:
            self.admin.put(item[0], self._payload[: item[1]])

        for _ in self.admin.map(put, items, drain=True):  # Ctrl-C: no put lands after cleanup
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
        with retry_records(cfg.verbose_retries):
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
                        logger.warning(
                            "cleanup after a failed run failed too (the run's objects under %s "
                            "may be left: delete them once the store answers): %s",
                            self.admin.url(self.prefix),
                            one_line(exc),
                        )
                raise
        if not cfg.keep and cfg.read_prefix is None:
            try:
                cleanup = self.cleanup()
            except StorageError as exc:
                failed = failed_requests(result)  # a store that stopped answering mid-run
                raise StorageError(
                    (f"{failed}; then " if failed else "")
                    + f"{_first_line(exc)} (cleaning up: the run's objects under "
                    f"{self.admin.url(self.prefix)} may be left; delete them once the store "
                    "answers)"
                ) from exc
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
        # Gets of objects the run had just written, on a local disk: read from the page cache.
        result["gets_from_page_cache"] = self.admin.is_local and bool(
            result.get("get", {}).get("ops")
        )
        if cfg.faults is not None:
            result["faults"] = {
                "injected": dict(cfg.faults.counts),
                "latency": str(cfg.faults.latency) if cfg.faults.latency else None,
                "error_rate": cfg.faults.error_rate,
                "slow_rate": cfg.faults.slow_rate,
                "hang_rate": cfg.faults.hang_rate,
            }
        if cfg.read_prefix is None:  # a read-only run wrote nothing to keep or delete
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
            try:
                while any(t.is_alive() for t in threads):
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        self._finish("duration")
                        break
                    if self._stop.wait(min(0.2, remaining)):
                        break
                    bar.update(self._progress_ops - bar.n)
            finally:  # also on Ctrl-C or SIGTERM: no worker writes while the cleanup deletes
                self._finish(self._stop_reason or "done")
                elapsed = self._join(threads)
            bar.update(self._progress_ops - bar.n)
        return elapsed

    def _join(self, threads: list[threading.Thread]) -> float:
        """Wait for workers to finish their current request; bounded by the retry policy."""
        if self.config.faults is not None:
            self.config.faults.release(fail_hung=True)
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
        return {op: self._op_result(op, elapsed_s) for op in ops}

    def _op_result(self, op: str, elapsed_s: float) -> dict[str, Any]:
        retries = self.store.counters.snapshot()["retries"].get(op, 0)
        return self._merged_stats[op].to_dict(elapsed_s, retries=retries)

    def _run_steady(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.readers:
            self._seed(max(16, 2 * cfg.readers), cfg.sizes)
        targets = [self._steady_writer] * cfg.writers + [self._steady_reader] * cfg.readers
        elapsed = self._workers(targets)
        return {"duration_s": elapsed, "stop_reason": self._stop_reason} | self._ops_result(elapsed)

    def _run_read(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.read_prefix is not None:
            self._existing(cfg.read_prefix)
        else:
            self._seed(cfg.objects, cfg.sizes)
        elapsed = self._workers([self._range_reader] * cfg.readers)
        return {
            "duration_s": elapsed,
            "stop_reason": self._stop_reason,
            "read_bytes": cfg.read_bytes,
            "objects": len(self._readable),
        } | self._ops_result(elapsed, ("get",))

    def _run_burst(self) -> dict[str, Any]:
        return run_burst(self)
