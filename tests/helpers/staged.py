"""What the device staging tests (cpu and CUDA) share: a state's snapshot, and a check that a
step loads back exactly, onto the same device."""

from __future__ import annotations

import torch

from ckptstore import Checkpointer, StagingOptions


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def assert_loads(ck: Checkpointer, step: int, expected: dict[str, torch.Tensor]) -> None:
    restored = {k: torch.zeros_like(v) for k, v in expected.items()}
    assert ck.load(restored, step=step) == step
    for key, value in expected.items():
        assert restored[key].device == value.device
        assert torch.equal(restored[key], value), f"step {step}: {key}"


def saves_back_to_back_within_budgets(uri, state: dict[str, torch.Tensor], update) -> None:
    """Eight saves never waited for (each may find every buffer held), ``update(state)`` after
    each: device and host staging stay within budgets of 2.5 states, and every step loads
    back exactly."""
    with Checkpointer(uri, staging="device") as ck:
        state_bytes = ck.engine.staged_bytes(list(state.values()))
    budget = int(state_bytes * 2.5)
    expected = []
    with Checkpointer(
        uri, staging=StagingOptions(mode="device", device_budget_bytes=budget, budget_bytes=budget)
    ) as ck:
        for step in range(8):
            expected.append(snapshot(state))
            ck.save(step, state)
            update(state)
        ck.wait()
        # Reused, never dropped and allocated again: every allocation is still held.
        pool = ck.engine.device_pool
        assert pool.allocations * state_bytes == pool.peak_allocated_bytes
        assert ck.engine.device_pool.peak_allocated_bytes <= budget
        assert ck.engine.pool.peak_allocated_bytes <= budget
        for step, values in enumerate(expected):
            assert_loads(ck, step, values)
