"""The prefetch window: reads in flight (bounded by count and bytes) that complete out of order,
handed to the consumer in plan order (a reorder buffer keyed by unit).

Reads are started in the order the consumer will first need them. The window admits the next
read while fewer than ``window_reads`` are in flight and the bytes in flight plus the bytes read
and not yet released stay within ``window_bytes`` (one read is always admitted when the window is
empty, so a unit larger than the window still makes progress). A unit is admitted at the size
its layout declares, times what the last units read grew by once decoded (``Growth``, kept by
the dataset from pass to pass), and counts, once decoded, what it says it takes (``mem_bytes``,
where larger than declared). Counts of reads in flight are estimates: ``max_resident_bytes``
is their sum with what is decoded and held. While the consumer waits for the
read it needs, every other completion tops the window up, so a slow read never holds back the
reads behind it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from loaders.metrics import ConsumerStats


class Growth:
    """What units of a dataset grow to once decoded, per byte their layout declares, learnt by
    every window of a dataset in turn (a pass's, the next pass's): the most of the last few
    measured (one dense unit does not slow the rest of the dataset for good). ``may_grow``: its
    layout's units can decode larger than declared (MDS json columns); until one is measured,
    its windows read one unit at a time."""

    RECENT = 8

    def __init__(self, may_grow: bool = False) -> None:
        self.may_grow = may_grow
        self._recent: deque[float] = deque(maxlen=self.RECENT)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def factor(self) -> float:
        with self._lock:
            return max(self._recent, default=1.0)

    def learning(self) -> bool:
        """No unit of a layout whose units may grow measured yet."""
        return self.may_grow and not self._recent

    def record(self, ratio: float) -> None:
        with self._lock:
            self._recent.append(max(1.0, ratio))


class Window:
    """Starts reads of ``schedule`` (units with their byte cost) through ``fetch``."""

    def __init__(
        self,
        schedule: Iterator[tuple[int, int]],
        fetch: Callable[[int], Any],
        *,
        window_reads: int,
        window_bytes: int,
        stats: ConsumerStats,
        growth: Growth | None = None,
    ) -> None:
        self._schedule = schedule
        self._next: tuple[int, int] | None = None
        self._fetch = fetch
        self._max_reads = window_reads
        self._max_bytes = window_bytes
        self._stats = stats
        self._pool = ThreadPoolExecutor(window_reads, thread_name_prefix="loaders-prefetch")
        self._futures: dict[int, Future] = {}
        self._cost: dict[int, int] = {}  # what each unit counts for now
        self._declared: dict[int, int] = {}  # what its layout said before it was read
        # Later reads are admitted at their declared size times what the units measured so
        # far grew by (MDS's JSON values take more than their text).
        self._growth = growth if growth is not None else Growth()
        self._held = 0  # bytes in flight plus read and not released
        # Reads count themselves out as they end (a done-callback), so that neither a top-up
        # nor a wait looks at the reads themselves: the window may hold thousands of completed
        # small reads, and polling futures cost the consumer more CPU than the reads did.
        self._ended = threading.Condition()
        self._inflight = 0
        self._then: Callable[[], None] | None = None  # what close() left to the last read
        self._completions = 0
        self._seen = 0  # completions when the window was last topped up

    def _read_ended(self, unit: int, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._account(unit, future.result())  # decoded ahead: counted before it is asked for
        with self._ended:
            self._inflight -= 1
            self._completions += 1
            self._ended.notify_all()
            then = None
            if not self._inflight:
                then, self._then = self._then, None
        if then is not None:
            then()

    def top_up(self) -> None:
        self._seen = self._completions
        try:
            self._admit()
        finally:
            stats = self._stats
            with self._ended:
                stats.max_inflight_reads = max(stats.max_inflight_reads, self._inflight)
                stats.max_resident_bytes = max(stats.max_resident_bytes, self._held)

    def _admit(self, force: bool = False) -> None:
        while force or self._inflight < self._max_reads:
            if self._next is None:
                self._next = next(self._schedule, None)
                if self._next is None:
                    return
            unit, declared = self._next
            cost = int(declared * self._growth.factor())
            if not force and self._held and self._held + cost > self._max_bytes:
                return
            if not force and self._inflight and self._growth.learning():
                return  # one at a time until a unit shows what they grow to
            force = False
            self._next = None
            with self._ended:
                self._inflight += 1
                self._declared[unit] = declared
                self._cost[unit] = cost
                self._held += cost
            future = self._pool.submit(self._fetch, unit)
            future.add_done_callback(functools.partial(self._read_ended, unit))
            self._futures[unit] = future

    def get(self, unit: int) -> Any:
        """The decoded unit; waits (and counts the wait) only if its read has not completed."""
        self.top_up()
        while unit not in self._futures:  # only when a block outgrows the window: progress first
            self._admit(force=True)
        future = self._futures[unit]
        if not future.done():
            t0 = time.monotonic()
            while not future.done():
                with self._ended:  # until it ends, or another read does: then top up
                    self._ended.wait_for(lambda: future.done() or self._completions != self._seen)
                self.top_up()
            waited = time.monotonic() - t0
            self._stats.wait.record(waited)
            self._stats.wait_s += waited
            self._stats.waits += 1
        result = future.result()
        self._account(unit, result)
        return result

    def _account(self, unit: int, result: Any) -> None:
        """A decoded ``unit`` that says what it takes (``mem_bytes``: MDS's samples) counts
        that from now on, never less than its layout declared (not after its release); later
        reads are admitted at what this one's growth suggests."""
        measured = getattr(result, "mem_bytes", None)
        if measured is None:
            return
        with self._ended:
            declared = self._declared.get(unit)
            if declared is None:  # released already
                return
            now = max(declared, measured)
            self._held += now - self._cost[unit]
            self._cost[unit] = now
            if declared:
                self._growth.record(measured / declared)
            stats = self._stats
            stats.max_resident_bytes = max(stats.max_resident_bytes, self._held)

    def ready(self, unit: int) -> bool:
        future = self._futures.get(unit)
        return future is not None and future.done()

    def release(self, unit: int) -> None:
        """The consumer is done with ``unit``: its bytes leave the window."""
        self._futures.pop(unit)
        with self._ended:
            self._held -= self._cost.pop(unit)
            del self._declared[unit]
        self.top_up()

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Cancel the reads not started; ``then()`` runs once none is in flight: now, or at the
        end of the last one (in its thread)."""
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if then is not None:
            with self._ended:
                if self._inflight:
                    self._then = then
                    return
            then()
