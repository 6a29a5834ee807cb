"""Datasets that name shards outside their root or hold decompression bombs: refused in one line
(ShardCorruptError), reading nothing outside the root and no more than the index declares.
MDS datasets are written by the project's own MDSWriter, then altered."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import zstandard

import loaders.formats.manifest as manifest_module
import loaders.formats.mds.reader as mds_reader
from ckptstore.store import open_store
from loaders import (
    MDS,
    LoaderConfig,
    MDSWriter,
    ReplicaConfig,
    ShardCorruptError,
    ShardDataset,
    ShardNotFoundError,
    ShardTooLargeError,
    TokenFiles,
    UnknownFormatError,
    WebDataset,
    WebDatasetWriter,
)
from loaders.formats._codecs import hasher
from loaders.formats.mds.reader import SAMPLE_BYTES, VALUE_BYTES, json_size
from tests.helpers.child import growth_in_child

IN_ORDER = LoaderConfig(shuffle=False)
BOMB = 1 << 30
GROWTH_LIMIT = 64 << 20
CHILD_TIMEOUT_S = 120


def write_mds(root: Path, compression: str | None) -> dict:
    """Ten small samples in one shard; the index, as written."""
    with MDSWriter(root, columns={"text": "str", "n": "int"}, compression=compression) as w:
        for i in range(10):
            w.write({"text": f"sample {i}", "n": i})
    return json.loads((root / "index.json").read_text())


def write_index(root: Path, index: dict) -> None:
    (root / "index.json").write_text(json.dumps(index))


def test_an_mds_basename_outside_the_root_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    index = write_mds(root, None)
    shard = index["shards"][0]["raw_data"]["basename"]
    os.replace(root / shard, tmp_path / "secret.mds")  # a valid shard, outside the root
    index["shards"][0]["raw_data"]["basename"] = "../secret.mds"
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=r"'\.\./secret\.mds'.*not inside the dataset"):
        list(ShardDataset(str(root), MDS(), config=IN_ORDER))


@pytest.mark.parametrize("name", ["/etc/hostname", "a/../../secret.mds", "s3:x", "a\\..\\b", ""])
def test_mds_basenames_that_are_not_plain_relative_paths_are_corrupt(
    tmp_path: Path, name: str
) -> None:
    root = tmp_path / "ds"
    index = write_mds(root, "zstd")
    index["shards"][0]["zip_data"]["basename"] = name
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match="not inside the dataset"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_a_negative_size_in_an_mds_index_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    index = write_mds(root, "zstd")
    index["shards"][0]["raw_data"]["bytes"] = -1
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match="raw bytes -1"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


@pytest.mark.parametrize("fmt", ["webdataset", "tokens"])
def test_a_manifest_naming_a_shard_outside_the_root_is_corrupt(tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    if fmt == "webdataset":
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo("a.txt")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
        (tmp_path / "secret.tar").write_bytes(buffer.getvalue())
        (root / "shards.txt").write_text("../secret.tar\n")
        dataset = WebDataset(manifest="shards.txt")
    else:
        np.arange(64, dtype=np.uint16).tofile(tmp_path / "secret.bin")
        (root / "files.txt").write_text("../secret.bin\n")
        dataset = TokenFiles(manifest="files.txt", sample_tokens=8)
    with pytest.raises(ShardCorruptError, match="not inside the dataset"):
        ShardDataset(str(root), dataset, config=IN_ORDER)


@pytest.mark.parametrize("name", ["../secret.bin", "/etc/hostname", "a/./b.bin"])
def test_a_declared_file_outside_the_root_is_a_loader_error(tmp_path: Path, name: str) -> None:
    """A reviewer's: ``files=["../x.bin"]`` was refused by the storage layer, with ckptstore's
    CheckpointCorruptError ("key ... leads outside the store"), not the loader's error."""
    root = tmp_path / "ds"
    root.mkdir()
    np.arange(64, dtype=np.uint16).tofile(tmp_path / "secret.bin")
    with pytest.raises(ShardCorruptError, match="declared list names shard .* not inside"):
        ShardDataset(str(root), TokenFiles(files=[name], sample_tokens=8), config=IN_ORDER)


def test_a_fifo_planted_as_a_shard_is_refused_at_once(tmp_path: Path) -> None:
    """Reviewer H: a FIFO named like a shard was listed (size 0) and read: the open waited for a
    writer until the read deadline (60 s by default). A file that is not a regular file is not
    read."""
    from loaders import ReplicaConfig, WebDataset

    root = tmp_path / "ds"
    root.mkdir()
    os.mkfifo(root / "evil.tar")
    config = ReplicaConfig(attempt_timeout_s=30, read_deadline_s=60)
    with pytest.raises(Exception, match="not a regular file") as refused:
        ShardDataset(str(root), WebDataset(), config=IN_ORDER, replica_config=config)
    assert "evil.tar" in str(refused.value)


def plant_zstd_bomb(root: Path) -> int:
    """Replace the shard of a zstd MDS dataset by a frame of BOMB zero bytes (about 32 KiB),
    the index's compressed size and hashes recomputed; the raw size the index declares."""
    index = json.loads((root / "index.json").read_text())
    info = index["shards"][0]
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=BOMB)
    zeros = bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(BOMB >> 20)) + compressor.flush()
    (root / info["zip_data"]["basename"]).write_bytes(bomb)
    info["zip_data"]["bytes"] = len(bomb)
    info["zip_data"]["hashes"] = {a: hasher(a)(bomb) for a in info["hashes"]}
    write_index(root, index)
    return info["raw_data"]["bytes"]


def test_an_mds_zstd_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_mds(root, "zstd")
    declared = plant_zstd_bomb(root)
    setup = f"""
        from loaders import MDS, LoaderConfig, ShardDataset
        dataset = ShardDataset({str(root)!r}, MDS(), config=LoaderConfig(shuffle=False))
        """
    action = """
        list(dataset)
        outcome = "READ"
        """
    growth, outcome = growth_in_child(setup, action, CHILD_TIMEOUT_S)
    assert growth < GROWTH_LIMIT, f"the read grew by {growth >> 20} MiB"
    assert outcome.startswith("ShardCorruptError"), outcome
    assert f"more than the {declared} raw bytes" in outcome, outcome


