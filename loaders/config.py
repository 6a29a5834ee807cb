"""Configuration of the loader: order and prefetch (:class:`LoaderConfig`), replicas and hedging
(:class:`ReplicaConfig`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptstore.store import HedgePolicy


@dataclass(kw_only=True)
class ReplicaConfig:
    """How reads are spread over replicas, hedged, failed over and bounded in time."""

    hedge: bool = True
    """Send a duplicate of a slow read to another replica after the hedge delay."""
    hedge_quantile: float = 96.5
    """The hedge delay is this percentile of recent first-attempt latencies of the size class,
    leaving out outliers over ``hedge_outlier_factor`` times their median (so that a few
    percent of slow reads cannot pull the delay up among themselves). With nothing slow,
    about ``100 - hedge_quantile`` percent of reads are hedged: 3.5% extra requests, which
    keeps a 5% target with room for the noise of a few thousand reads (at 96, about one run in
    five of ``ckptbench loader`` over fault seeds 1-21 went past 5%: docs/BENCHMARKS.md)."""
    hedge_outlier_factor: float = 5.0
    """Latencies over this many times the median are outliers to hedge, not part of the
    distribution whose percentile sets the delay."""
    hedge_min_delay_s: float = 0.002
    """Floor of the hedge delay."""
    hedge_initial_delay_s: float = 0.05
    """Hedge delay used until ``hedge_min_samples`` latencies of a size class are known (reads
    started before then hedge at the learnt delay as soon as there is one)."""
    hedge_min_samples: int = 10
    """Latencies of a size class needed before its percentile is trusted."""
    hedge_budget: float = 0.1
    """Hedges allowed per read, on average (token bucket refill per read): 0.1 = at most 10%
    extra requests in the long run."""
    hedge_burst: float = 32.0
    """Capacity of the hedge token bucket (hedges that may fire back to back), shared by a
    loader's DataLoader workers: each holds ``hedge_burst / num_workers`` (at least 1)."""
    max_hedges: int = 2
    """Duplicates one read may send (to distinct replicas), the n-th after n hedge delays; a
    second or later one only while the hedge bucket is more than half full."""
    attempt_timeout_s: float = 10.0
    """Deadline of one attempt on one replica (the replica Store's per-attempt deadline)."""
    read_deadline_s: float = 60.0
    """Overall deadline of one read, over every attempt, hedge and failover."""
    max_attempts: int = 6
    """Attempts of one read after errors (hedges not counted), across replicas."""
    bench_after_errors: int = 3
    """Consecutive errors after which a replica is benched (ejected: sent no reads)."""
    bench_slow_factor: float = 3.0
    """A replica whose latency (median of its last ``latency_window`` reads) exceeds this many
    times the best other healthy replica's is benched too, like one that errs."""
    bench_slow_margin_s: float = 0.01
    """...and is at least this much slower than it: a few milliseconds of thread scheduling on
    fast local reads are noise, not a slow replica."""
    bench_min_samples: int = 5
    """Latencies a replica needs before it can be benched for being slow (the median of 5
    is over 3x only if 3 of them are: with 5% slow reads, about 1 chance in 1,000)."""
    max_benched_slow: float = 0.5
    """Fraction of the replicas that may be benched for being slow at once, rounded down but at
    least one (so three replicas keep two to hedge between; the fastest is never benched for
    latency); replicas benched for errors are not limited."""
    bench_s: float = 5.0
    """First bench duration; doubles each time a replica is benched again before it has
    recovered, up to ``max_bench_s``."""
    max_bench_s: float = 60.0
    """Longest bench."""
    probation_share: float = 0.01
    """After its bench a replica is on probation: it gets one first attempt in every
    ``1 / probation_share`` (never a hedge while a healthy replica is free)."""
    recover_after: int = 3
    """Consecutive probation reads, each without error and no slower than ``bench_slow_factor``
    times the best healthy replica's average, that restore a replica to full traffic; a failed
    probation read benches it again for twice as long."""
    latency_window: int = 20
    """Recent reads whose median latency is a replica's latency: robust to the few slow reads
    every store has (hedging's job), quick to follow one that turns slow on every read."""
    verify_replicas: bool = True
    """At open, compare the index and every shard's size across replicas. Off: the index (an MDS
    ``index.json``, a token manifest) is read once, from the replica that answers (the first
    listed unless it is slow or fails): replicas that differ are not told, and ranks that list
    them in different orders may open different datasets."""

    def __post_init__(self) -> None:
        if not 0.0 < self.hedge_quantile < 100.0:
            raise ValueError(f"hedge_quantile must be in (0, 100), got {self.hedge_quantile}")
        if self.hedge_outlier_factor <= 1:
            raise ValueError(f"hedge_outlier_factor must be > 1, got {self.hedge_outlier_factor}")
        for name in (
            "hedge_min_delay_s",
            "hedge_initial_delay_s",
            "attempt_timeout_s",
            "read_deadline_s",
            "bench_s",
            "max_bench_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hedge_budget < 0:
            raise ValueError(f"hedge_budget must be >= 0, got {self.hedge_budget}")
        if self.hedge_burst < 1:
            raise ValueError(f"hedge_burst must be >= 1, got {self.hedge_burst}")
        if self.max_hedges < 0:
            raise ValueError(f"max_hedges must be >= 0, got {self.max_hedges}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.bench_after_errors < 1:
            raise ValueError(f"bench_after_errors must be >= 1, got {self.bench_after_errors}")
        if self.bench_slow_factor <= 1:
            raise ValueError(f"bench_slow_factor must be > 1, got {self.bench_slow_factor}")
        if self.bench_slow_margin_s < 0:
            raise ValueError(f"bench_slow_margin_s must be >= 0, got {self.bench_slow_margin_s}")
        if self.bench_min_samples < 1:
            raise ValueError(f"bench_min_samples must be >= 1, got {self.bench_min_samples}")
        if not 0.0 <= self.max_benched_slow < 1.0:
            raise ValueError(f"max_benched_slow must be in [0, 1), got {self.max_benched_slow}")
        if not 0.0 < self.probation_share <= 1.0:
            raise ValueError(f"probation_share must be in (0, 1], got {self.probation_share}")
        if self.recover_after < 1:
            raise ValueError(f"recover_after must be >= 1, got {self.recover_after}")
        if self.hedge_min_samples < 1:
            raise ValueError(f"hedge_min_samples must be >= 1, got {self.hedge_min_samples}")
        if self.latency_window < self.bench_min_samples:
            raise ValueError(
                f"latency_window must be >= bench_min_samples ({self.bench_min_samples}), "
                f"got {self.latency_window}"
            )

    def hedge_policy(self) -> HedgePolicy:
        """The store's hedging settings these options make (when and how often to hedge)."""
        return HedgePolicy(
            quantile=self.hedge_quantile,
            outlier_factor=self.hedge_outlier_factor,
            min_delay_s=self.hedge_min_delay_s,
            initial_delay_s=self.hedge_initial_delay_s,
            min_samples=self.hedge_min_samples,
            max_extra_fraction=self.hedge_budget,
            burst=self.hedge_burst,
        )


@dataclass(kw_only=True)
class LoaderConfig:
    """Sample order, sharding over ranks and workers, and the prefetch window."""

    seed: int = 0
    """Seed of the shuffle; the order is a function of (seed, epoch) only."""
    shuffle: bool = True
    """Shuffle units (read pieces), then samples within blocks of ``shuffle_block_units`` units."""
    shuffle_block_units: int = 8
    """Units whose samples are shuffled together; all of a block's units are held in memory at
    once, so ``window_bytes`` must hold the largest block's reads (checked at open), and should
    hold their decoded samples (else one WARNING, and the window grows past it to hold one)."""
    batch_size: int = 1
    """Consecutive samples a DataLoader worker takes in turn: set it to the DataLoader's
    ``batch_size`` so that its round-robin over workers yields the rank's order."""
    window_reads: int = 16
    """Reads in flight at most (hedges not counted)."""
    window_bytes: int = 256 * 2**20
    """Bytes of reads in flight plus read and not yet delivered, at most."""
    log_interval_s: float = 60.0
    """Log the metrics at INFO this often while iterating; 0 turns it off."""
    cache_dir: str | os.PathLike | None = None
    """Directory of a local cache of units read from remote replicas (see loaders/cache.py),
    shared by workers and processes; None: no cache. Local replicas are never cached."""
    cache_bytes: int | None = None
    """Byte budget of ``cache_dir`` (entry files, least recently used evicted); needed with it."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.shuffle_block_units < 1:
            raise ValueError(f"shuffle_block_units must be >= 1, got {self.shuffle_block_units}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.window_reads < 1:
            raise ValueError(f"window_reads must be >= 1, got {self.window_reads}")
        if self.window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {self.window_bytes}")
        if self.log_interval_s < 0:
            raise ValueError(f"log_interval_s must be >= 0, got {self.log_interval_s}")
        if self.cache_dir is not None and (self.cache_bytes is None or self.cache_bytes < 1):
            raise ValueError(f"cache_bytes must be >= 1 with cache_dir, got {self.cache_bytes}")
