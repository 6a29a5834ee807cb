"""The prefetch window: bounded by reads and bytes, out-of-order completion, in-order delivery."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bench.faults import Faults, LogNormal, with_faults
from ckptstore import Store
from loaders import LoaderConfig, ShardCorruptError, ShardDataset, TokenFiles
from loaders.metrics import ConsumerStats
from loaders.prefetch import Growth, Window
from loaders.replicas import ReplicaSet

pytestmark = pytest.mark.timeout(60)


def test_slow_read_does_not_block_the_reads_behind_it():
    gates = {u: threading.Event() for u in range(6)}
    started: list[int] = []

    def fetch(unit: int) -> str:
        started.append(unit)
        assert gates[unit].wait(10)
        return f"unit{unit}"

    stats = ConsumerStats()
    window = Window(
        iter([(u, 10) for u in range(6)]), fetch, window_reads=3, window_bytes=1000, stats=stats
    )
    try:
        window.top_up()
        result: dict[str, str] = {}
        consumer = threading.Thread(target=lambda: result.update(v=window.get(0)))
        consumer.start()
        # unit 0 is slow; 1 and 2 complete, and their slots go to 3 and 4 while 0 is awaited
        gates[1].set()
        gates[2].set()
        for _ in range(500):
            if window.ready(1) and window.ready(2) and len(started) >= 5:
                break
            threading.Event().wait(0.01)
        assert len(started) == 5  # 3 and 4 started before unit 0 completed
        assert consumer.is_alive()
        gates[0].set()
        consumer.join(10)
        assert result["v"] == "unit0"
        assert stats.waits == 1
        # ready units are handed over without waiting
        assert window.get(1) == "unit1" and window.get(2) == "unit2"
        assert stats.waits == 1
        for u in (3, 4, 5):
            gates[u].set()
        for u in range(6):
            assert window.get(u) == f"unit{u}"
            window.release(u)
        assert stats.max_inflight_reads <= 3
    finally:
        for g in gates.values():
            g.set()
        window.close()


def test_window_bytes_bound_what_is_held():
    stats = ConsumerStats()
    window = Window(
        iter([(u, 40) for u in range(10)]),
        lambda u: u,
        window_reads=8,
        window_bytes=100,
        stats=stats,
    )
    try:
        for u in range(10):
            assert window.get(u) == u
            window.release(u)
        assert stats.max_resident_bytes <= 100
        assert stats.max_inflight_reads <= 2
    finally:
        window.close()


def test_dataset_stays_within_its_window_under_latency(tmp_path):
    np.arange(64 * 200, dtype=np.uint16).tofile(tmp_path / "t.bin")
    store = with_faults(Store(str(tmp_path)), Faults(latency=LogNormal(0.002, 0.5), seed=1))
    config = LoaderConfig(seed=1, shuffle_block_units=2, window_reads=3, window_bytes=4 * 640)
    ds = ShardDataset(store, TokenFiles(sample_tokens=64, read_bytes=640), config=config)
    ids = [s["__index__"] for s in ds]
    assert sorted(ids) == list(range(200))
    consumer = ds.metrics()["consumer"]
    assert 0 < consumer["max_resident_bytes"] <= 4 * 640
    assert consumer["max_inflight_reads"] <= 3
    assert consumer["bytes_read"] == 200 * 128


def test_window_must_hold_a_shuffle_block(tmp_path):
    np.arange(64 * 200, dtype=np.uint16).tofile(tmp_path / "t.bin")
    config = LoaderConfig(shuffle_block_units=8, window_bytes=1000)
    with pytest.raises(ValueError, match="shuffle block of 8 units.*window_bytes=1000"):
        ShardDataset(str(tmp_path), TokenFiles(sample_tokens=64, read_bytes=640), config=config)


def test_read_error_surfaces_to_the_consumer(tmp_path):
    np.arange(64 * 20, dtype=np.uint16).tofile(tmp_path / "t.bin")
    store = Store(str(tmp_path))
    ds = ShardDataset(
        store, TokenFiles(sample_tokens=64, read_bytes=640), config=LoaderConfig(shuffle=False)
    )
    (tmp_path / "t.bin").write_bytes(b"\0" * 1000)  # truncated after open
    with pytest.raises(ShardCorruptError, match=r"t\.bin.*\[640:1280\].*truncated at offset 1000"):
        list(ds)


def test_a_read_answered_with_more_bytes_than_asked_is_not_called_truncated(tmp_path):
    """Loader adversary of stop 78: a read answered 2 bytes long was "truncated at offset"
    past the end of its range."""
    np.arange(64 * 20, dtype=np.uint16).tofile(tmp_path / "t.bin")
    layout = TokenFiles(sample_tokens=64, read_bytes=640).open(ReplicaSet([str(tmp_path)]))
    unit = layout.units[1]
    with pytest.raises(ShardCorruptError) as info:
        layout.decode(unit, b"\0" * (unit.nbytes + 2), "r0")
    assert f"returned {unit.nbytes + 2} bytes, not {unit.nbytes}" in str(info.value)
    assert "truncated" not in str(info.value)


def test_completed_reads_held_in_the_window_are_not_rescanned(monkeypatch):
    """The window holds every completed read until the consumer releases it (thousands of small
    reads with a large ``window_bytes``); looking for reads in flight must not walk them all at
    every top-up, or the loader's CPU time per read grows with what it holds."""
    from concurrent.futures import Future

    calls = 0
    done = Future.done

    def counting_done(self):
        nonlocal calls
        calls += 1
        return done(self)

    monkeypatch.setattr(Future, "done", counting_done)
    units = 3000
    window = Window(
        iter([(u, 1) for u in range(units)]),
        lambda u: u,
        window_reads=8,
        window_bytes=units,
        stats=ConsumerStats(),
    )
    try:
        for u in range(units):  # read everything before releasing anything
            assert window.get(u) == u
        for u in range(units):
            window.release(u)
    finally:
        window.close()
    # Scanning what is held made this ~units**2 / 2 (4.5 million); in-flight reads only: ~units * 8.
    assert calls < 50 * units


