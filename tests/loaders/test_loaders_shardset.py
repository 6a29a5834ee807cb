"""The set of shards is known and checked across replicas, never inferred from whichever replica
answers first (issue 9 item 4): replicas are real local directories, shards real files."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench.faults import Faults, with_faults
from ckptstore import Store
from loaders import (
    MDS,
    LoaderConfig,
    ReplicaConfig,
    ReplicaMismatchError,
    ShardDataset,
    ShardNotFoundError,
    TokenFiles,
    WebDataset,
)
from loaders.replicas import replica_retry_policy
from tests.helpers import MDS_FIXTURES

pytestmark = pytest.mark.timeout(60)

SAMPLE_TOKENS = 4
SHARDS = [f"shard-{i:04d}.bin" for i in range(4)]
PER_SHARD = 100
IN_ORDER = LoaderConfig(shuffle=False, log_interval_s=0)
MDS_FIXTURE = MDS_FIXTURES / "mixed-raw"


def _token_replicas(tmp_path: Path, names: str = "ab") -> list[Path]:
    """Identical replicas of 4 uint32 token shards of 100 samples; token t of sample i is
    ``i * SAMPLE_TOKENS + t``."""
    roots = []
    for name in names:
        root = tmp_path / name
        root.mkdir()
        for s, shard in enumerate(SHARDS):
            n = PER_SHARD * SAMPLE_TOKENS
            np.arange(s * n, (s + 1) * n, dtype=np.uint32).tofile(root / shard)
        roots.append(root)
    return roots


def _tokens(**kw) -> TokenFiles:
    return TokenFiles(dtype="uint32", sample_tokens=SAMPLE_TOKENS, read_bytes=16 * 25, **kw)


def _ids(ds: ShardDataset) -> list[int]:
    ids = []
    for s in ds:
        assert s["tokens"][0] == s["__index__"] * SAMPLE_TOKENS  # the bytes belong to the id
        ids.append(int(s["__index__"]))
    return ids


def _warnings(caplog) -> list[str]:
    """The loader's warnings, but a replica benched for its latency: on a loaded machine a
    local replica's read may be slow enough, and these tests are about what the survey says."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and r.name.startswith("loaders")
        and not ("benched for" in r.getMessage() and ": latency " in r.getMessage())
    ]


# -- the three cases of the issue, shards discovered by listing -------------------------------


def test_shard_missing_from_first_replica_is_read_from_the_other(tmp_path, caplog):
    a, b = _token_replicas(tmp_path)
    (a / SHARDS[2]).unlink()
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ds = ShardDataset([str(a), str(b)], _tokens(), config=IN_ORDER)
        assert ds.num_samples == 400
        assert _ids(ds) == list(range(400))
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert str(a) in warned[0] and SHARDS[2] in warned[0] and str(b) not in warned[0]
    # a was never asked for the shard it lacks: no error counted against it, not benched
    m = ds.metrics()["replicas"][str(a)]
    assert m["errors"] == 0 and m["benched"] == 0


def test_shard_missing_from_second_replica_is_read_from_the_first(tmp_path, caplog):
    a, b = _token_replicas(tmp_path)
    (b / SHARDS[1]).unlink()
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ds = ShardDataset([str(a), str(b)], _tokens(), config=IN_ORDER)
        assert _ids(ds) == list(range(400))
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert str(b) in warned[0] and SHARDS[1] in warned[0]
    assert ds.metrics()["replicas"][str(b)]["errors"] == 0


def test_shard_missing_from_every_replica_is_an_error_when_the_list_is_declared(tmp_path):
    a, b = _token_replicas(tmp_path)
    (a / SHARDS[3]).unlink()
    (b / SHARDS[3]).unlink()
    with pytest.raises(ShardNotFoundError, match=r"shard-0003\.bin is missing from every replica"):
        ShardDataset([str(a), str(b)], _tokens(files=SHARDS), config=IN_ORDER)
    with pytest.raises(ShardNotFoundError) as info:
        ShardDataset([str(a), str(b)], _tokens(files=SHARDS), config=IN_ORDER)
    assert str(a) in str(info.value) and str(b) in str(info.value)


def test_shard_missing_from_every_replica_is_an_error_with_a_manifest(tmp_path):
    a, b = _token_replicas(tmp_path)
    for root in (a, b):
        (root / "shards.txt").write_text("# token shards\n" + "\n".join(SHARDS) + "\n\n")
    ds = ShardDataset([str(a), str(b)], _tokens(manifest="shards.txt"), config=IN_ORDER)
    assert _ids(ds) == list(range(400))
    (a / SHARDS[0]).unlink()
    (b / SHARDS[0]).unlink()
    with pytest.raises(ShardNotFoundError, match=r"shard-0000\.bin is missing from every replica"):
        ShardDataset([str(a), str(b)], _tokens(manifest="shards.txt"), config=IN_ORDER)


def test_manifest_must_be_the_same_on_every_replica(tmp_path):
    a, b = _token_replicas(tmp_path)
    (a / "shards.txt").write_text("\n".join(SHARDS))
    (b / "shards.txt").write_text("\n".join(SHARDS[:3]))
    with pytest.raises(ReplicaMismatchError, match=r"shards\.txt"):
        ShardDataset([str(a), str(b)], _tokens(manifest="shards.txt"))
    with pytest.raises(ValueError, match="manifest"):
        _tokens(manifest="shards.txt", files=SHARDS)


