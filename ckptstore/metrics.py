"""Kept for importers of ``ckptstore.metrics``: ``LatencyHistogram`` lives in ``ckptstore.telemetry``."""

from ckptstore.telemetry.latency import LatencyHistogram

__all__ = ["LatencyHistogram"]
