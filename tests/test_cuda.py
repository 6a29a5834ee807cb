"""GPU staging: pinned buffers, copies on a side stream, and a state that stays exact when the
loop updates its tensors in place right after save() returns. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ckptstore import Checkpointer
from ckptstore.staging import Stager, StagingPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device: str = "cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "w": torch.randn(64, 2**18, generator=g, device=device),  # 64 MiB: the copy takes a while
        "b": torch.randn(4096, generator=g, device=device).to(torch.bfloat16),
        "step": torch.tensor(7, device=device),
    }


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


def test_in_place_updates_after_save_do_not_tear_the_staged_state(tmp_path):
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.engine.pool.pin_memory
        handle = ck.save(1, state)
        for _ in range(20):  # enqueued right behind the side-stream copy, on the loop's stream
            state["w"].mul_(-1.5).add_(1.0)
        handle.wait()
        restored = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.load(restored, step=1) == 1
    for key, value in expected.items():
        assert restored[key].device.type == "cuda"
        assert torch.equal(restored[key], value), key


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
    for _ in range(20):
        state["w"].mul_(-1.5).add_(1.0)
    future.result(timeout=120)
    assert writer.engine.pool.pin_memory
    restored = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(restored, storage_reader=StoreReader(str(tmp_path / "s")), no_dist=True)
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key
