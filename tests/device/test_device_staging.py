"""Device staging, reserved host memory and the overlapped restore, on the cpu "device": the
same code as on an accelerator (``ckptstore.device``), each copy finished when it is made.
tests/device/test_cuda.py holds the same behaviours on CUDA."""

from __future__ import annotations

import gc
import logging
import threading
from pathlib import Path

import pytest
import torch

import ckptstore.staging as staging
from ckptstore import Checkpointer, EncodingOptions, StagingOptions
from ckptstore.catalog import load_manifest
from ckptstore.device import Device, allocate_host
from ckptstore.device_load import read_to_device
from ckptstore.errors import CheckpointCorruptError
from ckptstore.format import chunk_key
from ckptstore.save.engine import SaveEngine
from ckptstore.steps import StepView
from tests.helpers.staged import assert_loads, saves_back_to_back_within_budgets, snapshot

FALLBACK = "staging through host memory"


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 512, generator=g),  # 512 KiB
        "b": torch.randn(300, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (77,), generator=g),
        "empty": torch.zeros(0),
    }


def test_device_buffer_and_host_buffer_are_reused_across_saves(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path / "ck", staging="device") as ck:
        expected = []
        for step in range(3):
            expected.append(snapshot(state))
            ck.save(step, state).wait()
            state["w"].add_(1.0)
        device_pool = ck.engine.device_pool
        assert device_pool is not None and device_pool.device.device == torch.device("cpu")
        assert device_pool.allocations == 1
        assert ck.engine.pool.allocations == 1
        for step, values in enumerate(expected):
            assert_loads(ck, step, values)


def test_back_to_back_saves_stay_within_both_budgets(tmp_path):
    def update(state):
        state["w"].mul_(-1.0).add_(0.5)

    saves_back_to_back_within_budgets(tmp_path / "ck", make_state(), update)


def test_a_state_over_the_device_budget_is_staged_through_the_host_with_one_log_line(
    tmp_path, caplog
):
    state = make_state()
    small = {"bias": torch.randn(1000)}
    with Checkpointer(
        tmp_path / "ck", staging=StagingOptions(mode="device", device_budget_bytes=64 * 1024)
    ) as ck:
        with caplog.at_level(logging.WARNING, logger="ckptstore.save.engine"):
            for step in range(3):
                ck.save(step, state).wait()
            assert ck.engine.device_pool is None  # no device memory was taken
            assert [r.getMessage() for r in caplog.records].count(
                f"rank 0: {FALLBACK}: {ck.engine.staged_bytes(list(state.values()))} bytes of "
                "state exceed the device staging budget of 65536 bytes"
            ) == 1
            ck.save(3, small).wait()  # fits: staged on the device again
            assert ck.engine.device_pool.allocations == 1
            ck.save(4, state).wait()  # over again: said again, once
            ck.save(5, state).wait()
        assert sum(FALLBACK in r.getMessage() for r in caplog.records) == 2
        assert_loads(ck, 5, state)
        assert_loads(ck, 3, small)


def test_auto_staging_keeps_a_cpu_state_on_the_host(tmp_path, caplog):
    state = make_state()
    with Checkpointer(tmp_path / "ck", staging="host") as host:
        assert host.engine.staging == "host"
    with Checkpointer(tmp_path / "ck") as ck:  # auto by default since the H100 run of issue 35
        assert ck.engine.staging == "auto"
        with caplog.at_level(logging.WARNING, logger="ckptstore.save.engine"):
            ck.save(1, state).wait()
        assert ck.engine.device_pool is None and ck.engine.pool.allocations == 1
        assert not [r for r in caplog.records if FALLBACK in r.getMessage()]


def _fake_accelerator(monkeypatch, *, free: int, reserved: int, peak: int) -> Device:
    """A "cuda:0" whose memory figures are given: the CPU has no accelerator to ask."""
    figures = {"free": free, "reserved": reserved, "peak": peak}
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda d: (figures["free"], 80))
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda d: figures["reserved"])
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda d: figures["peak"])
    device = Device("cuda:0")
    device.figures = figures
    return device


