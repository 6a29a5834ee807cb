"""Operational metrics: plain numbers from the Python API, and a real Prometheus scrape."""

from __future__ import annotations

import gc
import json
import math
import pickle
import threading
import urllib.request

import pytest
import torch

from ckptstore import Checkpointer, telemetry
from tests.helpers.child import run_script


def test_counter_counts_per_label_set_and_refuses_bad_use():
    c = telemetry.Counter("t_things_total", "things", ["kind"])
    c.inc(kind="a")
    c.inc(2.5, kind="a")
    c.inc(kind="b")
    assert c.value(kind="a") == 3.5
    assert c.samples() == {("a",): 3.5, ("b",): 1.0}
    with pytest.raises(ValueError, match="cannot decrease"):
        c.inc(-1, kind="a")
    with pytest.raises(ValueError, match=r"takes labels \['kind'\]"):
        c.inc(op="x")


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = telemetry.Histogram("t_latency_seconds", "latency", buckets=[0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    (series,) = h.series().values()
    assert series["count"] == 4
    assert series["sum"] == pytest.approx(2.65)
    assert series["buckets"] == [(0.1, 2), (1.0, 3), (math.inf, 4)]


def test_counts_add_merge_and_pickle_across_threads():
    a = telemetry.Counts()

    def count():
        for _ in range(1000):
            a.add(("get", "ok"))
            a.add_many({("put", "ok"): 1, "bytes": 3})

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.snapshot() == {("get", "ok"): 4000, ("put", "ok"): 4000, "bytes": 12000}
    b = pickle.loads(pickle.dumps(a))
    b.merge(a)
    b.set("waits", 2)
    assert b.snapshot() == {("get", "ok"): 8000, ("put", "ok"): 8000, "bytes": 24000, "waits": 2}
    assert a["bytes"] == 12000 and a["missing"] == 0  # the original is untouched


class _Owner:
    pass


def test_attached_counts_are_the_counters_number_while_their_owner_lives_and_after():
    c = telemetry.Counter("t_requests_total", "requests", ["op"])
    c.inc(op="get")
    owner, counts = _Owner(), telemetry.Counts({("requests", "get"): 5})
    # what the counts held when attached was counted elsewhere (another process, say)
    c.attach(owner, counts, lambda key: key[1:] if key[0] == "requests" else None)
    counts.add_many({("requests", "get"): 2, ("requests", "put"): 1, ("retries", "get"): 9})
    assert c.samples() == {("get",): 3.0, ("put",): 1.0}
    del owner
    gc.collect()
    assert c.samples() == {("get",): 3.0, ("put",): 1.0}  # its owner gone, its counts stay
    counts.add(("requests", "get"), 100)  # settled: read no more
    assert c.samples() == {("get",): 3.0, ("put",): 1.0}


def _storage(op: str, outcome: str = "ok") -> float:
    return telemetry.storage_requests_total.value(op=op, outcome=outcome)


_COUNTED_ONCE = """
import gc, json, tempfile
from ckptstore import telemetry
from ckptstore.errors import ObjectNotFoundError
from ckptstore.store import Store

def storage(op, outcome="ok"):
    return telemetry.storage_requests_total.value(op=op, outcome=outcome)

store = Store(tempfile.mkdtemp() + "/s")
for i in range(7):
    store.put(f"k{i}", b"x" * 10)
for i in range(3):
    store.get(f"k{i}")
try:
    store.get("nothing")
except ObjectNotFoundError:
    pass
print("OURS", json.dumps(store.counters.snapshot()["requests"], sort_keys=True))
print("PROCESS", storage("put"), storage("get"), storage("get", "not_found"),
      telemetry.storage_bytes_total.value(op="put"))
del store
gc.collect()
print("AFTER", storage("put"))
"""


def test_each_store_request_is_counted_once():
    """In a process of its own: a store of another test still at work (a Checkpointer's drain, a
    loader's prefetch) would add to the process-wide numbers meanwhile."""
    lines = run_script(_COUNTED_ONCE, timeout_s=120)
    ours = json.loads(lines[-3].removeprefix("OURS "))
    assert ours == {"put": {"ok": 7}, "get": {"ok": 3, "not_found": 1}}
    # the process-wide series read the store's counts: counted twice, these would be 14, 6, ...
    assert lines[-2] == "PROCESS 7.0 3.0 1.0 70.0"
    assert lines[-1] == "AFTER 7.0"  # a store gone keeps its requests in the process's numbers


_CHURN = """
import gc, threading
from ckptstore import telemetry
from ckptstore.store import Store

def puts():
    return telemetry.storage_requests_total.value(op="put", outcome="ok")

threads, stores_each, puts_each = 4, 15, 4
done = threading.Event()
readings = []

def read():
    while not done.is_set():
        readings.append(puts())

def work(t):
    for s in range(stores_each):
        store = Store(f"memory://telemetry-churn/{t}/{s}")
        for i in range(puts_each):
            store.put(f"k{i}", b"x")
        del store
        gc.collect()

reader = threading.Thread(target=read)
reader.start()
workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
done.set()
reader.join()
readings.append(puts())
print("MONOTONIC", all(a <= b for a, b in zip(readings, readings[1:])), len(readings))
print("LAST", int(readings[-1]))
"""


def test_process_numbers_never_drop_nor_double_while_stores_come_and_go():
    """Stores are made, used and dropped on several threads while another reads the series:
    every reading is at least the previous one, and the last is exactly what was done. In a
    process of its own: no other store of this one adds to the process-wide numbers meanwhile."""
    lines = run_script(_CHURN, timeout_s=120)
    assert lines[-2].startswith("MONOTONIC True"), lines[-2:]
    assert lines[-1] == f"LAST {4 * 15 * 4}"


def _value(name, **labels):
    metric = telemetry.METRICS.get(name)
    key = tuple(str(labels[k]) for k in metric.labels)
    if isinstance(metric, telemetry.Counter):
        return metric.samples().get(key, 0.0)
    return metric.series().get(key, {"count": 0})["count"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "step": seed}


def test_a_save_is_counted_in_plain_numbers(tmp_path):
    before = {
        "committed": _value("ckptstore_saves_total", frontend="checkpointer", outcome="committed"),
        "blocked": _value("ckptstore_save_blocked_seconds", frontend="checkpointer"),
        "persist": _value("ckptstore_save_persist_seconds", frontend="checkpointer"),
        "raw": _value("ckptstore_bytes_total", kind="raw"),
        "stored": _value("ckptstore_bytes_total", kind="stored"),
        "puts": _value("ckptstore_storage_requests_total", op="put", outcome="ok"),
    }
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, _state(1)).wait()
    assert _value("ckptstore_saves_total", frontend="checkpointer", outcome="committed") == (
        before["committed"] + 1
    )
    assert _value("ckptstore_save_blocked_seconds", frontend="checkpointer") == (
        before["blocked"] + 1
    )
    assert _value("ckptstore_save_persist_seconds", frontend="checkpointer") == (
        before["persist"] + 1
    )
    assert _value("ckptstore_bytes_total", kind="raw") - before["raw"] >= 256 * 64 * 4
    assert _value("ckptstore_bytes_total", kind="stored") > before["stored"]
    # at least: one chunk, the rank index, the manifest
    assert _value("ckptstore_storage_requests_total", op="put", outcome="ok") >= before["puts"] + 3


def test_encode_cpu_is_counted_for_the_chunks_a_save_encodes_and_none_it_reuses(tmp_path):
    from ckptstore import EncodingOptions

    state = {"w": torch.randn(512, 512, generator=torch.Generator().manual_seed(3))}
    encoding = EncodingOptions(compression="zstd", chunk_bytes=1 << 18)
    with Checkpointer(str(tmp_path / "ckpt"), encoding=encoding) as ckpt:
        before = _value("ckptstore_encode_cpu_seconds_total")
        ckpt.save(1, state).wait()
        first = _value("ckptstore_encode_cpu_seconds_total")
        assert first > before  # four 256 KiB chunks byte-grouped and compressed
        ckpt.save(2, state).wait()  # the same bytes: every chunk known, none encoded again
        assert _value("ckptstore_encode_cpu_seconds_total") == first


def test_a_dcp_async_save_is_counted_under_its_front_end(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreWriter

    def counts():
        return (
            _value("ckptstore_saves_total", frontend="dcp", outcome="committed"),
            _value("ckptstore_save_blocked_seconds", frontend="dcp"),
            _value("ckptstore_save_persist_seconds", frontend="dcp"),
        )

    before = counts()
    writer = StoreWriter(str(tmp_path / "dcp"))
    for seed in (1, 2):
        dcp.async_save(_state(seed), storage_writer=writer, no_dist=True).result(timeout=60)
    assert counts() == tuple(n + 2 for n in before)


def _scrape(port: int) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


@pytest.fixture
def prometheus_port():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    server, thread = telemetry.serve_prometheus(0, registry=registry)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_scrape_shows_what_the_python_api_counts(tmp_path, prometheus_port):
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, _state(1)).wait()
        ckpt.save(2, _state(2)).wait()
        scraped = _scrape(prometheus_port)
    key = ("ckptstore_saves_total", (("frontend", "checkpointer"), ("outcome", "committed")))
    assert scraped[key] == _value(
        "ckptstore_saves_total", frontend="checkpointer", outcome="committed"
    )
    assert scraped[key] >= 2
    count = ("ckptstore_save_blocked_seconds_count", (("frontend", "checkpointer"),))
    assert scraped[count] == _value("ckptstore_save_blocked_seconds", frontend="checkpointer")
    inf = ("ckptstore_save_blocked_seconds_bucket", (("frontend", "checkpointer"), ("le", "+Inf")))
    assert scraped[inf] == scraped[count]
    raw = ("ckptstore_bytes_total", (("kind", "raw"),))
    assert scraped[raw] == _value("ckptstore_bytes_total", kind="raw") > 0
    put_ok = ("ckptstore_storage_requests_total", (("op", "put"), ("outcome", "ok")))
    assert scraped[put_ok] >= 6


def test_register_twice_in_one_registry_is_harmless():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    assert telemetry.register_prometheus(registry) is registry
    assert telemetry.register_prometheus(registry) is registry


def test_a_scrape_during_a_loader_run_shows_reads_per_replica(tmp_path, prometheus_port):
    import numpy as np

    from loaders import LoaderConfig, ShardDataset, TokenFiles, TokenWriter

    replicas = [str(tmp_path / "a"), str(tmp_path / "b")]
    with TokenWriter(replicas, file_tokens=32 * 50) as writer:
        writer.write(np.arange(32 * 200) % 50_000)
    fmt = TokenFiles(dtype="uint16", sample_tokens=32, manifest="manifest.txt", read_bytes=256)
    dataset = ShardDataset(replicas, fmt, config=LoaderConfig(shuffle=False))
    samples = iter(dataset)
    for _ in range(50):
        next(samples)
    during = _scrape(prometheus_port)  # mid-epoch
    rest = sum(1 for _ in samples)
    after = _scrape(prometheus_port)
    assert 50 + rest == 200

    def reads(scraped):
        return {
            dict(labels)["replica"]: value
            for (name, labels), value in scraped.items()
            if name == "ckptstore_loader_read_seconds_count"
        }

    ours = dataset.metrics()["replicas"]  # this dataset's replicas, by name
    assert {uri for uri, stats in ours.items() if stats["wins"]} <= set(reads(after))
    # reads were counted while the epoch was under way, and none is lost by the end: every
    # attempt that answered on a replica is one observation of that replica
    assert sum(reads(during).get(uri, 0) for uri in ours) > 0
    for uri, stats in ours.items():
        counted = reads(after).get(uri, 0)
        assert reads(during).get(uri, 0) <= counted
        assert stats["wins"] <= counted <= stats["requests"]
    assert sum(reads(after).get(uri, 0) for uri in ours) >= dataset.metrics()["reads"]["reads"] > 0
