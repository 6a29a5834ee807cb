"""Nested states (dicts of tensors and plain values): a zeroed copy to load into, and an exact
comparison."""

from __future__ import annotations

import torch


def blank_like(state: dict) -> dict:
    """Same structure as ``state`` with zeroed tensors and placeholder objects."""
    out: dict = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = blank_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def assert_same(got: dict, want: dict, path: str = "") -> None:
    assert set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v, f"{path}.{k}")
        elif isinstance(v, torch.Tensor):
            assert isinstance(got[k], torch.Tensor), f"{path}.{k}: {type(got[k])}"
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{path}.{k} differs"
        else:
            assert got[k] == v, f"{path}.{k}: {got[k]!r} != {v!r}"
