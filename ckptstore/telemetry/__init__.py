"""Telemetry, in one place: counts as data, latency histograms, and the process-wide metrics.

- ``Counts`` (``counts``): numbers by key that pickle and merge by adding. A store's request
  counts (``store.counters``) and the loader's stats (``loaders.metrics``) are built on it.
- ``LatencyHistogram`` (``latency``): an HdrHistogram for percentiles, that pickles and merges.
- The process-wide metrics below (``series``: counters and fixed-bucket histograms with
  labels), read as plain numbers by ``snapshot()``. A counter's number is what was ``inc``-ed
  plus the ``Counts`` attached to it, so an event is counted once, by whoever counts it: the
  storage series are the sum of every store's counts (its own, or its last if it is gone).
- With ``prometheus_client`` installed, ``register_prometheus()`` adds one collector that reads
  these numbers at scrape time into its registry (the default one, or the one given), and
  ``serve_prometheus(port)`` serves that registry over HTTP (``prometheus``).

Names follow Prometheus conventions: base units (seconds, bytes), ``_total`` for counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstore.telemetry.counts import Counts
from ckptstore.telemetry.prometheus import register_prometheus, serve_prometheus
from ckptstore.telemetry.series import DEFAULT_BUCKETS_S, Counter, Histogram, Labels, Registry

if TYPE_CHECKING:
    from ckptstore.telemetry.latency import LatencyHistogram

__all__ = [
    "DEFAULT_BUCKETS_S",
    "METRICS",
    "Counter",
    "Counts",
    "Histogram",
    "LatencyHistogram",
    "Labels",
    "Registry",
    "register_prometheus",
    "serve_prometheus",
    "snapshot",
]

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
encode_cpu_seconds_total = METRICS.add(
    Counter(
        "ckptstore_encode_cpu_seconds_total",
        "CPU seconds the encode threads spent byte-grouping and compressing chunks (each "
        "thread's own CPU time; chunks already stored or written by another rank cost none).",
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
storage_sent_bytes_total = METRICS.add(
    Counter(
        "ckptstore_storage_sent_bytes_total",
        "Bytes sent by storage requests, by operation: every attempt (retries and hedges too), "
        "answered or not.",
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

tier_loads_total = METRICS.add(
    Counter(
        "ckptstore_tier_loads_total",
        "Ranks' loads with tiers (Checkpointer or StoreReader) by the tier the state came from: local, "
        "peer or durable.",
        ["tier"],
    )
)
tier_load_bytes_total = METRICS.add(
    Counter(
        "ckptstore_tier_load_bytes_total",
        "Stored bytes a load with tiers read (or received from a peer), by tier, failed tries "
        "included.",
        ["tier"],
    )
)


def snapshot() -> dict[str, dict[Labels, Any]]:
    """Every metric of this process as plain numbers (see ``Registry.snapshot``)."""
    return METRICS.snapshot()


def __getattr__(name: str) -> Any:
    if name == "LatencyHistogram":  # hdrh is imported by its users only (not the CLI's start)
        from ckptstore.telemetry.latency import LatencyHistogram

        return LatencyHistogram
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
