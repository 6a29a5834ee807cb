"""Counts as data: numbers by key that add up, pickle, and merge by adding."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from typing import Any


class Counts:
    """Thread-safe numbers by key (a missing key is 0). A store's requests, a loader replica's
    reads: whoever counts keeps one, and the process-wide series read them (``Counter.attach``).
    """

    def __init__(self, values: Mapping[Hashable, float] | None = None) -> None:
        self._lock = threading.Lock()
        self._values: dict[Hashable, float] = dict(values or {})

    def add(self, key: Hashable, amount: float = 1) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def add_many(self, amounts: Mapping[Hashable, float]) -> None:
        """Add every amount at once: a reader sees all of them or none."""
        with self._lock:
            for key, amount in amounts.items():
                self._values[key] = self._values.get(key, 0) + amount

    def set(self, key: Hashable, value: float) -> None:
        """For a figure its one writer assigns (``stats.waits += 1`` from one thread)."""
        with self._lock:
            self._values[key] = value

    def __getitem__(self, key: Hashable) -> float:
        with self._lock:
            return self._values.get(key, 0)

    def snapshot(self) -> dict[Hashable, float]:
        with self._lock:
            return dict(self._values)

    def merge(self, other: Counts) -> None:
        """Add ``other``'s numbers to these."""
        self.add_many(other.snapshot())

    def __getstate__(self) -> dict[str, Any]:
        return {"values": self.snapshot()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["values"])

    def __repr__(self) -> str:
        return f"Counts({self.snapshot()!r})"