def test_an_mds_sample_count_its_shard_cannot_hold_is_corrupt_at_open(tmp_path: Path) -> None:
    """Checked before the epoch order allocates an entry per sample the index claims."""
    root = tmp_path / "ds"
    index = write_mds(root, None)
    index["shards"][0]["samples"] = 10**12
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=r"1000000000000 samples cannot fit in a shard"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


@pytest.mark.parametrize("compression", ["zstd", "gz"])
def test_a_compressed_shard_declaring_more_raw_bytes_than_it_can_hold_is_corrupt_at_open(
    tmp_path: Path, compression: str
) -> None:
    """A shard of a hundred bytes declaring a GiB raw and a sample per 4 bytes of it: refused
    at open, not an epoch order of 2.7e8 entries (10 GiB) built from a few-hundred-byte index."""
    root = tmp_path / "ds"
    index = write_mds(root, compression)
    info = index["shards"][0]
    nbytes = info["zip_data"]["bytes"]
    info["raw_data"]["bytes"] = 1 << 30
    info["samples"] = (1 << 28) - 2
    write_index(root, index)
    with pytest.raises(
        ShardCorruptError, match=rf"{1 << 30} raw bytes cannot come from {nbytes} bytes of"
    ):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_a_compressed_shard_declaring_more_samples_than_its_bytes_can_number_is_corrupt(
    tmp_path: Path,
) -> None:
    """A reviewer: eight 1.6 KB zstd shards each declaring 13 million samples in 52 MB raw (within
    zstd's ratio) opened, and the first read built an epoch order of 104 million entries (6.5 GB)."""
    root = tmp_path / "ds"
    index = write_mds(root, "zstd")
    info = index["shards"][0]
    nbytes = info["zip_data"]["bytes"]
    info["samples"] = 4 * nbytes + 1
    info["raw_data"]["bytes"] = 4 + 4 * (info["samples"] + 1)
    write_index(root, index)
    with pytest.raises(
        ShardCorruptError, match=rf"{4 * nbytes + 1} samples cannot be numbered in {nbytes} bytes"
    ):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_a_shard_of_many_tiny_samples_at_zstd_s_best_opens(tmp_path: Path) -> None:
    """The bound leaves room: a hundred thousand one-byte samples, zstd at its best, still read."""
    root = tmp_path / "ds"
    with MDSWriter(root, columns={"x": "uint8"}, compression="zstd:22") as w:
        for i in range(100_000):
            w.write({"x": i % 2})
    info = json.loads((root / "index.json").read_text())["shards"][0]
    assert info["samples"] > info["zip_data"]["bytes"]  # more than a sample per stored byte
    assert len(list(ShardDataset(str(root), MDS(), config=IN_ORDER))) == 100_000


def test_a_zstd_shard_at_its_format_s_largest_ratio_opens(tmp_path: Path) -> None:
    """The bound is the format's, not a guess: 64 MiB of zeros, zstd at its best, still reads."""
    root = tmp_path / "ds"
    with MDSWriter(root, columns={"blob": "bytes"}, compression="zstd:22") as w:
        w.write({"blob": bytes(64 << 20)})
    info = json.loads((root / "index.json").read_text())["shards"][0]
    assert info["raw_data"]["bytes"] > 16_000 * info["zip_data"]["bytes"]  # near the bound
    (sample,) = list(ShardDataset(str(root), MDS(), config=IN_ORDER))
    assert sample["blob"] == bytes(64 << 20)


@pytest.mark.parametrize("algo", ["shake_128", "shake_256", "no_such_hash"])
def test_a_hash_of_no_fixed_length_is_unknown_not_a_replica_fault(tmp_path, caplog, algo):
    """hashlib has shake_128, but its digest needs a length the index cannot give: the data is
    read, the hash named as not checked (it benched the replica and failed 6 reads before)."""
    root = tmp_path / "ds"
    index = write_mds(root, None)
    for shard in index["shards"]:
        shard["hashes"] = [algo]
        shard["raw_data"]["hashes"] = {algo: "00"}
    write_index(root, index)
    with caplog.at_level("WARNING"):
        texts = [s["text"] for s in ShardDataset(str(root), MDS(), config=IN_ORDER)]
    assert texts == [f"sample {i}" for i in range(10)]
    assert f"hash {algo!r} is unknown, not checked" in caplog.text
    assert "benched" not in caplog.text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda ix: ix["shards"][0].pop("column_names"), r"malformed entry \(no 'column_names'\)"),
        (lambda ix: ix.update(shards=["x"]), "shard 0 is str, not an object"),
        (lambda ix: ix.update(shards={"a": 1}), "shards is dict, not a list"),
        (lambda ix: ix["shards"][0].update(raw_data=7), "malformed entry"),
        (
            lambda ix: ix["shards"][0]["column_names"].append("extra"),
            "3 column names, 2 encodings and 2 sizes",
        ),
        # reviewer H: these read unverified, or failed as "'NoneType' object is not subscriptable"
        (lambda ix: ix["shards"][0]["raw_data"].pop("hashes"), "records none of them"),
        (lambda ix: ix["shards"][0].update(compression="zstd"), "has no zip_data"),
        (lambda ix: ix["shards"][0].update(column_names={"a": 1, "b": 2}), "is not a list"),
    ],
)
def test_a_malformed_mds_index_entry_is_one_line_naming_the_index(tmp_path: Path, edit, message):
    root = tmp_path / "ds"
    index = write_mds(root, None)
    edit(index)
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=message) as info:
        ShardDataset(str(root), MDS(), config=IN_ORDER)
    assert "index.json" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("how", ["file", "directory"])
