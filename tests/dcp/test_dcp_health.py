"""Healthy steps through the DCP front-end: ``StoreWriter`` records each floating item's NaN and
Inf counts and sum of squares (DTensor shards included) and judges the step over every rank;
``StoreReader(healthy=True)`` loads the newest healthy step."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ckptstore import HealthPolicy, Store
from ckptstore.catalog import list_steps, load_manifest
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.errors import NoHealthyStepError, UnhealthyStepError
from tests.helpers.dist import run_ranks
from tests.helpers.states import assert_same, blank_like

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


def _state(scale: float) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g) * scale,
            "b16": (torch.randn(33, generator=g) * scale).to(torch.bfloat16),
        },
        "optim": {"exp_avg": torch.full((12,), scale)},
        "ids": torch.arange(5),
        "step": 42,
    }


def _sumsq(state: dict) -> float:
    tensors = [*state["model"].values(), state["optim"]["exp_avg"]]
    return sum(float(t.double().square().sum()) for t in tensors)


def test_dcp_save_records_health_and_healthy_reader_goes_back(tmp_path, caplog):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri)
    good = _state(1.0)
    dcp.save(good, storage_writer=writer, no_dist=True)
    assert writer.last_save.healthy
    assert writer.last_save.norm == pytest.approx(math.sqrt(_sumsq(good)), rel=1e-6)
    bad = _state(2.0)
    bad["model"]["b16"][3] = float("inf")
    bad["optim"]["exp_avg"][:2] = float("nan")
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        dcp.save(bad, storage_writer=writer, no_dist=True)
    assert writer.last_save.status == "unhealthy"
    assert set(writer.last_save.worst) == {
        "rank 0 optim.exp_avg: 2 NaN, 0 Inf",
        "rank 0 model.b16: 0 NaN, 1 Inf",
    }
    assert sum("step 1 is unhealthy" in r.getMessage() for r in caplog.records) == 1
    store = Store(uri)
    assert list_steps(store) == [0, 1]
    assert not load_manifest(store, 1).health["healthy"]

    reader = StoreReader(uri, healthy=True)
    assert reader.latest() == 0 and StoreReader(uri).latest() == 1
    target = blank_like(good)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, good)
    skipped = [r.getMessage() for r in caplog.records if "skipped by healthy=True" in r.message]
    assert len(skipped) == 1 and "step 1: unhealthy" in skipped[0]
    reader = StoreReader(uri, step=1, healthy=True)
    with pytest.raises(CheckpointException, match=r"step 1: unhealthy .*\(healthy=True\)"):
        dcp.load(blank_like(good), storage_reader=reader, no_dist=True)
    with pytest.raises(UnhealthyStepError):  # what DCP wraps
        reader._step()


def test_dcp_on_unhealthy_skip_commits_nothing_and_no_healthy_step_is_not_found(tmp_path):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, health=HealthPolicy(on_unhealthy="skip"))
    bad = _state(1.0)
    bad["model"]["w"][0, 0] = float("nan")
    dcp.save(bad, storage_writer=writer, no_dist=True)
    assert writer.last_save.status == "unhealthy" and not writer.last_save.committed
    assert list_steps(Store(uri)) == []
    dcp.save(bad, storage_writer=StoreWriter(uri), no_dist=True)  # the default policy saves it
    assert list_steps(Store(uri)) == [0]
    reader = StoreReader(uri, healthy=True)
    with pytest.raises(NoHealthyStepError, match="no healthy committed step.*step 0: unhealthy"):
        reader.latest()  # not None, "nothing to resume": a job that started over saves over it
    with pytest.raises(NoHealthyStepError, match="no healthy committed step"):
        reader._step()
    assert StoreReader(str(tmp_path / "empty"), healthy=True).latest() is None


def _one_rank_nan(rank: int, world: int, uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {
        "w": torch.arange(40, dtype=torch.float32).reshape(8, 5),
        "h": torch.ones(6, 4).to(torch.bfloat16),
    }
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}}
    writer = StoreWriter(uri)
    dcp.save(state, storage_writer=writer)  # step 0: healthy
    if rank == 1:  # this rank's shards only
        state["model"]["w"].to_local()[0, 0] = float("nan")
        state["model"]["h"].to_local()[0, 1] = float("-inf")
    dcp.save(state, storage_writer=writer)  # step 1
    statuses = [None] * world
    dist.all_gather_object(statuses, writer.last_save and writer.last_save.status)
    assert statuses[0] == "unhealthy", statuses  # the coordinator judged the whole step
    target = {
        "model": {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()
        }
    }
    dcp.load(target, storage_reader=StoreReader(uri, healthy=True))
    for k, v in full.items():
        assert torch.equal(target["model"][k].full_tensor(), v), f"rank {rank}: {k}"


@pytest.mark.dist
def test_dcp_nan_in_one_ranks_shard_makes_the_step_unhealthy(tmp_path):
    uri = str(tmp_path / "s")
    run_ranks(_one_rank_nan, 2, uri)
    health = load_manifest(Store(uri), 1).health
    assert (health["nan"], health["inf"]) == (1, 1)
    assert {t["rank"] for t in health["worst"]} == {1}
    assert load_manifest(Store(uri), 0).health["healthy"]


def test_dcp_tiers_healthy_reader_takes_the_newest_healthy_copy(tmp_path, caplog):
    from ckptstore import TierOptions
    from tests.helpers.dcp_tiers import assert_loaded, blank_state, step_state

    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    tiers = TierOptions(local_dir=local, durable_every=2, local_keep_last=5)
    writer = StoreWriter(root, tiers=tiers)
    for step in (1, 2, 3):  # 1 durable and local, 2 local only, 3 durable and local (NaN)
        state = step_state(step)
        if step == 3:
            state["v"][7] = float("nan")
        dcp.save(state, storage_writer=writer, checkpoint_id=step, no_dist=True)
    writer.wait()
    assert not load_manifest(Store(root), 3).health["healthy"]
    reader = StoreReader(root, tiers=tiers, healthy=True)
    assert reader.latest() == 2 and StoreReader(root, tiers=tiers).latest() == 3
    target = blank_state()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert_loaded(target, 2)
    assert sum("step 3: unhealthy" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(CheckpointException, match="step 3: unhealthy"):
        dcp.load(blank_state(), storage_reader=StoreReader(root, tiers=tiers, step=3, healthy=True))
