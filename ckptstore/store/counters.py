"""What a store did, as numbers: requests by operation and outcome, retries, hedges, bytes.

Shaped like the Prometheus metrics they are read into (``ckptstore_storage_requests_total{op,
outcome}``, ``ckptstore_storage_retries_total{op}``, ``ckptstore_storage_hedges_total{op,result}``,
``ckptstore_storage_bytes_total{op}``, ``ckptstore_storage_sent_bytes_total{op}``): each count is keyed by the metric and its label values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ckptstore import telemetry
from ckptstore.telemetry import Counts

OK = "ok"
"""The outcome of a request that answered; any other outcome is an error kind."""
ERROR_KINDS = ("not_found", "exists", "timeout", "access", "no_space", "transient", "error")
"""Outcomes of failed requests: ``transient`` is one that failed after its last retry."""
HEDGE_RESULTS = ("fired", "won")

# The store's counts are keyed (what, *label values); each is the process-wide series of `what`.
_SERIES = {
    "requests": telemetry.storage_requests_total,
    "retries": telemetry.storage_retries_total,
    "hedges": telemetry.storage_hedges_total,
    "bytes": telemetry.storage_bytes_total,
    "sent": telemetry.storage_sent_bytes_total,
}


class StoreCounters:
    """Thread-safe counts of one store's requests (each request once, whatever its attempts).

    They are the only count: the process-wide series of ``ckptstore.telemetry`` are the sum of
    every store's counters (attached to them), not counted again.
    """

    def __init__(self) -> None:
        self._counts = Counts()
        for what, series in _SERIES.items():
            series.attach(self, self._counts, _labels_of(what))

    def request(self, op: str, outcome: str, nbytes: int = 0) -> None:
        """One request of ``op`` ended with ``outcome`` (``OK`` or an error kind), moving
        ``nbytes`` when it answered."""
        counted: dict[Hashable, int] = {("requests", op, outcome): 1}
        if nbytes:
            counted["bytes", op] = nbytes
        self._counts.add_many(counted)

    def sent(self, op: str, nbytes: int) -> None:
        """An attempt of ``op`` sent ``nbytes`` (whether it answered, failed or timed out)."""
        if nbytes:
            self._counts.add(("sent", op), nbytes)

    def retry(self, op: str) -> None:
        """An attempt of ``op`` failed transiently or timed out (another may follow)."""
        self._counts.add(("retries", op))

    def hedge(self, op: str, result: str) -> None:
        """A duplicate of ``op`` was sent (``fired``) or answered first (``won``)."""
        assert result in HEDGE_RESULTS, result
        self._counts.add(("hedges", op, result))

    def snapshot(self) -> dict[str, Any]:
        """The counts as plain nested dicts::

        {"requests": {op: {outcome: n}}, "retries": {op: n},
         "hedges": {op: {"fired": n, "won": n}}, "bytes": {op: n}, "sent": {op: n}}
        """
        out: dict[str, dict] = {what: {} for what in _SERIES}
        for (what, op, *label), n in sorted(self._counts.snapshot().items()):  # type: ignore[misc]
            if label:
                out[what].setdefault(op, {})[label[0]] = n
            else:
                out[what][op] = n
        return out

    def errors(self) -> dict[str, dict[str, int]]:
        """Failed requests by operation and error kind."""
        return {
            op: kinds
            for op, outcomes in self.snapshot()["requests"].items()
            if (kinds := {k: n for k, n in outcomes.items() if k != OK})
        }


def _labels_of(what: str) -> Callable[[Hashable], tuple[str, ...] | None]:
    def labels(key: Hashable) -> tuple[str, ...] | None:
        return key[1:] if key[0] == what else None  # type: ignore[index]

    return labels
