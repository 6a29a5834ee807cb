"""Checkpointer: exact round trips, dedup, retention, async behaviour, errors."""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.faults import Faults, with_faults
from ckptstore import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointNotFoundError,
    EncodingOptions,
    FormatVersionError,
    ReadOptions,
    RetryPolicy,
    StagingOptions,
    StepExistsError,
    StorageError,
    StorageOptions,
    Store,
    UnsupportedStateError,
)
from ckptstore.catalog import list_steps
from ckptstore.format import commit_key
from tests.helpers.crafted import sealed
from tests.helpers.dist import run_ranks


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16, generator=g)).sum().backward()
    opt.step()
    base = torch.randn(40, 30, generator=g)
    return {
        "model": model,
        "optim": opt,
        "tensors": {
            "f32": torch.randn(1000, generator=g),
            "f64": torch.randn(7, 3, generator=g, dtype=torch.float64),
            "bf16": torch.randn(33, 17, generator=g).bfloat16(),
            "f16": torch.randn(5, generator=g).half(),
            "i64": torch.randint(-(2**40), 2**40, (9,), generator=g),
            "i8": torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (11,), generator=g, dtype=torch.uint8),
            "bool": torch.rand(23, generator=g) > 0.5,
            "c64": torch.randn(4, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 5),
            "transposed": base.t(),
            "strided": base[::3, 1::2],
            "view": base[5:9],
            "expanded": torch.randn(1, 6, generator=g).expand(4, 6),
        },
        "numpy": np.arange(12, dtype=np.int32).reshape(3, 4) * (seed + 1),
        "step": 41 + seed,
        "lr": 0.5,
        "inf": float("inf"),
        "name": "run-é",
        "none": None,
        "blob": b"\x00\xffraw",
        "pair": (1, "two", [3.0]),
        "int_keys": {0: "a", 7: "b"},
        "nested": [{"a": [1, 2, {"b": torch.ones(2)}]}],
        "rng": torch.get_rng_state(),
        "py_rng": random.Random(seed).getstate(),
        "np_rng": np.random.RandomState(seed).get_state(),
    }


def blank_state() -> dict:
    state = make_state(seed=99)
    for t in state["tensors"].values():
        if t.numel() and not t.is_complex() and t.dtype != torch.bool:
            t.zero_() if t.is_contiguous() or t._base is None else None
    return state


def assert_same(a, b, path="state"):
    if isinstance(a, torch.nn.Module) or isinstance(a, torch.optim.Optimizer):
        assert_same(a.state_dict(), b.state_dict(), path)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_round_trip_is_exact(store_uri):
    saved = make_state()
    with Checkpointer(store_uri) as ckpt:
        ckpt.save(10, saved).wait()
        assert ckpt.steps() == [10] and ckpt.latest() == 10
    target = make_state(seed=5)
    model_weight = target["model"][0].weight
    with Checkpointer(store_uri) as ckpt:
        assert ckpt.load(target) == 10
    assert_same(saved, target)
    assert target["model"][0].weight is model_weight  # loaded in place