def test_a_token_shard_linked_from_outside_the_root_is_not_read(
    tmp_path: Path, how: str, caplog
) -> None:
    root, outside = tmp_path / "ds", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    np.arange(64, dtype=np.uint16).tofile(root / "a.bin")
    (outside / "secret.bin").write_bytes(b"SECRET!!" * 8)
    if how == "file":
        (root / "b.bin").symlink_to(outside / "secret.bin")
        files = None  # every *.bin below the root
    else:
        (root / "sub").symlink_to(outside, target_is_directory=True)
        files = ["a.bin", "sub/secret.bin"]
    fmt = TokenFiles(files=files, dtype="uint16", sample_tokens=4)
    # reviewer H: a ReadFailedError ("no replica answered"), as if the replica were down
    with caplog.at_level(logging.WARNING, logger="loaders"):
        with pytest.raises(ShardCorruptError, match="outside the store's root") as info:
            list(ShardDataset(str(root), fmt, config=LoaderConfig(shuffle=False)))
    assert "SECRET" not in str(info.value)
    # loader adversary of stop 78: the warnings before it called the replica unreachable
    assert "unreachable" not in caplog.text and "unsafe to read" in caplog.text, caplog.text


def test_an_s3_listing_key_leading_out_of_the_dataset_is_a_shard_error(s3_uri: str) -> None:
    """Loader adversary of stop 78: an S3 key ``ds/../secret.bin`` (S3 takes any key) in the
    listing of a dataset failed its open with ``CheckpointCorruptError`` from the store's own
    check, which ``except LoaderError`` misses; it is a ``ShardCorruptError`` naming the key."""
    store = open_store(s3_uri)
    store.put("ds/a.bin", np.arange(64, dtype=np.uint16).tobytes())
    store.put("secret.bin", b"SECRET!!" * 8)
    import boto3

    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/ds/../secret.bin", Body=b"x" * 8)
    fmt = TokenFiles(files=None, dtype="uint16", sample_tokens=4)
    with pytest.raises(ShardCorruptError, match="not inside the dataset") as info:
        ShardDataset(f"{s3_uri}/ds", fmt, config=LoaderConfig(shuffle=False))
    assert "'../secret.bin'" in str(info.value) and "\n" not in str(info.value)


def test_an_mds_shard_declaring_more_raw_bytes_than_the_bound_is_refused_at_open(
    tmp_path: Path,
) -> None:
    """Adversary: the zstd bomb with the index's raw size raised to 2**62, so that the
    decompression bound (the declared size) no longer bounds anything: refused at open, before
    a byte of the shard is read. A bound below a real shard refuses it the same way."""
    root = tmp_path / "ds"
    write_mds(root, "zstd")
    plant_zstd_bomb(root)
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["raw_data"]["bytes"] = 1 << 62
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=r"4611686018427387904 raw bytes, more than MDS"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)
    small = tmp_path / "small"
    raw = write_mds(small, "zstd")["shards"][0]["raw_data"]["bytes"]
    # New user of stop 76: a bound too small read as corrupt data, with no word of raising it
    with pytest.raises(
        ShardTooLargeError, match=rf"{raw} raw bytes, more than MDS.max_shard_bytes .*raise it"
    ):
        ShardDataset(str(small), MDS(max_shard_bytes=raw - 1), config=IN_ORDER)
    decoded = raw + 10 * (SAMPLE_BYTES + 2 * VALUE_BYTES)  # and the samples' Python objects
    with pytest.raises(ShardCorruptError, match=r"10 samples of 2 column\(s\) decode to about"):
        ShardDataset(str(small), MDS(max_shard_bytes=decoded - 1), config=IN_ORDER)
    dataset = ShardDataset(str(small), MDS(max_shard_bytes=decoded), config=IN_ORDER)
    assert dataset.units[0].mem_bytes == decoded  # what the prefetch window accounts
    assert len(list(dataset)) == 10


