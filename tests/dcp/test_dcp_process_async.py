"""ckptstore.dcp: ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` through StoreWriter
(DCP's checkpoint process, its own gloo group, real files and moto S3), loaded back bit for bit."""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ckptstore.catalog import list_steps
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.options import TierOptions
from ckptstore.store import Store
from tests.helpers.dist import run_ranks
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.filterwarnings(
    "ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning"
)


def _state(rank: int, salt: float) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + int(salt))
    return {
        "shared": torch.arange(12.0) + salt,
        f"rank{rank}": {
            "w": torch.randn(33, 7, generator=g),
            "h": torch.randn(20, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-99, 99, (11,), generator=g),
        },
        "step_count": int(salt),
    }


def _zeros_like(state: dict) -> dict:
    return {
        k: (_zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v))
        if not isinstance(v, int)
        else 0
        for k, v in state.items()
    }


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_same(got[k], v, f"{where}/{k}")
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{where}/{k}"
        else:
            assert got[k] == v, f"{where}/{k}"


def _process_worker(rank: int, world: int, uri: str, stager: str) -> None:
    # DCP's checkpoint process builds its gloo group at MASTER_ADDR (the host's name if unset).
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    writer = StoreWriter(uri)
    for salt, checkpoint_id, step in ((1.0, None, 0), (2.0, 7, 7)):
        async_stager = (
            DefaultStager(StagingOptions(False, True, False, False))
            if stager == "default"
            else None
        )
        response = dcp.async_save(
            _state(rank, salt),
            storage_writer=writer,
            checkpoint_id=checkpoint_id,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=async_stager,
        )
        future = getattr(response, "upload_completion", response)
        future.result(timeout=120)
        if async_stager is not None:
            async_stager.close()
        else:  # the staging buffer went to shared memory, and is handed back all the same
            assert wait_until(lambda: (gc.collect(), not writer._staged)[1], timeout_s=30), (
                f"rank {rank}: staging still held after step {step}"
            )
        target = _zeros_like(_state(rank, salt))
        dcp.load(target, storage_reader=StoreReader(uri, step=step))
        _assert_same(target, _state(rank, salt), f"rank {rank} step {step}")


def _check_whole(uri: str, world: int) -> None:
    assert list_steps(Store(uri)) == [0, 7]
    for salt, step in ((1.0, 0), (2.0, 7)):
        want: dict = {}
        for rank in range(world):
            want.update(_state(rank, salt))
        target = _zeros_like(want)
        dcp.load(target, storage_reader=StoreReader(uri, step=step), no_dist=True)
        _assert_same(target, want, f"step {step}")


@pytest.mark.dist
@pytest.mark.parametrize("stager", ["writer", "default"])
def test_process_async_save_on_two_ranks_local(tmp_path, stager):
    uri = str(tmp_path / "s")
    run_ranks(_process_worker, 2, uri, stager, timeout_s=300)
    _check_whole(uri, 2)


@pytest.mark.dist
def test_process_async_save_on_two_ranks_s3(s3_uri):
    run_ranks(_process_worker, 2, s3_uri, "writer", timeout_s=300)
    _check_whole(s3_uri, 2)


def test_writer_pickles_its_configuration(tmp_path):
    writer = StoreWriter(str(tmp_path / "s"), step=4, keep_last=2)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy is not writer and copy.step == 4 and copy.store.uri == writer.store.uri
    dcp.save({"x": torch.arange(5.0)}, storage_writer=copy, no_dist=True)
    target = {"x": torch.zeros(5)}
    dcp.load(target, storage_reader=StoreReader(str(tmp_path / "s"), step=4), no_dist=True)
    assert torch.equal(target["x"], torch.arange(5.0))


def test_the_checkpoint_process_rebuilds_each_writer_once_and_keeps_the_newest_few(tmp_path):
    from ckptstore.dcp import writer as writer_module

    writers = [StoreWriter(str(tmp_path / f"s{i}")) for i in range(6)]
    # As DCP's checkpoint process sees them: pickled in another process (pid -1).
    again = [(w._token, -1, w._config, 3) for w in writers]
    first = writer_module._writer_in_process(*again[0])
    assert writer_module._writer_in_process(*again[0]) is first and first.step == 3
    for args in again[1:]:
        writer_module._writer_in_process(*args)
    kept = writer_module._REBUILT
    assert list(kept) == [w._token for w in writers[-writer_module._REBUILT_KEPT :]]
    assert writer_module._writer_in_process(*again[0]) is not first  # evicted, rebuilt
    kept.clear()


def test_tiered_writer_is_refused_by_the_checkpoint_process(tmp_path):
    writer = StoreWriter(str(tmp_path / "s"), tiers=TierOptions(local_dir=str(tmp_path / "l")))
    try:
        with pytest.raises(TypeError, match="cannot be sent to DCP's checkpoint process"):
            pickle.dumps(writer)
    finally:
        writer.close()


def _tiered_worker(rank: int, world: int, uri: str, local_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    writer = StoreWriter(uri, tiers=TierOptions(local_dir=local_dir))
    try:
        future = dcp.async_save(
            _state(rank, 1.0),
            storage_writer=writer,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        with pytest.raises(TypeError, match=r"TierOptions\(local_dir=\.\.\.\)\) cannot be sent"):
            getattr(future, "upload_completion", future).result(timeout=120)
    finally:
        writer.close()


@pytest.mark.dist
def test_tiered_process_async_save_fails_clearly_on_two_ranks(tmp_path):
    uri = str(tmp_path / "s")
    run_ranks(_tiered_worker, 2, uri, str(tmp_path / "local"), timeout_s=300)
    assert list_steps(Store(uri)) == []
