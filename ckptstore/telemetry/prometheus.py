"""The process's metrics read into prometheus_client (an optional dependency) at scrape time."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ckptstore.telemetry.series import Counter, Histogram, Registry


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
        from ckptstore.telemetry import METRICS

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