def test_large_tensors_split_and_small_ones_packed(tmp_path):
    state = {"big": torch.randn(300_000), "small": [torch.randn(10) for _ in range(50)]}
    with Checkpointer(tmp_path, encoding=EncodingOptions(chunk_bytes=64 * 1024)) as ckpt:
        ckpt.save(1, state).wait()
    chunks = list((tmp_path / "chunks").rglob("*"))
    n_chunks = len([c for c in chunks if c.is_file()])
    # 1.2 MB in 64 KiB pieces, plus one pack for the 50 small tensors
    assert n_chunks == -(-300_000 * 4 // (64 * 1024)) + 1
    target = {"big": torch.zeros(300_000), "small": [torch.zeros(10) for _ in range(50)]}
    Checkpointer(tmp_path).load(target)
    assert_same(state, target)


def test_unchanged_chunks_are_not_written_again(tmp_path):
    state = {"frozen": torch.randn(100_000), "moving": torch.randn(100_000)}
    with Checkpointer(tmp_path, encoding=EncodingOptions(chunk_bytes=64 * 1024)) as ckpt:
        ckpt.save(1, state).wait()
        before = {p for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
        state["moving"] += 1
        ckpt.save(2, state).wait()
        after = {p for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
    new = after - before
    assert 0 < len(new) <= len(before) // 2 + 1  # only the moving tensor's chunks


def test_save_copies_state_before_returning(tmp_path):
    state = {"w": torch.ones(1000)}
    with Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, state)
        state["w"].fill_(7.0)  # the training loop moves on
        handle.wait()
    target = {"w": torch.zeros(1000)}
    Checkpointer(tmp_path).load(target)
    assert torch.equal(target["w"], torch.ones(1000))


def test_staging_buffer_is_reused(tmp_path):
    state = {"w": torch.randn(50_000)}
    with Checkpointer(tmp_path) as ckpt:
        for step in range(4):
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.engine.pool.allocations == 1
        assert ckpt.engine.pool.allocated_bytes < 50_000 * 4 + 4096


def test_when_busy_skip_never_doubles_memory(tmp_path, caplog):
    faults = Faults(latency=None, slow_rate=1.0, slow_s=0.3, ops=frozenset({"put"}))
    store = with_faults(Store(tmp_path), faults)
    state = {"w": torch.randn(10_000)}
    with Checkpointer(
        tmp_path, storage=StorageOptions(store=store), staging=StagingOptions(when_busy="skip")
    ) as ckpt:
        first = ckpt.save(1, state)
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            second = ckpt.save(2, state)
        assert second.skipped and not first.skipped
        assert any("skipping save of step 2" in r.getMessage() for r in caplog.records)
        first.wait()
        assert ckpt.engine.pool.allocations == 1
        assert ckpt.steps() == [1]


def test_a_save_whose_staging_copy_fails_hands_its_buffer_back(tmp_path, monkeypatch):
    """Reviewer: a copy torch refused (a uint3 tensor: copy_kernel not implemented) kept the
    staging buffer, and the next save waited for it for ever (skipped, with when_busy="skip")."""
    state = {"w": torch.randn(10_000)}
    with Checkpointer(tmp_path, staging=StagingOptions(when_busy="skip")) as ckpt:
        copy = ckpt.engine.stager.copy

        def refused(*args, **kwargs):
            monkeypatch.setattr(ckpt.engine.stager, "copy", copy)
            raise NotImplementedError("\"copy_kernel\" not implemented for 'UInt3'")

        monkeypatch.setattr(ckpt.engine.stager, "copy", refused)
        with pytest.raises(NotImplementedError, match="copy_kernel"):
            ckpt.save(1, state)
        second = ckpt.save(2, state)
        assert not second.skipped
        second.wait()
        assert ckpt.steps() == [2]
        assert ckpt.engine.pool.allocations == 1


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs os.setpriority")
def test_background_nice_lowers_only_the_save_threads(tmp_path):
    import threading

    def nice_of(native_id: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, native_id)

    mine = nice_of(threading.get_native_id())
    if mine > 14:
        pytest.skip(f"this process already runs at nice {mine}")
    with Checkpointer(tmp_path / "ck", storage=StorageOptions(background_nice=5)) as ck:
        ck.save(0, {"x": torch.arange(1000.0)}).wait()
        encode = ck.store.submit(lambda: nice_of(threading.get_native_id())).result(timeout=10)
        request = ck.store._request("probe", "", lambda: nice_of(threading.get_native_id()))
        assert nice_of(ck._saver._thread.native_id) == mine + 5
        assert encode == mine + 5 and request == mine + 5
    assert nice_of(threading.get_native_id()) == mine  # the loop's thread keeps its priority
    with pytest.raises(ValueError, match="background_nice"):
        Checkpointer(tmp_path / "bad", storage=StorageOptions(background_nice=25))


def test_staging_budget_is_enforced(tmp_path):
    """Named by the option that sets it (resource reviewer: it named the deprecated keyword)."""
    with Checkpointer(tmp_path, staging=StagingOptions(budget_bytes=1000)) as ckpt:
        with pytest.raises(ValueError, match=r"but StagingOptions\.budget_bytes is 1000"):
            ckpt.save(1, {"w": torch.randn(10_000)})


def test_keep_last_deletes_old_steps_and_their_chunks(tmp_path):
    with Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in range(5):
            ckpt.save(step, {"w": torch.full((20_000,), float(step))})
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
    chunk_files = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file()]
    assert len(chunk_files) == 2
    assert not list((tmp_path / "pending").glob("*"))
    for step in (3, 4):
        target = {"w": torch.zeros(20_000)}
        Checkpointer(tmp_path).load(target, step=step)
        assert torch.equal(target["w"], torch.full((20_000,), float(step)))


def failing_checkpointer(uri: str) -> tuple[Checkpointer, Faults]:
    """A Checkpointer on ``uri`` whose every put fails (twice: then the save fails) until
    ``faults.error_rate`` is set back to 0."""
    faults = Faults(error_rate=1.0, ops=frozenset({"put"}))
    store = with_faults(Store(uri, retry=RetryPolicy(attempts=2, base_delay_s=0.001)), faults)
    return Checkpointer(uri, storage=StorageOptions(store=store)), faults


@pytest.mark.parametrize("fallback", [False, True])
def test_a_latest_load_whose_step_is_removed_meanwhile_loads_the_newer_one(tmp_path, fallback):
    """A job resuming while another process saves with keep_last=1: the step it planned to
    load is removed under it (its index gone); it plans again and loads the newest step, not
    an error saying data is missing (nor an older, also removed, step)."""
    uri = str(tmp_path)
    writer = Checkpointer(uri, keep_last=1)
    writer.save(1, {"w": torch.full((1000,), 1.0)}).wait()
    reader = Checkpointer(uri)
    get = reader.store.get
    raced = []

    def get_racing_a_save(key, *args, **kwargs):
        if key.startswith("indexes/") and not raced:
            raced.append(key)
            writer.save(2, {"w": torch.full((1000,), 2.0)}).wait()  # keep_last drops step 1
        return get(key, *args, **kwargs)

    reader.store.get = get_racing_a_save
    state = {"w": torch.zeros(1000)}
    assert reader.load(state, fallback=fallback) == 2
    assert raced and torch.equal(state["w"], torch.full((1000,), 2.0))
    reader.close()
    writer.close()


def test_background_error_surfaces_and_leaves_no_step():
    ckpt, faults = failing_checkpointer("memory://failing-saves")
    handle = ckpt.save(1, {"w": torch.randn(100)})
    with pytest.raises(StorageError, match="failed after 2 attempts"):
        handle.wait(timeout_s=60)
    assert ckpt.steps() == []
    faults.error_rate = 0.0
    ckpt.save(3, {"w": torch.randn(100)}).wait()  # reported once: the next save goes ahead
    assert ckpt.steps() == [3]
    ckpt.close()


def test_an_unwaited_save_error_is_raised_once_by_the_next_save():
    ckpt, faults = failing_checkpointer("memory://unwaited")
    handle = ckpt.save(1, {"w": torch.randn(100)})
    assert handle._future.exception(timeout=60) is not None  # failed; nobody called wait()
    faults.error_rate = 0.0
    with pytest.raises(StorageError, match="step 2 was not saved: the save of step 1 failed"):
        ckpt.save(2, {"w": torch.randn(100)})
    ckpt.save(3, {"w": torch.randn(100)}).wait()
    ckpt.wait()
    ckpt.close()  # nothing left to report
    assert ckpt.steps() == [3]


def test_a_failed_save_is_reported_once_not_also_logged_as_an_error(caplog):
    """The error reaches the caller once; the background thread logged it at ERROR too."""
    ckpt, _ = failing_checkpointer("memory://logged-once")
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        with pytest.raises(StorageError):
            ckpt.save(1, {"w": torch.randn(100)}).wait()
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and "step 1" in r.getMessage()
    ]
    assert any("save of step 1 failed" in r.getMessage() for r in caplog.records)  # at INFO
    ckpt.close()


