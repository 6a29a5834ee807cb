"""Hedged requests ("The Tail at Scale"): when a request is slower than most, send a duplicate
and take whichever answers first, within a budget of extra requests.

Used for chunk uploads: a chunk's key is its content hash and puts are exclusive creates, so a
duplicate put is idempotent (the loser finds the object there) and never duplicates an object.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

R = TypeVar("R")


@dataclass(kw_only=True)
class HedgePolicy:
    """When to hedge and how many extra requests that may cost."""

    quantile: float = 95.0
    """Hedge a request still running after this percentile of recent latencies."""
    min_delay_s: float = 0.05
    """Never hedge sooner than this."""
    initial_delay_s: float = 2.0
    """The delay until ``min_samples`` latencies have been seen."""
    min_samples: int = 20
    max_extra_fraction: float = 0.05
    """Hedges allowed per request (token bucket rate); 0.05 means at most ~5% extra requests."""
    burst: float = 2.0
    """Hedges that may be spent at once."""

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 100:
            raise ValueError(f"HedgePolicy.quantile must be within (0, 100), got {self.quantile}")
        if not 0 <= self.max_extra_fraction <= 1:
            raise ValueError("HedgePolicy.max_extra_fraction must be within [0, 1]")


class Hedger:
    """Tracks recent latencies and a token bucket; runs calls with at most one hedge each."""

    def __init__(self, policy: HedgePolicy | None = None) -> None:
        self.policy = policy or HedgePolicy()
        self._recent: deque[float] = deque(maxlen=512)
        self._lock = threading.Lock()
        self._tokens = self.policy.burst
        self.requests = 0
        self.hedges = 0
        self.hedges_won = 0

    def delay_s(self) -> float:
        p = self.policy
        with self._lock:
            if len(self._recent) < p.min_samples:
                return max(p.initial_delay_s, p.min_delay_s)
            return max(float(np.percentile(self._recent, p.quantile)), p.min_delay_s)

    def _take_token(self) -> bool:
        with self._lock:
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                self.hedges += 1
                return True
            return False

    def _record(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)
            self.requests += 1
            self._tokens = min(self.policy.burst, self._tokens + self.policy.max_extra_fraction)

    def call(self, fn: Callable[[], R], submit: Callable[[Callable[[], R]], Future]) -> R:
        """``fn()`` through ``submit``, hedged once if it runs past :meth:`delay_s`.

        The first success wins; if one attempt fails the other is awaited; the loser is
        cancelled if it has not started (a started one runs to completion, ignored).
        """
        start = time.perf_counter()
        first = submit(fn)
        try:
            result = first.result(timeout=self.delay_s())
            self._record(time.perf_counter() - start)
            return result
        except TimeoutError:
            if first.done():
                raise  # fn itself raised a timeout
        if not self._take_token():
            result = first.result()
            self._record(time.perf_counter() - start)
            return result
        second = submit(fn)
        pending = {first, second}
        error: BaseException | None = None
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                if future.exception() is None:
                    for other in pending:
                        other.cancel()
                    self._record(time.perf_counter() - start)
                    if future is second:
                        with self._lock:
                            self.hedges_won += 1
                    return future.result()
                error = error or future.exception()
        assert error is not None
        raise error

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "requests": self.requests,
                "hedges": self.hedges,
                "hedges_won": self.hedges_won,
            }
