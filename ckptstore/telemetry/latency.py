"""Latency histograms (HdrHistogram) that pickle and merge: the loader's stats and the bench."""

from __future__ import annotations

import threading

from hdrh.histogram import HdrHistogram

_US = 1_000_000


class LatencyHistogram:
    """Thread-safe latency histogram in microseconds, 3 significant figures, up to 1 hour.

    Values beyond the range are clamped to it rather than dropped, so ``max_s`` stays honest
    about a hang up to an hour.
    """

    _HIGHEST_US = 3600 * _US

    def __init__(self) -> None:
        self._hist = HdrHistogram(1, self._HIGHEST_US, 3)
        self._sum_us = 0  # hdrh's own mean walks every bucket: ~30 ms a summary
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        value = min(max(int(round(seconds * _US)), 1), self._HIGHEST_US)
        with self._lock:
            self._hist.record_value(value)
            self._sum_us += value

    def __getstate__(self) -> dict[str, object]:
        with self._lock:
            return {"encoded": self._hist.encode(), "sum_us": self._sum_us}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()
        self._hist.decode_and_add(state["encoded"])
        self._sum_us = state["sum_us"]

    def merge(self, other: LatencyHistogram) -> None:
        with other._lock:
            encoded = other._hist.encode()
            other_sum = other._sum_us
        with self._lock:
            self._hist.decode_and_add(encoded)
            self._sum_us += other_sum

    @property
    def count(self) -> int:
        return self._hist.get_total_count()

    def percentile_s(self, q: float) -> float:
        """The ``q``-th percentile (0-100) in seconds; 0.0 when empty."""
        with self._lock:
            if not self._hist.get_total_count():
                return 0.0
            return self._hist.get_value_at_percentile(q) / _US

    def summary(self) -> dict[str, float]:
        """count, mean_s, p50_s, p90_s, p99_s, p999_s, max_s."""
        with self._lock:
            h = self._hist
            n = h.get_total_count()
            if not n:
                return dict.fromkeys(
                    ("mean_s", "p50_s", "p90_s", "p99_s", "p999_s", "max_s"), 0.0
                ) | {"count": 0}
            return {
                "count": n,
                "mean_s": self._sum_us / n / _US,
                "p50_s": h.get_value_at_percentile(50) / _US,
                "p90_s": h.get_value_at_percentile(90) / _US,
                "p99_s": h.get_value_at_percentile(99) / _US,
                "p999_s": h.get_value_at_percentile(99.9) / _US,
                "max_s": h.get_max_value() / _US,
            }