def test_a_save_handle_answers_result_as_a_future_does(tmp_path):
    """Code written for DCP's ``async_save`` (a Future) calls ``result()``: it waits for the
    commit here too, and raises the save's error, reported once."""
    with Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, {"w": torch.ones(10)})
        assert handle.result(timeout=60) is None and handle.committed
    ckpt, _ = failing_checkpointer("memory://result-raises")
    with pytest.raises(StorageError, match="failed after 2 attempts"):
        ckpt.save(1, {"w": torch.randn(100)}).result(timeout=60)
    ckpt.close()  # reported already: not raised again


def test_an_unwaited_save_error_is_raised_by_close():
    ckpt, _ = failing_checkpointer("memory://unwaited-close")
    ckpt.save(1, {"w": torch.randn(100)})
    with pytest.raises(StorageError, match="failed after 2 attempts"):
        ckpt.close()


def test_a_caught_step_exists_error_does_not_refuse_the_next_save(tmp_path):
    """A loop that catches a failed wait() goes on saving: the next step is committed."""
    Checkpointer(tmp_path).save(100, {"w": torch.ones(10)}).wait()
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(StepExistsError, match="step 100 is already committed"):
        ckpt.save(100, {"w": torch.zeros(10)}).wait()
    ckpt.save(200, {"w": torch.full((10,), 2.0)}).wait()
    ckpt.close()
    assert ckpt.steps() == [100, 200]
    target = {"w": torch.zeros(10)}
    Checkpointer(tmp_path).load(target, step=200)
    assert torch.equal(target["w"], torch.full((10,), 2.0))


def test_two_writers_of_one_step(tmp_path):
    a, b = Checkpointer(tmp_path), Checkpointer(tmp_path)
    a.save(5, {"w": torch.ones(10)}).wait()
    with pytest.raises(StepExistsError, match="step 5 is already committed"):
        b.save(5, {"w": torch.zeros(10)}).wait()
    target = {"w": torch.zeros(10)}
    a.load(target)
    assert torch.equal(target["w"], torch.ones(10))
    a.close()
    b.close()  # its error was raised by wait() already


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(TypeError, match="store URI must be a path or URI string, not None"):
        Checkpointer(None)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            ckpt.load({"w": torch.zeros(3)})
        ckpt.save(1, {"w": torch.zeros(3), "n": 1}).wait()
        with pytest.raises(UnsupportedStateError, match=r"w: checkpoint has torch.float32 \(3,\)"):
            ckpt.load({"w": torch.zeros(4), "n": 0})
        with pytest.raises(UnsupportedStateError, match="float32"):
            ckpt.load({"w": torch.zeros(3, dtype=torch.float64), "n": 0})
        with pytest.raises(UnsupportedStateError, match="not in the checkpoint: \\['extra'\\]"):
            ckpt.load({"w": torch.zeros(3), "n": 0, "extra": 1})
        with pytest.raises(CheckpointNotFoundError, match="step 7 is not committed"):
            ckpt.load({"w": torch.zeros(3), "n": 0}, step=7)
        # Stop 83's new user: a meta tensor failed deep in torch, naming neither key nor device.
        with pytest.raises(UnsupportedStateError, match="w: state has a tensor on the meta device"):
            ckpt.load({"w": torch.zeros(3, device="meta"), "n": 0})
        with torch.device("meta"):
            model = torch.nn.Linear(3, 1)
        ckpt.save(2, {"model": torch.nn.Linear(3, 1)}).wait()
        with pytest.raises(
            UnsupportedStateError, match="model/weight: state has a tensor on the meta"
        ):
            ckpt.load({"model": model})


def _trained(optim_cls, out_features: int = 32):
    model = torch.nn.Linear(64, out_features)
    optim = optim_cls(model.parameters())
    model(torch.randn(4, 64)).square().sum().backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize("optim_cls", [torch.optim.AdamW, torch.optim.Adafactor])
def test_optimizer_state_for_other_parameters_is_refused_before_any_byte(tmp_path, optim_cls):
    """A fresh optimizer over parameters of another shape would take the step's moments as
    they are and fail only at its next step: refused by name, the model left untouched. State
    that only broadcasts to its parameter (Adafactor's factored moments) loads."""
    model, optim = _trained(optim_cls)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}).wait()
        fresh = torch.nn.Linear(64, 32)
        before = fresh.weight.clone()
        other = optim_cls(torch.nn.Linear(64, 16).parameters())
        with pytest.raises(UnsupportedStateError, match=r"optim/state/0/\w+: checkpoint has"):
            ckpt.load({"model": fresh, "optim": other})
        assert torch.equal(fresh.weight, before)
        same = optim_cls(fresh.parameters())
        assert ckpt.load({"model": fresh, "optim": same}) == 1
        assert torch.equal(fresh.weight, model.weight)
        saved, loaded = optim.state_dict()["state"][0], same.state_dict()["state"][0]
        assert all(
            torch.equal(torch.as_tensor(saved[k]), torch.as_tensor(loaded[k])) for k in saved
        )


