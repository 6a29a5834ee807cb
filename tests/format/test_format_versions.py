"""Format version 2 spreads rank indexes over 256 hash prefixes; version 1 steps still load,
verify and survive gc; a manifest whose index keys do not match its version is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptstore.format as fmt
from ckptstore import Checkpointer, Store
from ckptstore.catalog import load_manifest
from ckptstore.cli import main
from ckptstore.errors import CheckpointCorruptError
from ckptstore.format import decode_manifest, decode_rank_index, object_ref, rank_index_key
from ckptstore.retention import collect


def _state(step: int) -> dict:
    return {"w": torch.arange(50_000, dtype=torch.float32) + step, "step": step}


def _as_version_1(root: Path, step: int, monkeypatch) -> None:
    """Rewrite ``step`` as a version 1 writer would have written it."""
    store = Store(str(root))
    manifest = load_manifest(store, step)
    refs = []
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 1)
    try:
        for ref in manifest.ranks:
            index = decode_rank_index((root / ref.key).read_bytes(), ref.key)
            data = fmt.encode_rank_index(index)
            key = rank_index_key(step, manifest.attempt, index.rank, 1)
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(data)
            (root / ref.key).unlink()
            refs.append(object_ref(key, data))
        manifest.ranks = refs
        (root / fmt.commit_key(step)).write_bytes(fmt.encode_manifest(manifest))
    finally:
        monkeypatch.undo()


def test_version_2_spreads_a_saves_indexes_over_hash_prefixes():
    keys = [rank_index_key(7, "a1b2", r) for r in range(4096)]
    prefixes = {k.split("/")[1] for k in keys}
    assert all(k.startswith("indexes/") for k in keys)
    assert len(prefixes) == 256  # every prefix takes a share of a 4,096-rank save
    assert rank_index_key(7, "a1b2", 3, 1) == f"steps/{7:020d}/a1b2/rank-00003.json"


def test_version_1_steps_load_verify_and_survive_gc(tmp_path, monkeypatch, capsys):
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).wait()
    _as_version_1(tmp_path, 2, monkeypatch)
    text = (tmp_path / fmt.commit_key(2)).read_text()
    assert '"format_version":1' in text and '"key":"steps/' in text
    state = {"w": torch.zeros(50_000), "step": -1}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(state, step=2) == 2
        ckpt.verify("all")
        ckpt.save(4, _state(4)).wait()  # a version 2 step beside version 1 ones
    assert torch.equal(state["w"], _state(2)["w"])
    report = collect(Store(str(tmp_path)), keep_last=None)  # a kept v1 step keeps its index
    assert report.swept and report.kept_steps == [1, 2, 3, 4]
    assert main(["verify", str(tmp_path), "--all"]) == 0
    capsys.readouterr()
    report = collect(Store(str(tmp_path)), keep_last=2)
    assert report.kept_steps == [3, 4] and report.swept
    assert not list((tmp_path / "steps").rglob("rank-*.json"))  # step 2's v1 index swept


def test_an_orphan_index_of_either_layout_is_swept(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _state(1)).wait()
    for key in (rank_index_key(2, "dead", 0), rank_index_key(2, "dead", 0, 1)):
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_text("{}")
    report = collect(Store(str(tmp_path)), keep_last=None)
    assert report.deleted_other == 2
    assert not (tmp_path / rank_index_key(2, "dead", 0)).exists()
    kept = load_manifest(Store(str(tmp_path)), 1).ranks[0].key
    assert (tmp_path / kept).exists() and kept.startswith("indexes/")


@pytest.mark.parametrize("version", [1, 2])
def test_a_manifest_naming_the_other_layouts_key_is_refused(tmp_path, monkeypatch, version):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, _state(5)).wait()
    path = tmp_path / fmt.commit_key(5)
    manifest = decode_manifest(path.read_bytes(), "m")
    other = 2 if version == 1 else 1
    ref = manifest.ranks[0]
    manifest.ranks = [object_ref(rank_index_key(5, manifest.attempt, 0, other), b"x")]
    monkeypatch.setattr(fmt, "FORMAT_VERSION", version)
    data = fmt.encode_manifest(manifest)
    monkeypatch.undo()
    with pytest.raises(CheckpointCorruptError, match="is not one of this step's ranks"):
        decode_manifest(data, "m")
    assert json.loads(data)["format_version"] == version and ref.key.startswith("indexes/")


def _resealed(doc: dict) -> bytes:
    """``doc`` with a checksum as a writer that allowed NaN would compute it."""
    from ckptstore.codec import hash_bytes

    body = {k: v for k, v in doc.items() if k != "checksum"}
    canon = json.dumps(body, separators=(",", ":")).encode()  # as format._canonical, NaN let in
    return json.dumps({**body, "checksum": hash_bytes(canon)}).encode()


@pytest.mark.parametrize("kind", ["nan", "inf", "bigint"])
def test_a_nan_or_a_huge_int_in_a_sealed_object_is_corrupt_and_fallback_skips_it(tmp_path, kind):
    """json.loads takes NaN and refuses a 4300-digit int with a plain ValueError: the newest
    manifest holding one stopped every load(fallback=True) and every save with a raw
    ValueError, where one flipped byte made a corrupt step that fallback skips."""
    import sys

    sys.set_int_max_str_digits(0)  # so that the crafted manifest can be written at all
    try:
        uri = str(tmp_path / "s")
        with Checkpointer(uri) as ckpt:
            for step in (1, 2):
                ckpt.save(step, _state(step)).wait()
        path = tmp_path / "s" / "commits" / f"{2:020d}.json"
        doc = json.loads(path.read_bytes())
        doc["created_at"] = {"nan": float("nan"), "inf": float("inf")}.get(kind) or 10**5000
        path.write_bytes(_resealed(doc))
    finally:
        sys.set_int_max_str_digits(4300)
    store = Store(uri)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        load_manifest(store, 2)
    into = _state(0)
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(into, fallback=True) == 1
        ckpt.save(3, _state(3)).wait()


def test_a_manifest_claiming_a_huge_world_checks_only_the_ranks_it_lists(tmp_path, monkeypatch):
    """check_manifest made the key of every rank of the world it claims (2**20 xxh3s, 4 s per
    528-byte manifest: 20 of them held ls 95 s and load(fallback=True) 141 s)."""
    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, _state(1)).wait()
    path = tmp_path / "s" / "commits" / f"{1:020d}.json"
    doc = json.loads(path.read_bytes())
    doc["world_size"] = 1 << 20
    path.write_bytes(_resealed(doc))
    made = []
    key = fmt.rank_index_key
    monkeypatch.setattr(fmt, "rank_index_key", lambda *a, **k: made.append(a) or key(*a, **k))
    assert load_manifest(Store(uri), 1).world_size == 1 << 20  # one rank listed, its own key
    assert len(made) <= 2
    doc["ranks"][0]["key"] = doc["ranks"][0]["key"].replace("rank-00000", "rank-" + "9" * 40)
    path.write_bytes(_resealed(doc))
    with pytest.raises(CheckpointCorruptError, match="is not one of this step's ranks"):
        load_manifest(Store(uri), 1)


@pytest.mark.parametrize("previous", [[2], [3], [-1], ["1"], [True], 1, list(range(-1, -66, -1))])
def test_a_manifest_naming_no_earlier_step_as_its_previous_is_refused(tmp_path, previous):
    """``previous`` (the step its writer saw committed before it, which gc looks up) is a
    step below the manifest's own; a manifest without one reads as None."""
    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step)).wait()
    assert [load_manifest(Store(uri), s).previous for s in (1, 2)] == [[], [1]]
    path = tmp_path / "s" / "commits" / f"{2:020d}.json"
    doc = json.loads(path.read_bytes())
    doc["previous"] = previous
    path.write_bytes(_resealed(doc))
    with pytest.raises(CheckpointCorruptError, match="is not a step below 2|are not a list"):
        load_manifest(Store(uri), 2)


def test_only_a_dcp_index_is_held_to_the_chunk_size_cap():
    """Reviewer M: stores saved before the cap with chunk_bytes over 1 GiB must still read (a
    state index binds each chunk to its tensors); a DCP index, whose chunks its items do not
    bind, may not declare a chunk over MAX_CHUNK_BYTES (a reader allocates it)."""
    from ckptstore.format import (
        MAX_CHUNK_BYTES,
        ChunkInfo,
        RankIndex,
        Segment,
        TensorEntry,
        check_rank_index,
    )

    n = MAX_CHUNK_BYTES + 4096
    digest = "ab" * 16

    def index(**kind) -> RankIndex:
        tensor = TensorEntry(dtype="uint8", shape=[n], segments=[Segment(digest, 0, n)])
        return RankIndex(rank=0, tensors=[tensor], chunks={digest: ChunkInfo(n, n)}, **kind)

    check_rank_index(index(tree={"t": {"$t": 0}}), "state index")
    with pytest.raises(CheckpointCorruptError, match="more than any chunk holds"):
        check_rank_index(index(items={"t": 0}), "dcp index")
