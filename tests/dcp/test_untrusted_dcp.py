"""Issue 21, item 1: nothing is unpickled on a DCP load path.

Stores are real DCP saves whose metadata object is then rewritten (tests/helpers/crafted.py recomputes
the manifest's size and xxh3 of it): as a hostile pickle, as the pickle older ckptstore wrote, or
as damaged JSON. A hostile pickle opens a marker file when unpickled, so "nothing ran" is the
marker's absence."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ckptstore import StorageOptions
from ckptstore.catalog import load_manifest, read_object
from ckptstore.cli import main
from ckptstore.dcp import StoreReader, StoreWriter, load_full_state_dict
from ckptstore.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    PickledValueRefusedError,
    UnsupportedStateError,
)
from ckptstore.export import export_safetensors
from ckptstore.store import Store
from tests.helpers.crafted import replace_referenced, sealed

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


class _OpensMarker:
    """Unpickling this opens (creates) ``path``: the stand-in for running an attacker's code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(8, 4, generator=g),
            "b": torch.randn(4, generator=g).to(torch.bfloat16),
        },
        "step": 7,
    }


def _blank() -> dict:
    return {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": 0}


def _save(uri: str, state: dict | None = None) -> Store:
    dcp.save(state or _state(), storage_writer=StoreWriter(uri), no_dist=True)
    return Store(uri)


def _metadata_key(store: Store) -> str:
    return load_manifest(store, 0).dcp_metadata.key


def _old_writer_blob(store: Store) -> bytes:
    """The metadata of step 0 pickled as ckptstore's writer did before the JSON encoding."""
    metadata = StoreReader(store.uri, step=0, storage=StorageOptions(store=store)).read_metadata()
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def _hostile_blob(store: Store, marker: Path) -> bytes:
    """A real step's Metadata, pickled with a value whose unpickling opens ``marker``."""
    metadata = StoreReader(store.uri, step=0, storage=StorageOptions(store=store)).read_metadata()
    metadata.planner_data = _OpensMarker(marker)
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def _assert_same(got: dict, want: dict) -> None:
    for name in ("w", "b"):
        assert got["model"][name].dtype == want["model"][name].dtype
        assert torch.equal(got["model"][name], want["model"][name]), name
    assert got["step"] == want["step"]


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


# -- new steps store plain JSON ------------------------------------------------------------------


def test_a_new_step_stores_its_metadata_as_json_that_round_trips(tmp_path):
    store = _save(str(tmp_path / "s"))
    manifest = load_manifest(store, 0)
    doc = json.loads(read_object(store, manifest.dcp_metadata, "DCP metadata"))
    assert doc["type"] == "dcp_metadata"
    assert doc["state_dict_metadata"]["model.w"] == {
        "type": "tensor",
        "dtype": "float32",
        "size": [8, 4],
        "chunks": [[[0, 0], [8, 4]]],
    }
    assert doc["state_dict_metadata"]["step"] == {"type": "bytes"}
    assert doc["planner_data"]["model.w"] == {"$tuple": ["model", "w"]}
    target = _blank()
    dcp.load(target, storage_reader=StoreReader(store.uri), no_dist=True)
    _assert_same(target, _state())


# -- old steps (pickled metadata) still load, through the allowlist ---------------------------


def test_a_step_with_metadata_pickled_by_the_old_writer_still_loads(tmp_path):
    store = _save(str(tmp_path / "s"))
    replace_referenced(store, 0, _metadata_key(store), _old_writer_blob(store))
    _assert_same(load_full_state_dict(store, 0), _state())
    target = _blank()
    dcp.load(target, storage_reader=StoreReader(store.uri), no_dist=True)
    _assert_same(target, _state())
    result = export_safetensors(store.uri, tmp_path / "hf")
    assert result.as_dict()["tensors"] == 2


def _pickled_metadata(tensors: int, chunks: list) -> bytes:
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    shared = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([8, 4]), chunks
    )
    items = {f"t{i}": shared for i in range(tensors)}
    return pickle.dumps(Metadata(state_dict_metadata=items, storage_data={}), protocol=2)