def test_optimizer_state_of_its_own_shape_loads(tmp_path):
    """Reviewer V: LBFGS keeps flat vectors under parameter 0, and an optimizer outside
    torch.optim may keep factored moments (a row per parameter row): torch loads both, and so
    must a load (it refused them as moments of another parameter)."""

    class RowMoments(torch.optim.SGD):  # the layout of transformers' Adafactor
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                self.state[p]["exp_avg_sq_row"] = p.detach().square().mean(-1)
            return super().step(closure)

    for optim_cls in (torch.optim.LBFGS, lambda params: RowMoments(params, lr=0.1)):
        model = torch.nn.Linear(4, 3)
        optim = optim_cls(model.parameters())
        optim.step(lambda model=model: model(torch.ones(2, 4)).square().sum().backward() or 1.0)
        with Checkpointer(tmp_path / str(id(optim))) as ckpt:
            ckpt.save(1, {"optim": optim}).wait()
            into = optim_cls(torch.nn.Linear(4, 3).parameters())
            assert ckpt.load({"optim": into}) == 1
        saved, loaded = optim.state_dict()["state"], into.state_dict()["state"]
        assert saved.keys() == loaded.keys()
        for i in saved:
            for k, v in saved[i].items():
                w = loaded[i][k]
                same = torch.equal if isinstance(v, torch.Tensor) else (lambda a, b: a == b)
                assert (
                    all(torch.equal(a, b) for a, b in zip(v, w))
                    if isinstance(v, list)
                    else same(v, w)
                ), k


def _zero_redundancy_round_trip(rank: int, world: int, root: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def made():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1), model

    optim, model = made()
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    optim.consolidate_state_dict(to=0)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"optim": optim}).wait()
        into, _ = made()  # its state_dict() raises until consolidated; load_state_dict needs not
        assert ckpt.load({"optim": into}) == 1
    into.consolidate_state_dict(to=0)
    saved, loaded = optim.state_dict()["state"], into.state_dict()["state"]
    assert saved.keys() == loaded.keys() == {0, 1}
    for i in saved:
        assert saved[i].keys() == loaded[i].keys()
        assert all(torch.equal(saved[i][k], loaded[i][k]) for k in saved[i])


def test_a_fresh_zero_redundancy_optimizer_loads_without_consolidating_first(tmp_path):
    """Reviewer V: the load built its template from state_dict(), which ZeRO refuses before
    consolidate_state_dict(); torch's own load_state_dict takes the state without it."""
    run_ranks(_zero_redundancy_round_trip, 1, str(tmp_path))


def test_an_optimizer_whose_load_hook_adapts_the_saved_groups_loads(tmp_path):
    """Reviewer V: a run that added a parameter group after the save pads the saved groups in
    a load_state_dict pre-hook; torch loads that, and a load refused it by the group sizes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model[0].parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"optim": optim}).wait()
        grown = torch.optim.AdamW(model[0].parameters())
        grown.add_param_group({"params": list(model[1].parameters())})

        def pad(optimizer, state_dict):
            first = state_dict["param_groups"][0]
            state_dict["param_groups"].append({**first, "params": [2, 3]})
            return state_dict

        grown.register_load_state_dict_pre_hook(pad)
        assert ckpt.load({"optim": grown}) == 1
    assert torch.equal(
        grown.state[model[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"]
    )


def test_an_optimizer_whose_load_hook_reorders_the_saved_parameters_loads(tmp_path):
    """Reviewer X: a run that lists its parameters in another order maps the saved state in a
    pre-hook; torch loads that, and a load refused its moments as another parameter's shape."""
    w, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    optim = torch.optim.Adam([w, b])
    (w.sum() + b.sum()).backward()
    optim.step()
    reordered = torch.optim.Adam([b, w])
    reordered.register_load_state_dict_pre_hook(
        lambda _, sd: {**sd, "state": {0: sd["state"][1], 1: sd["state"][0]}}
    )
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"optim": optim}).wait()
        assert ckpt.load({"optim": reordered}) == 1
    for p in (w, b):
        assert torch.equal(reordered.state[p]["exp_avg"], optim.state[p]["exp_avg"])


def test_a_scheduler_whose_state_shares_a_list_with_another_entry_loads_each_value(tmp_path):
    """Reviewer X: a fresh SequentialLR's _last_lr is its first scheduler's list; written in
    place, the first scheduler's saved value overwrote it before load_state_dict ran."""

    def made():
        optim = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.01)
        warmup = torch.optim.lr_scheduler.LinearLR(optim, 0.1, total_iters=2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optim, 10)
        return optim, torch.optim.lr_scheduler.SequentialLR(optim, [warmup, cosine], [2])

    optim, sched = made()
    for _ in range(3):
        optim.step()
        sched.step()
    into_optim, into = made()
    assert into._last_lr is into._schedulers[0]._last_lr  # the sharing this is about
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"optim": optim, "sched": sched}).wait()
        assert ckpt.load({"optim": into_optim, "sched": into}) == 3
    assert into.get_last_lr() == sched.get_last_lr() != sched._schedulers[0].get_last_lr()
    assert [s.get_last_lr() for s in into._schedulers] == [
        s.get_last_lr() for s in sched._schedulers
    ]


