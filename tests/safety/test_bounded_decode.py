"""Decoding is bounded by what the rank index declares, and `verify` OK means `restore` loads:
zstd bombs in real saves' chunks fail in one line without growing the reader (peak RSS measured
in a child process), and shapes restore could not allocate are corrupt for both verify and
restore. Crafted from real saves (tests/helpers/crafted.py)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
import zstandard

from ckptstore import CheckpointCorruptError, Checkpointer, EncodingOptions, Store
from ckptstore.cli import main
from ckptstore.format import chunk_key
from tests.helpers.child import growth_in_child
from tests.helpers.crafted import put_rank_index, rank_index_doc, rewrite

N = 16384  # float32 elements: one chunk of 64 KiB (room for a 32 KiB bomb frame)
BOMB = 1 << 30  # what the bomb decompresses to
GROWTH_LIMIT = 64 << 20
CHILD_TIMEOUT_S = 120


def save_step(uri: str, step: int = 1) -> None:
    with Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=65536, compression="zstd")) as ckpt:
        ckpt.save(step, {"w": torch.arange(N, dtype=torch.float32)}).wait()


@pytest.fixture(scope="module")
def bomb_frame() -> bytes:
    """A zstd frame of BOMB zero bytes that says so in its header (about 32 KiB)."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=BOMB)
    zeros = bytes(1 << 20)
    parts = [compressor.compress(zeros) for _ in range(BOMB >> 20)]
    return b"".join(parts) + compressor.flush()


def chunk_object(raw_len: int, frame: bytes) -> bytes:
    """A chunk object (docs/FORMAT.md) of one zstd plane holding ``frame``."""
    return (
        struct.pack("<4sBBBxQ", b"CKC1", 1, 1, 1, raw_len)
        + struct.pack("<BQ", 1, len(frame))
        + frame
    )


def plant_bomb(uri: str, frame: bytes, *, declared_raw: int | None = None) -> str:
    """Replace the first chunk of step 1 by a bomb; the index's stored size (and with
    ``declared_raw`` its raw size and the header's) follow it. The digest it replaced."""
    store = Store(uri)
    doc = rank_index_doc(store, 1)
    digest, (raw, _) = next(iter(doc["chunks"].items()))
    raw = declared_raw if declared_raw is not None else raw
    obj = chunk_object(raw, frame)
    rewrite(store, chunk_key(digest), obj)
    doc["chunks"][digest] = [raw, len(obj)]
    put_rank_index(store, 1, 0, doc)
    return digest


def in_child(uri: str, action: str) -> tuple[int, str]:
    """``action`` (restore | verify) on ``uri`` in a child process: how much its peak RSS grew
    during the action, in bytes, and its outcome."""
    setup = f"""
        import torch
        from ckptstore import Checkpointer
        from ckptstore.cli import main
        target = {{"w": torch.zeros({N})}}
        ckpt = Checkpointer({uri!r})
        """
    action = f"""
        if {action!r} == "restore":
            ckpt.load(target)
            outcome = "LOADED"
        else:
            outcome = f"verify exit {{main(['verify', {uri!r}])}}"
        """
    return growth_in_child(setup, action, CHILD_TIMEOUT_S)


def test_a_frame_claiming_more_than_its_plane_is_refused_in_bounded_memory(
    tmp_path: Path, bomb_frame: bytes
) -> None:
    uri = str(tmp_path / "store")
    save_step(uri)
    plant_bomb(uri, bomb_frame)  # header and index agree on 64 KiB; the frame says 1 GiB

    growth, outcome = in_child(uri, "restore")
    assert growth < GROWTH_LIMIT, f"restore grew by {growth >> 20} MiB"
    assert outcome.startswith("CheckpointCorruptError") and "claims" in outcome, outcome

    growth, outcome = in_child(uri, "verify")
    assert growth < GROWTH_LIMIT, f"verify grew by {growth >> 20} MiB"
    assert outcome == "verify exit 1", outcome


def test_a_chunk_declaring_more_raw_bytes_than_its_tensors_use_is_refused(
    tmp_path: Path, bomb_frame: bytes
) -> None:
    uri = str(tmp_path / "store")
    save_step(uri)
    plant_bomb(uri, bomb_frame, declared_raw=BOMB)  # index and header say 1 GiB, the tensor 64 KiB

    growth, outcome = in_child(uri, "restore")
    assert growth < GROWTH_LIMIT, f"restore grew by {growth >> 20} MiB"
    assert outcome.startswith("CheckpointCorruptError"), outcome
    assert "raw bytes, its tensors use 65536" in outcome, outcome