def test_an_mds_shard_of_many_empty_samples_is_accounted_as_it_decodes(tmp_path: Path) -> None:
    """Reviewer of stop 60: a 1.4 KB shard of 4 million empty samples passed every bound (16 MB
    raw) and decoded to 1.3 GB of Python objects while the prefetch window counted 16 MB. Its
    samples' objects are counted (window, ``max_shard_bytes``): refused at open under a bound
    its raw bytes pass."""
    root = tmp_path / "ds"
    root.mkdir()
    samples = 1_000_000
    raw = np.concatenate([[samples], np.full(samples + 1, 4 + 4 * (samples + 1))])
    raw = raw.astype(np.uint32).tobytes()
    (root / "s.mds").write_bytes(raw)
    shard = {"format": "mds", "version": 2, "compression": None, "hashes": [], "samples": samples}
    shard |= {"column_names": [], "column_encodings": [], "column_sizes": []}
    shard |= {"raw_data": {"basename": "s.mds", "bytes": len(raw), "hashes": {}}}
    write_index(root, {"version": 2, "shards": [shard]})
    bound = 64 * len(raw)
    with pytest.raises(ShardCorruptError, match=r"1000000 samples of 0 column\(s\) decode to"):
        ShardDataset(str(root), MDS(max_shard_bytes=bound), config=IN_ORDER)
    (unit,) = ShardDataset(str(root), MDS(), config=IN_ORDER).units
    assert unit.mem_bytes >= samples * SAMPLE_BYTES > 60 * len(raw)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda ix: ix["shards"][0].update(column_sizes=[None, "x"]),
            r"column_sizes \[None, 'x'\] are not sizes or null",
        ),
        (
            lambda ix: ix["shards"][0].update(column_encodings=["str", "ndarray:uint16:abc"]),
            "MDS column encoding 'ndarray:uint16:abc' is malformed",
        ),
        (
            lambda ix: ix["shards"][0].update(column_encodings=["str", "ndarray:O"]),
            "'ndarray:O': object is not an array dtype",
        ),
        (  # a fuzzer: every sample silently lost a column to the other of its name
            lambda ix: ix["shards"][0].update(column_names=["n", "n"]),
            "column names repeat: n",
        ),
        (
            lambda ix: ix["shards"][0].update(column_names=["text", ["n"]]),
            "column_names of a shard in .* are not all names",
        ),
    ],
)
def test_malformed_mds_columns_are_corrupt_at_open(tmp_path: Path, edit, message) -> None:
    """Were a raw ValueError at open, or a type error every read retried as a replica failure."""
    root = tmp_path / "ds"
    index = write_mds(root, None)
    edit(index)
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=message):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_an_mds_index_nested_past_the_parser_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_mds(root, None)
    (root / "index.json").write_text("[" * 100_000)
    with pytest.raises(ShardCorruptError, match="index.json is not JSON"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_an_mds_index_past_the_bound_is_refused_read_no_further(tmp_path: Path) -> None:
    """An index.json was read whole, however large, on every replica before anything was
    checked: it is read no further than a byte past the bound of an index or manifest."""
    root = tmp_path / "ds"
    write_mds(root, None)
    index = root / "index.json"
    index.write_bytes(index.read_bytes() + b" " * 5000)
    store = open_store(str(root))
    with pytest.raises(
        ShardCorruptError, match=r"index\.json is more than 4096 bytes, MDS\.max_index_bytes: raise"
    ):
        ShardDataset(store, MDS(max_index_bytes=4096), config=IN_ORDER)
    assert store.counters.snapshot()["bytes"]["get"] == 4097
    assert MDS().max_index_bytes == 64 << 20  # an index decodes to up to 40x its bytes


@pytest.mark.parametrize(("encoding", "value"), [("str_decimal", "abc"), ("json", "[" * 100_000)])
def test_mds_values_their_encoding_cannot_decode_are_corrupt_samples(
    tmp_path: Path, encoding: str, value: str
) -> None:
    """A str_decimal that is no number, a json value nested past the parser: the sample is
    corrupt (named by shard and offset), not a replica read failure retried and benched."""
    root = tmp_path / "ds"
    with MDSWriter(root, columns={"v": "str"}) as w:
        w.write({"v": value})
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["column_encodings"] = [encoding]
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match="sample 0 at offset .* cannot be decoded") as e:
        list(ShardDataset(str(root), MDS(), config=IN_ORDER))
    assert "<class" not in str(e.value)  # decimal's InvalidOperation: a name, not a repr


