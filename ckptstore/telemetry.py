"""Process-wide operational metrics: plain numbers, optionally exported to Prometheus.

Every metric here is a plain Python counter or fixed-bucket histogram that ckptstore and the
loader update as they work; ``snapshot()`` reads them as a dict, so nothing depends on
``prometheus_client``. With it installed, ``register_prometheus()`` adds one collector that
reads these numbers at scrape time into its registry (the default one, or the one given), and
``serve_prometheus(port)`` serves that registry over HTTP.

Names follow Prometheus conventions: base units (seconds, bytes), ``_total`` for counters.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Iterator
from typing import Any

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


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: Any) -> float:
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def samples(self) -> dict[Labels, float]:
        with self._lock:
            return dict(self._values)


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


METRICS = Registry()

save_blocked_seconds = METRICS.add(
    Histogram(
        "ckptstore_save_blocked_seconds",
        "Time a save() held the caller (flatten and stage), per front-end.",
        ["frontend"],
    )
)
save_persist_seconds = METRICS.add(
    Histogram(
        "ckptstore_save_persist_seconds",
        "Time from the start of a save's background work to its commit, per front-end.",
        ["frontend"],
    )
)
saves_total = METRICS.add(
    Counter(
        "ckptstore_saves_total",
        "Saves by outcome: committed, failed, skipped (the previous save was still persisting).",
        ["frontend", "outcome"],
    )
)
bytes_total = METRICS.add(
    Counter(
        "ckptstore_bytes_total",
        "Chunk bytes written (chunks already stored are not counted): raw (before encoding) and "
        "stored (encoded, as put).",
        ["kind"],
    )
)
storage_requests_total = METRICS.add(
    Counter(
        "ckptstore_storage_requests_total",
        "Storage requests by operation and outcome (ok, or the error kind).",
        ["op", "outcome"],
    )
)
storage_bytes_total = METRICS.add(
    Counter(
        "ckptstore_storage_bytes_total",
        "Bytes moved by storage requests that answered, by operation.",
        ["op"],
    )
)
storage_retries_total = METRICS.add(
    Counter("ckptstore_storage_retries_total", "Storage request retries by operation.", ["op"])
)
storage_hedges_total = METRICS.add(
    Counter(
        "ckptstore_storage_hedges_total",
        "Hedged storage requests by operation: fired, and won (the duplicate answered first).",
        ["op", "result"],
    )
)
loader_read_seconds = METRICS.add(
    Histogram(
        "ckptstore_loader_read_seconds",
        "Latency of one read attempt of the data loader, per replica.",
        ["replica"],
    )
)
loader_hedges_total = METRICS.add(
    Counter(
        "ckptstore_loader_hedges_total",
        "Hedged loader reads: fired, and won (the duplicate answered first), per replica.",
        ["replica", "result"],
    )
)
loader_failovers_total = METRICS.add(
    Counter(
        "ckptstore_loader_failovers_total",
        "Loader reads retried on another replica after an error.",
    )
)


def snapshot() -> dict[str, dict[Labels, Any]]:
    """Every metric of this process as plain numbers (see ``Registry.snapshot``)."""
    return METRICS.snapshot()


class _PrometheusCollector:
    """Reads ``METRICS`` into prometheus_client metric families at scrape time."""

    def __init__(self, metrics: Registry) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # unchecked collector: the families are known only at collect time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        for m in self.metrics:
            if isinstance(m, Counter):
                # prometheus_client appends "_total" to counter family names itself
                family = CounterMetricFamily(m.name.removesuffix("_total"), m.help, labels=m.labels)
                for key, value in m.samples().items():
                    family.add_metric(list(key), value)
            else:
                assert isinstance(m, Histogram)
                family = HistogramMetricFamily(m.name, m.help, labels=m.labels)
                for key, s in m.series().items():
                    buckets = [("+Inf" if math.isinf(b) else repr(b), n) for b, n in s["buckets"]]
                    family.add_metric(list(key), buckets, s["sum"])
            yield family


_registered: dict[int, _PrometheusCollector] = {}


def register_prometheus(registry: Any = None) -> Any:
    """Expose ckptstore's metrics through ``prometheus_client`` (an optional dependency).

    ``registry`` defaults to prometheus_client's default ``REGISTRY``. Registering twice in the
    same registry is a no-op. Returns the registry.
    """
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "ckptstore's Prometheus export needs prometheus_client: pip install prometheus_client"
        ) from exc
    if registry is None:
        registry = prometheus_client.REGISTRY
    if id(registry) not in _registered:
        collector = _PrometheusCollector(METRICS)
        registry.register(collector)
        _registered[id(registry)] = collector
    return registry


def serve_prometheus(port: int, addr: str = "127.0.0.1", registry: Any = None) -> Any:
    """Register (see ``register_prometheus``) and serve the metrics over HTTP on ``addr:port``.

    Returns what ``prometheus_client.start_http_server`` returns (server and thread on recent
    versions) so the caller can shut it down.
    """
    import prometheus_client

    registry = register_prometheus(registry)
    return prometheus_client.start_http_server(port, addr=addr, registry=registry)