def test_old_pickled_metadata_naming_shared_objects_many_times_is_refused_unexpanded():
    """A pickle stores a shared list once: 2,000 tensors sharing one list of 2,000 chunks are
    a blob of 36 KB that would expand to four million chunk entries when walked."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from ckptstore.metadata import decode_metadata

    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 1]))
    blob = _pickled_metadata(2000, [chunk] * 2000)
    assert len(blob) < 64 * 1024
    with pytest.raises(CheckpointCorruptError, match="more values than its"):
        decode_metadata(blob, "crafted")
    # the same shape without sharing: 100 tensors of 32 chunks each, every object its own
    honest = pickle.loads(_pickled_metadata(1, []))
    blank = honest.state_dict_metadata["t0"]
    for i in range(100):
        meta = copy.deepcopy(blank)
        meta.chunks.extend(
            ChunkStorageMetadata(torch.Size([r, c]), torch.Size([1, 1]))
            for r in range(8)
            for c in range(4)
        )
        honest.state_dict_metadata[f"t{i}"] = meta
    decoded = decode_metadata(pickle.dumps(honest, protocol=2), "honest")
    assert len(decoded.state_dict_metadata) == 100
    assert all(len(m.chunks) == 32 for m in decoded.state_dict_metadata.values())


# -- a hostile pickle is refused, with nothing run, on every load path -------------------------


def _restore(fmt: str):
    return lambda uri, out, capsys: _cli(capsys, "restore", uri, "--to", out, "--format", fmt)


def _dcp_load(uri, out, capsys):
    dcp.load(_blank(), storage_reader=StoreReader(uri), no_dist=True)


def _verify(uri, out, capsys):
    code = main(["verify", uri, "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [p["what"] for p in problems] == ["dcp-metadata"], problems
    return code, problems[0]["object"] + ": " + problems[0]["error"]


def _export(uri, out, capsys):
    export_safetensors(uri, out)


def _load_full(uri, out, capsys):
    load_full_state_dict(uri, 0)  # a URI, as export_safetensors takes


REFUSING_PATHS = {
    "restore-torch": _restore("torch"),
    "restore-dcp": _restore("dcp"),
    "restore-safetensors": _restore("safetensors"),
    "verify": _verify,
    "dcp.load": _dcp_load,
    "export": _export,
    "load_full_state_dict": _load_full,
}


@pytest.mark.parametrize("path", sorted(REFUSING_PATHS))
def test_hostile_pickled_metadata_is_refused_and_runs_nothing(tmp_path, capsys, path):
    store = _save(str(tmp_path / "s"))
    key = _metadata_key(store)
    marker = tmp_path / "ran"
    replace_referenced(store, 0, key, _hostile_blob(store, marker))
    try:
        outcome = REFUSING_PATHS[path](store.uri, tmp_path / "out", capsys)
    except CheckpointException as exc:  # dcp.load wraps the reader's error
        outcome = str(exc)
    except CheckpointCorruptError as exc:
        outcome = str(exc)
    assert not marker.exists(), f"{path} ran code from the store"
    if isinstance(outcome, tuple):  # a CLI command: its exit status and stderr
        code, outcome = outcome
        assert code == 1, outcome
    assert key in outcome and "io.open is not a DCP metadata class" in outcome, outcome


def test_inspect_of_a_hostile_step_runs_nothing(tmp_path, capsys):
    store = _save(str(tmp_path / "s"))
    marker = tmp_path / "ran"
    replace_referenced(store, 0, _metadata_key(store), _hostile_blob(store, marker))
    code, err = _cli(capsys, "inspect", store.uri)
    assert code == 0, err
    assert not marker.exists()


def test_hostile_pickled_metadata_on_s3_is_refused_and_runs_nothing(s3_uri, tmp_path, capsys):
    store = _save(s3_uri)
    key = _metadata_key(store)
    marker = tmp_path / "ran"
    replace_referenced(store, 0, key, _hostile_blob(store, marker))
    with pytest.raises(CheckpointCorruptError, match="io.open is not a DCP metadata class"):
        load_full_state_dict(store, 0)
    code, err = _cli(capsys, "restore", s3_uri, "--to", tmp_path / "out.pt")
    assert code == 1 and key in err, err
    assert not marker.exists()


# -- values DCP pickled (BYTE_IO items) are loaded weights-only --------------------------------


def _save_hostile_value(uri: str, marker: Path) -> Store:
    """A real DCP save whose state holds a value that opens ``marker`` when unpickled."""
    return _save(uri, {**_state(), "evil": _OpensMarker(marker)})


def test_a_pickled_value_that_needs_code_is_refused_on_ckptstores_load_paths(tmp_path, capsys):
    marker = tmp_path / "ran"
    store = _save_hostile_value(str(tmp_path / "s"), marker)
    with pytest.raises(PickledValueRefusedError, match=r"'evil'.*refused.*io\.open"):
        load_full_state_dict(store, 0)
    for fmt, out in (("torch", "out.pt"), ("dcp", "out-dcp")):
        code, err = _cli(capsys, "restore", store.uri, "--to", tmp_path / out, "--format", fmt)
        assert code == 1 and "'evil'" in err and _REFUSED in err, err
    # verify finds what restore refuses, and runs nothing either
    assert main(["verify", store.uri]) == 1
    out, _ = capsys.readouterr()
    assert "'evil'" in out and _REFUSED in out and "corrupt" not in out.lower(), out
    assert not marker.exists()


_REFUSED = (
    "refused (pickled; allow its classes alone with torch.serialization.add_safe_globals([...]), "
    "or everything with StoreReader(trust_pickled_objects=True)"
)


def test_a_bytesio_value_is_refused_by_name_never_called_corrupt(tmp_path, capsys):
    """Older torchtitan and torchtune keep their train state as a ``BytesIO``, which DCP
    pickles: a safe load refuses it as pickled (an opt-in loads it), verify and restore say so,
    and none of them calls the intact value corrupt."""
    import io

    raw = io.BytesIO()
    torch.save({"step": 3, "lr": [0.1]}, raw)
    store = _save(str(tmp_path / "s"), {**_state(), "train_state": raw})
    target = {**_blank(), "train_state": io.BytesIO()}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=StoreReader(store.uri), no_dist=True)
    text = str(caught.value)
    assert "'train_state'" in text and _REFUSED in text and "Corrupt" not in text, text
    with pytest.raises(PickledValueRefusedError, match="'train_state'") as direct:
        load_full_state_dict(store, 0)
    assert not isinstance(direct.value, CheckpointCorruptError)
    code, err = _cli(capsys, "restore", store.uri, "--to", tmp_path / "out.pt")
    assert code == 1 and "'train_state'" in err and _REFUSED in err, err
    assert "corrupt" not in err.lower(), err
    assert main(["verify", store.uri]) == 1
    out, err = capsys.readouterr()
    assert "'train_state'" in out and "REFUSED" in out and "stored bytes intact" in out, out
    assert "corrupt" not in (out + err).lower(), out + err
    # The opt-in loads it back as saved.
    dcp.load(
        target, storage_reader=StoreReader(store.uri, trust_pickled_objects=True), no_dist=True
    )
    assert target["train_state"].getvalue() == raw.getvalue()
    _assert_same(target, _state())


def test_dcp_load_refuses_a_pickled_value_that_needs_code_unless_trusted(tmp_path):
    marker = tmp_path / "ran"
    store = _save_hostile_value(str(tmp_path / "s"), marker)
    target = {**_blank(), "evil": None}
    with pytest.raises(
        CheckpointException, match=r"'evil'.*refused \(pickled; allow its classes alone"
    ):
        dcp.load(target, storage_reader=StoreReader(store.uri), no_dist=True)
    assert not marker.exists()
    # The user's explicit opt-in hands the value to DCP's planner, which unpickles it.
    reader = StoreReader(store.uri, trust_pickled_objects=True)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert marker.exists()
    _assert_same(target, _state())


def test_plain_pickled_values_load_weights_only(tmp_path):
    state = {**_state(), "extra": {"lrs": [0.1, 0.01], "name": "run", "t": torch.arange(3)}}
    store = _save(str(tmp_path / "s"), state)
    got = load_full_state_dict(store, 0)
    assert got["extra"]["lrs"] == [0.1, 0.01] and got["extra"]["name"] == "run"
    assert torch.equal(got["extra"]["t"], torch.arange(3))


def test_a_value_a_load_will_refuse_is_named_at_its_first_save(tmp_path, caplog):
    """Exact-resume reviewer of stop 84: ``dcp.save`` of a numpy scalar (or an IntEnum, a
    namedtuple) committed, and every later ``dcp.load`` through ``StoreReader`` refused it: the
    job learnt at the restart that it could not resume. Its first save says so, once."""
    import numpy as np

    from ckptstore.dcp import items

    items._CHECKED.discard("ema")
    items._CHECKED.discard("lrs")
    state = {**_state(), "ema": np.float32(0.5), "lrs": [0.1, 0.01]}
    with caplog.at_level("WARNING", logger="ckptstore.dcp.items"):
        for step in (1, 2):
            dcp.save(
                state, storage_writer=StoreWriter(str(tmp_path / "s"), step=step), no_dist=True
            )
    said = [r.getMessage() for r in caplog.records if r.name == "ckptstore.dcp.items"]
    assert len(said) == 1, said  # once, and not for the plain list
    assert re.search(r"StoreReader refuses it at load.*DCP item 'ema': refused", said[0])
    with pytest.raises(CheckpointException, match=r"'ema'.*refused"):
        dcp.load(
            {**_blank(), "ema": None, "lrs": None},
            storage_reader=StoreReader(str(tmp_path / "s")),
            no_dist=True,
        )


def _deflated_torch_save(value) -> bytes:
    """``torch.save(value)`` with every record deflated: torch's reader inflates such records,
    which ``torch.save`` never writes (a hostile writer's decompression bomb)."""
    import io
    import zipfile

    plain = io.BytesIO()
    torch.save(value, plain)
    out = io.BytesIO()
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for record in src.infolist():
            dst.writestr(record.filename, src.read(record))
    return out.getvalue()


def _save_raw_value(uri: str, raw: bytes) -> Store:
    """A DCP save whose item ``blob`` is stored as ``raw``, as a hostile writer's would be."""
    import io

    from torch.distributed.checkpoint import DefaultSavePlanner

    class RawBlob(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == "blob":
                return io.BytesIO(raw)
            return super().resolve_data(write_item)

    state = {**_state(), "blob": 7}
    dcp.save(state, storage_writer=StoreWriter(uri), planner=RawBlob(), no_dist=True)
    return Store(uri)


def test_the_load_planner_unpickles_the_checked_value_never_the_stored_bytes(tmp_path):
    """Exact-resume reviewer of stop 84: the stored bytes passed torch's weights-only
    unpickler and then went, the same bytes, to DCP's planner, which unpickles them with
    ``weights_only=False``: bytes the two unpicklers read two ways would run code there. The
    planner now gets a pickle of the value the weights-only unpickler built."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner

    stored = io.BytesIO()
    torch.save({"lrs": [0.1, 0.01], "name": "run"}, stored, _disable_byteorder_record=True)
    store = _save_raw_value(str(tmp_path / "s"), stored.getvalue())
    given = {}

    class Recording(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            given[read_item.dest_index.fqn] = value.getvalue()
            value.seek(0)
            super().load_bytes(read_item, value)

    target = {**_blank(), "blob": None}
    dcp.load(target, storage_reader=StoreReader(store.uri), planner=Recording(), no_dist=True)
    assert target["blob"] == {"lrs": [0.1, 0.01], "name": "run"}
    assert given["blob"] != stored.getvalue()


def test_a_pickled_value_whose_records_are_compressed_is_refused_unread(tmp_path, capsys):
    """Adversary of stop 75: a BYTE_IO item of 926 bytes stored made ``verify`` and
    ``restore`` inflate 2 GB (torch's zip reader inflates deflated records, and a run of zeros
    deflates a thousandfold), and loaded it into the state in place of an int. A value whose
    archive holds a compressed record (torch.save never writes one) is now refused unread."""
    bomb = _deflated_torch_save(torch.zeros(1 << 20, dtype=torch.uint8))
    assert len(bomb) < (1 << 14)
    store = _save_raw_value(str(tmp_path / "s"), bomb)
    with pytest.raises(
        CheckpointCorruptError, match=r"'blob'.*compressed or misplaced.*torch.save never"
    ):
        load_full_state_dict(store, 0)
    code, err = _cli(capsys, "restore", store.uri, "--to", tmp_path / "out.pt")
    assert code == 1 and "'blob'" in err and "torch.save never writes" in err, err
    assert not (tmp_path / "out.pt").exists()
    assert main(["verify", store.uri]) == 1
    out, _ = capsys.readouterr()
    assert "'blob'" in out and "torch.save never writes" in out, out
    target = {**_blank(), "blob": 0}
    with pytest.raises(CheckpointException, match="torch.save never writes"):
        dcp.load(target, storage_reader=StoreReader(store.uri), no_dist=True)
    assert target["blob"] == 0


def test_a_pickled_value_that_is_not_torch_saves_zip_is_refused(tmp_path):
    """torch's pre-zip format sizes each storage by the pickle's word: refused too."""
    store = _save_raw_value(str(tmp_path / "s"), pickle.dumps(3, protocol=2))
    with pytest.raises(
        CheckpointCorruptError, match=r"'blob'.*not a zip archive, which torch.save"
    ):
        load_full_state_dict(store, 0)


def _two_directories(deflated: bytes) -> bytes:
    """``deflated``'s records under two central directories of one size: the one its end
    record points at (deflated, what torch's reader reads) and a copy marked stored right
    before the end record (what Python's zipfile reads, taking the gap for prepended bytes)."""
    import struct

    eocd = deflated.rfind(b"PK\x05\x06")
    size, offset = struct.unpack("<II", deflated[eocd + 12 : eocd + 20])
    real = deflated[offset : offset + size]
    fake, at = bytearray(real), 0
    while at < len(fake):
        names, extra, comment = struct.unpack("<HHH", fake[at + 28 : at + 34])
        struct.pack_into("<H", fake, at + 10, 0)  # method: stored
        struct.pack_into("<II", fake, at + 20, 1, 1)  # sizes
        at += 46 + names + extra + comment
    return deflated[:offset] + real + bytes(fake) + deflated[eocd:]


def _two_zip64_records(stored: list, deflated: list) -> bytes:
    """Records of two archives one after the other, each with its directory and zip64 end
    record; the locator points at the deflated one's, while the stored one's sits right before
    the locator (where Python's zipfile reads it)."""
    import struct
    import zlib

    def put(out: bytearray, name: bytes, data: bytes, method: int) -> bytes:
        packed = data
        if method:
            pack = zlib.compressobj(9, zlib.DEFLATED, -15)
            packed = pack.compress(data) + pack.flush()
        crc, at = zlib.crc32(data), len(out)
        sizes = (crc, len(packed), len(data), len(name))
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, *sizes, 0) + name
        out += packed
        crc, packed_n, data_n, name_n = sizes
        return (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0,
                crc,
                packed_n,
                data_n,
                name_n,
                0,
                0,
                0,
                0,
                0,
                at,
            )
            + name
        )

    out = bytearray()
    dirs = [[put(out, n.encode(), d, 0) for n, d in stored]]
    dirs.append([put(out, n.encode(), d, 8) for n, d in deflated])
    ends = []
    for entries in reversed(dirs):  # the deflated directory first
        at = len(out)
        out += b"".join(entries)
        ends.append(len(out))
        size = len(out) - at
        out += struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, *[len(entries)] * 2, size, at
        )
    out += struct.pack("<IIQI", 0x07064B50, 0, ends[0], 1)
    return bytes(
        out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, *[0xFFFFFFFF] * 2, 0)
    )


