"""Counters and latency histograms of the loader: per replica, per read, and for the consumer."""

from __future__ import annotations

import threading
from typing import Any

from ckptstore import telemetry
from ckptstore.metrics import LatencyHistogram


class ReplicaStats:
    """What one replica was asked and how it answered. Thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.latency = LatencyHistogram()
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0
        self.errors = 0
        self.hedges_fired = 0
        self.hedges_won = 0
        self.wins = 0
        self.cancelled = 0
        self.discarded = 0
        self.benched = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)
        for result in ("fired", "won"):
            if counts.get(f"hedges_{result}"):
                telemetry.loader_hedges_total.inc(
                    counts[f"hedges_{result}"], replica=self.name, result=result
                )

    def record_latency(self, seconds: float) -> None:
        """One attempt on this replica answered after ``seconds``."""
        self.latency.record(seconds)
        telemetry.loader_read_seconds.observe(seconds, replica=self.name)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "requests": self.requests,
                "bytes": self.bytes,
                "errors": self.errors,
                "wins": self.wins,
                "hedges_fired": self.hedges_fired,
                "hedges_won": self.hedges_won,
                "cancelled": self.cancelled,
                "discarded": self.discarded,
                "benched": self.benched,
            }
        lat = self.latency.summary()
        out.update({k: lat[k] for k in ("p50_s", "p90_s", "p99_s", "max_s")})
        return out


class ReadStats:
    """End-to-end reads (over every attempt and hedge) of one replica set. Thread-safe."""

    def __init__(self) -> None:
        self.latency = LatencyHistogram()
        self._lock = threading.Lock()
        self.reads = 0
        self.failed = 0
        self.hedges = 0
        self.hedges_refused = 0
        self.failovers = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)
        if counts.get("failovers"):
            telemetry.loader_failovers_total.inc(counts["failovers"])

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "reads": self.reads,
                "failed": self.failed,
                "hedges": self.hedges,
                "hedges_refused": self.hedges_refused,
                "failovers": self.failovers,
            }
        out.update(self.latency.summary())
        return out


class ConsumerStats:
    """How long the consumer waited for data, and how much the prefetch window held."""

    def __init__(self) -> None:
        self.wait = LatencyHistogram()
        self.wait_s = 0.0
        self.waits = 0
        self.samples = 0
        self.bytes_read = 0
        self.max_resident_bytes = 0
        self.max_inflight_reads = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "bytes_read": self.bytes_read,
            "wait_s": self.wait_s,
            "waits": self.waits,
            "wait_p99_s": self.wait.percentile_s(99),
            "max_resident_bytes": self.max_resident_bytes,
            "max_inflight_reads": self.max_inflight_reads,
        }
