"""Fault injection for the storage layer: latency, slow requests, errors and hangs.

Used by tests and by ``ckptbench`` to make a fast local store behave like a remote one::

    Store(uri, faults=Faults(latency=LogNormal(median_s=0.01, sigma=0.5), slow_rate=0.05,
                             slow_factor=20, error_rate=0.01))

Injected errors are transient (``InjectedFaultError`` is a ``ConnectionError``) so the store's
retry loop handles them like real resets; hangs last until ``hang_s`` or ``Faults.release()``.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

ALL_OPS = frozenset({"put", "get", "size", "exists", "list", "delete"})


class InjectedFaultError(ConnectionError):
    """A transient error injected on purpose."""


@dataclass(frozen=True)
class Fixed:
    """Every request takes ``s`` seconds."""

    s: float

    @property
    def median_s(self) -> float:
        return self.s

    def sample(self, rng: random.Random) -> float:
        return self.s


@dataclass(frozen=True)
class LogNormal:
    """Log-normal latency around ``median_s``; ``sigma`` is the spread of its logarithm."""

    median_s: float
    sigma: float = 0.5

    def sample(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median_s), self.sigma)


def parse_latency(spec: str) -> Fixed | LogNormal | None:
    """``"none"``, ``"fixed:0.01"`` or ``"lognormal:MEDIAN_S[:SIGMA]"``."""
    parts = spec.strip().lower().split(":")
    try:
        if parts[0] in ("", "none", "0"):
            return None
        if parts[0] == "fixed" and len(parts) == 2:
            return Fixed(float(parts[1]))
        if parts[0] == "lognormal" and len(parts) in (2, 3):
            return LogNormal(float(parts[1]), float(parts[2]) if len(parts) == 3 else 0.5)
    except ValueError:
        pass
    raise ValueError(
        f"bad latency spec {spec!r}: expected none, fixed:SECONDS or lognormal:MEDIAN_S[:SIGMA]"
    )


@dataclass(kw_only=True)
class Faults:
    """What to inject, per request, into the operations named in ``ops``."""

    latency: Fixed | LogNormal | None = None
    """Base latency added to every request."""
    slow_rate: float = 0.0
    """Fraction of requests delayed by ``slow_factor`` times the median latency (or ``slow_s``)."""
    slow_factor: float = 20.0
    slow_s: float | None = None
    error_rate: float = 0.0
    """Fraction of requests that fail with :class:`InjectedFaultError`."""
    hang_rate: float = 0.0
    """Fraction of requests that hang for ``hang_s`` (or until :meth:`release`)."""
    hang_s: float = 3600.0
    ops: frozenset[str] = ALL_OPS
    seed: int | None = None
    counts: Counter = field(default_factory=Counter, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("slow_rate", "error_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"Faults.{name} must be within [0, 1], got {value}")
        unknown = set(self.ops) - ALL_OPS
        if unknown:
            raise ValueError(f"Faults.ops has unknown operations {sorted(unknown)}")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._released = threading.Event()

    def release(self) -> None:
        """End every hang now and inject no more hangs."""
        self._released.set()

    def inject(self, op: str) -> None:
        """Called before a request runs: sleeps, hangs or raises as configured."""
        if op not in self.ops:
            return
        with self._lock:
            delay = self.latency.sample(self._rng) if self.latency else 0.0
            slow = self._rng.random() < self.slow_rate
            error = self._rng.random() < self.error_rate
            hang = self._rng.random() < self.hang_rate and not self._released.is_set()
            if slow:
                median = self.latency.median_s if self.latency else 0.0
                delay += self.slow_s if self.slow_s is not None else self.slow_factor * median
                self.counts["slow"] += 1
            self.counts["requests"] += 1
        if hang:
            self.counts["hangs"] += 1
            self._released.wait(self.hang_s)
        elif delay > 0:
            time.sleep(delay)
        if error:
            self.counts["errors"] += 1
            raise InjectedFaultError(f"injected fault in {op}")


class FaultyBackend:
    """A storage backend with :class:`Faults` injected before each request."""

    def __init__(self, inner, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.fs = inner.fs
        self.is_local = inner.is_local
        self.enforces_create = inner.enforces_create

    def put_once(self, path, data):
        self.faults.inject("put")
        return self.inner.put_once(path, data)

    def get(self, path, start=None, end=None):
        self.faults.inject("get")
        return self.inner.get(path, start, end)

    def get_view(self, path, start=None, end=None):
        self.faults.inject("get")
        return self.inner.get_view(path, start, end)

    def size(self, path):
        self.faults.inject("size")
        return self.inner.size(path)

    def exists(self, path):
        self.faults.inject("exists")
        return self.inner.exists(path)

    def list(self, path):
        self.faults.inject("list")
        return self.inner.list(path)

    def delete(self, path):
        self.faults.inject("delete")
        return self.inner.delete(path)
