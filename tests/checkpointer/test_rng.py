"""Random generators in a state (issue 25, item 3): ``ckptstore.RNGState`` and
``torch.Generator`` values, and state trees whose tags are damaged."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ckptstore import CheckpointCorruptError, Checkpointer, RNGState
from tests.helpers.crafted import put_rank_index, rank_index_doc


def draws(generator: torch.Generator | None = None) -> tuple:
    own = torch.rand(3, generator=generator).tolist() if generator is not None else None
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), own


def test_rng_state_resumes_every_generator(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"rng": RNGState()}).wait()
        expected = draws()
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(7)
        assert draws() != expected
        ckpt.load({"rng": RNGState()})
        assert draws() == expected


def test_a_torch_generator_is_saved_and_restored_in_place(tmp_path):
    generator = torch.Generator().manual_seed(11)
    torch.rand(5, generator=generator)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"gen": generator}).wait()
        expected = torch.rand(4, generator=generator)
        other = torch.Generator().manual_seed(0)
        state = {"gen": other}
        ckpt.load(state)
        assert state["gen"] is other
        assert torch.equal(torch.rand(4, generator=other), expected)
        fresh = {"gen": None}
        ckpt.load(fresh)
        assert isinstance(fresh["gen"], torch.Generator)
        assert torch.equal(torch.rand(4, generator=fresh["gen"]), expected)


def test_a_generator_is_not_loaded_into_something_else(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"gen": torch.Generator()}).wait()
        with pytest.raises(Exception, match="torch.Generator"):
            ckpt.load({"gen": torch.zeros(3)})


@pytest.mark.parametrize(
    "tree",
    [
        {"gen": {"$generator": {"device": "cpu"}}},
        {"gen": {"$generator": {"device": 3, "state": {"$t": 0}}}},
        {"w": {"$t": 5}},
        {"w": {"$t": -1}},
        {"w": {"$float": "1e400"}},
        {"w": {"$bytes": "not base64!"}},
        {"w": {"$dict": [["a"]]}},
        {"w": {"$pickle": "gASV"}},
        {"w": {"$t": 0, "other": 1}, "$x": 2},
    ],
)
def test_a_damaged_state_tree_is_refused_before_any_load(tmp_path, tree):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    doc = rank_index_doc(ckpt.store, 1)
    doc["tree"] = tree
    put_rank_index(ckpt.store, 1, 0, doc)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="state tree"):
            ckpt.load({"w": torch.zeros(3)})
        with pytest.raises(CheckpointCorruptError, match="state tree"):
            ckpt.verify(1)