def _pax_tar(path: Path, name: str, pax: dict[str, str]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 5
        info.pax_headers = pax
        tar.addfile(info, io.BytesIO(b"hello"))


def test_a_long_pax_header_is_refused_before_tarfile_parses_it(tmp_path):
    """Python before 3.11.10 parses a pax header in time quadratic in its length (CVE-2024-6232):
    a 160 KB shard took 80 s a read, blamed on the replica and retried. A real pax header (a
    long path, a few attributes) still reads."""
    root = tmp_path / "ds"
    root.mkdir()
    long_name = "d" * 200 + "/sample.txt"  # over ustar's 100 bytes: a pax path record
    _pax_tar(root / "good.tar", long_name, {"comment": "x" * 1000})
    (sample,) = list(ShardDataset(str(root), WebDataset(), config=IN_ORDER))
    assert sample["txt"] == b"hello" and sample["__key__"] == long_name[: -len(".txt")]
    (root / "good.tar").unlink()
    _pax_tar(root / "bad.tar", "a.txt", {"comment": "1" * 20000})
    with pytest.raises(ShardCorruptError, match="a pax header of .* bytes at offset 0"):
        list(ShardDataset(str(root), WebDataset(), config=IN_ORDER))


def _hidden_pax_tar(path: Path, hide: str) -> None:
    """A tar whose 20 KB pax header a walker skipping every header's size field misses:
    behind a directory header whose size field covers it (``tarfile`` reads no data after a
    directory), or behind a member whose size field covers it while a pax ``size`` record
    says 0 (``tarfile`` skips the record's size, not the header's)."""

    def header(name: str, kind: bytes, size: int) -> bytes:
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, size
        return info.tobuf(format=tarfile.USTAR_FORMAT)

    def pad(data: bytes) -> bytes:
        return data + bytes(-len(data) % tarfile.BLOCKSIZE)

    record = b" comment=" + b"1" * 20000 + b"\n"
    record = str(len(record) + 6).encode() + record  # its length counts its own 5 digits
    long_pax = header("././@PaxHeader", tarfile.XHDTYPE, len(record)) + pad(record)
    if hide == "directory":
        front = header("d/", tarfile.DIRTYPE, len(long_pax))
    elif hide == "unparsed-payload":  # a walk that stops at a payload it cannot parse
        front = header("././@PaxHeader", tarfile.XHDTYPE, 7) + pad(b"garbage")
        front += header("a.txt", tarfile.REGTYPE, 0)
    else:
        size_record = b"9 size=0\n"
        front = header("././@PaxHeader", tarfile.XHDTYPE, len(size_record)) + pad(size_record)
        front += header("a.txt", tarfile.REGTYPE, len(long_pax))
    sample = header("b.txt", tarfile.REGTYPE, 5) + pad(b"hello")
    path.write_bytes(front + long_pax + sample + bytes(2 * tarfile.BLOCKSIZE))


@pytest.mark.parametrize("hide", ["directory", "pax-size", "unparsed-payload"])
def test_a_long_pax_header_hidden_from_a_naive_walk_is_refused(tmp_path, hide):
    """Reviewers L and M: a walk of the headers before tarfile read them could be led
    elsewhere than tarfile goes (a directory header's size field, a pax size record, a payload
    the walk could not parse, and more), so a long pax header reached tarfile's parse: a
    100 KB one took 19 s a read on Python 3.11.7. tarfile's own members are checked now."""
    root = tmp_path / "ds"
    root.mkdir()
    _hidden_pax_tar(root / "bad.tar", hide)
    with pytest.raises(ShardCorruptError, match="a pax header of .* bytes at offset"):
        list(ShardDataset(str(root), WebDataset(), config=IN_ORDER))


def test_a_member_of_negative_size_is_refused_not_read_for_ever(tmp_path):
    """Reviewer M: a base-256 size of -512 sent tarfile back to the same header for ever,
    memory growing (732 MB after 20 s)."""
    first = tarfile.TarInfo("a.txt")
    first.size = 5
    data = first.tobuf(format=tarfile.GNU_FORMAT) + b"hello" + bytes(507)
    looping = bytearray(tarfile.TarInfo("nodot").tobuf(format=tarfile.GNU_FORMAT))
    looping[124:136] = tarfile.itn(-512, 12, tarfile.GNU_FORMAT)
    looping[148:156] = b"        "
    looping[148:155] = b"%06o\0" % sum(looping)  # the checksum of the edited header
    root = tmp_path / "ds"
    root.mkdir()
    (root / "bad.tar").write_bytes(data + bytes(looping) + bytes(2 * tarfile.BLOCKSIZE))
    with pytest.raises(ShardCorruptError, match="a member of -512 bytes"):
        list(ShardDataset(str(root), WebDataset(), config=IN_ORDER))


@pytest.mark.parametrize("fmt", ["mds", "wds"])
def test_a_shard_grown_after_open_is_refused_without_being_read_whole(tmp_path, fmt):
    """Reviewer of stop 60: a whole-shard read (MDS, WebDataset) asked for the whole object, so
    a shard replaced after open by a 1 GiB one (or a replica that lies about its size) was read
    into memory before its size was checked. It is read no further than one byte past the size
    the dataset opened with; a good replica then serves it."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    if fmt == "mds":
        write_mds(good, None)
        declared, made = MDS(), "MDS()"
    else:
        with WebDatasetWriter(good, max_count=100) as w:
            for i in range(10):
                w.write({"__key__": f"s{i}", "txt": f"sample {i}"})
        declared, made = WebDataset(manifest="manifest.txt"), 'WebDataset(manifest="manifest.txt")'
    shutil.copytree(good, bad)
    dataset = ShardDataset([str(bad), str(good)], declared, config=IN_ORDER)
    (unit,) = dataset.units
    setup = f"""
        import os
        from loaders import MDS, LoaderConfig, ShardDataset, WebDataset
        dataset = ShardDataset({str(bad)!r}, {made}, config=LoaderConfig(shuffle=False))
        """
    action = f"""
        os.truncate({str(bad / unit.key)!r}, {BOMB})  # sparse: 1 GiB, zeros past its bytes
        list(dataset)
        outcome = "READ"
        """
    growth, outcome = growth_in_child(setup, action, CHILD_TIMEOUT_S)
    assert growth < GROWTH_LIMIT, f"the read grew by {growth >> 20} MiB"
    assert outcome.startswith("ShardCorruptError"), outcome
    assert f"is more than {unit.nbytes} bytes, the size listed when the dataset opened" in outcome
    assert len(list(dataset)) == 10  # opened before: the good replica serves the shard


def test_an_mds_index_listing_no_shards_is_refused_at_open(tmp_path: Path) -> None:
    """Reviewer of stop 60: ``"shards": []`` opened as a dataset of no samples, where token
    files and WebDataset say no shards were found."""
    root = tmp_path / "ds"
    root.mkdir()
    write_index(root, {"version": 2, "shards": []})
    with pytest.raises(ShardNotFoundError, match="index.json lists no shards"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_a_small_mds_dataset_of_many_small_samples_opens_with_the_default_config(
    tmp_path: Path, caplog
) -> None:
    """Reviewer of stop 60: once samples' objects were counted, the default config refused a
    9 MiB dataset of one int column at open (a shuffle block of 8 shards "may take" 335 MB,
    more than window_bytes). It opens and reads, with one WARNING naming the figure."""
    root = tmp_path / "ds"
    with MDSWriter(root, columns={"n": "int32"}, size_limit=1 << 16) as w:
        for i in range(40_000):
            w.write({"n": i})
    config = LoaderConfig(window_bytes=1 << 20)  # 8 shards' objects do not fit
    with caplog.at_level("WARNING", logger="loaders.dataset"):
        dataset = ShardDataset(str(root), MDS(), config=config)
    assert any("may take" in r.getMessage() for r in caplog.records), caplog.records
    assert sorted(int(s["n"]) for s in dataset) == list(range(40_000))


def _tar_of(path: Path, members: list[tarfile.TarInfo]) -> None:
    with tarfile.open(path, "w") as tar:
        for info in members:
            tar.addfile(info, io.BytesIO(b"hello") if info.isfile() else None)


def _file(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 5
    return info


@pytest.mark.parametrize("name", ["../../etc/x.txt", "/etc/passwd.txt", "a/../../b.txt"])
def test_a_tar_member_named_outside_the_shard_is_corrupt(tmp_path: Path, name: str) -> None:
    """A reviewer: such members were handed out with ``__key__`` '../../etc/x', a path a user
    writing samples out by key would follow."""
    root = tmp_path / "ds"
    root.mkdir()
    _tar_of(root / "s.tar", [_file("a.txt"), _file(name)])
    with pytest.raises(ShardCorruptError, match=rf"member '{re.escape(name)}' at offset \d+ names"):
        list(ShardDataset(str(root), WebDataset(), config=IN_ORDER))
    with pytest.raises(ValueError, match="absolute or with '..'"):
        WebDatasetWriter(str(tmp_path / "out")).write({"__key__": name[:-4], "txt": "x"})


def test_link_members_of_a_tar_are_skipped_unfollowed_and_said_once(tmp_path: Path, caplog):
    root = tmp_path / "ds"
    root.mkdir()
    link = tarfile.TarInfo("b.txt")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    hard = tarfile.TarInfo("b.cls")
    hard.type, hard.linkname = tarfile.LNKTYPE, "a.txt"
    _tar_of(root / "s.tar", [_file("a.txt"), link, hard])
    with caplog.at_level(logging.WARNING, logger="loaders"):
        for _ in range(2):
            samples = list(ShardDataset(str(root), WebDataset(), config=IN_ORDER))
            assert [s["__key__"] for s in samples] == ["a"] and samples[0]["txt"] == b"hello"
    said = [r.getMessage() for r in caplog.records if "link member" in r.getMessage()]
    assert len(said) == 1 and "2 link member(s) skipped, never followed ('b.txt'" in said[0], said


def test_an_mds_index_naming_a_shard_twice_is_corrupt(tmp_path: Path) -> None:
    """A reviewer: its samples were read twice, under new ids."""
    root = tmp_path / "ds"
    index = write_mds(root, None)
    index["shards"].append(dict(index["shards"][0]))
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=r"\(shard 1\): names shard .* again \(shard 0"):
        ShardDataset(str(root), MDS(), config=IN_ORDER)


def test_unhashed_mds_shards_are_said_to_be_read_unverified_once(tmp_path: Path, caplog):
    """A reviewer: a byte flipped in an unhashed shard (upstream's writer's default) was read
    without a word; the docs said so only of WebDataset and token files."""
    hashed, bare = tmp_path / "hashed", tmp_path / "bare"
    write_mds(hashed, None)
    with MDSWriter(bare, columns={"n": "int"}, hashes=()) as w:
        w.write({"n": 1})
    with caplog.at_level(logging.INFO, logger="loaders"):
        for root in (hashed, bare, bare):
            ShardDataset(str(root), MDS(), config=IN_ORDER)
    said = [r for r in caplog.records if "read unverified" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert f"{bare}" in said[0].getMessage() and "lists no hashes" in said[0].getMessage()


@pytest.mark.parametrize("listing", ["tokens.00000.bin\ntokens.00000.bin\n", "# only a comment\n"])
def test_a_token_manifest_listing_a_shard_twice_or_none_is_a_loader_error(tmp_path, listing):
    """A fuzzer: both were a bare ValueError, which ``except LoaderError`` missed."""
    root = tmp_path / "ds"
    root.mkdir()
    np.arange(64, dtype=np.uint16).tofile(root / "tokens.00000.bin")
    (root / "files.txt").write_text(listing)
    with pytest.raises(ShardCorruptError, match="manifest files.txt lists"):
        ShardDataset(str(root), TokenFiles(manifest="files.txt", sample_tokens=8), config=IN_ORDER)


def _pax(kind: bytes, records: dict[str, object]) -> bytes:
    """A pax header block of ``kind`` (per member or global) holding ``records``, padded."""
    body = b""
    for key, value in records.items():
        line = f" {key}={value}\n".encode()
        n = len(line) + 1
        while len(str(n)) + len(line) != n:
            n += 1
        body += str(n).encode() + line
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = kind, len(body)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + body + bytes(-len(body) % tarfile.BLOCKSIZE)


def _member(name: str, data: bytes = b"") -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def _refused(tmp_path: Path, tar: bytes, match: str, **wds) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    (root / "s.tar").write_bytes(tar)
    bounded = ReplicaConfig(attempt_timeout_s=20, read_deadline_s=30)
    with pytest.raises(ShardCorruptError, match=match):
        list(ShardDataset(str(root), WebDataset(**wds), config=IN_ORDER, replica_config=bounded))


def test_a_negative_size_in_a_pax_record_is_refused_not_read_for_ever(tmp_path):
    """Adversary of stop 75: a pax ``size=-1536`` passed the check of the header's own size
    field and sent tarfile back to the pax header for ever, memory growing after the read
    timed out. The size a pax record gives is checked too."""
    tar = _member("a.txt", b"hello") + _pax(tarfile.XHDTYPE, {"size": -1536}) + _member("noext")
    _refused(tmp_path, tar + bytes(1024), "pax header says -1536 bytes")


def test_global_pax_headers_are_bounded_in_all(tmp_path):
    """Adversary of stop 75: 128 global pax headers under 8 KiB each (81k keys) made tarfile
    walk every key for every member: a 193 KiB shard parsed for about 1,000 s."""
    many = {f"g{i}": "x" for i in range(300)}  # about 2.7 KiB a header
    tar = b"".join(_pax(tarfile.XGLTYPE, many) for _ in range(4)) + _member("a.txt", b"hi")
    _refused(tmp_path, tar + bytes(1024), "global pax headers of .* bytes by offset")


def test_pax_headers_chained_deeper_than_a_writer_makes_are_one_line_corrupt(tmp_path):
    """Adversary of stop 75: 400 pax headers in a row raised RecursionError out of the tar
    parse, taken for a read failure: retried 6 times and the replica benched."""
    tar = _pax(tarfile.XHDTYPE, {"comment": "x"}) * 1200 + _member("a.txt")
    _refused(tmp_path, tar + bytes(1024), "extended headers chained deeper")


def test_a_sparse_member_is_refused_not_read_past_its_bytes(tmp_path):
    """Adversary of stop 75: a GNU sparse member (``tar -S``) was sliced at its expanded size,
    so its sample held the next member's header and bytes, silently."""
    info = tarfile.TarInfo("x.bin")
    info.size, info.type = 512, tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[386:410] = b"%011o\0" % 0 + b"%011o\0" % 512  # one chunk: 512 bytes at 0
    header[483:495] = b"%011o\0" % 2048  # its expanded size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    tar = bytes(header) + b"A" * 512 + _member("x.txt", b"hello")
    _refused(tmp_path, tar + bytes(1024), "x.bin.* is a sparse file")


def test_a_shard_listed_larger_than_max_shard_bytes_is_refused_unread(tmp_path):
    """Adversary of stop 75: a plain tar of 1.5 GiB (sparse on disk) was read whole at open,
    1,760 MiB of memory with max_shard_bytes=1 MiB, which bounded only decompression."""
    tar = _member("a.txt", b"x" * 20000) + bytes(1024)
    _refused(
        tmp_path,
        tar,
        "s.tar is 22016 bytes, more than WebDataset.max_shard_bytes",
        max_shard_bytes=8192,
    )


def test_an_mds_shard_stored_larger_than_max_shard_bytes_is_refused_at_open(tmp_path: Path):
    """Adversary of stop 75: ``zip_data.bytes`` was not bounded, so a compressed shard of
    1.5 GiB (sparse on disk, its index saying so) was read whole at open with
    max_shard_bytes=1 MiB."""
    root = tmp_path / "ds"
    write_mds(root, "zstd")
    index = json.loads((root / "index.json").read_text())
    zipped = index["shards"][0]["zip_data"]
    with open(root / zipped["basename"], "r+b") as shard:
        shard.truncate(1 << 26)  # 64 MiB, sparse: no disk taken
    zipped["bytes"] = 1 << 26
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match=r"67108864 bytes stored, more than MDS"):
        ShardDataset(str(root), MDS(max_shard_bytes=1 << 20, verify_hashes=False), config=IN_ORDER)


