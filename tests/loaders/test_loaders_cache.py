"""The local cache of remote shards (loaders/cache.py): budget, LRU eviction, corruption, later
epochs and restarts served from disk, and workers and processes sharing one cache directory.
The remote replica is the moto S3 server (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from ckptstore import Store
from loaders import MDS, LoaderConfig, ShardDataset, StatefulLoader, TokenFiles
from loaders.cache import ShardCache, open_cache
from tests.helpers import MDS_FIXTURES, ROOT

pytestmark = [pytest.mark.timeout(180), pytest.mark.s3]

SAMPLE_TOKENS = 64
UNIT_SAMPLES = 8
UNIT_BYTES = UNIT_SAMPLES * SAMPLE_TOKENS * 2  # uint16
ENTRY_BYTES = 32 + UNIT_BYTES  # the cache's header + the unit
FILES = ["a.bin", "b.bin"]
UNITS = 16  # 8 a file


def _tokens() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    per_file = UNITS // len(FILES) * UNIT_SAMPLES * SAMPLE_TOKENS
    return {f: rng.integers(0, 2**16, per_file, dtype=np.uint16) for f in FILES}


def _upload_tokens(uri: str) -> None:
    store = Store(uri)
    for name, tokens in _tokens().items():
        store.put(name, tokens.tobytes())


def _dataset(uri: str, cache_dir, cache_bytes: int, **config) -> ShardDataset:
    return ShardDataset(
        uri,
        TokenFiles(files=FILES, sample_tokens=SAMPLE_TOKENS, read_bytes=UNIT_BYTES),
        config=LoaderConfig(
            cache_dir=cache_dir, cache_bytes=cache_bytes, shuffle_block_units=2, **config
        ),
    )


def _check_epoch(samples) -> None:
    """Every sample of the dataset once, each holding exactly the tokens at its index."""
    flat = np.concatenate(list(_tokens().values()))
    seen = []
    for sample in samples:
        tokens, index = np.asarray(sample["tokens"]), np.asarray(sample["__index__"]).reshape(-1)
        tokens = tokens.reshape(len(index), SAMPLE_TOKENS)
        for row, i in zip(tokens, index.tolist()):
            np.testing.assert_array_equal(row, flat[i * SAMPLE_TOKENS : (i + 1) * SAMPLE_TOKENS])
            seen.append(i)
    assert sorted(seen) == list(range(UNITS * UNIT_SAMPLES))


def _s3_requests(ds: ShardDataset) -> int:
    return sum(r["requests"] for r in ds.metrics()["replicas"].values())


def _check_directory(cache_dir, budget: int) -> list[str]:
    """The directory holds only whole, valid entries within the budget; their names."""
    names = sorted(os.listdir(cache_dir))
    assert not [n for n in names if n.startswith(".tmp-")], names
    entries = [n for n in names if n.endswith(".unit")]
    assert sum(os.path.getsize(os.path.join(cache_dir, n)) for n in entries) <= budget
    reader = ShardCache(cache_dir, budget_bytes=budget, namespace="checks no namespace")
    for name in entries:
        assert reader.lookup(name, UNIT_BYTES) is not None, f"entry {name} is not valid"
    assert reader.stats.as_dict()["corrupt"] == 0
    return entries


def test_second_epoch_is_read_from_the_cache(s3_uri, tmp_path):
    _upload_tokens(s3_uri)
    ds = _dataset(s3_uri, tmp_path / "cache", 100 * ENTRY_BYTES)
    before = _s3_requests(ds)
    _check_epoch(ds)
    first = _s3_requests(ds)
    assert first - before == UNITS
    cache = ds.metrics()["cache"]
    assert (cache["misses"], cache["fills"], cache["hits"]) == (UNITS, UNITS, 0)
    assert cache["cached_bytes"] == UNITS * ENTRY_BYTES

    _check_epoch(ds)
    assert _s3_requests(ds) == first, "the second epoch asked S3"
    cache = ds.metrics()["cache"]
    assert (cache["hits"], cache["misses"], cache["bytes_hit"]) == (
        UNITS,
        UNITS,
        UNITS * UNIT_BYTES,
    )


def test_reading_more_than_the_budget_stays_within_it(s3_uri, tmp_path):
    _upload_tokens(s3_uri)
    budget = 4 * ENTRY_BYTES + ENTRY_BYTES // 2
    ds = _dataset(s3_uri, tmp_path / "cache", budget, window_reads=2)
    for _ in range(2):
        _check_epoch(ds)
    cache = ds.metrics()["cache"]
    assert cache["cached_bytes"] <= budget
    assert len(_check_directory(tmp_path / "cache", budget)) == 4
    assert cache["fills"] - cache["evictions"] == 4
    assert cache["evictions"] >= UNITS  # the first epoch alone evicts 12


def _entry(cache: ShardCache, i: int) -> tuple[str, bytes]:
    return cache.entry_name("k.bin", i * 100, (i + 1) * 100, 100), bytes([i]) * 100


def test_least_recently_used_entry_is_evicted_first(tmp_path):
    cache = ShardCache(tmp_path, budget_bytes=3 * 132, namespace="s3://bucket/ds")
    a, b, c, d, e = (_entry(cache, i) for i in range(5))
    for name, data in (a, b, c):
        assert cache.put(name, data)
    assert cache.lookup(a[0], 100).data == a[1]  # a is now more recent than b and c
    assert cache.put(*d)
    assert cache.lookup(b[0], 100) is None
    assert cache.lookup(c[0], 100).data == c[1]  # order of use now: a, d, c
    assert cache.put(*e)
    assert cache.lookup(a[0], 100) is None
    assert {x.name for x in cache.entries()} == {c[0], d[0], e[0]}
    assert cache.stats.as_dict()["evictions"] == 2


def test_recency_and_state_survive_a_new_cache_object(tmp_path):
    first = ShardCache(tmp_path, budget_bytes=2 * 132, namespace="s3://bucket/ds")
    a, b, c = (_entry(first, i) for i in range(3))
    first.put(*a)
    first.put(*b)
    first.lookup(a[0], 100)
    second = ShardCache(tmp_path, budget_bytes=2 * 132, namespace="s3://bucket/ds")
    assert second.put(*c)
    assert second.lookup(b[0], 100) is None  # b was the least recent, as seen from the files
    assert second.lookup(a[0], 100).data == a[1]


def test_entries_never_collide_across_replica_sets_and_ranges(tmp_path):
    one = open_cache(tmp_path, 10_000, ["s3://bucket/ds-a"])
    other = open_cache(tmp_path, 10_000, ["s3://bucket/ds-b"])
    name = one.entry_name("x.bin", 0, 100, 100)
    assert name != other.entry_name("x.bin", 0, 100, 100)
    assert name != one.entry_name("x.bin", 100, 200, 100)
    assert name != one.entry_name("x.bin", None, None, 101)
    assert open_cache(tmp_path, 10_000, [str(tmp_path / "local")]) is None
    assert open_cache(None, None, ["s3://bucket/ds-a"]) is None


def test_an_entry_file_under_another_entrys_name_is_corrupt(tmp_path):
    """Entries bind their name: two valid entry files swapped (or one copied over another)
    serve no bytes of the other unit, even for data with no hashes of its own."""
    cache = ShardCache(tmp_path, budget_bytes=10 * 132, namespace="s3://bucket/ds")
    a, b = _entry(cache, 1), _entry(cache, 2)
    for name, data in (a, b):
        assert cache.put(name, data)
    path_a, path_b = cache.path(a[0]), cache.path(b[0])
    os.rename(path_a, f"{path_a}.x")
    os.rename(path_b, path_a)
    os.rename(f"{path_a}.x", path_b)
    assert cache.lookup(a[0], 100) is None and cache.lookup(b[0], 100) is None
    assert cache.stats.as_dict()["corrupt"] == 2
    assert not os.path.exists(path_a) and not os.path.exists(path_b)


def test_a_unit_larger_than_the_budget_is_not_cached(tmp_path):
    cache = ShardCache(tmp_path, budget_bytes=100, namespace="s3://bucket/ds")
    assert not cache.put(*_entry(cache, 0))
    assert cache.entries() == []
    assert cache.stats.as_dict()["skipped"] == 1


def test_cache_dir_needs_a_budget():
    with pytest.raises(ValueError, match="cache_bytes must be >= 1 with cache_dir"):
        LoaderConfig(cache_dir="/tmp/x")


def test_a_dataset_rewritten_in_place_is_never_served_from_the_old_entries(s3_uri, tmp_path):
    """Unhashed token files (a nanoGPT ``train.bin``) written again at the same URI and size:
    the cache's entries name the objects' ETags, so the new tokens are read, not the old."""
    _upload_tokens(s3_uri)
    cache_dir = tmp_path / "cache"
    first = _dataset(s3_uri, cache_dir, 100 * ENTRY_BYTES)
    _check_epoch(first)
    store = Store(s3_uri)
    for name, tokens in _tokens().items():
        store.delete(name)
        store.put(name, (tokens ^ 0xFFFF).tobytes())  # every token changed, sizes kept
    again = _dataset(s3_uri, cache_dir, 100 * ENTRY_BYTES)
    flat = np.concatenate([t ^ 0xFFFF for t in _tokens().values()])
    seen = 0
    for sample in again:
        tokens, index = np.asarray(sample["tokens"]), np.asarray(sample["__index__"]).reshape(-1)
        for row, i in zip(tokens.reshape(len(index), SAMPLE_TOKENS), index):
            assert np.array_equal(row, flat[i * SAMPLE_TOKENS : (i + 1) * SAMPLE_TOKENS]), i
            seen += 1
    assert seen == UNITS * UNIT_SAMPLES
    assert again.metrics()["cache"]["hits"] == 0


def test_corrupt_entries_are_dropped_and_fetched_again(s3_uri, tmp_path):
    _upload_tokens(s3_uri)
    cache_dir = tmp_path / "cache"
    ds = _dataset(s3_uri, cache_dir, 100 * ENTRY_BYTES)
    _check_epoch(ds)
    entries = sorted(cache_dir.glob("*.unit"))
    assert len(entries) == UNITS
    flipped = bytearray(entries[0].read_bytes())
    flipped[32 + 500] ^= 0x01  # one bit of the payload
    entries[0].write_bytes(bytes(flipped))
    entries[1].write_bytes(entries[1].read_bytes()[:-10])  # torn
    entries[2].write_bytes(b"")

    requests = _s3_requests(ds)
    _check_epoch(ds)  # the bytes handed out stay exact
    cache = ds.metrics()["cache"]
    assert cache["corrupt"] == 3
    assert (cache["hits"], cache["misses"]) == (UNITS - 3, UNITS + 3)
    assert _s3_requests(ds) - requests == 3
    _check_directory(cache_dir, 100 * ENTRY_BYTES)  # refilled whole


def _upload_mds(uri: str) -> Path:
    src = MDS_FIXTURES / "tokens-zstd"
    store = Store(uri)
    for path in src.iterdir():
        if path.name != "expected.jsonl":
            store.put(path.name, path.read_bytes())
    return src


def _mds_samples(ds: ShardDataset) -> dict[int, tuple]:
    return {s["__index__"]: (s["id"], s["source"], s["tokens"].tobytes()) for s in ds}


def test_entry_passing_its_own_hash_but_not_the_mds_index_hash_is_refetched(s3_uri, tmp_path):
    src = _upload_mds(s3_uri)
    want = _mds_samples(ShardDataset(str(src), MDS()))
    cache_dir = tmp_path / "cache"
    config = LoaderConfig(cache_dir=cache_dir, cache_bytes=1 << 20)
    ds = ShardDataset(s3_uri, MDS(), config=config)
    assert _mds_samples(ds) == want
    # Rewrite one entry with other bytes under a valid cache header: only the format's hashes
    # (sha1 and xxh64 in the MDS index) can tell.
    entry = sorted(cache_dir.glob("*.unit"))[0]
    raw = bytearray(entry.read_bytes())
    payload = raw[32:]
    payload[-1] ^= 0xFF
    digest = xxhash.xxh3_128(bytes(payload)).digest()
    entry.write_bytes(bytes(raw[:16]) + digest + bytes(payload))
    assert _mds_samples(ds) == want
    cache = ds.metrics()["cache"]
    assert cache["corrupt"] == 1
    assert cache["hits"] == len(ds.units) - 1


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from {module} import _read_in_child
print(json.dumps(_read_in_child(*json.loads(sys.argv[1]))))
"""


