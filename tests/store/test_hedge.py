"""Hedged requests and hedged chunk uploads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from bench.faults import Faults, with_faults
from ckptstore import Checkpointer, EncodingOptions, StorageOptions, Store
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.pipeline import fetch_chunk
from ckptstore.store import ElasticPool, HedgePolicy, Hedger


def test_slow_call_is_hedged_and_the_fast_one_wins():
    pool = ElasticPool("test-hedge")
    calls = []
    lock = threading.Lock()
    first_may_answer = threading.Event()

    def fn():
        with lock:
            calls.append(len(calls))
            first = len(calls) == 1
        if first:  # hangs until the hedge has won
            first_may_answer.wait(timeout=60)
        return "first" if first else "hedge"

    hedger = Hedger(HedgePolicy(initial_delay_s=0.05, min_delay_s=0.01, burst=1))
    try:
        assert hedger.call(fn, pool.submit) == "hedge"
    finally:
        first_may_answer.set()
    assert hedger.stats() == {"requests": 1, "hedges": 1, "hedges_won": 1}


def test_hedge_budget_caps_extra_requests():
    pool = ElasticPool("test-budget")
    policy = HedgePolicy(
        initial_delay_s=0.001, min_delay_s=0.001, max_extra_fraction=0.05, burst=1.0
    )
    hedger = Hedger(policy)
    for _ in range(60):
        hedger.call(lambda: time.sleep(0.005), pool.submit)
    # one token to start with plus 5% of the requests made
    assert hedger.hedges <= 1 + 0.05 * 60
    assert hedger.requests == 60


def test_an_error_in_one_attempt_waits_for_the_other():
    pool = ElasticPool("test-err")
    count = iter(range(10))
    hedge_started, first_failed = threading.Event(), threading.Event()

    def fn():
        if next(count) == 0:  # fails once the hedge is running
            assert hedge_started.wait(timeout=60)
            first_failed.set()
            raise ConnectionError("first attempt fails while the hedge runs")
        hedge_started.set()
        assert first_failed.wait(timeout=60)  # answers only after the first attempt's error
        return 42

    hedger = Hedger(HedgePolicy(initial_delay_s=0.05, min_delay_s=0.01))
    assert hedger.call(fn, pool.submit) == 42


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_hedged_uploads_do_not_duplicate_objects(tmp_path, backend):
    uri = str(tmp_path / "s") if backend == "local" else "memory://hedged-uploads"
    faults = Faults(slow_rate=0.3, slow_s=1.0, ops=frozenset({"put"}), seed=7)
    store = with_faults(Store(uri), faults)
    ckpt = Checkpointer(
        uri,
        storage=StorageOptions(store=store),
        encoding=EncodingOptions(chunk_bytes=64 * 1024, hedge_uploads=True, encode_threads=4),
    )
    store.hedger.policy = HedgePolicy(
        initial_delay_s=0.1, min_delay_s=0.05, burst=50, max_extra_fraction=1.0
    )
    state = {"w": torch.randn(400_000)}  # 25 chunks
    ckpt.save(1, state).wait()
    assert store.hedger.hedges > 0
    manifest = load_manifest(store, 1)
    index = load_rank_index(store, manifest, 0)
    chunk_keys = store.list("chunks")
    assert len(chunk_keys) == len(index.chunks) == len(set(chunk_keys))
    for digest, info in index.chunks.items():
        fetch_chunk(store, digest, info)
    if backend == "local":
        assert not [p for p in (tmp_path / "s").rglob("*.tmp-*")]
    target = {"w": torch.zeros(400_000)}
    ckpt.load(target)
    assert torch.equal(target["w"], state["w"]) and list_steps(store) == [1]
    ckpt.close()


def test_hedge_delay_leaves_out_the_slow_requests_it_exists_to_cut():
    """5% of requests 20x slow: the 96th percentile of all latencies lies among the slow ones,
    so a delay taken from it would never hedge them; the delay is the body's percentile."""
    rng = np.random.default_rng(0)
    body = 0.010 * np.exp(0.5 * rng.standard_normal(480))
    latencies = np.concatenate([body, np.full(24, 0.210)])
    rng.shuffle(latencies)
    hedger = Hedger(HedgePolicy(quantile=96, min_samples=10, min_delay_s=0.001))
    assert not hedger.learnt(4096)
    for seconds in latencies:
        hedger.record(4096, float(seconds))
    assert hedger.learnt(4096)
    assert np.percentile(latencies, 96) > 0.2  # the plain percentile: among the slow requests
    assert np.percentile(body, 94) <= hedger.delay_s(4096) <= np.percentile(body, 98)


def test_hedge_delay_without_outliers_is_the_plain_percentile():
    rng = np.random.default_rng(1)
    latencies = 0.010 * np.exp(0.5 * rng.standard_normal(500))
    hedger = Hedger(HedgePolicy(quantile=96, min_samples=10, min_delay_s=0.001))
    for seconds in latencies:
        hedger.record(4096, float(seconds))
    assert hedger.delay_s(4096) == pytest.approx(np.percentile(latencies, 96), rel=0.02)
    assert hedger.delay_s(1 << 30) == hedger.policy.initial_delay_s  # another size class


def test_a_hedger_seeded_with_anothers_latencies_starts_at_their_delay():
    """A new DataLoader worker's hedger starts from the last pass's latencies: learnt from its
    first request, at the delay the measuring one had, not at the initial guess."""
    rng = np.random.default_rng(2)
    policy = HedgePolicy(quantile=95, min_samples=10, min_delay_s=0.001, initial_delay_s=0.05)
    measured = Hedger(policy)
    for seconds in 0.080 * np.exp(0.1 * rng.standard_normal(200)):
        measured.record(1 << 20, float(seconds))
    fresh = Hedger(policy)
    assert not fresh.learnt(1 << 20) and fresh.delay_s(1 << 20) == 0.05
    fresh.seed(measured.samples())
    assert fresh.learnt(1 << 20)
    assert fresh.delay_s(1 << 20) == measured.delay_s(1 << 20) > 0.08
    assert not fresh.learnt(4096)  # a size class nobody measured keeps the initial guess