def _records(value) -> list:
    import io
    import zipfile

    out = io.BytesIO()
    torch.save(value, out)
    with zipfile.ZipFile(out) as archive:
        return [(r.filename, archive.read(r)) for r in archive.infolist()]


def test_check_torch_save_bytes_refuses_what_two_zip_readers_read_apart():
    """Adversary of the check above: Python's zipfile and torch's reader disagreed on where the
    directory is (a second one placed before the end record), or on the format (a pre-zip pickle
    with a zip appended): the check passed one value and torch loaded another, 50 MB from 50 KB.
    What torch.save writes passes: nested values, many records, a 64 MiB tensor."""
    import io

    from ckptstore.step_reader import check_torch_save_bytes

    value = torch.zeros(1 << 16, dtype=torch.uint8)
    plain = io.BytesIO()
    torch.save(value, plain)
    crafted = _two_directories(_deflated_torch_save(value))
    with pytest.raises(CheckpointCorruptError, match="not where its end record says"):
        check_torch_save_bytes(crafted, "x")
    legacy = io.BytesIO()
    torch.save({"evil": torch.arange(5)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointCorruptError, match="not a zip archive"):
        check_torch_save_bytes(legacy.getvalue() + plain.getvalue(), "x")
    check_torch_save_bytes(legacy.getvalue(), "x", legacy=True)  # a pickled storage's format
    with pytest.raises(CheckpointCorruptError, match="after its end record"):
        check_torch_save_bytes(plain.getvalue() + b"\0", "x")
    # the second adversary: a zip64 locator pointing past the record Python's reader takes
    crafted = _two_zip64_records(_records({"ok": 1}), _records(value))
    assert torch.load(io.BytesIO(crafted), weights_only=True).shape == value.shape
    with pytest.raises(CheckpointCorruptError, match="zip64 end record is not where its locator"):
        check_torch_save_bytes(crafted, "x")
    for good in (
        {"a": [torch.arange(3), {"b": torch.ones(2, 2, dtype=torch.bfloat16)}], "n": 7},
        [torch.full((2,), float(i)) for i in range(70000)],  # a zip64 archive
        torch.zeros(16 << 20),
    ):
        out = io.BytesIO()
        torch.save(good, out)
        check_torch_save_bytes(out.getvalue(), "x")


# -- damaged or hostile JSON metadata -----------------------------------------------------------


def _tensor_doc(doc: dict) -> dict:
    return doc["state_dict_metadata"]["model.w"]


DAMAGES = {
    "an unknown dtype": (lambda d: _tensor_doc(d).update(dtype="object"), "dtype 'object'"),
    "a negative size": (lambda d: _tensor_doc(d).update(size=[-8, 4]), "non-negative ints"),
    "a chunk outside its tensor": (
        lambda d: _tensor_doc(d).update(chunks=[[[4, 0], [8, 4]]]),
        "exceeds size",
    ),
    "a bool as a size": (lambda d: _tensor_doc(d).update(size=[True, 4]), "non-negative ints"),
    "a location of an unknown item": (
        lambda d: d["storage_data"].append(["ghost", None, 0, 0]),
        "'ghost'",
    ),
    "an unknown planner_data tag": (
        lambda d: d.update(planner_data={"$code": "os.system"}),
        "unknown tag",
    ),
    "a format version that is no version": (
        lambda d: d.update(format_version="2"),
        "format_version '2' is not 1",
    ),
    # DCP's planner would append None to a list up to the index a path names
    "a place a billion slots into a list": (
        lambda d: d["planner_data"].update({"model.w": {"$tuple": ["model", "w", 10**9]}}),
        "list slots",
    ),
    "a negative list index": (
        lambda d: d["planner_data"].update({"model.w": {"$tuple": ["model", "w", -1]}}),
        "not a path of keys",
    ),
    # the second item would silently replace the first
    "two items at one place": (
        lambda d: d["planner_data"].update({"model.b": {"$tuple": ["model", "w"]}}),
        "where another item is",
    ),
    "an item inside another": (
        lambda d: d["planner_data"].update({"model.b": {"$tuple": ["model", "w", "x"]}}),
        "inside another item",
    ),
    # adversary of stop 79: verify said OK, and restore failed with DCP's "Missing key"
    "a place of another name": (
        lambda d: d["planner_data"].update({"model.w": {"$tuple": ["x"]}}),
        "'model.w' is placed at \\('x',\\), a place of another name",
    ),
    "a place of a name no item has": (
        lambda d: d["planner_data"].update({"model.w": {"$tuple": ["model", "v"]}}),
        "a place of another name",
    ),
    "an absurd tensor": (
        lambda d: _tensor_doc(d).update(size=[1 << 40, 1 << 40], chunks=[]),
        "2\\*\\*63 bytes",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_json_metadata_is_a_one_line_error_naming_the_object(tmp_path, damage):
    store = _save(str(tmp_path / "s"))
    key = _metadata_key(store)
    doc = json.loads(store.get(key))
    change, message = DAMAGES[damage]
    change(doc)
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptError, match=message) as caught:
        load_full_state_dict(store, 0)
    assert key in str(caught.value) and "\n" not in str(caught.value)


def test_metadata_of_a_newer_format_version_asks_for_an_upgrade_not_corrupt(tmp_path):
    """Stop 83's format reader: a newer version of the DCP metadata (its bytes vouched for by
    the manifest's hash) was called corrupt, which a fallback load skips and quarantines."""
    store = _save(str(tmp_path / "s"))
    key = _metadata_key(store)
    doc = json.loads(store.get(key))
    doc["format_version"] = 2
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    with pytest.raises(FormatVersionError, match=r"format version 2; .* \(upgrade ckptstore"):
        load_full_state_dict(store, 0)


def test_verify_refuses_metadata_that_places_an_item_where_no_index_holds_it(tmp_path, capsys):
    """verify OK means restore loads: an item the metadata locates at a tensor its rank's index
    does not hold is found by verify, as restore would find it (the trial's storage_oob)."""
    uri = str(tmp_path / "s")
    store = _save(uri)
    key = _metadata_key(store)
    doc = json.loads(store.get(key))
    doc["storage_data"][0][-1] = 1000000
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    code = main(["verify", uri])
    out, err = capsys.readouterr()
    assert code == 1 and "dcp.metadata" in err and "does not hold it at 1000000" in out


def test_chunks_that_overlap_where_others_leave_a_gap_are_refused_by_verify_and_restore(
    tmp_path, capsys
):
    """model.w declared [16, 4] of two stored [8, 4] chunks at rows 0 and 4: their sizes add up,
    so verify (which only added them) said OK, where restore refused the overlap (rows 12-16
    never stored). Both refuse it now, by one check."""
    uri = str(tmp_path / "s")
    store = _save(uri)
    key = _metadata_key(store)
    doc = json.loads(store.get(key))
    _tensor_doc(doc).update(size=[16, 4], chunks=[[[0, 0], [8, 4]], [[4, 0], [8, 4]]])
    doc["storage_data"].append(["model.w", [4, 0], 0, 0])
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    assert main(["verify", uri]) == 1
    assert "'model.w' do not cover its size [16, 4] exactly once" in capsys.readouterr().out
    with pytest.raises(CheckpointCorruptError, match=r"'model.w' do not cover its size \[16, 4\]"):
        load_full_state_dict(store, 0)


@pytest.mark.parametrize(
    ("chunks", "overlap"),
    [
        ([((0, 0), (4, 4)), ((4, 0), (4, 4))], False),  # rows
        ([((0, 0), (8, 2)), ((0, 2), (8, 2))], False),  # columns: swept along dim 1
        ([((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)], False),  # a 2x2 grid
        ([((0, 0), (4, 4)), ((3, 3), (1, 1))], True),  # one corner inside another
        ([((0, 0), (4, 1)), ((0, 0), (0, 4)), ((2, 0), (2, 2))], True),  # zero-size ignored
        ([((0,), (5,)), ((5,), (0,)), ((5,), (3,))], False),
        ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((0, 0), (2, 2))], True),  # a cell twice
    ],
)
def test_overlap_of_chunks(chunks, overlap):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from ckptstore.metadata import _overlap

    made = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]
    assert _overlap(made, "t") is overlap