def test_device_free_memory_leaves_the_loops_peak_and_cached_blocks_alone(monkeypatch):
    # The allocator's cached blocks (activations between steps) are the loop's: not free.
    device = _fake_accelerator(monkeypatch, free=40 << 30, reserved=30 << 30, peak=30 << 30)
    assert device.free_bytes() == 40 << 30
    # After empty_cache() the loop's next step takes 10 GiB back from the free memory.
    device.figures.update(reserved=20 << 30)
    assert device.free_bytes() == 30 << 30
    device.figures.update(free=5 << 30)
    assert device.free_bytes() == 0


def test_auto_staging_stages_its_first_save_through_the_host(monkeypatch, caplog):
    device = _fake_accelerator(monkeypatch, free=40 << 30, reserved=1 << 30, peak=1 << 30)
    monkeypatch.setattr(Device, "of", classmethod(lambda cls, tensors: device))
    tensors = list(make_state().values())
    auto = SaveEngine(staging="auto")
    # A reservation before the first save, then the first save: the loop's peak is unknown.
    assert auto._staging_device(tensors, 1 << 20, 0, reserving=True) is None
    assert auto._staging_device(tensors, 1 << 20, 0) is None
    assert auto._staging_device(tensors, 1 << 20, 0) is device  # a step ran since
    with caplog.at_level(logging.INFO, logger="ckptstore.save.engine"):
        assert auto._staging_device(tensors, 30 << 30, 0) is None  # over half the free memory
    assert [r.levelno for r in caplog.records if FALLBACK in r.getMessage()] == [logging.INFO]
    # A device budget given, or staging="device": the device from the first save.
    budgeted = SaveEngine(staging="auto", device_staging_budget_bytes=2 << 20)
    assert budgeted._staging_device(tensors, 1 << 20, 0) is device
    assert SaveEngine(staging="device")._staging_device(tensors, 1 << 20, 0) is device


def test_in_place_updates_right_after_save_do_not_tear_the_staged_state(tmp_path):
    state = make_state()
    expected = snapshot(state)
    with Checkpointer(tmp_path / "ck", staging="device") as ck:
        nbytes = ck.engine.staged_bytes(list(state.values()))
        held = ck.engine.pool.acquire(nbytes)  # the host buffer: the drain cannot copy yet
        handle = ck.save(1, state)
        for _ in range(5):  # the loop's next steps, while the save's bytes are on the device
            state["w"].mul_(-1.5).add_(1.0)
            state["ids"].add_(3)
        assert not handle.done()
        assert ck.engine.device_pool.allocated_bytes == nbytes
        ck.engine.pool.release(held)
        handle.wait()
        assert_loads(ck, 1, expected)


def test_a_failed_drain_surfaces_at_wait_and_gives_both_buffers_back(tmp_path, monkeypatch):
    state = make_state()
    with Checkpointer(tmp_path / "ck", staging="device") as ck:
        ck.save(0, state).wait()
        acquire = ck.engine.pool.acquire

        def failing(nbytes, **kwargs):
            raise MemoryError("no host memory left")

        monkeypatch.setattr(ck.engine.pool, "acquire", failing)
        handle = ck.save(1, state)
        with pytest.raises(MemoryError, match="no host memory left"):
            handle.wait()
        monkeypatch.setattr(ck.engine.pool, "acquire", acquire)
        ck.save(2, state).wait()  # neither buffer was left held
        assert ck.engine.device_pool.allocations == 1 and ck.engine.pool.allocations == 1
        assert ck.steps() == [0, 2]


