"""ckptstore.catalog: steps, manifests, rank indexes, tensor names and saves in flight, read
from real stores made by real saves (Checkpointer and DCP)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import Checkpointer, CheckpointNotFoundError
from ckptstore.catalog import (
    list_steps,
    load_manifest,
    load_rank_index,
    load_rank_indexes,
    open_step,
    parse_step,
    resolve_step,
    saves_in_flight,
)
from ckptstore.dcp import StoreWriter
from ckptstore.format import KIND_DCP, KIND_STATE
from ckptstore.retention import collect
from ckptstore.steps import tensor_names
from ckptstore.store import Store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def state_store(tmp_path: Path) -> Store:
    with Checkpointer(tmp_path / "s") as ckpt:
        for step in (3, 5, 9):
            state = {
                "model": {"w": torch.full((4, 4), float(step)), "b": torch.zeros(4)},
                "extra": (np.arange(3), torch.ones(2)),
                "step": step,
            }
            ckpt.save(step, state).wait()
    return Store(str(tmp_path / "s"))


def test_steps_resolve_latest_numbers_and_strings(state_store: Store) -> None:
    assert list_steps(state_store) == [3, 5, 9]
    assert resolve_step(state_store, "latest") == 9
    assert resolve_step(state_store, None) == 9
    assert resolve_step(state_store, 5) == 5
    assert resolve_step(state_store, "3") == 3
    assert open_step(state_store).step == 9
    assert parse_step("latest") is None and parse_step("12") == 12


def test_an_uncommitted_step_names_the_latest_ones(state_store: Store, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"step 4 is not committed .*3, 5, 9"):
        resolve_step(state_store, 4)
    for name in ("newest", "\u0663", "\u00b2"):  # an Arabic-Indic 3 and a superscript 2
        with pytest.raises(ValueError, match="integer or 'latest'"):
            resolve_step(state_store, name)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        resolve_step(Store(str(tmp_path / "empty")), "latest")


def test_state_step_tensor_names_are_paths(state_store: Store) -> None:
    manifest = load_manifest(state_store, 5)
    assert manifest.kind == KIND_STATE
    (index,) = load_rank_indexes(state_store, manifest)
    assert index.rank == 0
    assert load_rank_index(state_store, manifest, 0).tensors == index.tensors
    names = sorted(tensor_names(manifest, index).values())
    assert names == ["extra/0", "extra/1", "model/b", "model/w"]
    with pytest.raises(CheckpointNotFoundError, match="no index for rank 1"):
        load_rank_index(state_store, manifest, 1)


def test_dcp_step_tensor_names_are_fqns(tmp_path: Path) -> None:
    uri = str(tmp_path / "d")
    state = {"layer": {"weight": torch.randn(3, 2)}, "meta": {"epoch": 4}}
    dcp.save(state, storage_writer=StoreWriter(uri), no_dist=True)
    store = Store(uri)
    manifest = open_step(store, 0)
    assert manifest.kind == KIND_DCP
    (index,) = load_rank_indexes(store, manifest)
    names = set(tensor_names(manifest, index).values())
    assert "layer.weight" in names
    assert "meta.epoch" in names  # a value DCP pickled, stored as bytes


def test_saves_in_flight_lists_legacy_markers_by_age(state_store: Store) -> None:
    young = {"step": 11, "attempt": "a1", "rank": 0, "created_at": time.time()}
    old = {"step": 10, "attempt": "a0", "rank": 0, "created_at": time.time() - 7 * 3600}
    state_store.put("pending/00000000000000000011-a1-00000.json", json.dumps(young).encode())
    state_store.put("pending/00000000000000000010-a0-00000.json", json.dumps(old).encode())
    found = {p["step"]: p for p in saves_in_flight(state_store)}
    assert found[11]["stale"] is False and found[11]["kind"] == "save"
    assert found[10]["stale"] is True
    # gc: the young marker blocks the sweep, the stale one is removed
    report = collect(state_store, keep_last=None)
    assert report.blocked_by == ["pending/00000000000000000011-a1-00000.json"]
    assert state_store.list("pending") == ["pending/00000000000000000011-a1-00000.json"]
