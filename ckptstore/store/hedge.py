"""Hedged requests ("The Tail at Scale"): when a request is slower than most of its size, send a
duplicate and take whichever answers first, within a budget of extra requests.

One implementation for the store's own gets and puts (a duplicate of the same request) and for
the loader's replica reads (the duplicate goes to another replica, chosen by the replica set):
:class:`Hedger` decides *when* a duplicate is due (a percentile of recent first-attempt latencies
of the request's size class, with a floor and an initial value) and *whether* the budget allows
it (a token bucket refilled by a fraction of a token per request); :meth:`Hedger.call` runs the
first-answer-wins race for callers that duplicate the same call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TypeVar

from ckptstore.store.counters import StoreCounters

R = TypeVar("R")

_WINDOW = 512  # recent latencies kept per size class
_REFRESH = 16  # recompute a class's percentile after this many new latencies


@dataclass(kw_only=True)
class HedgePolicy:
    """When to hedge and how many extra requests that may cost."""

    quantile: float = 95.0
    """Hedge a request still running after this percentile of recent first-attempt latencies
    of its size class (outliers left out: see ``outlier_factor``)."""
    outlier_factor: float = 5.0
    """Latencies over this many times the class's median are left out of the percentile: they
    are the slow requests hedging exists to cut, and counting them would pull the delay up
    into the very tail it is meant to cut (5% of requests 20x slow put the 95th percentile
    of all latencies among the slow ones)."""
    min_delay_s: float = 0.05
    """Never hedge sooner than this."""
    initial_delay_s: float = 2.0
    """The delay until ``min_samples`` latencies of a size class have been seen."""
    min_samples: int = 20
    """Latencies of a size class needed before its percentile is trusted."""
    max_extra_fraction: float = 0.05
    """Hedges allowed per request (token bucket refill); 0.05 means at most ~5% extra requests."""
    burst: float = 2.0
    """Hedges that may be spent at once (the bucket's capacity)."""

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 100:
            raise ValueError(f"HedgePolicy.quantile must be within (0, 100), got {self.quantile}")
        if self.outlier_factor <= 1:
            raise ValueError(f"HedgePolicy.outlier_factor must be > 1, got {self.outlier_factor}")
        if self.max_extra_fraction < 0:
            raise ValueError(
                f"HedgePolicy.max_extra_fraction must be >= 0, got {self.max_extra_fraction}"
            )
        if self.min_delay_s <= 0 or self.initial_delay_s <= 0:
            raise ValueError("HedgePolicy.min_delay_s and initial_delay_s must be > 0")
        if self.min_samples < 1:
            raise ValueError(f"HedgePolicy.min_samples must be >= 1, got {self.min_samples}")
        if self.burst < 1:
            raise ValueError(f"HedgePolicy.burst must be >= 1, got {self.burst}")


def size_class(nbytes: int) -> int:
    """Requests within a factor of 4 of each other share a class (0 for unknown or tiny)."""
    return max(int(nbytes).bit_length() - 12, 0) // 2


def _trimmed_percentile(values: deque[float], q: float, outlier_factor: float) -> float:
    """The ``q``-th percentile of ``values`` no greater than ``outlier_factor`` x their median."""
    import numpy as np  # only once latencies are measured: not on every import of the store

    a = np.fromiter(values, dtype=np.float64, count=len(values))
    body = a[a <= outlier_factor * float(np.median(a))]
    return float(np.percentile(body, q))


class Hedger:
    """Hedge delays per size class, a token bucket, and counts of requests and hedges.

    First attempts are measured whether they win or lose (a hedged request's own latency would
    hide the tail it cut and drift the delay upward), so the delay tracks the service as it is.
    """

    def __init__(
        self,
        policy: HedgePolicy | None = None,
        *,
        counters: StoreCounters | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._counters = counters
        self.policy = policy or HedgePolicy()

    @property
    def policy(self) -> HedgePolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: HedgePolicy) -> None:
        """A new policy starts afresh: no latencies known, a full bucket."""
        with self._lock:
            self._policy = policy
            self._recent: dict[int, deque[float]] = {}
            self._cached: dict[int, float] = {}
            self._new: dict[int, int] = {}
            self._tokens = policy.burst
            self.requests = 0
            self.hedges = 0
            self.hedges_won = 0

    # -- when -------------------------------------------------------------------------------

    def record(self, nbytes: int, seconds: float) -> None:
        """A first attempt of a request of ``nbytes`` took ``seconds``."""
        cls = size_class(nbytes)
        with self._lock:
            self._recent.setdefault(cls, deque(maxlen=_WINDOW)).append(seconds)
            self._new[cls] = self._new.get(cls, 0) + 1

    def delay_s(self, nbytes: int = 0) -> float:
        """How long a request of ``nbytes`` runs before a duplicate is due."""
        p = self._policy
        cls = size_class(nbytes)
        with self._lock:
            recent = self._recent.get(cls)
            if recent is None or len(recent) < p.min_samples:
                return max(p.initial_delay_s, p.min_delay_s)
            if cls not in self._cached or self._new.get(cls, 0) >= _REFRESH:
                self._cached[cls] = _trimmed_percentile(recent, p.quantile, p.outlier_factor)
                self._new[cls] = 0
            return max(self._cached[cls], p.min_delay_s)

    def samples(self) -> dict[int, list[float]]:
        """The recent first-attempt latencies of each size class (for :meth:`seed`)."""
        with self._lock:
            return {cls: list(recent) for cls, recent in self._recent.items()}

    def seed(self, samples: dict[int, list[float]]) -> None:
        """Start from latencies another process measured (``samples()`` of the last pass's
        readers): a new reader hedges at the learnt delay from its first request, not at the
        initial guess until it has measured ``min_samples`` of its own."""
        with self._lock:
            for cls, seconds in samples.items():
                recent = self._recent.setdefault(int(cls), deque(maxlen=_WINDOW))
                recent.extend(float(s) for s in seconds[-_WINDOW:])
                self._new[int(cls)] = _REFRESH

    def learnt(self, nbytes: int = 0) -> bool:
        """Whether the delay of ``nbytes`` requests comes from their latencies (not the initial
        guess)."""
        with self._lock:
            recent = self._recent.get(size_class(nbytes))
            return recent is not None and len(recent) >= self._policy.min_samples

    def delays(self) -> dict[str, float]:
        """The current delay of each size class seen, keyed by its upper bound in bytes."""
        with self._lock:
            classes = list(self._recent)
        return {f"<{2 ** (13 + 2 * c)}B": self.delay_s(2 ** (12 + 2 * c)) for c in classes}

    # -- whether ----------------------------------------------------------------------------

    def admit(self) -> None:
        """A request that may be hedged starts: it earns the bucket its share of a token."""
        with self._lock:
            self.requests += 1
            self._tokens = min(self._policy.burst, self._tokens + self._policy.max_extra_fraction)

    def try_hedge(self, op: str, *, reserve: float = 0.0) -> bool:
        """Take a token for a duplicate of ``op`` if more than ``reserve`` would be left (a
        request's later duplicates pass a reserve, so that first ones, which cut the most
        latency, are not starved)."""
        with self._lock:
            if self._tokens < 1.0 + reserve:
                return False
            self._tokens -= 1.0
            self.hedges += 1
        if self._counters is not None:
            self._counters.hedge(op, "fired")
        return True

    def won(self, op: str) -> None:
        """A duplicate of ``op`` answered first."""
        with self._lock:
            self.hedges_won += 1
        if self._counters is not None:
            self._counters.hedge(op, "won")

    @property
    def tokens(self) -> float:
        return self._tokens

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"requests": self.requests, "hedges": self.hedges, "hedges_won": self.hedges_won}

    # -- the race ---------------------------------------------------------------------------

    def call(
        self,
        fn: Callable[[], R],
        submit: Callable[[Callable[[], R]], Future],
        *,
        op: str = "call",
        nbytes: int = 0,
    ) -> R:
        """``fn()`` through ``submit``, duplicated once if it runs past :meth:`delay_s`.

        The first success wins; if one attempt fails the other is awaited; the loser is
        cancelled if it has not started (a started one runs to completion, ignored). The first
        attempt's latency is recorded when it ends: on success, and after losing the race
        whatever its end (a write-once put that lost finds the winner's object).
        """
        self.admit()
        start = time.perf_counter()
        first = submit(fn)
        raced = threading.Event()

        def measure(future: Future) -> None:
            if not future.cancelled() and (raced.is_set() or future.exception() is None):
                self.record(nbytes, time.perf_counter() - start)

        first.add_done_callback(measure)
        try:
            return first.result(timeout=self.delay_s(nbytes))
        except TimeoutError:
            if first.done():
                raise  # fn itself raised a timeout
        if not self.try_hedge(op):
            return first.result()
        second = submit(fn)
        pending = {first, second}
        error: BaseException | None = None
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                if future.exception() is None:
                    raced.set()
                    for other in pending:
                        other.cancel()
                    if future is second:
                        self.won(op)
                    return future.result()
                error = error or future.exception()
        assert error is not None
        raise error