def test_an_optimizer_rolled_back_keeps_no_state_the_step_predates(tmp_path):
    """Reviewer Q: loading a step saved before a parameter had optimizer state into the live
    optimizer kept that parameter's later state (its step count and moments); torch's own
    load_state_dict leaves only what the step holds."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optim = torch.optim.Adam([a, b], lr=0.1)
    a.grad = torch.ones(3)
    optim.step()  # only a has state
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"optim": optim}).wait()
        b.grad = torch.ones(3)
        optim.step()
        assert b in optim.state
        assert ckpt.load({"optim": optim}) == 1
    assert list(optim.state_dict()["state"]) == [0] and b not in optim.state
    assert optim.state[a]["step"].item() == 1.0


def test_unsupported_state_is_refused_by_name(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match="opt/fn: cannot save a value of type"):
            ckpt.save(1, {"opt": {"fn": lambda x: x}})
        with pytest.raises(ValueError, match="step must be"):
            ckpt.save(-1, {})
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="unknown compression"):
        Checkpointer(tmp_path, encoding=EncodingOptions(compression="lz5"))


class _Phase(enum.IntEnum):
    WARMUP = 1


class _Mode(str, enum.Enum):
    TRAIN = "train"


class _Cfg(tuple):  # what collections.namedtuple makes, without the import
    def _asdict(self) -> dict:
        return {"lr": self[0]}


class _Steps(list):
    pass


@pytest.mark.parametrize(
    ("value", "loses", "hint"),
    [
        (_Phase.WARMUP, "int", r"value\.value"),
        (_Mode.TRAIN, "str", r"value\.value"),
        (_Cfg((0.1,)), "tuple", r"value\._asdict\(\)"),
        (torch.Size([2, 3]), "tuple", r"tuple\(value\)"),
        (bytearray(b"ab"), "bytes", r"bytes\(value\)"),
        (_Steps([1, 2]), "list", r"list\(value\)"),
        (np.ma.array([1.0, 1000.0], mask=[0, 1]), "numpy.ndarray", r"np\.asarray\(value\)"),
    ],
    ids=[
        "IntEnum",
        "str-Enum",
        "namedtuple",
        "torch.Size",
        "bytearray",
        "list-subclass",
        "masked-array",
    ],
)
def test_a_value_a_load_would_give_back_as_another_type_is_refused_at_save(
    tmp_path, value, loses, hint
):
    """Reviewer (exact resume): an IntEnum, a namedtuple, torch.Size and bytearray were saved
    and loaded back as int, tuple and bytes (``state["cfg"].lr`` failed after resume); a masked
    array lost its mask (the masked values back in its mean). Each is refused at save naming
    where, and what to save instead."""
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match=rf"^cfg/x: .*{hint}") as caught:
            ckpt.save(1, {"w": torch.ones(2), "cfg": {"x": value}})
        if loses is not None:
            assert f"load back as a plain {loses}" in str(caught.value)
        assert ckpt.latest() is None


def test_values_of_the_types_a_state_holds_load_back_with_their_types(tmp_path):
    import collections

    state = {
        "plain": [1, True, "s", 0.5, b"b", None, (1, [2]), {3: "int key", None: 0}],
        "numpy": [np.float64(0.5), np.int32(-3), np.bool_(True), np.asarray(np.float32(0.25))],
        "ordered": collections.OrderedDict(b=1, a=2),
        # Fix adversary: an optimizer's lr from a float32 table, numpy keys (np.unique's),
        # a memmap's copy (nanoGPT's batches) were refused; they load as their values
        "lr": np.float32(0.25),
        "keys": {np.str_("cat"): 0, np.float64(0.5): 1},
        "batch": np.memmap(tmp_path / "m.bin", dtype=np.uint16, mode="w+", shape=(4,))[1:].copy(),
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state).wait()
        into = {
            "plain": None,
            "numpy": None,
            "ordered": collections.OrderedDict(),
            "lr": None,
            "keys": None,
            "batch": None,
        }
        ckpt.load(into)
    assert into["plain"] == state["plain"]
    assert [type(v) for v in into["plain"]] == [type(v) for v in state["plain"]]
    assert into["numpy"][:3] == [0.5, -3, True]
    assert [type(v) for v in into["numpy"][:3]] == [float, int, bool]
    zero_d = into["numpy"][3]
    assert type(zero_d) is np.ndarray and zero_d.dtype == np.float32 and zero_d.shape == ()
    assert type(into["ordered"]) is collections.OrderedDict and list(into["ordered"]) == ["b", "a"]
    assert type(into["lr"]) is float and into["lr"] == 0.25
    assert into["keys"] == {"cat": 0, 0.5: 1} and [type(k) for k in into["keys"]] == [str, float]
    assert type(into["batch"]) is np.ndarray and into["batch"].dtype == np.uint16


def test_a_nested_tensor_is_refused_by_name(tmp_path):
    """Reviewer (exact resume): a strided nested tensor failed save() with torch's "Internal
    error ... please file an issue"."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"^nt: a nested tensor .*unbind"):
            ckpt.save(1, {"nt": nested})


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_conjugate_or_negative_view_is_loaded_into_through_its_values(tmp_path, view):
    """Reviewer (exact resume): a destination that is a conj view (or has the neg bit) is
    contiguous, so the load decoded into its bytes (``view``: torch's "not supported for
    conjugate view tensors", naming no key)."""
    dtype = torch.complex64 if view == "conj" else torch.float32
    saved, base = torch.randn(3, dtype=dtype), torch.zeros(3, dtype=dtype)
    dest = base.conj() if view == "conj" else torch._neg_view(base)
    assert dest.is_contiguous() and (dest.is_conj() or dest.is_neg())
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"z": saved}).wait()
        ckpt.load({"z": dest})
    assert torch.equal(dest.resolve_conj().resolve_neg(), saved)


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


def test_corrupt_chunk_is_refused_on_load(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.randn(5000)}).wait()
    (chunk,) = _chunk_files(tmp_path)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=f"^step 1: chunk .*{chunk.name}"):
        Checkpointer(tmp_path).load({"w": torch.zeros(5000)})
    chunk.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointCorruptError, match=chunk.name):
        Checkpointer(tmp_path).load({"w": torch.zeros(5000)})
    chunk.unlink()
    with pytest.raises(CheckpointNotFoundError, match=chunk.name):
        Checkpointer(tmp_path).load({"w": torch.zeros(5000)})