def test_a_manifest_of_blank_lines_opens_in_bounded_memory(tmp_path: Path) -> None:
    """Adversary of stop 75: 64 MiB of newlines took 5.5 GB (a list of empty lines, then
    tuples) and 18 s before it failed "lists no shards". Blank lines are never held."""
    root = tmp_path / "ds"
    root.mkdir()
    tar = _member("a.txt", b"hello") + bytes(1024)
    (root / "s.tar").write_bytes(tar)
    (root / "manifest.txt").write_bytes(b"\n" * (24 << 20) + b"s.tar\n")
    setup = "from loaders import LoaderConfig, ShardDataset, WebDataset"
    action = f"""
        dataset = ShardDataset({str(root)!r}, WebDataset(manifest="manifest.txt"),
                               config=LoaderConfig(shuffle=False))
        outcome = f"READ {{len(list(dataset))}}"
        """
    growth, outcome = growth_in_child(setup, action, CHILD_TIMEOUT_S)
    assert outcome == "READ 1", outcome
    assert growth < (24 << 20) + GROWTH_LIMIT, f"the open grew by {growth >> 20} MiB"


def test_a_manifest_of_more_lines_than_the_bound_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_LINES", 2)
    root = tmp_path / "ds"
    root.mkdir()
    (root / "manifest.txt").write_text("a.tar\n\nb.tar\nc.tar\n")
    with pytest.raises(ShardCorruptError, match="manifest.txt holds more than 2 lines"):
        ShardDataset(str(root), WebDataset(manifest="manifest.txt"), config=IN_ORDER)