# -- disagreement is visible, and survives the trip into DataLoader workers --------------------


def test_each_replica_lacking_shards_is_named_in_one_warning(tmp_path, caplog):
    a, b, c = _token_replicas(tmp_path, "abc")
    (a / SHARDS[0]).unlink()
    (b / SHARDS[2]).unlink()
    (b / SHARDS[3]).unlink()
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ds = ShardDataset([str(a), str(b), str(c)], _tokens(), config=IN_ORDER)
        assert _ids(ds) == list(range(400))
    warned = _warnings(caplog)
    assert len(warned) == 2, warned
    (wa,) = [w for w in warned if str(a) in w]
    (wb,) = [w for w in warned if str(b) in w]
    assert SHARDS[0] in wa and SHARDS[2] not in wa
    assert SHARDS[2] in wb and SHARDS[3] in wb and SHARDS[0] not in wb


def test_missing_shards_are_known_in_a_copy_of_the_dataset(tmp_path):
    a, b = _token_replicas(tmp_path)
    (a / SHARDS[1]).unlink()
    ds = ShardDataset([str(a), str(b)], _tokens(), config=IN_ORDER)
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    copy._pid = -1  # as in another process: the replica set is opened again
    assert copy.replicas is not ds.replicas
    assert copy.replicas.missing == {SHARDS[1]: frozenset({str(a)})}
    assert _ids(copy) == list(range(400))
    assert copy.metrics()["replicas"][str(a)]["errors"] == 0


def test_listing_is_checked_without_size_verification(tmp_path, caplog):
    a, b = _token_replicas(tmp_path)
    (a / SHARDS[2]).unlink()
    config = ReplicaConfig(verify_replicas=False)
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ds = ShardDataset([str(a), str(b)], _tokens(), config=IN_ORDER, replica_config=config)
        assert _ids(ds) == list(range(400))
    assert any(str(a) in w and SHARDS[2] in w for w in _warnings(caplog))


# -- the other formats ---------------------------------------------------------------------


def _wds_replicas(tmp_path: Path) -> list[Path]:
    import webdataset as wds

    roots = []
    for name in "ab":
        root = tmp_path / name
        root.mkdir()
        n = 0
        for s in range(4):
            with wds.TarWriter(str(root / f"part-{s:04d}.tar")) as w:
                for _ in range(5):
                    w.write({"__key__": f"k{n:04d}", "txt": str(n)})
                    n += 1
        roots.append(root)
    return roots


def test_webdataset_shard_missing_from_one_replica(tmp_path, caplog):
    a, b = _wds_replicas(tmp_path)
    (a / "part-0001.tar").unlink()
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ds = ShardDataset([str(a), str(b)], WebDataset(), config=IN_ORDER)
        got = [int(s["txt"]) for s in ds]
    assert got == list(range(20))
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(a) in warned[0] and "part-0001.tar" in warned[0]
    (b / "part-0001.tar").unlink()
    shards = [f"part-{s:04d}.tar" for s in range(4)]
    with pytest.raises(ShardNotFoundError, match=r"part-0001\.tar is missing from every replica"):
        ShardDataset([str(a), str(b)], WebDataset(shards=shards))


def test_mds_index_is_the_authority(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(MDS_FIXTURE, a)
    shutil.copytree(MDS_FIXTURE, b)
    expected = len((MDS_FIXTURE / "expected.jsonl").read_text().splitlines())
    shard = json.loads((a / "index.json").read_text())["shards"][3]["raw_data"]["basename"]
    (a / shard).unlink()
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ds = ShardDataset([str(a), str(b)], MDS(), config=IN_ORDER)
        got = [s["__index__"] for s in ds]
    assert got == list(range(expected))
    warned = [w for w in _warnings(caplog) if "read unverified" not in w]  # upstream's: unhashed
    assert len(warned) == 1 and str(a) in warned[0] and shard in warned[0]
    assert ds.metrics()["replicas"][str(a)]["errors"] == 0
    (b / shard).unlink()
    with pytest.raises(ShardNotFoundError, match=rf"{shard} is missing from every replica"):
        ShardDataset([str(a), str(b)], MDS(), config=IN_ORDER)


def test_unreachable_replica_is_named_when_a_declared_shard_is_missing(tmp_path, caplog):
    (a,) = _token_replicas(tmp_path, "a")
    (a / SHARDS[1]).unlink()
    config = ReplicaConfig(bench_after_errors=100)
    mem = f"memory://shardset-{tmp_path.name}"
    for shard in SHARDS:
        Store(mem).put(shard, (a / SHARDS[0]).read_bytes())
    broken = with_faults(Store(mem, retry=replica_retry_policy(config)), Faults(error_rate=1.0))
    with caplog.at_level(logging.WARNING, logger="loaders"):
        with pytest.raises(ShardNotFoundError, match=rf"shard-0001\.bin .*unreachable: {mem}"):
            ShardDataset([broken, str(a)], _tokens(files=SHARDS), replica_config=config)
    assert any(mem in w and "unreachable" in w for w in _warnings(caplog))
