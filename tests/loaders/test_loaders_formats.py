"""Formats read through the storage layer, against data written by each format's own tools."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

from loaders import (
    MDS,
    LoaderConfig,
    ReplicaConfig,
    ReplicaMismatchError,
    ShardCorruptError,
    ShardDataset,
    ShardNotFoundError,
    TokenFiles,
    UnknownFormatError,
    WebDataset,
)
from tests.helpers import MDS_FIXTURES
from tests.helpers.mds import expected_value

# Written by mosaicml-streaming's own MDSWriter (copied from the project's shared fixtures).
IN_ORDER = LoaderConfig(shuffle=False)


def _fixture(name: str) -> Path:
    path = MDS_FIXTURES / name
    assert (path / "index.json").exists(), f"MDS fixture {path} is missing from the repository"
    return path


@pytest.mark.parametrize("name", ["mixed-raw", "tokens-zstd", "json-order"])
def test_mds_matches_upstream_writer(name):
    path = _fixture(name)
    expected = [json.loads(line) for line in (path / "expected.jsonl").read_text().splitlines()]
    got = list(ShardDataset(str(path), MDS(), config=IN_ORDER))
    assert len(got) == len(expected)
    for i, (sample, want) in enumerate(zip(got, expected)):
        assert sample["__index__"] == i
        for column, value in want.items():
            value = expected_value(value)
            if isinstance(value, np.ndarray):
                assert sample[column].dtype == value.dtype, (i, column)
                np.testing.assert_array_equal(sample[column], value)
            else:
                assert sample[column] == value, (i, column)


IMAGE_COLUMNS = ("jpg", "png", "pil")


def test_mds_image_columns_refused_by_name_unless_read_raw():
    path = _fixture("images")  # jpeg, png and pil columns, by Streaming's own MDSWriter
    with pytest.raises(UnknownFormatError, match=r"columns 'jpg', 'pil', 'png'.*raw_columns="):
        ShardDataset(str(path), MDS(), config=IN_ORDER)  # every image column named at once
    with pytest.raises(UnknownFormatError, match=r"column 'pil'.*raw_columns=\('pil',\)"):
        ShardDataset(str(path), MDS(raw_columns=("jpg", "png")), config=IN_ORDER)
    with pytest.raises(ValueError, match=r"raw_columns names 'img'.*columns: id, jpg"):
        ShardDataset(str(path), MDS(raw_columns=("img", *IMAGE_COLUMNS)), config=IN_ORDER)


def _decode_images(sample: dict) -> dict:
    """A user's transform: the raw columns decoded with Pillow, as Streaming's reader does."""
    from PIL import Image

    width, height, mode_bytes = np.frombuffer(sample["pil"], np.uint32, 3)
    mode = sample["pil"][12 : 12 + mode_bytes].decode()
    pixels = sample["pil"][12 + mode_bytes :]
    return {
        **sample,
        "jpg": np.asarray(Image.open(io.BytesIO(sample["jpg"]))),
        "png": np.asarray(Image.open(io.BytesIO(sample["png"]))),
        "pil": np.asarray(Image.frombytes(mode, (int(width), int(height)), pixels)),
    }


def test_mds_image_columns_read_raw_and_decoded_in_a_transform():
    path = _fixture("images")
    expected = [json.loads(line) for line in (path / "expected.jsonl").read_text().splitlines()]
    fmt = MDS(raw_columns=IMAGE_COLUMNS)
    raw = list(ShardDataset(str(path), fmt, config=IN_ORDER))
    decoded = list(ShardDataset(str(path), fmt, config=IN_ORDER, transform=_decode_images))
    assert len(raw) == len(decoded) == len(expected) == 6
    for i, (stored, image, want) in enumerate(zip(raw, decoded, expected)):
        assert (stored["id"], stored["label"]) == (want["id"], want["label"]), i
        for column in IMAGE_COLUMNS:
            assert stored[column] == bytes.fromhex(want[column]["hex"]), (i, column)
            # Pixels as Streaming's own reader decodes them (recorded when it read the fixture).
            assert list(image[column].shape) == want[column]["decoded_shape"], (i, column)
            digest = hashlib.sha256(image[column].tobytes()).hexdigest()
            assert digest == want[column]["decoded_sha256"], (i, column)


def test_mds_hash_mismatch_names_shard_and_replica(tmp_path):
    src = _fixture("tokens-zstd")
    shutil.copytree(src, tmp_path / "ds")
    shard = tmp_path / "ds" / "shard.00002.mds.zstd"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ShardCorruptError, match=r"shard\.00002\.mds\.zstd on replica .*: (sha1|xxh64)"
    ):
        list(ShardDataset(str(tmp_path / "ds"), MDS(), config=IN_ORDER))


def test_a_corrupt_shard_on_one_replica_is_read_from_the_other_and_reported(tmp_path, caplog):
    src = _fixture("tokens-zstd")
    shutil.copytree(src, tmp_path / "bad")
    shutil.copytree(src, tmp_path / "good")
    for shard in (tmp_path / "bad").glob("shard.*"):  # every shard: the first one read is there
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
    expected = list(ShardDataset(str(tmp_path / "good"), MDS(), config=IN_ORDER))
    ds = ShardDataset(
        [str(tmp_path / "good"), str(tmp_path / "bad")],
        MDS(),
        config=IN_ORDER,
        replica_config=ReplicaConfig(hedge=False),
    )
    with caplog.at_level("WARNING", logger="loaders.replicas"):
        got = list(ds)
    assert [s["__index__"] for s in got] == [s["__index__"] for s in expected]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    bad = ds.metrics()["replicas"][ds.replicas.uris[1]]
    corrupt = [r.getMessage() for r in caplog.records if "corrupt data" in r.getMessage()]
    # A new set's first read (the index) goes to its first replica and is its latency sample;
    # the first shard's to the other, still unmeasured and idle (a corrupt read is no sample,
    # so later ones too until it is benched). Past that, the pick is weighted random: with the
    # corrupt replica first, no shard read need ever reach it.
    assert bad["corrupt"] == len(corrupt) >= 1
    assert all(f"replica {ds.replicas.uris[1]}" in m and ".mds.zstd" in m for m in corrupt)


def test_mds_truncated_shard_names_offset(tmp_path):
    src = _fixture("mixed-raw")
    shutil.copytree(src, tmp_path / "ds")
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    shard = tmp_path / "ds" / "shard.00001.mds"
    data = bytearray(shard.read_bytes())
    struct.pack_into("<I", data, 4 + 4 * 3, 999_999)  # offset table entry 3 beyond the end
    shard.write_bytes(bytes(data))
    assert index["shards"][1]["raw_data"]["bytes"] == len(data)
    with pytest.raises(ShardCorruptError, match=r"shard\.00001\.mds.*entry 3 \(at byte 16\)"):
        list(ShardDataset(str(tmp_path / "ds"), MDS(), config=IN_ORDER))


def _write_mds(root: Path, shards: list[list[bytes]]) -> None:
    """A minimal MDS v2 dataset with one ``bytes`` column (for empty / one-sample shards)."""
    root.mkdir(parents=True, exist_ok=True)
    infos = []
    for i, samples in enumerate(shards):
        encoded = [struct.pack("<I", len(s)) + s for s in samples]
        head = 4 + 4 * (len(samples) + 1)
        offsets = np.cumsum([head] + [len(e) for e in encoded]).astype("<u4")
        blob = struct.pack("<I", len(samples)) + offsets.tobytes() + b"".join(encoded)
        name = f"shard.{i:05d}.mds"
        (root / name).write_bytes(blob)
        infos.append(
            {
                "column_encodings": ["bytes"],
                "column_names": ["b"],
                "column_sizes": [None],
                "compression": None,
                "format": "mds",
                "hashes": [],
                "raw_data": {"basename": name, "bytes": len(blob), "hashes": {}},
                "samples": len(samples),
                "size_limit": 1 << 20,
                "version": 2,
                "zip_data": None,
            }
        )
    (root / "index.json").write_text(json.dumps({"shards": infos, "version": 2}))


def test_mds_empty_and_one_sample_shards(tmp_path):
    _write_mds(tmp_path, [[b"a", b"bc"], [], [b"only"], [b""]])
    got = [s["b"] for s in ShardDataset(str(tmp_path), MDS(), config=IN_ORDER)]
    assert got == [b"a", b"bc", b"only", b""]


def test_mds_unknown_version_and_encoding(tmp_path):
    _write_mds(tmp_path / "v", [[b"a"]])
    index = json.loads((tmp_path / "v" / "index.json").read_text())
    index["version"] = 3
    (tmp_path / "v" / "index.json").write_text(json.dumps(index))
    with pytest.raises(UnknownFormatError, match="version 3"):
        ShardDataset(str(tmp_path / "v"), MDS())
    index["version"] = 2
    index["shards"][0]["column_encodings"] = ["jpeg"]
    (tmp_path / "v" / "index.json").write_text(json.dumps(index))
    with pytest.raises(UnknownFormatError, match="'jpeg'"):
        ShardDataset(str(tmp_path / "v"), MDS())


def test_unknown_format_object():
    with pytest.raises(ValueError, match="unknown dataset format"):
        ShardDataset("memory://nothing", "parquet")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"the class MDS: pass an instance, MDS\(\.\.\.\)"):
        ShardDataset("memory://nothing", MDS)  # type: ignore[arg-type]  # reviewer Q


def _write_wds(root: Path, counts: list[int]) -> list[dict]:
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    written, n = [], 0
    for s, count in enumerate(counts):
        with wds.TarWriter(str(root / f"shard-{s:04d}.tar")) as w:
            for _ in range(count):
                sample = {
                    "__key__": f"dir/s{n:05d}",
                    "txt": f"text {n}",
                    "cls": str(n % 7),
                    "bin": bytes([n % 256]) * (n % 50),
                }
                w.write(sample)
                written.append(sample)
                n += 1
    return written


def test_webdataset_from_tarwriter_with_empty_and_one_sample_shards(tmp_path):
    written = _write_wds(tmp_path, [5, 0, 1, 9])
    got = list(ShardDataset(str(tmp_path), WebDataset(), config=IN_ORDER))
    assert [s["__key__"] for s in got] == [w["__key__"] for w in written]
    assert [s["txt"].decode() for s in got] == [w["txt"] for w in written]
    assert [s["bin"] for s in got] == [w["bin"] for w in written]
    assert got[5]["__url__"] == "shard-0002.tar"


def test_webdataset_shardwriter(tmp_path):
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "part-%03d.tar"), maxcount=4, verbose=0) as w:
        for i in range(10):
            w.write({"__key__": f"k{i}", "json": json.dumps({"i": i}).encode()})
    ds = ShardDataset(str(tmp_path), WebDataset(), config=LoaderConfig(seed=3))
    got = sorted(json.loads(s["json"])["i"] for s in ds)
    assert got == list(range(10))


def test_webdataset_corrupt_tar_names_shard_and_offset(tmp_path):
    _write_wds(tmp_path, [4, 4])
    shard = tmp_path / "shard-0001.tar"
    data = bytearray(shard.read_bytes())
    data[1024 + 148 : 1024 + 156] = b"garbage!"  # checksum field of the second header
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match=r"shard-0001\.tar.*offset"):
        ShardDataset(str(tmp_path), WebDataset())


def test_a_shard_corrupt_on_every_replica_is_named_whole_not_by_a_range(tmp_path):
    """Reviewer Q: the error named shard-0001.tar[0:N+1], the byte past the end a whole-shard
    read asks for to catch a longer copy, as if part of the shard had been read."""
    for replica in ("a", "b"):
        _write_wds(tmp_path / replica, [4, 4])
        shard = tmp_path / replica / "shard-0001.tar"
        data = bytearray(shard.read_bytes())
        data[148:156] = b"garbage!"  # checksum field of the first header
        shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match=r"shard-0001\.tar: no replica holds") as failed:
        ShardDataset([str(tmp_path / "a"), str(tmp_path / "b")], WebDataset())
    assert "shard-0001.tar[" not in str(failed.value)


def test_webdataset_counts_given_and_checked(tmp_path):
    _write_wds(tmp_path, [3, 2])
    fmt = WebDataset(shards=["shard-0000.tar", "shard-0001.tar"], sample_counts=[3, 3])
    ds = ShardDataset(str(tmp_path), fmt, config=IN_ORDER)
    with pytest.raises(ShardCorruptError, match=r"shard-0001\.tar.* 2 samples, 3 expected"):
        list(ds)


def test_tokens_cut_into_samples_across_read_boundaries(tmp_path):
    a = np.arange(1000, dtype=np.uint16)
    b = np.arange(5000, 5000 + 777, dtype=np.uint16)
    a.tofile(tmp_path / "a.bin")
    b.tofile(tmp_path / "b.bin")
    # 30-token samples (60 bytes); reads of 100 bytes round down to one sample, 1000 to 16
    for read_bytes in (100, 1000, 1 << 20):
        fmt = TokenFiles(sample_tokens=30, read_bytes=read_bytes)
        got = list(ShardDataset(str(tmp_path), fmt, config=IN_ORDER))
        assert len(got) == 1000 // 30 + 777 // 30
        want = [a[i * 30 : (i + 1) * 30] for i in range(1000 // 30)]
        want += [b[i * 30 : (i + 1) * 30] for i in range(777 // 30)]
        for s, w in zip(got, want):
            np.testing.assert_array_equal(s["tokens"], w)


def test_tokens_uint32_with_header_and_short_file(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"H" * 16 + np.arange(64, dtype=np.uint32).tobytes())
    (tmp_path / "y.bin").write_bytes(b"H" * 16 + np.arange(3, dtype=np.uint32).tobytes())
    fmt = TokenFiles(dtype="uint32", sample_tokens=8, header_bytes=16, read_bytes=64)
    ds = ShardDataset(str(tmp_path), fmt, config=IN_ORDER)
    assert ds.num_samples == 8  # y.bin holds less than one sample
    batches = list(ds.iter_batches(3))
    tokens = np.concatenate([b["tokens"] for b in batches])
    np.testing.assert_array_equal(tokens.ravel(), np.arange(64, dtype=np.uint32))


def test_token_files_shorter_than_one_sample_are_an_error_not_an_empty_dataset(tmp_path):
    """Reviewer Q: sample_tokens above every file's length opened a dataset of 0 samples with
    no word (list(ds) empty: 227k tokens dropped); only a StatefulLoader complained."""
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "b.bin")
    with pytest.raises(ValueError, match=r"no sample in 2 token file.*500 tokens.*=501"):
        ShardDataset(str(tmp_path), TokenFiles(sample_tokens=501), config=IN_ORDER)
    assert ShardDataset(str(tmp_path), TokenFiles(sample_tokens=500)).num_samples == 1


def test_tokens_partial_token_is_corrupt(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 101)
    with pytest.raises(ShardCorruptError, match=r"x\.bin.*offset 100"):
        ShardDataset(str(tmp_path), TokenFiles(sample_tokens=10))


def test_missing_shard_is_one_clear_error(tmp_path):
    _write_wds(tmp_path, [2, 2])
    fmt = WebDataset(shards=["shard-0000.tar", "shard-0009.tar"])
    with pytest.raises(ShardNotFoundError, match=r"shard-0009\.tar"):
        ShardDataset(str(tmp_path), fmt)


def test_missing_index_is_one_clear_error(tmp_path):
    with pytest.raises(ShardNotFoundError, match=r"index\.json"):
        ShardDataset(str(tmp_path), MDS())


def test_replica_with_a_different_index_is_detected(tmp_path):
    """An index that differs between replicas refuses the dataset (a shard of another size on
    one replica only benches that replica for it: tests/loaders/test_loaders_token_hashes.py)."""
    src = _fixture("mixed-raw")
    shutil.copytree(src, tmp_path / "m1")
    shutil.copytree(src, tmp_path / "m2")
    index = json.loads((tmp_path / "m2" / "index.json").read_text())
    index["shards"][0]["samples"] += 0
    (tmp_path / "m2" / "index.json").write_text(json.dumps(index, indent=1))
    with pytest.raises(ReplicaMismatchError, match=r"index\.json"):
        ShardDataset([str(tmp_path / "m1"), str(tmp_path / "m2")], MDS())


def test_tar_written_by_tarfile_with_dirs_and_dotfiles(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [
            ("d/a.x.txt", b"1"),
            ("d/a.y", b"2"),
            ("d/.hidden", b"3"),
            ("d/b.X", b"4"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "s.tar").write_bytes(buf.getvalue())
    got = list(ShardDataset(str(tmp_path), WebDataset(), config=IN_ORDER))
    assert [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in got] == [
        ("d/a", ["x.txt", "y"]),
        ("d/b", ["x"]),
    ]


def test_iter_batches_runs_the_transform_or_refuses_it(tmp_path):
    """A reviewer's finding: ``iter_batches`` handed out raw samples where the dataset's
    ``transform`` ran on every sample ``__iter__`` gave."""
    _write_wds(tmp_path / "wds", [5, 4])

    def key(sample: dict) -> str:
        return sample["__key__"].upper()

    ds = ShardDataset(str(tmp_path / "wds"), WebDataset(), config=IN_ORDER, transform=key)
    batched = [s for batch in ds.iter_batches(4) for s in batch]
    assert batched == list(ds) == [f"DIR/S{n:05d}" for n in range(9)]
    (tmp_path / "tok").mkdir()
    np.arange(64, dtype=np.uint16).tofile(tmp_path / "tok" / "t.bin")
    tokens = ShardDataset(str(tmp_path / "tok"), TokenFiles(sample_tokens=8))
    assert len(next(tokens.iter_batches(2))["tokens"]) == 2
    tokens.transform = len
    with pytest.raises(ValueError, match="per-sample transform cannot run"):
        tokens.iter_batches(2)