def _read_in_child(uri: str, cache_dir: str, budget: int, epochs: int, seed: int) -> dict:
    """Run in a new process: read ``epochs`` epochs, check each exactly; the cache metrics and
    the S3 requests made after opening the dataset."""
    ds = _dataset(uri, cache_dir, budget, seed=seed, window_reads=4)
    opened = _s3_requests(ds)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        _check_epoch(ds)
    return {"cache": ds.metrics()["cache"], "requests": _s3_requests(ds) - opened}


def _start_child(uri: str, cache_dir, budget: int, epochs: int, seed: int) -> subprocess.Popen:
    script = _CHILD.format(root=str(ROOT), module=__name__)  # this module, in the child
    args = json.dumps([uri, str(cache_dir), budget, epochs, seed])
    return subprocess.Popen(
        [sys.executable, "-c", script, args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def _child_result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_new_process_reuses_the_cache(s3_uri, tmp_path):
    _upload_tokens(s3_uri)
    cache_dir = tmp_path / "cache"
    _check_epoch(_dataset(s3_uri, cache_dir, 100 * ENTRY_BYTES))
    got = _child_result(_start_child(s3_uri, cache_dir, 100 * ENTRY_BYTES, 1, 0))
    assert got["requests"] == 0, got
    assert (got["cache"]["hits"], got["cache"]["misses"]) == (UNITS, 0)


def test_two_workers_share_a_cache_smaller_than_the_dataset(s3_uri, tmp_path):
    _upload_tokens(s3_uri)
    cache_dir = tmp_path / "cache"
    budget = 5 * ENTRY_BYTES
    ds = _dataset(s3_uri, cache_dir, budget)
    loader = StatefulLoader(ds, batch_size=4, num_workers=2)
    for _ in range(3):
        _check_epoch(loader)
    assert len(_check_directory(cache_dir, budget)) == 5


def test_two_processes_share_a_cache_smaller_than_the_dataset(s3_uri, tmp_path):
    _upload_tokens(s3_uri)
    cache_dir = tmp_path / "cache"
    budget = 6 * ENTRY_BYTES
    procs = [_start_child(s3_uri, cache_dir, budget, 4, seed) for seed in (1, 2)]
    results = [_child_result(p) for p in procs]
    for got in results:
        cache = got["cache"]
        assert cache["hits"] + cache["misses"] == 4 * UNITS
        assert cache["corrupt"] == 0 and cache["errors"] == 0
        assert got["requests"] == cache["misses"]
    assert sum(r["cache"]["evictions"] for r in results) > 0
    assert len(_check_directory(cache_dir, budget)) == 6


def test_a_cache_that_cannot_write_never_fails_reads_or_metrics(s3_uri, tmp_path, caplog):
    """Reviewer of stop 60: with a cache directory that cannot be locked (its ``.lock`` not a
    file here; a read-only directory fails the same ``open``), ``metrics()`` raised, and every
    fill logged a warning. Reads go to the replicas, ``cached_bytes`` is null, ``errors``
    counts each failure and one WARNING names the cache."""
    _upload_tokens(s3_uri)
    cache_dir = tmp_path / "cache"
    (cache_dir / ".lock").mkdir(parents=True)
    ds = _dataset(s3_uri, cache_dir, 100 * ENTRY_BYTES)
    with caplog.at_level("DEBUG", logger="loaders.cache"):
        _check_epoch(ds)
        cache = ds.metrics()["cache"]
        loader = StatefulLoader(ds, batch_size=4)
        assert loader.metrics()["cache"]["cached_bytes"] is None
    assert cache["cached_bytes"] is None and cache["fills"] == 0
    assert cache["errors"] >= UNITS, cache
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "cannot store an entry" in warned[0].getMessage(), warned
