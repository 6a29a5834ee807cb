"""Figures of a storage bench run: per-operation histograms and error counts."""

from __future__ import annotations

import contextlib
import logging
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptstore.telemetry import LatencyHistogram

# -- figures ----------------------------------------------------------------------------------


class _OpStats:
    """One worker's figures for one operation; merged at the end of the run."""

    def __init__(self) -> None:
        self.hist = LatencyHistogram()
        self.ops = 0
        self.bytes = 0
        self.errors: Counter[str] = Counter()
        self.first_error: str | None = None
        self.first_error_s: float | None = None  # when, in seconds since the run began

    def merge(self, other: _OpStats) -> None:
        self.hist.merge(other.hist)
        self.ops += other.ops
        self.bytes += other.bytes
        self.errors.update(other.errors)
        if other.first_error_s is not None and (
            self.first_error_s is None or other.first_error_s < self.first_error_s
        ):
            self.first_error, self.first_error_s = other.first_error, other.first_error_s

    def to_dict(self, elapsed_s: float, *, retries: int = 0) -> dict[str, Any]:
        """The figures, with ``retries`` (attempts after a failed one) from the store, and the
        first error and when it came where a request failed."""
        summary = self.hist.summary()
        first = {"first_error": self.first_error, "first_error_s": self.first_error_s}
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
        } | (first if self.first_error is not None else {})


def failed_requests(result: dict[str, Any]) -> str | None:
    """``"3 of 40 puts failed from t=4.1 s, 2 of 9 gets from t=4.0 s (first: ...)"`` for the
    requests of a run's ``result`` that failed; None where none did."""
    failed = [(op, result[op]) for op in ("put", "get") if result.get(op, {}).get("errors")]
    if not failed:
        return None
    counts = [
        f"{r['errors']} of {r['ops'] + r['errors']} {op}s"
        + (" failed" if not i else "")
        + f" from t={r['first_error_s']:.1f} s"
        for i, (op, r) in enumerate(failed)
    ]
    first = min((r for _, r in failed), key=lambda r: r["first_error_s"])["first_error"]
    return f"{', '.join(counts)} (first: {first})"


@contextlib.contextmanager
def retry_records(show: bool, count: Callable[[], None] | None = None) -> Iterator[None]:
    """The store's record of each failed attempt (INFO, marked ``ckptstore_retry``), for a run
    that reports totals from its own counters: each is counted by ``count``, and reaches the
    root's handlers only if ``show``. The store's other records pass as before."""
    store_logger = logging.getLogger("ckptstore.store")
    level, before = store_logger.level, store_logger.getEffectiveLevel()

    def keep(record: logging.LogRecord) -> bool:
        if not getattr(record, "ckptstore_retry", False):
            return record.levelno >= before
        if count is not None:
            count()
        return show

    store_logger.addFilter(keep)
    store_logger.setLevel(min(before, logging.INFO))
    try:
        yield
    finally:
        store_logger.setLevel(level)
        store_logger.removeFilter(keep)


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


@dataclass(kw_only=True)
class _Timeline:
    """Background-read samples for the burst plot: start time since the run began, latency."""

    t_s: array = field(default_factory=lambda: array("d"))
    latency_s: array = field(default_factory=lambda: array("d"))
    dropped: int = 0
