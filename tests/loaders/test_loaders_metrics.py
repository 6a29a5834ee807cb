"""StatefulLoader.metrics(): the figures of the processes that read, summed over DataLoader
workers and passes, checked against what the epoch plan says each worker must fetch."""

from __future__ import annotations

import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from torch.utils.data import DataLoader

import loaders.dataset
from bench.faults import Faults, parse_latency, with_faults
from ckptstore import telemetry
from ckptstore.store import Store
from ckptstore.telemetry import LatencyHistogram
from loaders import LoaderConfig, ReplicaConfig, ShardDataset, StatefulLoader, TokenFiles
from loaders.metrics import ConsumerStats, ReaderReport, ReaderReports, ReadStats, ReplicaStats
from loaders.order import Reader

pytestmark = pytest.mark.timeout(120)

SAMPLE_TOKENS = 8
UNIT_SAMPLES = 10
UNITS = 24
BATCH = 4


def _replicas(tmp_path) -> list[str]:
    tokens = np.arange(UNITS * UNIT_SAMPLES * SAMPLE_TOKENS, dtype=np.uint16)
    roots = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        tokens.tofile(tmp_path / name / "tokens.bin")
        roots.append(str(tmp_path / name))
    return roots


def _loader(roots, workers: int) -> StatefulLoader:
    ds = ShardDataset(
        roots,
        TokenFiles(sample_tokens=SAMPLE_TOKENS, read_bytes=UNIT_SAMPLES * SAMPLE_TOKENS * 2),
        config=LoaderConfig(seed=3, shuffle_block_units=2),
        # No hedges: every read is then one request, so the replicas' counts must add up to it.
        replica_config=ReplicaConfig(hedge=False),
    )
    return StatefulLoader(ds, batch_size=BATCH, num_workers=workers)


def _fetches(ds: ShardDataset, epoch: int, workers: int) -> int:
    """Units the plan of ``epoch`` has its readers fetch (each worker reads its blocks' units)."""
    readers = [
        Reader(worker=w, num_workers=max(workers, 1), batch_size=BATCH)
        for w in range(max(workers, 1))
    ]
    return sum(len(plan.needed) for r in readers for plan in ds.order(epoch).plan(r, 0))


def _check_sums(m: dict, reads: int, samples: int, opening: dict | None = None) -> None:
    """``opening``: the replicas' figures after the dataset opened in this process (its
    metadata requests are not reads)."""
    assert m["reads"]["reads"] == reads and m["reads"]["count"] == reads
    assert m["reads"]["failed"] == 0 and m["reads"]["p50_s"] > 0
    assert m["readers"]["samples"] == samples
    assert m["readers"]["bytes_read"] == reads * UNIT_SAMPLES * SAMPLE_TOKENS * 2

    def total(field: str) -> int:
        before = sum(r[field] for r in (opening or {}).values())
        return sum(r[field] for r in m["replicas"].values()) - before

    assert total("requests") == reads and total("wins") == reads
    assert total("bytes") == m["readers"]["bytes_read"]


def test_metrics_sum_the_reads_of_every_worker_over_passes(tmp_path):
    loader = _loader(_replicas(tmp_path), workers=2)
    ds = loader.dataset
    expected = [_fetches(ds, epoch, 2) for epoch in (0, 1)]
    assert expected[0] > UNITS  # workers share blocks: more fetches than units
    opening = loader.metrics()["replicas"]  # this process's requests at open count too
    assert sum(r["requests"] for r in opening.values()) > 0

    batches = sum(1 for _ in loader)
    assert batches == UNITS * UNIT_SAMPLES // BATCH
    m = loader.metrics()
    _check_sums(m, expected[0], UNITS * UNIT_SAMPLES, opening)
    assert m["workers"] == 2 and m["consumer"]["samples"] == UNITS * UNIT_SAMPLES
    assert m["consumer"]["batches"] == batches and m["consumer"]["wait_s"] > 0
    for uri in ds.replicas.uris:
        assert m["replicas"][uri]["health"] == {"healthy": 2}

    sum(1 for _ in loader)  # the next epoch, in new worker processes
    m = loader.metrics()
    _check_sums(m, sum(expected), 2 * UNITS * UNIT_SAMPLES, opening)
    # Final reports are folded into the total and their files removed.
    assert os.listdir(loader._reports.directory) == []
    assert loader.metrics()["reads"]["reads"] == sum(expected)

    # A DataLoader of the user's over the same dataset does not report into this loader.
    plain = DataLoader(ds, batch_size=BATCH, num_workers=2)
    assert sum(len(b["__index__"]) for b in plain) == UNITS * UNIT_SAMPLES
    assert loader.metrics()["reads"]["reads"] == sum(expected)


