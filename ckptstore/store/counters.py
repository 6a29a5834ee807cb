"""What a store did, as numbers: requests by operation and outcome, retries, hedges, bytes.

Shaped like the Prometheus metrics they become (``ckptstore_storage_requests_total{op,outcome}``,
``ckptstore_storage_retries_total{op}``, ``ckptstore_storage_hedges_total{op,result}``,
``ckptstore_storage_bytes_total{op}``): each count is keyed by its label values.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ckptstore import telemetry

OK = "ok"
"""The outcome of a request that answered; any other outcome is an error kind."""
ERROR_KINDS = ("not_found", "exists", "timeout", "access", "no_space", "transient", "error")
"""Outcomes of failed requests: ``transient`` is one that failed after its last retry."""
HEDGE_RESULTS = ("fired", "won")


class StoreCounters:
    """Thread-safe counts of one store's requests (each request once, whatever its attempts).

    Every count is also added to the process-wide metrics of ``ckptstore.telemetry``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._retries: Counter[str] = Counter()
        self._hedges: Counter[tuple[str, str]] = Counter()
        self._bytes: Counter[str] = Counter()

    def request(self, op: str, outcome: str, nbytes: int = 0) -> None:
        """One request of ``op`` ended with ``outcome`` (``OK`` or an error kind), moving
        ``nbytes`` when it answered."""
        with self._lock:
            self._requests[op, outcome] += 1
            if nbytes:
                self._bytes[op] += nbytes
        telemetry.storage_requests_total.inc(op=op, outcome=outcome)
        if nbytes:
            telemetry.storage_bytes_total.inc(nbytes, op=op)

    def retry(self, op: str) -> None:
        """An attempt of ``op`` failed transiently or timed out (another may follow)."""
        with self._lock:
            self._retries[op] += 1
        telemetry.storage_retries_total.inc(op=op)

    def hedge(self, op: str, result: str) -> None:
        """A duplicate of ``op`` was sent (``fired``) or answered first (``won``)."""
        assert result in HEDGE_RESULTS, result
        with self._lock:
            self._hedges[op, result] += 1
        telemetry.storage_hedges_total.inc(op=op, result=result)

    def snapshot(self) -> dict[str, Any]:
        """The counts as plain nested dicts::

        {"requests": {op: {outcome: n}}, "retries": {op: n},
         "hedges": {op: {"fired": n, "won": n}}, "bytes": {op: n}}
        """
        with self._lock:
            requests, hedges = dict(self._requests), dict(self._hedges)
            retries, nbytes = dict(self._retries), dict(self._bytes)
        return {
            "requests": _nest(requests),
            "retries": retries,
            "hedges": _nest(hedges),
            "bytes": nbytes,
        }

    def errors(self) -> dict[str, dict[str, int]]:
        """Failed requests by operation and error kind."""
        return {
            op: kinds
            for op, outcomes in self.snapshot()["requests"].items()
            if (kinds := {k: n for k, n in outcomes.items() if k != OK})
        }


def _nest(counts: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (op, label), n in sorted(counts.items()):
        out.setdefault(op, {})[label] = n
    return out