def test_reserve_allocates_the_host_buffer_ahead_in_slabs_off_the_callers_thread(
    tmp_path, monkeypatch
):
    slabs: list[tuple[int, int, int]] = []

    def recording(nbytes, *, pin, slab_bytes, **kwargs):
        def on_slab(start: int, length: int) -> None:
            slabs.append((start, length, threading.get_ident()))

        return allocate_host(nbytes, pin=pin, slab_bytes=slab_bytes, on_slab=on_slab)

    monkeypatch.setattr(staging, "allocate_host", recording)
    state = make_state()
    with Checkpointer(tmp_path / "ck", staging="host") as ck:
        ck.engine.pool.slab_bytes = 64 * 1024
        nbytes = ck.engine.staged_bytes(list(state.values()))
        ck.reserve(state).result(timeout=60)
        assert ck.engine.pool.allocations == 1 and ck.engine.pool.allocated_bytes == nbytes
        assert len(slabs) == -(-nbytes // (64 * 1024)) > 1
        assert all(length <= 64 * 1024 for _, length, _ in slabs)
        assert sum(length for _, length, _ in slabs) == nbytes
        assert {ident for _, _, ident in slabs} != {threading.get_ident()}
        ck.save(1, state).wait()  # found the reserved buffer
        assert ck.engine.pool.allocations == 1
        ck.reserve(nbytes).result(timeout=60)  # a byte count; the buffer is there already
        assert ck.engine.pool.allocations == 1
        assert_loads(ck, 1, state)


def test_a_save_during_a_reservation_waits_for_it_instead_of_allocating(tmp_path, monkeypatch):
    go = threading.Event()
    started = threading.Event()

    def slow(nbytes, *, pin, slab_bytes, **kwargs):
        started.set()
        assert go.wait(60)
        return allocate_host(nbytes, pin=pin, slab_bytes=slab_bytes)

    monkeypatch.setattr(staging, "allocate_host", slow)
    state = make_state()
    with Checkpointer(tmp_path / "ck", staging="host") as ck:
        reserved = ck.reserve(state)
        assert started.wait(60)
        saved = threading.Thread(target=lambda: ck.save(1, state).wait())
        saved.start()
        go.set()
        saved.join(60)
        reserved.result(timeout=60)
        assert ck.engine.pool.allocations == 1
        assert ck.steps() == [1]


def test_reserve_of_a_device_staged_state_allocates_its_device_buffer_too(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path / "ck", staging="device") as ck:
        ck.reserve(state).result(timeout=60)
        assert ck.engine.device_pool.allocations == 1 and ck.engine.pool.allocations == 1
        ck.save(1, state).wait()  # staged into both reserved buffers: nothing allocated
        assert ck.engine.device_pool.allocations == 1 and ck.engine.pool.allocations == 1
        assert_loads(ck, 1, state)
    with Checkpointer(tmp_path / "ck2", staging="host") as ck:
        ck.reserve(state).result(timeout=60)
        assert ck.engine.device_pool is None and ck.engine.pool.allocations == 1


def test_reserve_refuses_nothing_to_reserve(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(ValueError, match="positive"):
        ck.reserve(0)


def test_allocate_host_covers_the_buffer_in_bounded_slabs():
    seen: list[tuple[int, int]] = []
    buf = allocate_host(
        10 * 4096 + 5, pin=False, slab_bytes=4 * 4096, on_slab=lambda *s: seen.append(s)
    )
    assert buf.numel() == 10 * 4096 + 5 and buf.dtype == torch.uint8
    assert seen == [(0, 4 * 4096), (4 * 4096, 4 * 4096), (8 * 4096, 2 * 4096 + 5)]
    with pytest.raises(ValueError, match="multiple of 4096"):
        allocate_host(100, pin=False, slab_bytes=1000)


# -- restore into device tensors ----------------------------------------------------------------


def restore_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(40_000, generator=g),  # 160 KB: a batch of its own
        "b": torch.randn(100, 30, generator=g).to(torch.bfloat16),
        "c": torch.randint(-5, 5, (3000,), generator=g, dtype=torch.int32),
        "d": torch.randn(20_000, generator=g).double(),
        "e": torch.zeros(0, 4),
        "f": torch.randn(7, generator=g),
    }


def saved_index(tmp_path: Path, state: dict[str, torch.Tensor], **kwargs):
    ck = Checkpointer(
        tmp_path / "ck",
        encoding=EncodingOptions(compression="none", chunk_bytes=64 * 1024),
        **kwargs,
    )
    ck.save(1, state).wait()
    index = StepView(ck.store, load_manifest(ck.store, 1)).index(0)
    return ck, index


def restore_on_cpu_device(ck: Checkpointer, index, dests, written: set[int]):
    """``read_to_device`` with batches small enough that the state takes several."""
    cfg = ck.engine.config
    device = Device("cpu")
    return read_to_device(
        ck.store, index, dests, cfg, device=device, written=written, batch_bytes=48 * 1024
    )


def test_the_overlapped_restore_fills_device_tensors_exactly(tmp_path):
    state = restore_state()
    ck, index = saved_index(tmp_path, state)
    with ck:
        dests = {i: torch.full_like(t, 7) for i, t in enumerate(state.values())}
        dests[1] = torch.zeros(30, 100, dtype=torch.bfloat16).t()  # a strided destination
        written: set[int] = set()
        out = restore_on_cpu_device(ck, index, dests, written)
        assert written == set(dests)
        for i, value in enumerate(state.values()):
            assert out[i] is dests[i]
            assert torch.equal(dests[i], value), i


def test_an_overlapped_restore_that_fails_names_only_the_batches_it_copied(tmp_path):
    state = restore_state()
    ck, index = saved_index(tmp_path, state)
    with ck:
        last = max(i for i, e in enumerate(index.tensors) if e.segments)
        digest = index.tensors[last].segments[-1].chunk
        path = Path(ck.store.uri.removeprefix("file://")) / chunk_key(digest)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(raw))
        dests = {i: torch.zeros_like(t) for i, t in enumerate(state.values())}
        written: set[int] = set()
        with pytest.raises(CheckpointCorruptError):
            restore_on_cpu_device(ck, index, dests, written)
        assert last not in written and written  # earlier batches were copied, not the last
        for i in written:
            assert torch.equal(dests[i], list(state.values())[i])
        untouched = set(dests) - written
        assert all(not dests[i].any() for i in untouched)