def test_a_header_disagreeing_with_the_index_is_refused_before_decompressing(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "store")
    save_step(uri)
    store = Store(uri)
    digest = next(iter(rank_index_doc(store, 1)["chunks"]))
    frame = zstandard.ZstdCompressor().compress(bytes(8192))
    obj = chunk_object(8192, frame)  # the index still says 65536 raw bytes
    rewrite(store, chunk_key(digest), obj)
    doc = rank_index_doc(store, 1)
    doc["chunks"][digest][1] = len(obj)
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(CheckpointCorruptError, match="header says 8192 raw bytes"):
        Checkpointer(uri).load({"w": torch.zeros(N)})


def test_a_dcp_chunk_declaring_more_raw_bytes_than_any_chunk_holds_is_corrupt(
    tmp_path: Path, capsys
) -> None:
    """A DCP index may declare a chunk larger than its own items use (other ranks' items share
    it), so a raw size of 1 TiB passed its checks and a load allocated it: a MemoryError that
    `dcp.resume` did not skip. No chunk holds more than MAX_CHUNK_BYTES."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreReader, StoreWriter, resume
    from ckptstore.format import MAX_CHUNK_BYTES

    uri = str(tmp_path / "store")
    for step in (1, 2):
        state = {"w": torch.arange(N, dtype=torch.float32) + step}
        dcp.save(state, storage_writer=StoreWriter(uri, step=step), no_dist=True)
    store = Store(uri)
    doc = rank_index_doc(store, 2)
    digest = next(iter(doc["chunks"]))
    doc["chunks"][digest][0] = 1 << 40
    put_rank_index(store, 2, 0, doc)

    assert main(["verify", uri, "--step", "2"]) == 1
    assert f"{1 << 40} raw bytes, more than any chunk holds" in capsys.readouterr().out
    target = {"w": torch.zeros(N)}
    assert resume(target, StoreReader(uri), no_dist=True) == 1  # step 2 skipped
    assert torch.equal(target["w"], torch.arange(N, dtype=torch.float32) + 1)
    with pytest.raises(ValueError, match="chunk_bytes must be within"):
        Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=MAX_CHUNK_BYTES + 64))


# -- verify OK means restore loads ---------------------------------------------------------------


def reshape(uri: str, shape: list[int], dtype: str | None = None) -> None:
    store = Store(uri)
    doc = rank_index_doc(store, 1)
    doc["tensors"][0]["shape"] = shape
    if dtype is not None:
        doc["tensors"][0]["dtype"] = dtype
    put_rank_index(store, 1, 0, doc)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        pytest.param([-1, -N], None, id="negative"),  # the same byte count as [1, N]
        pytest.param([0, 2**62, 2**62], None, id="stride-overflows-int64"),
        pytest.param([0, 2**64], None, id="dim-overflows-int64"),
        pytest.param([N], "Tensor", id="not-a-dtype"),
        pytest.param([True, N], None, id="bool-dim"),
    ],
)
def test_verify_fails_every_shape_restore_cannot_load(
    tmp_path: Path, capsys, shape: list[int], dtype: str | None
) -> None:
    uri = str(tmp_path / "store")
    save_step(uri)
    reshape(uri, shape, dtype)
    code = main(["verify", uri, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1, report
    with pytest.raises(CheckpointCorruptError, match="tensor 0"):
        Checkpointer(uri).load({"w": torch.zeros(N)})


def test_segments_must_add_up_to_the_tensor_and_stay_in_their_chunk(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    save_step(uri)
    store = Store(uri)
    doc = rank_index_doc(store, 1)
    digest, (raw, stored) = next(iter(doc["chunks"].items()))
    doc["tensors"][0]["segments"][0][1] = raw  # starts at the end of its chunk
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(CheckpointCorruptError, match="past the end of chunk"):
        Checkpointer(uri).load({"w": torch.zeros(N)})


def test_an_empty_segment_of_an_empty_tensor_loads_as_the_empty_tensor(tmp_path, capsys):
    """Reviewer S: a crafted index giving a 0-element tensor one segment of 0 bytes verified
    OK, then the load wrote the other tensors and failed on a KeyError (fallback too), and
    restore said "unexpected KeyError". Saves write no segment for an empty tensor; one of
    no bytes has nothing to copy."""
    uri = str(tmp_path / "s")
    save_step(uri)
    store = Store(uri)
    doc = rank_index_doc(store, 1)
    digest = next(iter(doc["chunks"]))
    doc["tensors"].append({**doc["tensors"][0], "shape": [0], "segments": [[digest, 0, 0]]})
    doc["tree"]["x"] = {"$t": len(doc["tensors"]) - 1}
    put_rank_index(store, 1, 0, doc)
    assert main(["verify", uri]) == 0
    state = {"w": torch.zeros(N)}
    assert Checkpointer(uri).load(state) == 1
    assert torch.equal(state["w"], torch.arange(N, dtype=torch.float32))
    assert state["x"].dtype == torch.float32 and state["x"].shape == (0,)
    assert main(["restore", uri, "--to", str(tmp_path / "out.pt")]) == 0
    restored = torch.load(tmp_path / "out.pt", weights_only=True)
    assert restored["x"].shape == (0,) and torch.equal(restored["w"], state["w"])


@pytest.mark.parametrize("dtype", ["quint2x4", "quint4x2", "qint8", "uint3"])
def test_a_quantized_dtype_in_an_index_is_corrupt_for_verify_and_load(tmp_path, dtype, capsys):
    """torch says quint2x4's itemsize is 1 but packs 4 elements a byte: a load allocated a
    quarter of the bytes the segment checks allowed and copied the chunk's bytes past the end
    (a segfault, or worse). No save holds a quantized tensor; an index naming one is corrupt."""
    uri = str(tmp_path / "s")
    save_step(uri)
    store = Store(uri)
    doc = rank_index_doc(store, 1)
    doc["tensors"][0]["dtype"] = dtype  # float32 of N elements -> 4N "elements" of 1 byte
    doc["tensors"][0]["shape"] = [4 * N]
    put_rank_index(store, 1, 0, doc)
    with pytest.raises(CheckpointCorruptError, match=f"unknown dtype '{dtype}'"):
        Checkpointer(uri).load({"w": torch.zeros(N)}, strict=False)
    assert main(["verify", uri]) == 1
    assert f"unknown dtype '{dtype}'" in capsys.readouterr().out


def test_a_byte_view_of_a_tensor_holding_fewer_bytes_than_its_elements_is_refused():
    from ckptstore.pipeline import _byte_view

    packed = torch.empty(64, dtype=torch.quint2x4)  # 16 bytes of storage
    with pytest.raises(CheckpointCorruptError, match="64 elements holds 16 bytes"):
        _byte_view(packed)
    assert _byte_view(torch.zeros(4)).nbytes == 16


def _np_of_bfloat16(doc: dict) -> None:
    i = doc["tree"]["a"]["$np"]
    doc["tensors"][i].update(dtype="bfloat16", shape=[12])  # 24 bytes of float64 -> bf16


@pytest.mark.parametrize(
    "craft, says",
    [
        (lambda d: d["tree"].update(d={"$dict": [[[1, 2], "x"]]}), "malformed $dict node"),
        (lambda d: d["tree"]["g"]["$generator"].update(device="bogus"), "device 'bogus'"),
        (_np_of_bfloat16, "a numpy array of bfloat16, which numpy lacks"),
        # reviewer S: a generator's state a float tensor (TypeError after the state was set)
        (lambda d: d["tree"]["g"]["$generator"].update(state=d["tree"]["w"]), "$generator node"),
    ],
)
def test_a_tree_the_load_cannot_build_is_corrupt_before_any_tensor_is_written(
    tmp_path, craft, says
):
    """A list as a dict key, a generator on a device torch does not know, a numpy array of a
    dtype numpy lacks: the load overwrote the state's tensors, then raised TypeError or
    RuntimeError in its last phase, and fallback did not skip the step."""
    import numpy as np

    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2):
            state = {"w": torch.full((8,), float(step)), "g": torch.Generator(), "d": {1: "x"}}
            ckpt.save(step, {**state, "a": np.zeros(3)}).wait()
    store = Store(uri)
    doc = rank_index_doc(store, 2)
    craft(doc)
    put_rank_index(store, 2, 0, doc)
    if "bogus" not in says:  # the index's own checks find it: verify too
        assert main(["verify", uri, "--step", "2"]) == 1
    into = {"w": torch.zeros(8), "d": {}, "a": None, "g": None}
    with Checkpointer(uri) as ckpt:
        with pytest.raises(CheckpointCorruptError, match=re.escape(says)):
            ckpt.load(into, 2, strict=False)
        assert not into["w"].any()  # refused before a byte was written
        assert ckpt.load(into, fallback=True, strict=False) == 1 and into["w"][0] == 1.0


def test_a_chunk_linked_out_of_the_store_is_corrupt_and_fallback_skips_its_step(tmp_path):
    """The link is not followed (never was); it was a StorageError, which fallback does not
    skip, where the same chunk missing is."""
    import os

    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((8,), float(step))}).wait()
    store = Store(uri)
    (digest,) = rank_index_doc(store, 2)["chunks"]
    (tmp_path / "outside").write_bytes(b"secret")
    path = tmp_path / "s" / chunk_key(digest)
    path.unlink()
    os.symlink(tmp_path / "outside", path)
    into = {"w": torch.zeros(8)}
    with Checkpointer(uri) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="leads outside the store's root"):
            ckpt.load(into, 2)
        assert ckpt.load(into, fallback=True) == 1 and into["w"][0] == 1.0
    assert (tmp_path / "outside").read_bytes() == b"secret"


def plant_declared_tensor(uri: str, huge: int) -> None:
    """Steps 1 and 2, step 2's index (checksums recomputed) declaring a tensor 'bomb' of
    ``huge`` bytes whose one chunk is a small frame."""
    save_step(uri, 1)
    save_step(uri, 2)
    store = Store(uri)
    doc = rank_index_doc(store, 2)
    digest = "ab" * 16
    obj = chunk_object(huge, zstandard.ZstdCompressor().compress(bytes(65536)))
    rewrite(store, chunk_key(digest), obj)
    doc["tensors"].append({"dtype": "uint8", "shape": [huge], "segments": [[digest, 0, huge]]})
    doc["chunks"][digest] = [huge, len(obj)]
    doc["tree"]["bomb"] = {"$t": len(doc["tensors"]) - 1}
    put_rank_index(store, 2, 0, doc)


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_a_tensor_larger_than_the_hosts_memory_is_refused_naming_it(tmp_path, capsys, fmt):
    """Stop 82's operator: an index (checksums recomputed) declaring a 1 PiB tensor failed
    `restore` with torch's allocator error, "unexpected RuntimeError", naming neither the
    step nor the tensor; it is refused before the allocation, naming both."""
    uri = str(tmp_path / "store")
    plant_declared_tensor(uri, 1 << 50)
    capsys.readouterr()
    assert main(["restore", uri, "--step", "2", "--format", fmt, "--to", str(tmp_path / "o")]) == 1
    said = capsys.readouterr().err.strip()
    assert "\n" not in said and "more than this host's available memory" in said, said
    assert ("tensor 'bomb'" if fmt == "safetensors" else "step 2 cannot be restored") in said
    assert not (tmp_path / "o").exists()


def test_a_tensor_larger_than_the_containers_memory_limit_is_refused(tmp_path, capsys, monkeypatch):
    """Stop 82's fix adversary: the check read the host's MemAvailable alone; in a container
    whose cgroup allows less, a tensor between the two was allocated and the kernel killed the
    process as it filled. A 2 GiB tensor under a 1 GiB cgroup v2 limit is refused."""
    import ckptstore.device as device

    uri = str(tmp_path / "store")
    plant_declared_tensor(uri, 2 << 30)
    sys_root = tmp_path / "cgroup"
    sys_root.mkdir()
    for name, text in {"cgroup.controllers": "memory", "memory.max": str(1 << 30)}.items():
        (sys_root / name).write_text(text)
    (sys_root / "memory.current").write_text(str(64 << 20))
    (tmp_path / "self_cgroup").write_text("0::/\n")
    monkeypatch.setattr(device, "CGROUP_ROOT", str(sys_root))
    monkeypatch.setattr(device, "SELF_CGROUP", str(tmp_path / "self_cgroup"))
    capsys.readouterr()
    assert main(["restore", uri, "--step", "2", "--to", str(tmp_path / "o")]) == 1
    said = capsys.readouterr().err.strip()
    assert f"more than this host's available memory ({(1 << 30) - (64 << 20)} bytes)" in said, said