class _Decoded(list):
    """A unit that says what it takes decoded, as MDS's samples do."""

    mem_bytes = 0


def test_units_decoded_ahead_count_what_they_take_and_teach_the_window():
    """Loader adversary of stop 76: a unit's measured size was counted only when the consumer
    took it, so reads decoded ahead of a slow consumer held 48 times ``window_bytes`` (shards of
    JSON values, 43x their text). A read counts what it takes as it ends, and later reads are
    admitted at the growth seen."""
    ended, gate = threading.Semaphore(0), threading.Event()

    def fetch(unit: int) -> _Decoded:
        assert gate.wait(10)
        out = _Decoded([unit])
        out.mem_bytes = 500  # declared 100: five times that once decoded
        ended.release()
        return out

    stats = ConsumerStats()
    window = Window(
        iter([(u, 100) for u in range(20)]), fetch, window_reads=8, window_bytes=1000, stats=stats
    )
    try:
        window.top_up()  # 8 reads at 100 each, before any is measured
        gate.set()
        for _ in range(8):
            assert ended.acquire(timeout=10)
        window.top_up()  # nothing more: they hold 8 x 500
        assert stats.max_resident_bytes == 4000 and stats.max_inflight_reads == 8
        for u in range(8):
            assert window.get(u) == [u]
            window.release(u)
        # Now each read is admitted at 500: two fit, never eight.
        for u in range(8, 20):
            assert window.get(u) == [u]
            window.release(u)
            assert window._held <= 1000
        assert stats.max_inflight_reads == 8  # the first batch only
    finally:
        window.close()


def test_a_dataset_whose_units_may_grow_reads_one_until_one_is_measured_then_every_pass_knows():
    """Loader adversary of stop 76 (second round): each window learnt the growth afresh, so the
    first window_reads reads of every pass (and of every worker) were admitted at their text's
    size and held 20 to 25 times window_bytes once decoded. Until one unit is measured a window
    reads one at a time, and the dataset's ``Growth`` carries what it learnt to the next."""
    growth = Growth(may_grow=True)
    gate = threading.Event()

    def fetch(unit: int) -> _Decoded:
        assert gate.wait(10)
        out = _Decoded([unit])
        out.mem_bytes = 500
        return out

    for _ in range(2):  # two passes over the same dataset
        stats = ConsumerStats()
        window = Window(
            iter([(u, 100) for u in range(10)]),
            fetch,
            window_reads=8,
            window_bytes=1000,
            stats=stats,
            growth=growth,
        )
        try:
            window.top_up()
            gate.set()
            for u in range(10):
                assert window.get(u) == [u]
                window.release(u)
            assert stats.max_inflight_reads <= 2 and stats.max_resident_bytes <= 1000
        finally:
            window.close()
        gate.clear()


def test_one_dense_unit_does_not_slow_the_rest_of_the_dataset_for_good():
    """The same adversary: the growth was the most any unit ever grew by, so one small dense
    shard (38x) had every later read admitted past the window, one at a time, 5 times slower.
    It is the most of the last few measured."""
    growth = Growth(may_grow=True)
    growth.record(38.0)
    assert growth.factor() == 38.0 and not growth.learning()
    for _ in range(Growth.RECENT):
        growth.record(2.0)
    assert growth.factor() == 2.0