def test_unknown_format_version_is_refused(tmp_path):
    """A newer writer's manifest (its checksum its own) is refused as a version to upgrade
    for; one whose version digit flipped (the checksum holds for version 2) is corrupt
    (reviewer of stop 71: it said "upgrade ckptstore", and was never quarantined)."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.randn(10)}).wait()
    path = tmp_path / commit_key(1)
    doc = json.loads(path.read_text())
    path.unlink()
    path.write_bytes(sealed({**doc, "format_version": 99}))
    with pytest.raises(FormatVersionError, match="format version 99"):
        Checkpointer(tmp_path).load({"w": torch.zeros(10)})
    path.unlink()
    path.write_text(json.dumps({**doc, "format_version": 3}, separators=(",", ":")))
    with pytest.raises(CheckpointCorruptError, match="version 3 fails the checksum that version 2"):
        Checkpointer(tmp_path).load({"w": torch.zeros(10)})


def test_only_committed_steps_are_listed(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.randn(10)}).wait()
    # an attempt that died before its commit: chunks and index exist, no manifest
    (tmp_path / "steps" / f"{2:020d}" / "deadbeef").mkdir(parents=True)
    (tmp_path / "steps" / f"{2:020d}" / "deadbeef" / "rank-00000.json").write_text("{}")
    assert list_steps(Store(tmp_path)) == [1]


def test_nonexistent_store_path_lists_nothing_and_loads_clearly(tmp_path):
    ckpt = Checkpointer(tmp_path / "does-not-exist")
    assert ckpt.steps() == [] and ckpt.latest() is None
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ckpt.load({})
    ckpt.close()
    assert not os.path.exists(tmp_path / "does-not-exist")


def test_verify_checks_every_chunk_and_names_what_is_wrong(tmp_path):
    ckpt = Checkpointer(tmp_path, encoding=EncodingOptions(chunk_bytes=4096, compression="none"))
    ckpt.save(1, {"w": torch.randn(4096)}).wait()
    ckpt.save(2, {"w": torch.randn(4096)}).wait()
    ckpt.verify()
    ckpt.verify("all")
    store = ckpt.store
    from ckptstore.catalog import load_manifest, load_rank_index

    index = load_rank_index(store, load_manifest(store, 2), 0)
    first, second = sorted(index.chunks)[:2]
    path = tmp_path / "chunks" / first[:2] / first
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    ckpt.verify(1)  # step 1 shares no chunk with step 2
    with pytest.raises(CheckpointCorruptError, match=f"step 2: chunks/{first[:2]}/{first} corrupt"):
        ckpt.verify("all")
    path.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))  # mended
    (tmp_path / "chunks" / second[:2] / second).unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"{second} missing"):
        ckpt.verify(2)
    ckpt.close()


def test_verify_of_a_store_that_does_not_answer_is_a_storage_error_not_corrupt(
    tmp_path, monkeypatch
):
    """Reviewer: Checkpointer.verify raised CheckpointCorruptError when the chunks' reads timed
    out, where ``ckptstore verify`` says NOT VERIFIED: a caller quarantining on it would drop
    intact steps."""
    from ckptstore import pipeline
    from ckptstore.errors import StorageError, StorageTimeoutError

    with Checkpointer(tmp_path, encoding=EncodingOptions(chunk_bytes=4096)) as ckpt:
        ckpt.save(1, {"w": torch.randn(4096)}).wait()

        def stalled(s, digest, *args, **kwargs):
            raise StorageTimeoutError(f"get {s.url(digest)}: no answer within 5.0s")

        monkeypatch.setattr(pipeline, "fetch_chunk", stalled)
        with pytest.raises(StorageError, match="this says nothing of the checkpoint") as caught:
            ckpt.verify("all")
        assert not isinstance(caught.value, CheckpointCorruptError)
        monkeypatch.undo()
        ckpt.verify("all")


def test_the_flat_keywords_of_earlier_releases_still_work_and_say_what_to_pass(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with pytest.warns(DeprecationWarning, match=r"pass EncodingOptions\(chunk_bytes=\.\.\."):
        ckpt = Checkpointer(tmp_path, chunk_bytes=4096, compression="none")
    with ckpt:
        assert ckpt.engine.config.chunk_bytes == 4096
        ckpt.save(1, state).wait()
        into = {"w": torch.zeros(1000)}
        assert ckpt.load(into) == 1 and torch.equal(into["w"], state["w"])


def test_a_flat_keyword_beside_its_option_object_is_refused_not_silently_preferred(tmp_path):
    with pytest.raises(TypeError, match=r"got compression= and encoding=: pass it in the enc"):
        Checkpointer(tmp_path, compression="none", encoding=EncodingOptions(compression="zstd"))
    with pytest.warns(DeprecationWarning):  # the string form of staging= takes flat keywords
        Checkpointer(tmp_path, staging="host", staging_budget_bytes=1 << 20).close()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: Checkpointer(p, keep_last=2.5), "keep_last takes an int or None, got float"),
        (lambda p: Checkpointer(p, keep_last="3"), "keep_last takes an int or None, got str"),
        (lambda p: EncodingOptions(chunk_bytes="32MiB"), "EncodingOptions.chunk_bytes takes int"),
        (lambda p: StorageOptions(timeout_s="30"), "StorageOptions.timeout_s takes float, got s"),
        (lambda p: StorageOptions(timeout_s=True), "StorageOptions.timeout_s takes float, got b"),
        (lambda p: StorageOptions(max_concurrency=2.5), "max_concurrency takes int, got float"),
        (lambda p: EncodingOptions(compression=1.5), "compression takes str or int or None"),
        (lambda p: EncodingOptions(compression="gzip"), "unknown compression 'gzip'"),
        (lambda p: ReadOptions(read_concurrency=None), "read_concurrency takes int, got NoneT"),
    ],
)
def test_an_option_of_the_wrong_kind_is_refused_where_it_is_given_naming_it(
    tmp_path, make, message
):
    """keep_last=2.5 made every save commit and every wait() raise a TypeError of slices."""
    with pytest.raises((TypeError, ValueError), match=message):
        make(tmp_path)


def test_options_take_numbers_of_any_integral_or_real_kind(tmp_path):
    storage = StorageOptions(max_concurrency=np.int64(3), timeout_s=5)
    with Checkpointer(tmp_path, keep_last=np.int64(2), storage=storage) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
        assert ckpt.steps() == [1]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_load_fetches_at_most_read_concurrency_chunks_at_once(tmp_path, monkeypatch, concurrency):
    """``ReadOptions.read_concurrency`` bounds a Checkpointer load's chunks in flight; a load
    reaches that bound (each fetch waits, bounded, until that many are in flight)."""
    import threading

    import ckptstore.pipeline as pipeline

    encoding = EncodingOptions(chunk_bytes=64 * 1024, compression="none")
    state = {
        f"t{i}": torch.rand(16 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)
    }
    with Checkpointer(tmp_path / "s", encoding=encoding) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()

    fetch = pipeline.fetch_chunk
    lock, full = threading.Lock(), threading.Event()
    in_flight, most = 0, 0

    def counted(*args, **kwargs):
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
            if in_flight >= concurrency:
                full.set()
        try:
            full.wait(timeout=10)
            return fetch(*args, **kwargs)
        finally:
            with lock:
                in_flight -= 1

    monkeypatch.setattr(pipeline, "fetch_chunk", counted)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    reads = ReadOptions(read_concurrency=concurrency)
    with Checkpointer(tmp_path / "s", encoding=encoding, reads=reads) as ckpt:
        ckpt.load(loaded)
    assert most == concurrency
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_an_error_in_a_with_block_is_not_hidden_by_a_save_that_failed_too(tmp_path, caplog):
    Checkpointer(tmp_path).save(1, {"w": torch.ones(2)}).wait()
    with pytest.raises(KeyError, match="the loop's own"), caplog.at_level("ERROR"):
        with Checkpointer(tmp_path) as ckpt:
            ckpt.save(1, {"w": torch.zeros(2)})  # fails in the background: step 1 exists
            raise KeyError("the loop's own")
    assert "closed after an error in its block" in caplog.text and "step 1" in caplog.text
    with pytest.raises(StepExistsError):  # without an error of the block, close() raises it
        with Checkpointer(tmp_path) as ckpt:
            ckpt.save(1, {"w": torch.zeros(2)})


@pytest.mark.parametrize("where", ["above", "inside"])
def test_a_path_just_above_or_inside_a_store_is_named_not_taken_for_a_fresh_start(
    tmp_path, caplog, where
):
    """A reviewer's: a Checkpointer given the directory above a store, or one inside it, found
    no step and said nothing: the README's resume started the job over, saving elsewhere."""
    store = tmp_path / "runs" / "run1"
    with Checkpointer(str(store)) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    wrong = store.parent if where == "above" else store / "chunks"
    hint = f"but {store} holds checkpoints" if where == "above" else f"inside the store {store}"
    ckpt = Checkpointer(str(wrong))
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert ckpt.latest() is None and ckpt.latest() is None
    assert [r.getMessage() for r in caplog.records if hint in r.getMessage()] != []
    assert len([r for r in caplog.records if "mistyped path" in r.getMessage()]) == 1  # once
    with pytest.raises(CheckpointNotFoundError, match=f"no committed checkpoint in .*{hint}"):
        ckpt.load({"w": torch.zeros(3)})
    other = Checkpointer(str(store.parent / "run2"))  # a new run beside it: no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert other.latest() is None
    assert not caplog.records


