"""ckptstore.save: one SaveSession builds what both front-ends write, so a DCP save and a
Checkpointer save of the same state record the same step."""

from __future__ import annotations

import ast

import pytest
import torch

from ckptstore import EncodingOptions, RetentionOptions, StagingOptions, StorageOptions
from ckptstore.catalog import load_manifest
from ckptstore.store import Store
from tests.helpers import ROOT
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHUNK_BYTES = 64 * 1024
NUMEL = CHUNK_BYTES // 4  # each tensor fills one chunk of its own


def _replicated_state() -> dict[str, torch.Tensor]:
    """Every rank's copy of the same state: a weight and three zero-initialized optimizer
    buffers, which share one chunk's content."""
    return {
        "weight": torch.arange(NUMEL, dtype=torch.float32),
        "exp_avg": torch.zeros(NUMEL),
        "exp_avg_sq": torch.zeros(NUMEL),
        "momentum": torch.zeros(NUMEL),
    }


def _save_both_ways(rank: int, world: int, ckpt_uri: str, dcp_uri: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore import Checkpointer
    from ckptstore.dcp import StoreWriter

    with Checkpointer(
        ckpt_uri, encoding=EncodingOptions(compression="zstd", chunk_bytes=CHUNK_BYTES)
    ) as ckpt:
        ckpt.save(1, _replicated_state()).wait()
    # DCP's planner gives each replicated tensor to one rank: the zero buffers land on both.
    writer = StoreWriter(
        dcp_uri, step=1, encoding=EncodingOptions(compression="zstd", chunk_bytes=CHUNK_BYTES)
    )
    dcp.save(_replicated_state(), storage_writer=writer)


def test_dcp_and_checkpointer_saves_count_the_same_bytes(tmp_path):
    ckpt_uri, dcp_uri = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    run_ranks(_save_both_ways, 2, ckpt_uri, dcp_uri)
    ckpt = load_manifest(Store(ckpt_uri), 1)
    dcp_manifest = load_manifest(Store(dcp_uri), 1)
    assert (ckpt.world_size, dcp_manifest.world_size) == (2, 2)
    # Two distinct chunks (the weight, the zeros), each counted once however many ranks wrote it.
    assert ckpt.raw_bytes == 2 * CHUNK_BYTES
    assert (dcp_manifest.raw_bytes, dcp_manifest.stored_bytes) == (
        ckpt.raw_bytes,
        ckpt.stored_bytes,
    )


PACKAGE = ROOT / "ckptstore"
# Read-only modules that merge the rank indexes they read into one (never written).
READERS = {"step_reader.py", "dcp/reader.py", "export.py"}


def _constructions(tree: ast.AST) -> list[tuple[str, int]]:
    """(function called, line) of every ``Manifest(...)`` / ``RankIndex(...)`` in ``tree``."""
    return [
        (node.func.id, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("Manifest", "RankIndex")
    ]


def _decoder_lines(tree: ast.AST) -> set[int]:
    """The lines of format.py's ``decode_*`` functions (they build what they read)."""
    return {
        line
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("decode_")
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }


def test_only_the_save_package_builds_manifests_and_rank_indexes_to_write():
    """Outside ckptstore/save/, a Manifest or RankIndex is built only to read: by format.py's
    decoders, or by a reader that merges the indexes it read."""
    built_by_save: set[str] = set()
    offenders: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        name = path.relative_to(PACKAGE).as_posix()
        found = _constructions(tree)
        if name.startswith("save/"):
            built_by_save.update(kind for kind, _ in found)
            continue
        if name == "format.py":
            decoders = _decoder_lines(tree)
            found = [(kind, line) for kind, line in found if line not in decoders]
        elif name in READERS:
            assert "ckptstore.save" not in source, f"{name} reads only"
            continue
        offenders += [f"ckptstore/{name}:{line} builds a {kind}" for kind, line in found]
    assert not offenders, offenders
    assert built_by_save == {"Manifest", "RankIndex"}


def test_dcp_writer_takes_the_checkpointers_save_settings(tmp_path):
    from ckptstore.dcp import StoreWriter

    writer = StoreWriter(
        tmp_path,
        encoding=EncodingOptions(hedge_uploads=True),
        staging=StagingOptions(budget_bytes=1 << 20),
        retention=RetentionOptions(gc_wait_s=5.0),
        storage=StorageOptions(background_nice=3),
    )
    engine = writer.engine
    assert (engine.hedge_uploads, engine.pool.budget_bytes, engine.gc_wait_s) == (
        True,
        1 << 20,
        5.0,
    )
    assert StoreWriter(tmp_path).engine.hedge_uploads is False  # a local store: not hedged
    with pytest.raises(ValueError, match="background_nice"):
        StoreWriter(tmp_path, storage=StorageOptions(background_nice=20))