def test_a_workers_figures_show_before_its_pass_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders.dataset, "_REPORT_S", 0.0)  # a report before every block
    loader = _loader(_replicas(tmp_path), workers=2)
    opening = loader.metrics()["replicas"]
    it = iter(loader)
    batches = UNITS * UNIT_SAMPLES // BATCH
    for _ in range(batches * 3 // 4):
        next(it)
    # Both workers went on to later blocks, each having reported the reads of earlier ones.
    during = loader.metrics()
    assert 0 < during["reads"]["reads"] <= _fetches(loader.dataset, 0, 2)
    assert [n for n in os.listdir(loader._reports.directory) if n.endswith(".report")]
    assert during["readers"]["samples"] > 0
    for _ in it:
        pass
    _check_sums(loader.metrics(), _fetches(loader.dataset, 0, 2), UNITS * UNIT_SAMPLES, opening)


def test_reads_in_flight_when_a_pass_is_broken_off_are_counted(tmp_path):
    # Each read takes 50 ms, so reads are in flight when the consumer stops after two batches.
    faults = Faults(latency=parse_latency("fixed:0.05"), ops=frozenset({"get"}))
    stores = [with_faults(Store(root), faults) for root in _replicas(tmp_path)]
    ds = ShardDataset(
        stores,
        TokenFiles(sample_tokens=SAMPLE_TOKENS, read_bytes=UNIT_SAMPLES * SAMPLE_TOKENS * 2),
        config=LoaderConfig(seed=3, shuffle_block_units=2),
        replica_config=ReplicaConfig(hedge=False),
    )
    loader = StatefulLoader(ds, batch_size=BATCH, num_workers=2)
    opening = loader.metrics()["replicas"]
    it = iter(loader)
    next(it), next(it)
    it.close()  # the DataLoader shuts its workers down; their reads in flight end first
    m = loader.metrics()
    reads = m["reads"]["reads"]
    assert reads > 0 and m["readers"]["bytes_read"] == reads * UNIT_SAMPLES * SAMPLE_TOKENS * 2

    def total(field: str) -> int:
        return sum(r[field] for r in m["replicas"].values()) - sum(
            r[field] for r in opening.values()
        )

    # Every request a worker made is in its final report, with its answer.
    assert total("requests") == total("wins") == reads
    assert os.listdir(loader._reports.directory) == []


def test_without_workers_metrics_are_this_processes(tmp_path):
    loader = _loader(_replicas(tmp_path), workers=0)
    opening = loader.metrics()["replicas"]
    sum(1 for _ in loader)
    m = loader.metrics()
    _check_sums(m, _fetches(loader.dataset, 0, 0), UNITS * UNIT_SAMPLES, opening)
    assert m["workers"] == 0
    assert {r["health"]["healthy"] for r in m["replicas"].values()} == {1}


def test_stats_pickle_and_merge():
    a, b = ReadStats(), ReadStats()
    a.add(reads=2, hedges=1)
    b.add(reads=3, failed=1)
    for s in (0.010, 0.020):
        a.latency.record(s)
    b.latency.record(0.400)
    copy = pickle.loads(pickle.dumps(a))
    copy.merge(b)
    got = copy.as_dict()
    assert (got["reads"], got["hedges"], got["failed"], got["count"]) == (5, 1, 1, 3)
    assert got["max_s"] == pytest.approx(0.400, rel=1e-3)
    assert got["mean_s"] == pytest.approx((0.010 + 0.020 + 0.400) / 3, rel=1e-3)
    assert a.as_dict()["reads"] == 2  # the original is untouched
    h = pickle.loads(pickle.dumps(LatencyHistogram()))
    assert h.summary()["count"] == 0


def test_stats_are_counted_once_in_this_processes_series():
    """A replica's hedges and a replica set's failovers count in the process-wide series by
    being the stats' own counts: a report's copy, merged, adds nothing; a copy that reads on
    (as in a spawned worker) adds only what it counts there."""

    def hedges(result: str) -> float:
        return telemetry.loader_hedges_total.value(replica="r-once", result=result)

    fired, failovers = hedges("fired"), telemetry.loader_failovers_total.value()
    replica, reads = ReplicaStats("r-once"), ReadStats()
    replica.add(requests=3, hedges_fired=2, hedges_won=1)
    reads.add(reads=3, failovers=1)
    assert hedges("fired") - fired == 2 and telemetry.loader_failovers_total.value() == (
        failovers + 1
    )
    report = ReaderReport(ConsumerStats(), reads, {"r-once": replica}, health={})
    total = ReaderReports.merged(None, report)
    total.merge(report)
    assert total.replicas["r-once"].hedges_fired == 4
    assert hedges("fired") - fired == 2  # figures carried and summed are not counted again
    worker = pickle.loads(pickle.dumps(replica))
    worker.add(hedges_fired=5)
    assert hedges("fired") - fired == 7 and worker.hedges_fired == 7


def test_workers_read_on_when_their_report_directory_is_gone(tmp_path):
    loader = _loader(_replicas(tmp_path), workers=2)
    ds = loader.dataset
    shutil.rmtree(loader._reports.directory)  # as when the loader was collected
    assert sum(1 for _ in loader) == UNITS * UNIT_SAMPLES // BATCH
    assert loader.metrics()["reads"]["reads"] == 0  # nothing reported, nothing invented
    # A plain DataLoader over the same dataset reads too.
    plain = DataLoader(ds, batch_size=BATCH, num_workers=2)
    assert sum(len(b["__index__"]) for b in plain) == UNITS * UNIT_SAMPLES


def test_metrics_from_several_threads_at_once_count_each_report_once(tmp_path):
    loader = _loader(_replicas(tmp_path), workers=2)
    sum(1 for _ in loader)  # the workers' final reports wait in the directory
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: loader.metrics()["reads"]["reads"], range(8)))
    assert got == [_fetches(loader.dataset, 0, 2)] * 8


