"""Keys stay inside the store: a manifest or rank index that names an object outside it (a
``../`` key, another step's index, a digest that is not one) is refused when it is decoded,
before any I/O, and `verify` calls it corrupt. Crafted from real saves (tests/helpers/crafted.py)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from ckptstore import (
    CheckpointCorruptError,
    Checkpointer,
    EncodingOptions,
    Store,
    UnsupportedStateError,
)
from ckptstore.catalog import legacy_markers, load_manifest, load_rank_index
from ckptstore.cli import main
from ckptstore.errors import StorageTimeoutError
from ckptstore.retention import collect
from tests.helpers.child import run_script
from tests.helpers.crafted import manifest_doc, put_manifest, put_rank_index, rank_index_doc

N = 4096  # float32 elements: 4 chunks of 4096 bytes
CHILD_TIMEOUT_S = 60


def save_step(uri: str, step: int = 1) -> None:
    with Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=4096, compression="zstd")) as ckpt:
        ckpt.save(step, {"w": torch.arange(N, dtype=torch.float32)}).wait()


def load(uri: str) -> None:
    Checkpointer(uri).load({"w": torch.zeros(N)})


def verify_exit_code(uri: str, capsys) -> tuple[int, str]:
    code = main(["verify", uri])
    out, err = capsys.readouterr()
    return code, out + err


def load_in_child(uri: str) -> str:
    """Restore ``uri`` in a child process (bounded memory and time: old code read /dev/zero
    until MemoryError or a FIFO until the deadline); its one line of outcome."""
    script = f"""
        import resource, torch
        resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))
        from ckptstore import Checkpointer
        try:
            Checkpointer({uri!r}).load({{"w": torch.zeros({N})}})
            print("LOADED")
        except Exception as exc:
            print(type(exc).__name__, str(exc).replace("\\n", " "))
        """
    return run_script(script, CHILD_TIMEOUT_S)[-1]


def rename_chunk(doc: dict, new: str) -> None:
    """Rename the first chunk of a rank index document to ``new``, in its segments too."""
    old = next(iter(doc["chunks"]))
    doc["chunks"] = {(new if h == old else h): v for h, v in doc["chunks"].items()}
    for tensor in doc["tensors"]:
        tensor["segments"] = [[new if s[0] == old else s[0], *s[1:]] for s in tensor["segments"]]


@pytest.fixture
def store_uri(tmp_path: Path) -> str:
    uri = str(tmp_path / "store")
    save_step(uri)
    return uri


def test_rank_index_key_outside_the_store_is_refused(store_uri: str, tmp_path: Path, capsys):
    store = Store(store_uri)
    doc = manifest_doc(store, 1)
    real = doc["ranks"][0]["key"]
    outside = tmp_path / "elsewhere" / "rank-00000.json"
    outside.parent.mkdir()
    outside.write_bytes(store.get(real))  # a valid index, but not the store's
    doc["ranks"][0]["key"] = "steps/../../elsewhere/rank-00000.json"
    put_manifest(store, 1, doc)

    with pytest.raises(CheckpointCorruptError, match="rank index key") as caught:
        load(store_uri)
    assert "commits/00000000000000000001.json" in str(caught.value)
    code, text = verify_exit_code(store_uri, capsys)
    assert code != 0 and "rank index key" in text


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d.update(attempt="../../x"), id="attempt-with-dots"),
        pytest.param(lambda d: d.update(attempt="a/b"), id="attempt-with-slash"),
        pytest.param(lambda d: d["ranks"].append(dict(d["ranks"][0])), id="rank-listed-twice"),
        pytest.param(
            lambda d: d["ranks"][0].update(key=d["ranks"][0]["key"].replace("00001/", "00002/")),
            id="another-steps-index",
        ),
        pytest.param(lambda d: d["ranks"][0].update(key="/etc/passwd"), id="absolute-key"),
        pytest.param(lambda d: d["ranks"][0].update(nbytes=2**62), id="an-index-of-2-62-bytes"),
        pytest.param(
            lambda d: d["ranks"][0].update(key="s3://other-bucket/rank-00000.json"),
            id="scheme",
        ),
        pytest.param(
            lambda d: (
                d.update(dcp_metadata={"key": "../dcp.metadata", "nbytes": 1, "xxh3": "0"})
                or d.update(kind="dcp")
            ),
            id="dcp-metadata-outside",
        ),
    ],
)
def test_a_manifest_naming_objects_not_its_own_does_not_decode(store_uri: str, change) -> None:
    store = Store(store_uri)
    doc = manifest_doc(store, 1)
    change(doc)
    put_manifest(store, 1, doc)
    with pytest.raises(CheckpointCorruptError, match="commits/00000000000000000001.json"):
        load_manifest(store, 1)


def test_verify_fails_a_step_whose_manifest_lists_fewer_ranks_than_saved_it(store_uri, capsys):
    """A Checkpointer step saved by 2 ranks whose manifest lists one index: verify said "OK"
    (1/2 ranks) and restore then failed; every command now names it corrupt."""
    store = Store(store_uri)
    doc = manifest_doc(store, 1)
    doc["world_size"] = 2
    put_manifest(store, 1, doc)
    code, text = verify_exit_code(store_uri, capsys)
    assert code == 1 and "lists 1 rank index(es) for a step saved by 2 ranks" in text
    with pytest.raises(CheckpointCorruptError, match="saved by 2 ranks"):
        load(store_uri)


def test_chunk_digest_pointing_at_dev_zero_is_refused_before_any_read(store_uri: str) -> None:
    store = Store(store_uri)
    doc = rank_index_doc(store, 1)
    climb = "../" * 40 + "dev/zero"  # chunks/../<digest>: out of the store, up to /dev/zero
    rename_chunk(doc, climb)
    put_rank_index(store, 1, 0, doc)

    outcome = load_in_child(store_uri)
    assert outcome.startswith("CheckpointCorruptError"), outcome
    assert "not 32 lowercase hex digits" in outcome and "rank-00000.json" in outcome


def test_chunk_digest_pointing_at_a_fifo_does_not_hang(store_uri: str, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    store = Store(store_uri)
    doc = rank_index_doc(store, 1)
    rename_chunk(doc, "../fifo")  # chunks/../../fifo: next to the store
    put_rank_index(store, 1, 0, doc)

    outcome = load_in_child(store_uri)
    assert outcome.startswith("CheckpointCorruptError") and "../fifo" in outcome, outcome


@pytest.mark.parametrize(
    "digest",
    ["A" * 32, "0" * 31, "0" * 33, "g" * 32, "00/" + "0" * 29],
    ids=["upper", "short", "long", "not-hex", "slash"],
)
def test_malformed_chunk_digests_are_corrupt(store_uri: str, digest: str, capsys) -> None:
    store = Store(store_uri)
    doc = rank_index_doc(store, 1)
    rename_chunk(doc, digest)
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(CheckpointCorruptError, match="lowercase hex"):
        load(store_uri)
    code, text = verify_exit_code(store_uri, capsys)
    assert code != 0 and "lowercase hex" in text


def test_keys_outside_the_prefix_are_refused_on_s3(s3_uri: str) -> None:
    save_step(s3_uri)
    store = Store(s3_uri)
    doc = rank_index_doc(store, 1)
    rename_chunk(doc, "../../other/" + next(iter(doc["chunks"])))  # another prefix
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(CheckpointCorruptError, match="lowercase hex"):
        load(s3_uri)

    doc = manifest_doc(store, 1)
    doc["ranks"][0]["key"] = "../" + doc["ranks"][0]["key"]
    put_manifest(store, 1, doc)
    with pytest.raises(CheckpointCorruptError, match="rank index key"):
        load(s3_uri)


def test_the_store_refuses_a_key_that_leaves_its_root(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"not yours")
    store = Store(str(tmp_path / "store"))
    for key in ("../secret", "chunks/../../secret", "/etc/hostname"):
        with pytest.raises(CheckpointCorruptError, match="outside the store"):
            store.get(key)


def test_an_object_longer_than_its_manifest_says_is_read_no_further(tmp_path):
    """A rank index padded to 64 MiB behind the manifest's back: the reader reads the declared
    size and one byte more, and refuses it; a manifest over 64 MiB is refused the same way."""
    from ckptstore.format import MAX_MANIFEST_BYTES

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait()
    store = Store(tmp_path)
    ref = load_manifest(store, 1).ranks[0]
    path = tmp_path / ref.key
    padded = path.read_bytes() + b" " * (64 << 20)
    os.chmod(path, 0o644)
    path.write_bytes(padded)
    before = store.counters.snapshot()["bytes"].get("get", 0)
    with pytest.raises(CheckpointCorruptError, match="size or xxh3 does not match"):
        load_rank_index(store, load_manifest(store, 1), 0)
    assert store.counters.snapshot()["bytes"].get("get", 0) - before < ref.nbytes + 4096
    manifest = tmp_path / "commits" / f"{1:020d}.json"
    os.chmod(manifest, 0o644)
    manifest.write_bytes(manifest.read_bytes() + b" " * MAX_MANIFEST_BYTES)
    with pytest.raises(CheckpointCorruptError, match="larger than any manifest"):
        load_manifest(store, 1)


def test_an_index_tree_nested_beyond_the_bound_is_corrupt_not_a_recursion_error(store_uri):
    """A hostile index whose tree nests 600 deep: refused by the decoder as corrupt (so
    fallback=True skips it), before a walk recurses; a save nesting deeper than a state may
    is refused with one line, not a RecursionError."""
    store = Store(store_uri)
    doc = rank_index_doc(store, 1)
    tree = doc["tree"]
    for _ in range(600):
        tree = {"k": tree}
    doc["tree"] = tree
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(CheckpointCorruptError, match="nested deeper than 256 nodes"):
        load(store_uri)
    state: dict = {"w": torch.zeros(1)}
    for _ in range(400):
        state = {"k": state}
    with Checkpointer(store_uri) as ckpt:
        with pytest.raises(UnsupportedStateError, match="nested deeper than 64 levels"):
            ckpt.save(2, state)


@pytest.mark.parametrize("name", ["99", "123456789012345678901234", "²" * 20])
def test_a_commit_under_a_name_no_save_writes_is_not_a_step(tmp_path: Path, name: str, capsys):
    """A reviewer's: commits/99.json (a manifest copied there) was listed as the latest step,
    which every read then called "not committed" (ls exit 1, inspect and restore of latest
    failed; load() without fallback too), and gc left it."""
    uri = str(tmp_path / "s")
    save_step(uri, 1)
    commits = tmp_path / "s" / "commits"
    (commits / f"{name}.json").write_bytes((commits / f"{1:020d}.json").read_bytes())
    assert Checkpointer(uri).latest() == 1
    load(uri)
    assert main(["ls", uri]) == 0
    assert main(["restore", uri, "--to", str(tmp_path / "out.pt")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("dress", ["items-beside-the-tree", "items-for-the-tree"])
def test_a_state_index_dressed_as_a_dcp_index_is_corrupt(store_uri: str, dress: str, capsys):
    """A state step's index given DCP ``items`` skipped the tree's checks (a tree naming tensor
    7 of 1 raised IndexError, a deep one RecursionError, and `verify` said OK); one whose tree
    was taken away as well loaded nothing into the state and returned the step."""
    store = Store(store_uri)
    doc = rank_index_doc(store, 1)
    doc["items"] = {}
    if dress == "items-beside-the-tree":
        doc["tree"] = {"w": {"$t": 7}}
    else:
        doc.pop("tree")
    put_rank_index(store, 1, 0, doc)
    state = {"w": torch.zeros(N)}
    with pytest.raises(CheckpointCorruptError, match="rank-00000.json: .*DCP items"):
        Checkpointer(store_uri).load(state)
    assert not state["w"].any()
    code, text = verify_exit_code(store_uri, capsys)
    assert code == 1 and "DCP items" in text, text


BIG = int("1" + "0" * 400)  # a JSON int no float holds


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda d: d.update(created_at=BIG), id="created-400-digits"),
        pytest.param(lambda d: d.update(created_at=1e308), id="created-past-year-9999"),
        pytest.param(lambda d: d.update(raw_bytes=1e300), id="raw-bytes-a-float"),
        pytest.param(lambda d: d.update(stored_bytes=-7), id="stored-bytes-negative"),
        pytest.param(lambda d: d["health"].update(sumsq=BIG), id="health-400-digits"),
        pytest.param(None, id="raw-bytes-1e400"),
    ],
)
def test_numbers_out_of_range_in_a_manifest_are_corrupt(store_uri: str, edit, capsys) -> None:
    """A 400-digit created_at raised OverflowError out of load(fallback=True) and the CLI, 1e400
    (JSON's inf) a ValueError before the checksum was compared, a time past the year 9999
    broke `ls`; sizes were not checked. Each is a corrupt manifest a fallback skips."""
    from tests.helpers.crafted import sealed

    with Checkpointer(store_uri) as ckpt:
        ckpt.save(2, {"w": torch.ones(N)}).wait()
    store = Store(store_uri)
    doc = manifest_doc(store, 2)
    if edit is None:
        data = sealed(doc).replace(b'"raw_bytes":', b'"raw_bytes":1e400,"was":', 1)
        os.chmod(os.path.join(store_uri, "commits", f"{2:020d}.json"), 0o644)
        Path(store_uri, "commits", f"{2:020d}.json").write_bytes(data)
    else:
        edit(doc)
        put_manifest(store, 2, doc)
    with pytest.raises(CheckpointCorruptError, match="commits/00000000000000000002.json"):
        Checkpointer(store_uri).load({"w": torch.zeros(N)}, 2)
    assert main(["ls", store_uri]) == 1  # lists step 1, names step 2 as unreadable
    out, err = capsys.readouterr()
    assert "unexpected" not in out + err and re.search(r"\n +1 +state", out), out + err
    target = {"w": torch.zeros(N)}
    assert Checkpointer(store_uri).load(target, fallback=True) == 1
    assert torch.equal(target["w"], torch.arange(N, dtype=torch.float32))


def test_a_lease_or_marker_with_a_number_no_float_holds_does_not_stop_saves(
    store_uri: str, capsys
) -> None:
    """A lease whose ttl_s, or a legacy pending/ marker whose created_at, is a 400-digit int
    raised OverflowError out of every save's retention, gc and ls (and out of a fallback load
    after it had loaded the older step); each now counts as unreadable."""
    root = Path(store_uri)
    lease = root / "leases" / "save" / "someone" / f"{1:012d}.json"
    lease.parent.mkdir(parents=True)
    lease.write_text(f'{{"kind": "save", "ttl_s": {BIG}}}')
    marker = root / "pending" / "00000000000000000009-abc-0.json"
    marker.parent.mkdir()
    marker.write_text(f'{{"created_at": {BIG}}}')
    with Checkpointer(store_uri, keep_last=1) as ckpt:
        ckpt.save(2, {"w": torch.ones(N)}).wait(timeout_s=60)
    assert main(["ls", store_uri]) == 0, capsys.readouterr()
    assert "unexpected" not in "".join(capsys.readouterr())


@pytest.mark.parametrize("hostile", ["nested", "large"])
def test_a_hostile_legacy_marker_is_read_bounded_and_stops_nothing(
    store_uri: str, capsys, monkeypatch, hostile: str
) -> None:
    """Hostile-checkpoint adversary: a pending/ marker was read whole (a sparse 2 GiB one took
    4.7 GB of memory in ``ls``), and one nested 100,000 deep raised RecursionError out of
    ``ls`` and every ``gc``. A marker is read to 64 KiB at most and one that does not decode
    counts as unreadable (stale), as a lease does."""
    marker = Path(store_uri) / "pending" / "00000000000000000009-abc-00000.json"
    marker.parent.mkdir()
    if hostile == "nested":
        marker.write_text("[" * 100_000)
    else:
        with open(marker, "wb") as f:  # sparse: 1 GiB that takes no disk
            f.truncate(2**30)
    read: list[tuple[int | None, int | None]] = []  # the byte ranges of marker reads
    get = Store.get

    def bounded(self, key, start=None, end=None, **kwargs):
        if key.startswith("pending/"):
            read.append((start, end))
        return get(self, key, start, end, **kwargs)

    monkeypatch.setattr(Store, "get", bounded)
    with Checkpointer(store_uri, keep_last=1) as ckpt:
        ckpt.save(2, {"w": torch.ones(N)}).wait(timeout_s=60)
    for argv in (["ls", store_uri], ["gc", store_uri, "--dry-run"], ["gc", store_uri]):
        assert main(argv) == 0, capsys.readouterr()
        assert "unexpected" not in "".join(capsys.readouterr())
    assert read and all(end is not None and end <= 64 * 1024 + 1 for _, end in read), read


def test_gc_dry_run_leaves_a_stale_legacy_marker_in_place(store_uri: str, capsys) -> None:
    """Hostile-checkpoint adversary: ``gc --dry-run`` deleted stale pending/ markers while it
    said it would delete nothing; only ``gc`` itself deletes them."""
    marker = Path(store_uri) / "pending" / "00000000000000000009-abc-00000.json"
    marker.parent.mkdir()
    marker.write_text('{"created_at": 1000.0}')  # 1970: stale
    assert main(["gc", store_uri, "--dry-run"]) == 0, capsys.readouterr()
    assert marker.exists()
    assert main(["gc", store_uri]) == 0, capsys.readouterr()
    assert not marker.exists()


def test_a_legacy_marker_that_cannot_be_read_now_blocks_gc(store_uri: str, monkeypatch) -> None:
    """A young legacy marker whose read failed for a passing reason (a timeout) counted as
    stale, so gc deleted it and swept under its save. Such a marker is aged by its modification
    time, as an unreadable lease is (adversary of stop 78: one a year old blocked every gc for
    ever); one that is no plain file, or a link to nothing, is garbage."""
    pending = Path(store_uri) / "pending"
    pending.mkdir()
    young, old = pending / "00000000000000000009-abc-00000.json", pending / "07-old-00000.json"
    for marker in (young, old):
        marker.write_text(json.dumps({"created_at": time.time()}))
    year_ago = time.time() - 365 * 86400
    os.utime(old, (year_ago, year_ago))
    os.mkfifo(pending / "00000000000000000008-fifo-00000.json")
    (pending / "06-dangling-00000.json").symlink_to(pending / "nothing")
    get = Store.get

    def times_out(self, key, *args, **kwargs):
        if key in ("pending/" + young.name, "pending/" + old.name):
            raise StorageTimeoutError(f"{key}: read timed out")
        return get(self, key, *args, **kwargs)

    monkeypatch.setattr(Store, "get", times_out)
    stale = {m.key: m.stale for m in legacy_markers(Store(store_uri))}
    assert stale == {
        "pending/" + young.name: False,
        "pending/" + old.name: True,
        "pending/00000000000000000008-fifo-00000.json": True,
        "pending/06-dangling-00000.json": True,
    }
    report = collect(Store(store_uri), keep_last=None)
    assert report.blocked_by == ["pending/" + young.name]
    assert sorted(os.listdir(pending)) == [young.name]


def test_a_shape_of_thousands_of_dims_is_named_in_one_short_line(store_uri: str, capsys) -> None:
    """Hostile-checkpoint adversary: a rank index whose tensor had 5,001 dims (byte count
    unchanged) was refused, but the one-line message listed every dim. It is named by its first
    and last dims and its count, in the load's error and in ``verify``'s."""
    store = Store(store_uri)
    doc = rank_index_doc(store, 1)
    doc["tensors"][0]["shape"] = [1] * 5000 + [N]
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(UnsupportedStateError) as raised:
        load(store_uri)
    message = str(raised.value)
    assert "(1, 1, 1, 1, ..., 1, 1, 1, 4096) [5001 dims]" in message, message
    assert len(message) < 200 and "\n" not in message, message
    code, out = verify_exit_code(store_uri, capsys)
    assert max(map(len, out.splitlines())) < 300, out
