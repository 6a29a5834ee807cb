"""DCP's resharding through ``StoreWriter`` / ``StoreReader`` gives what it gives through torch's
own ``FileSystemWriter`` / ``FileSystemReader``.

Each state is saved through both backends and loaded back through both into the same
templates: every placement of a DTensor on a 1-D mesh of 4 ranks and on a 2-D (2, 2) mesh, into
every placement on either mesh (uneven shards, and a rank whose shard is empty, included); and,
on 2 ranks, ShardedTensors of uneven shards swapped with plain tensors, and pickled values. The
two loads must agree shard for shard, and with the tensor saved.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ckptstore.dcp import StoreReader, StoreWriter
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.dist


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        # 7 rows: shards of 2, 2, 2, 1 over 4 ranks; 6 columns: 2, 2, 2 and an empty one.
        "w": torch.randn(7, 6, generator=g),
        "ids": torch.randint(-1000, 1000, (9, 4), generator=g),
    }


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    return [
        ("1d", (s0,)),
        ("1d", (s1,)),
        ("1d", (r,)),
        ("2d", (r, r)),
        ("2d", (r, s0)),
        ("2d", (s0, r)),
        ("2d", (s0, s0)),
        ("2d", (s0, s1)),
        ("2d", (s1, s0)),
    ]


def _both(state: dict, step: int, directory: Path, writer: StoreWriter) -> None:
    dcp.save(state, storage_writer=writer, checkpoint_id=step)
    dcp.save(state, storage_writer=FileSystemWriter(directory))
    assert writer.saved_step == step


def _load_both(make, step: int, store: str, directory: Path) -> tuple[dict, dict]:
    ours, torchs = make(), make()
    dcp.load(ours, storage_reader=StoreReader(store, step=step))
    dcp.load(torchs, storage_reader=FileSystemReader(directory))
    return ours, torchs


def _dtensor_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {"1d": init_device_mesh("cpu", (world,)), "2d": init_device_mesh("cpu", (2, 2))}
    full = _full()
    placements = _placements()
    store = f"{root}/store"
    writer = StoreWriter(store)

    def sharded(values, mesh, placement):
        return {k: distribute_tensor(v, meshes[mesh], list(placement)) for k, v in values.items()}

    for step, (mesh, placement) in enumerate(placements):
        directory = Path(root) / f"fs-{step}"
        _both(sharded(full, mesh, placement), step, directory, writer)
        for mesh2, placement2 in placements:
            zeros = {k: torch.zeros_like(v) for k, v in full.items()}
            ours, torchs = _load_both(
                lambda z=zeros, m=mesh2, p=placement2: sharded(z, m, p), step, store, directory
            )
            case = f"rank {rank}: {mesh} {placement} -> {mesh2} {placement2}"
            for k, v in full.items():
                assert ours[k].placements == torchs[k].placements, case
                assert torch.equal(ours[k].to_local(), torchs[k].to_local()), f"{case}: {k}"
                assert torch.equal(ours[k].full_tensor(), v), f"{case}: {k}"


@pytest.mark.slow
def test_every_dtensor_placement_reshards_as_through_torchs_file_system_writer(tmp_path):
    run_ranks(_dtensor_worker, 4, str(tmp_path), timeout_s=240.0)


def _sharded_tensor_specs(size: int) -> list:
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    def shards(*pieces):
        out, offset = [], 0
        for length, rank in pieces:
            out.append(ShardMetadata([offset], [length], f"rank:{rank}/cpu"))
            offset += length
        return EnumerableShardingSpec(out)

    return [
        ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]),
        ChunkShardingSpec(dim=0, placements=["rank:1/cpu", "rank:0/cpu", "rank:0/cpu"]),
        shards((3, 1), (size - 3, 0)),
        shards((5, 0), (2, 1), (size - 7, 0)),
    ]


def _gather(tensor) -> torch.Tensor:
    out = torch.zeros(tensor.size()) if dist.get_rank() == 0 else None
    tensor.gather(out=out)
    return out


def _sharded_tensor_worker(rank: int, world: int, root: str) -> None:
    warnings.simplefilter("ignore")  # ShardedTensor is deprecated in favour of DTensor
    from torch.distributed._shard import sharded_tensor

    size = 13
    store = f"{root}/store"
    writer = StoreWriter(store)
    step = 0
    for save_spec in _sharded_tensor_specs(size):
        for load_spec in _sharded_tensor_specs(size):
            replicated = torch.rand(size)
            dist.broadcast(replicated, src=0)
            state = {
                "sharded": sharded_tensor.rand(save_spec, size),
                "replicated": replicated,
                "values": {"lr": 0.25, "names": ["a", "b"], "epoch": step},
            }
            directory = Path(root) / f"fs-{step}"
            _both(state, step, directory, writer)

            def swapped(spec=load_spec):
                # The sharded tensor loads into a plain one, the plain one into shards.
                return {
                    "sharded": torch.zeros(size),
                    "replicated": sharded_tensor.zeros(spec, size),
                    "values": {"lr": 0.0, "names": [], "epoch": -1},
                }

            ours, torchs = _load_both(swapped, step, store, directory)
            case = f"rank {rank}: {save_spec} -> {load_spec}"
            assert torch.equal(ours["sharded"], torchs["sharded"]), case
            for mine, theirs in zip(
                ours["replicated"].local_shards(), torchs["replicated"].local_shards(), strict=True
            ):
                assert torch.equal(mine.tensor, theirs.tensor), case
            assert ours["values"] == torchs["values"] == state["values"], case
            saved = _gather(state["sharded"])
            loaded = _gather(ours["replicated"])
            if rank == 0:
                assert torch.equal(ours["sharded"], saved), case
                assert torch.equal(loaded, replicated), case
            step += 1


@pytest.mark.slow
def test_sharded_tensors_swapped_with_plain_ones_load_as_through_torchs_writer(tmp_path):
    run_ranks(_sharded_tensor_worker, 2, str(tmp_path), timeout_s=240.0)