def test_metadata_declaring_a_tensor_its_chunks_do_not_cover_is_refused(tmp_path, capsys):
    """Adversary: model.w declared [512, 4], its one stored chunk left [8, 4]. Restore allocated
    the whole tensor and wrote the rows never stored (the restoring process's heap) into its
    output, exit 0, and verify said OK; a size of 2**36 rows made a KB store a TiB allocation."""
    uri = str(tmp_path / "s")
    store = _save(uri)
    key = _metadata_key(store)
    doc = json.loads(store.get(key))
    _tensor_doc(doc).update(size=[512, 4])
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptError, match=r"'model.w' do not cover its size \[512, 4\]"):
        load_full_state_dict(store, 0)
    code, err = _cli(capsys, "restore", uri, "--to", tmp_path / "out.pt")
    assert code == 1 and "do not cover its size [512, 4] exactly once" in err
    assert not (tmp_path / "out.pt").exists()
    assert main(["verify", uri]) == 1
    assert "do not cover its size" in capsys.readouterr().out
    _tensor_doc(doc).update(size=[1 << 36, 4])
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    with pytest.raises(UnsupportedStateError, match=r"more than the .* this host has available"):
        load_full_state_dict(store, 0)


def test_metadata_listing_one_chunk_twice_is_refused_by_the_safetensors_export(tmp_path, capsys):
    """Adversary: model.w declared [16, 4] over its one stored [8, 4] chunk listed twice. The
    counts add up (32 + 32), so the export allocated the tensor and wrote rows 8-15, never
    stored, from the process's heap (pointers: an ASLR leak) into the file, exit 0."""
    uri = str(tmp_path / "s")
    store = _save(uri)
    key = _metadata_key(store)
    doc = json.loads(store.get(key))
    _tensor_doc(doc).update(size=[16, 4], chunks=[[[0, 0], [8, 4]], [[0, 0], [8, 4]]])
    replace_referenced(store, 0, key, json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptError, match="'model.w'"):
        export_safetensors(uri, tmp_path / "hf")
    code, err = _cli(capsys, "restore", uri, "--to", tmp_path / "hf2", "--format", "safetensors")
    assert code == 1 and "'model.w'" in err
    assert not list((tmp_path / "hf2").glob("*.safetensors"))


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_gc_never_keeps_a_dcp_step_without_its_metadata_in_place_of_one_that_loads(
    tmp_path, capsys, how
):
    """Plain gc (no --verify) read a DCP step's manifest and indexes, not its metadata: a step
    whose dcp.metadata was cut short or gone counted as kept, and gc --keep-last 1 deleted the
    older step that loads."""
    uri = str(tmp_path / "s")
    for step in (0, 1):
        dcp.save(_state(), storage_writer=StoreWriter(uri), no_dist=True, checkpoint_id=step)
    store = Store(uri)
    key = load_manifest(store, 1).dcp_metadata.key
    if how == "deleted":
        store.delete(key)
    else:
        data = store.get(key)
        store.delete(key)
        store.put(key, data[: len(data) // 2])
    assert main(["gc", uri, "--keep-last", "1"]) == 1
    out = capsys.readouterr().out
    assert "deleted steps: none" in out and "unreadable step 1: kept, not counted" in out
    assert load_full_state_dict(store, 0)["step"] == 7


@dataclasses.dataclass
class _TrainConfig:
    lr: float


def test_a_class_the_user_allows_with_add_safe_globals_loads_and_no_other(tmp_path):
    """DCP migrator: the refusal named only trust_pickled_objects=True (which runs any code);
    torch's add_safe_globals admits the classes named, and the message says so."""
    store = _save(str(tmp_path / "s"), {**_state(), "cfg": _TrainConfig(0.1)})
    with pytest.raises(CheckpointException, match=r"add_safe_globals\(\[\.\.\.\]\)"):
        dcp.load({**_blank(), "cfg": None}, storage_reader=StoreReader(store.uri), no_dist=True)
    with torch.serialization.safe_globals([_TrainConfig]):
        target = {**_blank(), "cfg": None}
        dcp.load(target, storage_reader=StoreReader(store.uri), no_dist=True)
    assert target["cfg"] == _TrainConfig(0.1)


def test_a_refused_value_that_calls_os_system_names_the_global_not_torchs_advice(tmp_path):
    """A fuzzer: a value whose unpickling calls ``os.system`` was refused with a message cut at
    torch's advice ('Re-running torch.load with weights_only set to False'), the refused global
    and 'arbitrary code execution' left out."""
    import os

    class System:
        def __reduce__(self):
            return (os.system, ("true",))

    store = _save(str(tmp_path / "s"), {**_state(), "evil": System()})
    with pytest.raises(PickledValueRefusedError) as refused:
        load_full_state_dict(store, 0)
    said = str(refused.value)
    assert "posix.system" in said and "weights_only` set to `False" not in said, said


def test_resume_passes_over_a_manifest_linked_out_of_the_store(tmp_path):
    """A fuzzer: the newest step's manifest replaced by a link to a copy outside the store made
    ``dcp.resume`` fail ('leads outside the store's root'), where a FIFO there, and the
    Checkpointer's ``load(fallback=True)``, went back to the step before."""
    from ckptstore.dcp import resume
    from ckptstore.format import commit_key

    uri = str(tmp_path / "s")
    writer = StoreWriter(uri)
    for step in (1, 2):
        dcp.save(_state(), storage_writer=writer, checkpoint_id=step, no_dist=True)
    manifest = Path(uri) / commit_key(2)
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(outside)
    target = _blank()
    assert resume(target, StoreReader(uri), no_dist=True) == 1
    saved = _state()["model"]
    assert all(torch.equal(target["model"][k], saved[k]) for k in ("w", "b"))


@pytest.mark.parametrize(
    "item, field, value, said",
    [
        ("model.w@0,0", "shape", [32], r"the metadata's shard is \[8, 4\], the index's \[32\]"),
        ("model.b@0", "dtype", "float16", "the metadata says bfloat16, the index float16"),
    ],
)
def test_an_index_that_disagrees_with_the_metadata_is_corrupt_for_verify_and_load(
    tmp_path, capsys, item, field, value, said
):
    """A fuzzer: a rank index giving an item another shape of the same bytes (resealed) passed
    verify and failed every load on an IndexError inside torch; another dtype was cast in
    silence. Both are one corrupt item, named by verify, restore and ``dcp.load``."""
    uri = str(tmp_path / "s")
    store = _save(uri)
    (ref,) = load_manifest(store, 0).ranks
    doc = json.loads(store.get(ref.key))
    doc["tensors"][doc["items"][item]][field] = value
    replace_referenced(store, 0, ref.key, sealed(doc))
    assert main(["verify", uri]) == 1
    out, _ = capsys.readouterr()
    assert re.search(said, out), out
    with pytest.raises(CheckpointCorruptError, match=said):
        load_full_state_dict(store, 0)
    with pytest.raises(CheckpointException, match=said):
        dcp.load(_blank(), storage_reader=StoreReader(uri), no_dist=True)
