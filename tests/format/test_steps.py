"""ckptstore.steps: one view of a committed step, whichever front-end wrote it, and the only
code that tells the two kinds apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import Checkpointer, UnsupportedStateError
from ckptstore.dcp import StoreWriter
from ckptstore.steps import CHECKPOINTER, DCP, StepView
from ckptstore.store import Store
from tests.helpers import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)},
        "step": 7,
    }


@pytest.fixture
def both(tmp_path):
    """The same state saved as step 1 by a Checkpointer and through DCP."""
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, _state()).wait()
    dcp.save(_state(), storage_writer=StoreWriter(str(tmp_path / "dcp"), step=1), no_dist=True)
    return (
        StepView.open(Store(str(tmp_path / "ckpt")), 1),
        StepView.open(Store(str(tmp_path / "dcp")), "latest"),
    )


def test_both_kinds_name_the_same_whole_tensors(both):
    state_view, dcp_view = both
    for view in both:
        tensors, skipped = view.whole_tensors()
        shapes = {t.name: (t.dtype, t.shape) for t in tensors}
        assert shapes == {"model.w": ("float32", [3, 4]), "model.b": ("float32", [4])}
        assert skipped == ["step"]
        (piece,) = next(t for t in tensors if t.name == "model.w").pieces
        assert (piece.rank, piece.offsets, piece.shape) == (0, [0, 0], [3, 4])
    assert (state_view.kind, dcp_view.kind) == ("state", "dcp")
    assert dcp_view.shard_offsets(dcp_view.index(0)) != {}
    assert state_view.shard_offsets(state_view.index(0)) == {}


def test_both_kinds_load_whole_as_plain_objects(both):
    for view in both:
        plain = view.load_plain()
        got = plain["model"]
        assert torch.equal(got["w"], _state()["model"]["w"]) and torch.equal(
            got["b"], torch.ones(4)
        )
        assert plain["step"] == 7


def test_each_kind_is_refused_by_the_other_loader_naming_its_own(both):
    state_view, dcp_view = both
    state_view.require(CHECKPOINTER)
    dcp_view.require(DCP)
    with pytest.raises(UnsupportedStateError, match="Checkpointer.load"):
        state_view.require(DCP)
    with pytest.raises(UnsupportedStateError, match="StoreReader"):
        dcp_view.require(CHECKPOINTER)


def test_a_dcp_item_the_indexes_do_not_hold_is_found_before_restore(both):
    _, view = both
    indexes = {i.rank: i for i in view.indexes()}
    assert list(view.problems(indexes)) == []
    held = indexes[0].items
    held[next(iter(held))] += 1000  # the metadata's location no longer matches the index
    (found,) = list(view.problems(indexes))
    assert (found.what, found.key) == ("dcp-metadata", view.manifest.dcp_metadata.key)
    assert "does not hold it" in str(found.error)


PACKAGE = ROOT / "ckptstore"


def _names_a_step_kind(node: ast.expr) -> bool:
    """``KIND_DCP``, ``KIND_STATE``, or ``<...>manifest.kind``."""
    if isinstance(node, ast.Name):
        return node.id in ("KIND_DCP", "KIND_STATE")
    if isinstance(node, ast.Attribute) and node.attr == "kind":
        owner = node.value
        return "manifest" in (
            owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        )
    return False


def test_only_the_step_view_switches_on_the_kind():
    """Outside steps.py no module compares a step's kind: readers ask the view."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "steps.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                map(_names_a_step_kind, [node.left, *node.comparators])
            ):
                offenders.append(f"ckptstore/{name}:{node.lineno}")
    assert not offenders, offenders


def test_a_corrupt_chunk_of_a_pickled_dcp_value_is_reported_once_as_the_chunk(both):
    """verify named the intact rank index as a refused pickled value (with a trust hint that
    cannot help) besides the chunk."""
    from ckptstore._inspect import verify_steps
    from ckptstore.format import chunk_key

    _, view = both
    index = view.index(0)
    (tensor,) = [i for i, offsets in view.shard_offsets(index).items() if offsets is None]
    digest = index.tensors[tensor].segments[0].chunk
    path = Path(view.store.path(chunk_key(digest)))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    (check,) = verify_steps(view.store, [view.step])
    assert [(p.what, p.object) for p in check.problems] == [("chunk", chunk_key(digest))]
    assert "trust_pickled_objects" not in check.problems[0].error


def test_dcp_load_of_a_checkpointer_step_ends_with_the_one_cause(both):
    """DCP wraps a reader's error; its last line names the loader to use, and no refused
    rank-local fallback stands beside it (StoreReader.read_metadata took **kwargs)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.dcp import StoreReader

    state_view, _ = both
    with pytest.raises(CheckpointException) as raised:
        dcp.load(
            {"x": torch.zeros(1)}, storage_reader=StoreReader(state_view.store.uri), no_dist=True
        )
    text = str(raised.value)
    assert text.strip().splitlines()[-1].endswith("load it with Checkpointer.load")
    assert "rank local" not in text