def test_a_member_a_pax_gnu_sparse_record_resizes_is_refused(tmp_path):
    """The second adversary: ``GNU.sparse.realsize`` without a sparse map set the member's size
    while tarfile did not call it sparse, so its sample ran into the next member's bytes."""
    tar = _pax(tarfile.XHDTYPE, {"GNU.sparse.realsize": 600}) + _member("s1.cls", b"LABEL=cat\n")
    tar += _member("s1.txt", b"hello") + bytes(1024)
    _refused(tmp_path, tar, "s1.cls.* is a sparse file")


def write_json_column(root: Path, values: list[str]) -> None:
    """One shard of ``values``, each a JSON text, in one ``json`` column."""
    with MDSWriter(root, columns={"v": "str"}) as w:
        for v in values:
            w.write({"v": v})
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["column_encodings"] = ["json"]
    write_index(root, index)


NESTED = '{"":' * 200 + "0" + "}" * 200  # 1 KB of text, 37 KB of dicts decoded


def test_mds_json_values_are_measured_into_the_window_and_the_shard_bound(tmp_path, monkeypatch):
    """Dataset adversary of stop 75: JSON values decode to up to 37x their text (dicts nested
    in dicts), while the window and ``max_shard_bytes`` counted the text: 64 MiB of them held
    1.3 GB. The decoded values are measured: the window accounts them, the bound refuses them."""
    root = tmp_path / "ds"
    write_json_column(root, [NESTED] * 200)
    dataset = ShardDataset(str(root), MDS(), config=IN_ORDER)
    samples = list(dataset)
    assert [s["v"] for s in samples] == [json.loads(NESTED)] * 200
    decoded = sum(json_size(s["v"]) for s in samples)
    assert decoded > 30 * len(NESTED) * 200
    assert dataset.stats.max_resident_bytes >= decoded  # the window held what they take
    declared = dataset.units[0].mem_bytes  # their text: below what they take
    assert declared < decoded
    bound = MDS(max_shard_bytes=declared + decoded // 2)
    with pytest.raises(ShardTooLargeError, match=r"sample 1\d\d has a json value of 1001 bytes"):
        list(ShardDataset(str(root), bound, config=IN_ORDER))
    # measured after decoding too, were a text to take more than the worst case per byte
    monkeypatch.setattr(mds_reader, "JSON_WORST_BYTES_PER_BYTE", 1)
    with pytest.raises(ShardTooLargeError, match=r"json values decode to more than MDS\.max_shard"):
        list(ShardDataset(str(root), bound, config=IN_ORDER))


def test_a_shard_past_a_bound_of_the_dataset_blames_no_replica(tmp_path) -> None:
    """Loader adversary of stop 76: a shard whose json values decode past max_shard_bytes is
    the same on every replica, yet each was said to return corrupt data and benched, and the
    error said no replica holds bytes that verify."""
    write_json_column(tmp_path / "a", [NESTED] * 200)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    dataset = ShardDataset(
        [str(tmp_path / "a"), str(tmp_path / "b")], MDS(max_shard_bytes=1 << 20), config=IN_ORDER
    )
    with pytest.raises(ShardTooLargeError, match=r"past MDS\.max_shard_bytes \(1048576\)"):
        list(dataset)
    replicas = dataset.replicas.metrics()["replicas"].values()
    assert [(m["corrupt"], m["errors"], m["benched"]) for m in replicas] == [(0, 0, 0)] * 2


def test_a_json_value_that_may_decode_past_the_bound_is_not_decoded(tmp_path) -> None:
    root = tmp_path / "ds"
    write_json_column(root, ["[" + "{}," * 300_000 + "{}]"])
    setup = f"""
        from loaders import MDS, LoaderConfig, ShardDataset
        dataset = ShardDataset({str(root)!r}, MDS(max_shard_bytes=8 << 20),
                               config=LoaderConfig(shuffle=False))
        """
    action = """
        list(dataset)
        outcome = "READ"
        """
    growth, outcome = growth_in_child(setup, action, CHILD_TIMEOUT_S)
    assert outcome.startswith("ShardTooLargeError"), outcome
    assert "json value of 900004 bytes, which may decode to 48x that" in outcome, outcome
    assert growth < 16 << 20, f"the read grew by {growth >> 20} MiB"


def test_a_sparse_token_file_of_a_tebibyte_is_refused_at_open_not_cut_into_reads(tmp_path):
    """Dataset adversary of stop 75: a token file listed (or sparse on disk) at a huge size was
    cut into a Unit per read at open, about 256 bytes each: 1 PiB at 4 MiB reads is 68 GB of
    them. The reads are counted first."""
    root = tmp_path / "ds"
    root.mkdir()
    with open(root / "a.bin", "wb") as f:
        f.truncate(1 << 40)  # sparse: no block written
    setup = """
        from loaders import LoaderConfig, ShardDataset, TokenFiles
        """
    action = f"""
        tokens = TokenFiles(sample_tokens=1024, read_bytes=2048)
        ShardDataset({str(root)!r}, tokens, config=LoaderConfig())
        outcome = "OPENED"
        """
    growth, outcome = growth_in_child(setup, action, CHILD_TIMEOUT_S)
    assert outcome.startswith("ShardTooLargeError"), outcome
    assert "make 536870912 reads of TokenFiles.read_bytes=2048, more than 8388608" in outcome
    assert growth < GROWTH_LIMIT, f"the open grew by {growth >> 20} MiB"


@pytest.mark.parametrize(
    "value",
    [
        list(range(1000, 1512)),  # numbers: measured at C speed
        [1, 2, 3, 4, 5, 6, 7, 8, 9, [10, [11]], {"a": [], "b": {"c": "d"}}, "e" * 40],
        [[1, 2]] * 20,
        json.loads(NESTED),
        {"text": "é" * 50, "n": 1.5, "deep": [{"x": [None, True]}] * 12},
    ],
)
def test_json_size_counts_every_object_of_a_value(value) -> None:
    """The walk that skips numbers and strings in a long list still counts them (and each
    nested list or dict once)."""
    import sys

    def every(v):
        if isinstance(v, list):
            return sys.getsizeof(v) + sum(every(x) for x in v)
        if isinstance(v, dict):
            return sys.getsizeof(v) + sum(every(k) + every(x) for k, x in v.items())
        return sys.getsizeof(v)

    assert json_size(value) == every(value)


def test_an_unhashed_shard_past_the_json_bound_is_another_replicas_to_try(tmp_path) -> None:
    """Loader adversary of stop 76 (second round): in a dataset without hashes (upstream's
    default) a replica whose damage moved bytes between a sample's columns made its json value
    look too large: ShardTooLargeError, no failover, the damaged replica judged healthy. Its
    bytes unverified, the bound is corrupt data of that replica's."""
    root = tmp_path / "ds"
    with MDSWriter(root, columns={"v": "str"}, hashes=()) as w:
        for _ in range(200):
            w.write({"v": NESTED})
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["column_encodings"] = ["json"]
    write_index(root, index)
    with pytest.raises(ShardCorruptError, match="json value") as raised:
        list(ShardDataset(str(root), MDS(max_shard_bytes=1 << 20), config=IN_ORDER))
    assert not isinstance(raised.value, ShardTooLargeError)


def test_llmc_files_read_past_their_header_as_another_dtype_are_refused(tmp_path) -> None:
    """New user of stop 76: uint16 llm.c files read with dtype='uint32', header_bytes=1024
    (the docs' TokenWriter.HEADER_BYTES) gave every sample as pairs of tokens glued, silently."""
    from loaders import TokenWriter

    root = tmp_path / "ds"
    with TokenWriter(root, dtype="uint16", header="llmc") as w:
        w.write(np.arange(4096, dtype=np.uint16))
    tokens = TokenFiles(dtype="uint32", sample_tokens=256, header_bytes=1024)
    with pytest.raises(UnknownFormatError, match=r"llm.c header of 4096 uint16 tokens, read as"):
        ShardDataset(str(root), tokens, config=IN_ORDER)
    right = TokenFiles(dtype="uint16", sample_tokens=256, header_bytes=1024)
    assert len(list(ShardDataset(str(root), right, config=IN_ORDER))) == 16


@pytest.mark.parametrize("name", ["shard-2024-05-01T12:00.bin", "back\\slash.bin"])
def test_a_listed_shard_with_an_odd_name_inside_the_root_is_read(tmp_path: Path, name: str):
    """Adversary of stop 78: the listing check that refuses keys out of the dataset took the
    declared-key rule, which refuses a ``:`` or a backslash too: such a dataset no longer
    opened (its replica benched as unsafe). Only a key that leads out is refused."""
    root = tmp_path / "ds"
    root.mkdir()
    np.arange(64, dtype=np.uint16).tofile(root / "a.bin")
    np.arange(64, 128, dtype=np.uint16).tofile(root / name)
    fmt = TokenFiles(files=None, dtype="uint16", sample_tokens=4)
    samples = list(ShardDataset(str(root), fmt, config=LoaderConfig(shuffle=False)))
    assert len(samples) == 32