def test_checkpointer_load_into_cpu_tensors_keeps_the_host_path(tmp_path, monkeypatch):
    import ckptstore.device_load as device_load

    def refuse(*args, **kwargs):
        raise AssertionError("host tensors went through the device path")

    monkeypatch.setattr(device_load, "read_to_device", refuse)
    state = restore_state()
    ck, _ = saved_index(tmp_path, state)
    with ck:
        assert_loads(ck, 1, state)


# -- ckptbench --device ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the flag is accepted")
@pytest.mark.parametrize("command", ["save", "restore", "interference"])
def test_bench_refuses_device_cuda_in_one_line_without_cuda(command, capsys, tmp_path):
    from bench.cli import main

    assert main([command, "--device", "cuda", "--size", "1MiB", "--uri", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ckptbench {command}: error: --device cuda: no CUDA device is available "
        f"(torch {torch.__version__})"
    )
    assert list(tmp_path.iterdir()) == []  # refused before any work


def test_a_pinned_host_buffer_is_locked_by_one_registration(monkeypatch):
    # A copy whose host range spans two cudaHostRegister'd ranges fails on CUDA ("invalid
    # argument"), so the slabs fault the pages in and one registration locks the whole buffer.
    from ckptstore import device as device_module

    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []
    monkeypatch.setattr(device_module, "host_pins_in_slabs", lambda: True)
    monkeypatch.setattr(device_module, "_register", lambda p, n: registered.append((p, n)))
    monkeypatch.setattr(device_module, "_unregister", lambda ps: unregistered.extend(ps))
    buf = allocate_host(10 * 4096 + 5, pin=True, slab_bytes=4 * 4096)
    ((start, length),) = registered
    assert start % 4096 == 0 and start <= buf.data_ptr() < start + 4096
    assert start + length == buf.data_ptr() + buf.numel()
    del buf
    gc.collect()
    assert unregistered == [start]