def test_report_directories_of_killed_processes_are_removed(tmp_path, monkeypatch):
    """A SIGKILLed loader runs no cleanup: the next one removes what it left behind."""
    import os
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    from ckptstore.store.processes import machine_tag

    tag = machine_tag()
    dead = tmp_path / f"loaders-reports-{tag}-{int(child.stdout)}-abc"
    mine = tmp_path / f"loaders-reports-{tag}-{os.getpid()}-def"
    # Reviewer of stop 60: a directory of another container sharing /tmp (another machine
    # tag, its pid unknown here) is never judged by this one's pids.
    elsewhere = tmp_path / f"loaders-reports-{'f' * 8}-{int(child.stdout)}-ghi"
    for path in (dead, mine, elsewhere):
        path.mkdir()
    reports = ReaderReports()
    assert not dead.exists() and mine.exists() and elsewhere.exists()
    assert os.path.basename(reports.directory).startswith(f"loaders-reports-{tag}-{os.getpid()}-")


def _benching_dataset(slow: Store, fast: Store) -> ShardDataset:
    """Over replicas ``slow`` and ``fast``: no hedges, a replica benched at its first slow read
    and for a minute (longer than a test)."""
    return ShardDataset(
        [slow, fast],
        TokenFiles(sample_tokens=SAMPLE_TOKENS, read_bytes=UNIT_SAMPLES * SAMPLE_TOKENS * 2),
        config=LoaderConfig(seed=3, shuffle_block_units=2),
        replica_config=ReplicaConfig(
            hedge=False, bench_min_samples=1, bench_s=60.0, max_bench_s=60.0
        ),
    )


