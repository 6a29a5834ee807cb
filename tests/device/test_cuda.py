"""GPU staging and restore: pinned buffers, copies on side streams, device staging through a
reused device buffer, reserved pinned memory, and a state that stays exact when the loop
updates its tensors in place right after save() returns. The same behaviours as
tests/device/test_device_staging.py, on CUDA. Skipped without CUDA."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import ckptstore.device_load as device_load
import ckptstore.staging as staging
from ckptstore import Checkpointer, StagingOptions
from ckptstore.catalog import load_manifest
from ckptstore.device import Device, allocate_host
from ckptstore.staging import Stager, StagingPool
from ckptstore.steps import StepView
from tests.helpers.staged import assert_loads, saves_back_to_back_within_budgets, snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device: str = "cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "w": torch.randn(64, 2**18, generator=g, device=device),  # 64 MiB: the copy takes a while
        "b": torch.randn(4096, generator=g, device=device).to(torch.bfloat16),
        "step": torch.tensor(7, device=device),
    }


def _step(state: dict[str, torch.Tensor]) -> None:
    """The loop's next update, enqueued on its stream right behind save()."""
    for _ in range(20):
        state["w"].mul_(-1.5).add_(1.0)
    state["step"].add_(1)


def test_staging_buffers_are_pinned_and_reused():
    pool = StagingPool(pin_memory=True)
    stager = Stager()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    buf = pool.acquire(t.numel() * 4)
    assert buf.is_pinned()
    stager.copy(buf, [t], [0]).wait()
    assert torch.equal(buf.view(torch.float32).cpu(), t.cpu())
    pool.release(buf)
    again = pool.acquire(t.numel() * 4)
    assert pool.allocations == 1 and again.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("mode", ["host", "device"])
def test_in_place_updates_after_save_do_not_tear_the_staged_state(tmp_path, mode):
    state = _state()
    expected = snapshot(state)
    with Checkpointer(tmp_path / "ck", staging=mode) as ck:
        assert ck.engine.pool.pin_memory
        handle = ck.save(1, state)
        _step(state)
        handle.wait()
        assert_loads(ck, 1, expected)
        assert (ck.engine.device_pool is not None) == (mode == "device")


def test_auto_staging_puts_a_cuda_state_that_fits_on_the_device_after_the_first_save(tmp_path):
    state = _state()
    with Checkpointer(tmp_path / "ck") as ck:  # "auto", the default
        ck.reserve(state).result(timeout=60)
        ck.save(1, state).wait()  # before the loop's memory peak is known: through the host
        assert ck.engine.device_pool is None
        _step(state)
        ck.save(2, state).wait()
        assert ck.engine.device_pool is not None
        assert ck.engine.device_pool.device.device.type == "cuda"
        assert_loads(ck, 2, state)


def test_device_and_host_buffers_are_reused_across_saves(tmp_path):
    state = _state()
    expected = []
    with Checkpointer(tmp_path / "ck", staging="device") as ck:
        for step in range(3):
            expected.append(snapshot(state))
            ck.save(step, state).wait()
            _step(state)
        assert ck.engine.device_pool.allocations == 1 and ck.engine.pool.allocations == 1
        held = ck.engine.pool.acquire(1)
        assert held.is_pinned()
        ck.engine.pool.release(held)
        for step, values in enumerate(expected):
            assert_loads(ck, step, values)


def test_the_device_copy_alone_fences_the_loop_and_the_state_stays_exact(tmp_path):
    state = _state()
    expected = snapshot(state)
    with Checkpointer(tmp_path / "ck", staging="device") as ck:
        nbytes = ck.engine.staged_bytes(list(state.values()))
        held = ck.engine.pool.acquire(nbytes)  # the drain to host memory cannot start yet
        handle = ck.save(1, state)
        _step(state)
        torch.cuda.current_stream().synchronize()  # the loop's stream runs on, drain or not
        assert not handle.done()
        ck.engine.pool.release(held)
        handle.wait()
        assert_loads(ck, 1, expected)


def test_back_to_back_saves_stay_within_both_budgets(tmp_path):
    saves_back_to_back_within_budgets(tmp_path / "ck", _state(), _step)


def test_a_state_over_the_device_budget_is_staged_through_the_host(tmp_path, caplog):
    state = _state()
    with Checkpointer(
        tmp_path / "ck", staging=StagingOptions(mode="auto", device_budget_bytes=2**20)
    ) as ck:
        with caplog.at_level(logging.INFO, logger="ckptstore.save.engine"):
            for step in range(3):
                ck.save(step, state).wait()
        assert ck.engine.device_pool is None
        fallbacks = [r for r in caplog.records if "staging through host memory" in r.getMessage()]
        assert [r.levelno for r in fallbacks] == [logging.INFO]  # "auto": the policy, not news
        assert_loads(ck, 2, state)


def test_reserve_pins_the_host_buffer_ahead_in_slabs(tmp_path, monkeypatch):
    slabs: list[tuple[int, int]] = []

    def recording(nbytes, *, pin, slab_bytes, **kwargs):
        assert threading.current_thread() is not threading.main_thread()
        return allocate_host(
            nbytes, pin=pin, slab_bytes=slab_bytes, on_slab=lambda *s: slabs.append(s)
        )

    monkeypatch.setattr(staging, "allocate_host", recording)
    state = _state()
    with Checkpointer(tmp_path / "ck", staging="host") as ck:
        ck.engine.pool.slab_bytes = 8 * 2**20
        ck.reserve(state).result(timeout=120)
        assert len(slabs) > 1 and all(length <= 8 * 2**20 for _, length in slabs)
        held = ck.engine.pool.acquire(1)
        assert held.is_pinned()
        ck.engine.pool.release(held)
        expected = snapshot(state)
        handle = ck.save(1, state)  # into the reserved buffer, with a non-blocking copy
        _step(state)
        handle.wait()
        assert ck.engine.pool.allocations == 1
        assert_loads(ck, 1, expected)


def test_restore_into_cuda_tensors_goes_through_pinned_batches(tmp_path, monkeypatch):
    calls = []
    original = device_load.read_to_device

    def counting(*args, **kwargs):
        calls.append(kwargs["device"])
        return original(*args, **kwargs)

    monkeypatch.setattr(device_load, "read_to_device", counting)
    state = _state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).wait()
        assert_loads(ck, 1, state)
        assert [d.device.type for d in calls] == ["cuda"]
        index = StepView(ck.store, load_manifest(ck.store, 1)).index(0)
        dests = {i: torch.zeros_like(t) for i, t in enumerate(state.values())}
        written: set[int] = set()
        original(
            ck.store,
            index,
            dests,
            ck.engine.config,
            device=Device("cuda"),
            written=written,
            batch_bytes=2**20,
        )
        assert written == set(dests)
        for i, value in enumerate(state.values()):
            assert torch.equal(dests[i], value), i


def test_cuda_state_restores_into_cpu_tensors(tmp_path):
    state = _state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, state).wait()
        restored = {k: torch.empty_like(v, device="cpu") for k, v in state.items()}
        ck.load(restored)
    for key, value in state.items():
        assert torch.equal(restored[key], value.cpu()), key


def test_dcp_async_save_stages_cuda_state_before_it_changes(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreReader, StoreWriter

    state = _state()
    expected = {k: v.cpu() for k, v in state.items()}
    writer = StoreWriter(str(tmp_path / "s"))
    future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    _step(state)
    future.result(timeout=120)
    assert writer.engine.pool.pin_memory
    restored = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(restored, storage_reader=StoreReader(str(tmp_path / "s")), no_dist=True)
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key