def test_last_load_says_the_step_and_source_of_an_untiered_load(tmp_path):
    """A reviewer: ``ckpt.last_load`` stayed an empty LoadReport after a load without tiers."""
    ckpt = Checkpointer(tmp_path / "s")
    ckpt.save(3, {"w": torch.ones(4)}).wait()
    assert ckpt.last_load.step is None
    assert ckpt.load({"w": torch.zeros(4)}) == 3
    assert (ckpt.last_load.step, ckpt.last_load.source) == (3, "storage")
    assert ckpt.last_load.seconds > 0
    ckpt.close()


class _Level(enum.IntEnum):  # an int that would read back as a plain one
    INFO = 20


@pytest.mark.parametrize(
    "metadata, why",
    [
        ("epoch 3", "must be a dict of JSON values, not str"),
        (["a"], "must be a dict of JSON values, not list"),
        (
            {"t": torch.ones(1)},
            "metadata['t'] is of type torch.Tensor, which JSON would not give back",
        ),
        ({"loss": float("nan")}, "metadata['loss'] is nan"),
        ({1: "a"}, "metadata: the key 1 is of type int, not str"),
        ({"shape": (2, 3)}, "metadata['shape'] is of type tuple"),
        ({"lr": np.float64(0.1)}, "metadata['lr'] is of type numpy.float64"),
        ({"n": [1, _Level.INFO]}, "metadata['n'][1] is of type tests.checkpointer"),
        ({"deep": functools.reduce(lambda inner, _: [inner], range(100), 1)}, "nested deeper"),
        ({"ckptstore_tier": {}}, "are ckptstore's own"),
        ({"blob": "x" * (1 << 20)}, "over 1048576"),
    ],
)
def test_metadata_a_manifest_cannot_record_as_given_is_refused_at_save(tmp_path, metadata, why):
    """Stop 83's new user: ``metadata="epoch 3"`` committed a step that no load, ls, inspect
    or verify could read (``wait()`` said committed), and ``keep_last`` then swept nothing."""
    with Checkpointer(str(tmp_path / "s"), keep_last=1) as ckpt:
        with pytest.raises((TypeError, ValueError), match=re.escape(why)):
            ckpt.save(1, {"w": torch.ones(2)}, metadata=metadata)
        ckpt.save(2, {"w": torch.ones(2)}, metadata={"epoch": 3, "seen": [1, 2]}).wait()
        assert ckpt.metadata(2) == {"epoch": 3, "seen": [1, 2]}
        assert ckpt.steps() == [2]