def test_a_replica_the_last_passes_workers_benched_starts_the_next_pass_benched(tmp_path, caplog):
    """Each pass's DataLoader workers are new processes whose replicas started afresh: a replica
    slow all through a pass took each new worker's first reads (an unmeasured replica is tried
    first) until it was benched again. The workers of the next pass start where the last ones
    left off: the benched replica gets no read, the others start at their measured latency."""
    import logging

    from bench.faults import Fixed

    roots = _replicas(tmp_path)
    slow = with_faults(Store(roots[0]), Faults(latency=Fixed(0.03)))
    fast = with_faults(Store(roots[1]), Faults(latency=Fixed(0.001)))
    ds = _benching_dataset(slow, fast)
    loader = StatefulLoader(ds, batch_size=BATCH, num_workers=2)

    def slow_requests() -> int:
        return loader.metrics()["replicas"][slow.uri]["requests"]

    before = slow_requests()
    assert sum(1 for _ in loader) == UNITS * UNIT_SAMPLES // BATCH
    first_pass = slow_requests() - before
    assert first_pass >= 2  # each worker tried it (unmeasured) and benched it
    assert loader.metrics()["replicas"][slow.uri]["health"] == {"benched": 2}
    with caplog.at_level(logging.INFO, logger="loaders"):
        assert sum(1 for _ in loader) == UNITS * UNIT_SAMPLES // BATCH
    assert slow_requests() - before == first_pass  # none in the second pass
    assert any(
        slow.uri in r.getMessage() and "start the next pass benched" in r.getMessage()
        for r in caplog.records
    )


def test_a_replica_the_open_benched_is_benched_in_the_first_passes_workers(tmp_path):
    """Reviewer Q: the dataset's open (in the training process) benched a hung replica (or
    measured a slow one), but the first pass's DataLoader workers started afresh and sent it
    their first reads (a hung S3 replica took 64 of a pass's requests)."""
    roots = _replicas(tmp_path)
    slow = with_faults(Store(roots[0]), Faults(error_rate=1.0))  # a replica that fails
    fast = Store(roots[1])
    ds = _benching_dataset(slow, fast)
    for _ in range(4):  # reads in this process, as an MDS or llm.c open makes
        ds.replicas.read("tokens.bin", 0, 16)
    assert ds.replicas.metrics()["replicas"][slow.uri]["health"] == "benched"
    loader = StatefulLoader(ds, batch_size=BATCH, num_workers=2)
    before = loader.metrics()["replicas"][slow.uri]["requests"]
    assert sum(1 for _ in loader) == UNITS * UNIT_SAMPLES // BATCH
    assert loader.metrics()["replicas"][slow.uri]["requests"] == before


def test_the_next_pass_workers_start_from_the_hedge_latencies_of_the_last(tmp_path):
    """A reviewer: each pass's DataLoader workers started with the initial hedge delay (50 ms)
    and a full bucket each, so replicas slower than that had most of every pass's first reads
    hedged (82 hedges for 41 reads). The workers of a pass report their hedge latencies and the
    next pass's workers start from all of them."""
    from bench.faults import Fixed

    roots = _replicas(tmp_path)
    stores = [with_faults(Store(root), Faults(latency=Fixed(0.005))) for root in roots]
    ds = ShardDataset(
        stores,
        TokenFiles(sample_tokens=SAMPLE_TOKENS, read_bytes=UNIT_SAMPLES * SAMPLE_TOKENS * 2),
        config=LoaderConfig(seed=3, shuffle_block_units=2),
    )
    loader = StatefulLoader(ds, batch_size=BATCH, num_workers=2)
    assert sum(1 for _ in loader) == UNITS * UNIT_SAMPLES // BATCH
    first = loader._reports.carried().hedge
    assert sum(len(seconds) for seconds in first.values()) >= UNITS  # every first attempt
    assert sum(1 for _ in loader) == UNITS * UNIT_SAMPLES // BATCH
    loader._reports.collect()
    workers = list(loader._reports._hedge.values())
    assert len(workers) == 2
    for samples in workers:  # each worker: the whole last pass's latencies, then its own
        for cls, seconds in first.items():
            assert seconds == samples[cls][: len(seconds)]


def test_the_workers_of_a_pass_share_the_hedge_bucket():
    """Each of ``n`` DataLoader workers hedges from a bucket of ``hedge_burst / n``."""
    from torch.utils.data import IterableDataset

    from loaders.dataset import _worker_share

    class Bursts(IterableDataset):
        def __iter__(self):
            yield _worker_share(ReplicaConfig(hedge_burst=32.0)).hedge_burst

    assert sorted(DataLoader(Bursts(), batch_size=None, num_workers=2)) == [16.0, 16.0]
    assert _worker_share(ReplicaConfig(hedge_burst=32.0)).hedge_burst == 32.0  # no workers
    assert list(DataLoader(Bursts(), batch_size=None, num_workers=0)) == [32.0]
