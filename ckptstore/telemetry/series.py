"""Named metrics with labels, as Prometheus shapes them: counters, fixed-bucket histograms, and
the registry of a process's metrics."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptstore.telemetry.counts import Counts

Labels = tuple[str, ...]

DEFAULT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labels: Labels = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, Any]) -> Labels:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {list(self.labels)}, got {sorted(labels)}")
        return tuple(str(labels[k]) for k in self.labels)


@dataclass(frozen=True)
class _Attachment:
    counts: Counts
    labels_of: Callable[[Hashable], Labels | None]
    baseline: dict[Hashable, float]  # what ``counts`` held when attached: counted elsewhere

    def counted(self) -> dict[Labels, float]:
        out: dict[Labels, float] = {}
        for key, n in self.counts.snapshot().items():
            labels = self.labels_of(key)
            if labels is not None and (n := n - self.baseline.get(key, 0)):
                out[labels] = out.get(labels, 0) + n
        return out


class Counter(_Metric):
    """A monotonically increasing count per label set: what ``inc`` added, plus what the
    ``Counts`` attached to it counted. Whoever keeps counts of its own (a store, a loader
    replica) attaches them rather than counting each event a second time here."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._settled = Counts()  # inc()'s, and those of attachments whose owner is gone
        self._attached: dict[int, _Attachment] = {}
        self._tokens = itertools.count()
        # Finalizers may run inside any allocation, this metric's lock held or not: they only
        # queue the attachment here, and the next reader settles it under the lock.
        self._gone: deque[int] = deque()

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        self._settled.add(self._key(labels), amount)

    def attach(
        self, owner: object, counts: Counts, labels_of: Callable[[Hashable], Labels | None]
    ) -> None:
        """Count in this metric what ``counts`` counts from now on, each key under the label
        values ``labels_of(key)`` (``None``: a key that is not this metric's), while ``owner``
        lives and after. ``labels_of`` must not refer to ``owner``, or it never dies."""
        attachment = _Attachment(counts, labels_of, counts.snapshot())
        with self._lock:
            self._settle_gone()
            token = next(self._tokens)
            self._attached[token] = attachment
        weakref.finalize(owner, self._gone.append, token)

    def _settle_gone(self) -> None:
        while self._gone:
            attachment = self._attached.pop(self._gone.popleft())
            self._settled.add_many(attachment.counted())

    def value(self, **labels: Any) -> float:
        return self.samples().get(self._key(labels), 0.0)

    def samples(self) -> dict[Labels, float]:
        with self._lock:
            self._settle_gone()
            total = self._settled.snapshot()
            for attachment in self._attached.values():
                for labels, n in attachment.counted().items():
                    total[labels] = total.get(labels, 0) + n
        return {labels: float(n) for labels, n in total.items()}  # type: ignore[misc]


class Histogram(_Metric):
    """Observations counted into fixed buckets (upper bounds, seconds by default), per label set."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labels: Iterable[str] = (),
        buckets: Iterable[float] = DEFAULT_BUCKETS_S,
    ) -> None:
        super().__init__(name, help, labels)
        self.bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        self._series: dict[Labels, list] = {}  # key -> [per-bucket counts (+inf last), sum]

    def observe(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        slot = bisect.bisect_left(self.bounds, value)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = [[0] * (len(self.bounds) + 1), 0.0]
            series[0][slot] += 1
            series[1] += value

    def series(self) -> dict[Labels, dict[str, Any]]:
        """Per label set: count, sum, and cumulative (upper bound, count) buckets ending at +inf."""
        with self._lock:
            raw = {k: (list(counts), total) for k, (counts, total) in self._series.items()}
        out = {}
        for key, (counts, total) in raw.items():
            running, buckets = 0, []
            for bound, n in zip((*self.bounds, math.inf), counts):
                running += n
                buckets.append((bound, running))
            out[key] = {"count": running, "sum": total, "buckets": buckets}
        return out


class Registry:
    """The metrics of one process, by name."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def add(self, metric: _Metric) -> Any:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def __iter__(self) -> Iterator[_Metric]:
        with self._lock:
            return iter(list(self._metrics.values()))

    def get(self, name: str) -> _Metric:
        return self._metrics[name]

    def snapshot(self) -> dict[str, dict[Labels, Any]]:
        """name -> {label values -> number (counter) or {count, sum, buckets} (histogram)}."""
        return {
            m.name: m.samples() if isinstance(m, Counter) else m.series()  # type: ignore[union-attr]
            for m in self
        }
