"""Fault injection for the storage layer: latency, slow requests, errors and hangs. Not public
API and not part of ``ckptstore``: ``ckptbench storage`` (``--latency``, ``--error-rate``,
``--hang-rate``, ...), the loader bench and the tests use it.

A backend wrapper that makes a fast local store behave like a remote one::

    store = with_faults(Store(uri), Faults(latency=LogNormal(median_s=0.01, sigma=0.5),
                                           slow_rate=0.05, slow_factor=20, error_rate=0.01))

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
from typing import Any

from ckptstore.store import Backend, Store
from ckptstore.store.backends import Data

ALL_OPS = frozenset({"put", "get", "size", "exists", "modified", "list", "delete"})


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
        numbers = [float(p) for p in parts[1:]]
        if not all(math.isfinite(n) and n >= 0 for n in numbers):
            raise ValueError(f"bad latency spec {spec!r}: times must be finite and >= 0")
        if parts[0] == "fixed" and len(parts) == 2:
            return Fixed(numbers[0])
        if parts[0] == "lognormal" and len(parts) in (2, 3) and numbers[0] > 0:
            return LogNormal(numbers[0], numbers[1] if len(parts) == 3 else 0.5)
    except ValueError as exc:
        if "must be" in str(exc):
            raise
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
        self._fail_released = False

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into another process: the same settings, with a lock and state of its own.
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_released")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._released = threading.Event()

    def release(self, *, fail_hung: bool = False) -> None:
        """End every hang now and inject no more hangs. ``fail_hung``: a request it ends fails
        (:class:`InjectedFaultError`) rather than going on, as a run's end abandons it: it
        never answered, and must not count as an answer."""
        self._fail_released = fail_hung
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
            if self._released.wait(self.hang_s) and self._fail_released:
                raise InjectedFaultError(f"hung {op} abandoned: the run ended before it answered")
        elif delay > 0:
            time.sleep(delay)
        if error:
            self.counts["errors"] += 1
            raise InjectedFaultError(f"injected fault in {op}")


class FaultyBackend(Backend):
    """A storage backend with :class:`Faults` injected before each request to ``inner``."""

    def __init__(self, inner: Backend, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.root = inner.root
        self.is_local = inner.is_local
        self.remote = inner.remote
        self.enforces_create = inner.enforces_create
        self.endpoint = inner.endpoint
        self.clock_resolution_s = inner.clock_resolution_s

    def reopen(self) -> Backend:
        return FaultyBackend(self.inner.reopen(), self.faults)

    def put_once(self, path: str, data: Data) -> None:
        self.faults.inject("put")
        return self.inner.put_once(path, data)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self.faults.inject("get")
        return self.inner.get(path, start, end)

    def get_view(self, path: str, start: int | None = None, end: int | None = None) -> Any:
        self.faults.inject("get")
        return self.inner.get_view(path, start, end)

    def size(self, path: str) -> int:
        self.faults.inject("size")
        return self.inner.size(path)

    def stat(self, path: str) -> tuple[int, str]:
        self.faults.inject("size")
        return self.inner.stat(path)

    def exists(self, path: str) -> bool:
        self.faults.inject("exists")
        return self.inner.exists(path)

    def modified(self, path: str) -> float:
        self.faults.inject("modified")
        return self.inner.modified(path)

    def list(self, path: str) -> list[str]:
        self.faults.inject("list")
        return self.inner.list(path)

    def list_times(self, path: str) -> dict[str, float]:
        self.faults.inject("list")
        return self.inner.list_times(path)

    def delete(self, path: str) -> None:
        self.faults.inject("delete")
        return self.inner.delete(path)

    def stale_temporaries(
        self, root: str, *, older_than_s: float, now: float | None = None
    ) -> list[str]:
        return self.inner.stale_temporaries(root, older_than_s=older_than_s, now=now)


def with_faults(store: Store, faults: Faults | None) -> Store:
    """``store`` with ``faults`` injected into its backend from now on (None: unchanged)."""
    if faults is not None:
        store.backend = FaultyBackend(store.backend, faults)
    return store


def faults_of(store: Store) -> Faults | None:
    """The faults injected into ``store``, if any."""
    backend = store.backend
    return backend.faults if isinstance(backend, FaultyBackend) else None
