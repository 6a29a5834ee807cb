"""When to hedge: an adaptive delay per size class, and a token bucket capping extra requests."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from loaders.config import ReplicaConfig

_WINDOW = 512  # recent latencies kept per size class
_REFRESH = 16  # recompute a class's percentile after this many new latencies


def size_class(nbytes: int) -> int:
    """Reads within a factor of 4 of each other share a class (0 for unknown or tiny)."""
    return max(int(nbytes).bit_length() - 12, 0) // 2


class HedgeDelay:
    """The ``hedge_quantile``-th percentile of recent first-attempt latencies of a size class.

    First attempts are measured whether they win or lose (a hedged read's own latency would hide
    the tail it cut and drift the delay upward), so the delay tracks the service as it is.
    """

    def __init__(self, config: ReplicaConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._recent: dict[int, deque[float]] = {}
        self._cached: dict[int, float] = {}
        self._new: dict[int, int] = {}

    def record(self, nbytes: int, seconds: float) -> None:
        cls = size_class(nbytes)
        with self._lock:
            self._recent.setdefault(cls, deque(maxlen=_WINDOW)).append(seconds)
            self._new[cls] = self._new.get(cls, 0) + 1

    def delay_s(self, nbytes: int) -> float:
        cfg = self._config
        cls = size_class(nbytes)
        with self._lock:
            recent = self._recent.get(cls)
            if recent is None or len(recent) < cfg.hedge_min_samples:
                return max(cfg.hedge_initial_delay_s, cfg.hedge_min_delay_s)
            if cls not in self._cached or self._new.get(cls, 0) >= _REFRESH:
                self._cached[cls] = float(np.percentile(recent, cfg.hedge_quantile))
                self._new[cls] = 0
            return max(self._cached[cls], cfg.hedge_min_delay_s)

    def snapshot(self) -> dict[str, float]:
        """The current delay of each size class seen, keyed by its upper bound in bytes."""
        with self._lock:
            classes = list(self._recent)
        return {f"<{2 ** (13 + 2 * c)}B": self.delay_s(2 ** (12 + 2 * c)) for c in classes}


class HedgeBudget:
    """Token bucket: each read adds ``rate`` tokens (up to ``burst``); a hedge takes one."""

    def __init__(self, rate: float, burst: float) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._lock = threading.Lock()

    def on_read(self) -> None:
        with self._lock:
            self._tokens = min(self._burst, self._tokens + self._rate)

    def try_take(self, *, reserve: float = 0.0) -> bool:
        """Take a token if more than ``reserve`` would be left (later hedges of one read pass a
        reserve, so that first hedges, which cut the most latency, are not starved)."""
        with self._lock:
            if self._tokens >= 1.0 + reserve:
                self._tokens -= 1.0
                return True
            return False

    @property
    def tokens(self) -> float:
        return self._tokens
