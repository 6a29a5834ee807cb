"""``ckptbench storage``: a load generator for any store the storage layer reaches.

Every request goes through :class:`ckptstore.store.Store` (the code path the checkpointer and the
loader use), optionally with faults injected into its backend (:mod:`bench.faults`).
Three modes:

- ``steady``: writers put objects drawn from a size mix while readers get whole objects written
  earlier in the run; closed loop, one request in flight per worker.
- ``burst``: background readers issue small paced reads; after ``baseline_s`` every writer starts
  at once and writes ``checkpoint_bytes`` of objects (``queue_depth`` puts in flight each, through
  ``Store.map``), then the readers go on for ``after_s``. Read latency is reported before, during
  and after the burst.
- ``read``: ranged gets over objects written in a setup step (or existing objects under
  ``read_prefix``, which are never written or deleted).

Latencies go to HDR histograms (:class:`ckptstore.telemetry.LatencyHistogram`) of successful
requests, retries included in their latency; failed requests are counted by error type, retries
are read from the store's counters (``Store.counters``). Everything the bench writes lies under
``ckptbench-<random>/`` and is deleted at the end, by key, unless ``keep`` is set.

Modules: ``config`` (the run's settings), ``stats`` (figures), ``run`` (workers, setup,
cleanup, steady and read modes), ``burst``, ``report`` (table and plot), ``cli``.
"""

from bench.storage.cli import add_parser, config_from_args, run
from bench.storage.config import StorageBenchConfig, parse_sizes
from bench.storage.report import plot, print_table
from bench.storage.run import StorageBench
from bench.storage.stats import _OpStats

__all__ = [
    "StorageBench",
    "StorageBenchConfig",
    "add_parser",
    "config_from_args",
    "parse_sizes",
    "plot",
    "print_table",
    "run",
    "_OpStats",
]