def test_a_step_saved_with_metadata_not_a_dict_still_loads(tmp_path):
    """A step committed before ``save()`` refused such metadata reads back, the value kept."""
    from tests.helpers.crafted import manifest_doc, put_manifest

    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}).wait()
    store = Store(uri)
    doc = manifest_doc(store, 1)
    doc["user"] = "epoch 3"
    put_manifest(store, 1, doc)
    into = {"w": torch.zeros(2)}
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(into) == 1 and into["w"][0] == 1.0
        assert ckpt.metadata(1) == {"value": "epoch 3"}


def _lines_after(function, first: str) -> list[int]:
    """The line numbers of ``function``'s source from the line holding ``first`` on, but a
    ``try:`` line: Python 3.11 runs it as a NOP that no SIGINT handler interrupts (it checks
    for signals at calls and jumps), and a trace function raising there, inside a ``with``,
    skips the ``with``'s exit: a lock left held that no Ctrl-C leaves."""
    import inspect

    source, start = inspect.getsourcelines(function)
    at = next(i for i, line in enumerate(source) if first in line)
    return [start + i for i in range(at, len(source)) if source[i].strip() not in ("", "try:")]


def _interrupted_at(function, line: int, call) -> bool:
    """Run ``call()`` raising KeyboardInterrupt at ``line`` of ``function`` (as a SIGINT
    handler does between two lines); whether it got there."""
    import sys

    code = function.__code__
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(line)
            raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return bool(fired)


@pytest.mark.parametrize("staging", ["host", "device"])
def test_a_ctrl_c_anywhere_in_save_after_staging_leaves_the_next_saves_whole(tmp_path, staging):
    """Lifecycle reviewer of stop 84: a Ctrl-C landing in ``save()`` after the state was
    staged and before the job was queued kept the pool's staging buffer: every later save
    blocked for good (``except KeyboardInterrupt: ckpt.save(...)`` hung). At every line from
    the staging on (``save()``'s and the staging's own), the next two saves, made without a
    wait between them, commit each its own bytes (a buffer handed back twice would be staged
    into by both). ``staging="device"`` runs the device path on the CPU: a drain copies the
    device buffer into a host one (fix adversary: a Ctrl-C as the save handed it the copy
    kept that host buffer). ``wait()`` after an interrupted save waits for the save before it
    (fix adversary: it returned at once, that save still persisting). The pool's own lines
    too (fix adversary: an interrupt between taking a free buffer and returning it lost it)."""
    from ckptstore.save.engine import SaveEngine
    from ckptstore.staging import StagingPool

    places = (
        [
            (Checkpointer.save, line)
            for line in _lines_after(Checkpointer.save, "staged: Staged | None = None")
        ]
        + [
            (SaveEngine.stage, line)
            for line in _lines_after(SaveEngine.stage, "buffer, ticket = None")
        ]
        + [
            (StagingPool.acquire, line)
            for line in _lines_after(StagingPool.acquire, "nbytes = max(nbytes, 1)")
        ]
    )
    reached = 0
    for n, (function, line) in enumerate(places):
        root = tmp_path / str(n)
        with Checkpointer(root, staging=staging) as ckpt:
            ckpt.save(0, {"w": torch.zeros(1000)})
            reached += _interrupted_at(
                function, line, lambda: ckpt.save(1, {"w": torch.zeros(1000)})
            )
            ckpt.wait()
            assert 0 in ckpt.steps(), (line, "wait() returned before the save before it")
            saves = [ckpt.save(step, {"w": torch.full((1000,), float(step))}) for step in (2, 3)]
            for handle in saves:
                handle.wait(timeout_s=60)  # TimeoutError: the buffer never came back
            for step in (2, 3):
                into = {"w": torch.empty(1000)}
                ckpt.load(into, step=step)
                assert torch.equal(into["w"], torch.full((1000,), float(step))), (line, step)
    assert reached >= 20  # the lines a save runs through, not only the skipped branch


def test_a_ctrl_c_during_a_device_drain_hands_its_buffers_back_without_waiting(
    tmp_path, monkeypatch
):
    """Fix adversary of stop 84: an interrupted device-staged save handed its buffers back by
    waiting for its drain to land (for as long as the save before it persisted, or a stalled
    store); a second Ctrl-C in that wait kept the host buffer for good. It now lets the drain
    hand them back as it lands."""
    import threading

    from ckptstore.staging import Drainer

    go = threading.Event()
    copy = Drainer._copy

    def held_copy(self, *args):
        assert go.wait(60)
        return copy(self, *args)

    monkeypatch.setattr(Drainer, "_copy", held_copy)
    line = _lines_after(Checkpointer.save, "self._saves += 1")[0]
    with Checkpointer(tmp_path, staging="device") as ckpt:
        assert _interrupted_at(
            Checkpointer.save, line, lambda: ckpt.save(1, {"w": torch.zeros(1000)})
        )
        assert not go.is_set()  # the interrupted save returned while its drain was held
        go.set()
        ckpt.save(2, {"w": torch.full((1000,), 2.0)}).wait(timeout_s=60)
        assert ckpt.steps() == [2]


def test_a_store_path_that_is_a_file_is_refused_when_opened(tmp_path):
    """New-user reviewer: ``Checkpointer(path)`` of an existing file said ``latest()`` None with
    no warning, and its first save failed on a lease (``NotADirectoryError``), naming no path
    the user gave. Both front-ends open their store the same way."""
    from ckptstore.dcp import StoreReader, StoreWriter

    path = tmp_path / "run.ckpt"
    path.write_bytes(b"not a store")
    for opened in (Checkpointer, StoreWriter, StoreReader):
        with pytest.raises(ValueError, match=f"{path} is a file, not a store directory"):
            opened(str(path))
    assert path.read_bytes() == b"not a store"
