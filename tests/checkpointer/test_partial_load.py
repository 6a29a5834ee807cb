"""``Checkpointer.load(state, strict=False)``: the part of a step the state asks for (issue 25,
item 4): evaluating weights without building the optimizer."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, Store, UnsupportedStateError
from ckptstore.catalog import load_manifest, load_rank_index
from ckptstore.format import chunk_key


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def saved_step(uri: str) -> torch.nn.Module:
    net = model()
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 64)).sum().backward()
    opt.step()
    with Checkpointer(
        uri, encoding=EncodingOptions(compression="none", chunk_bytes=64 << 10)
    ) as ckpt:
        ckpt.save(7, {"model": net, "optim": opt, "step": 7}).wait()
    return net


def test_a_model_alone_loads_from_a_step_that_also_holds_the_optimizer(tmp_path):
    uri = str(tmp_path)
    net = saved_step(uri)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ckpt = Checkpointer(uri)
    try:
        ckpt.load({"model": fresh})
    except UnsupportedStateError as exc:
        assert "strict=False" in str(exc) or "optim" in str(exc)
    else:
        raise AssertionError("a strict load of a part of the step must fail")
    assert ckpt.load({"model": fresh}, strict=False) == 7
    for a, b in zip(fresh.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert sorted(ckpt.last_load_left_out) == [
        "optim (not in the state)",
        "step (not in the state)",
    ]
    ckpt.close()


def test_what_is_left_out_is_not_read(tmp_path):
    uri = str(tmp_path)
    net = saved_step(uri)
    store = Store(uri)
    index = load_rank_index(store, load_manifest(store, 7), 0)
    model_chunks = {seg.chunk for t in index.tensors[: len(net.state_dict())] for seg in t.segments}
    optimizer_only = set(index.chunks) - model_chunks
    assert optimizer_only
    for digest in optimizer_only:
        store.delete(chunk_key(digest))
    fresh = {"model": model()}
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(fresh, strict=False) == 7


def test_state_keys_the_step_lacks_are_left_alone(tmp_path):
    uri = str(tmp_path)
    net = saved_step(uri)
    ema = torch.full((3,), 5.0)
    state = {"model": model(), "optim": torch.optim.AdamW(net.parameters()), "ema": ema}
    state["step"] = 0
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(state, strict=False) == 7
        assert ckpt.last_load_left_out == ["ema (not in step 7)"]
    assert state["step"] == 7 and state["ema"] is ema and torch.equal(ema, torch.full((3,), 5.0))


def test_restore_only_writes_the_part_asked_for(tmp_path, capsys):
    from ckptstore.cli import main

    uri = str(tmp_path / "store")
    net = saved_step(uri)
    out = tmp_path / "model.pt"
    assert main(["restore", uri, "--to", str(out), "--only", "model"]) == 0
    restored = torch.load(out, weights_only=True)
    assert list(restored) == ["model"]
    for a, b in zip(restored["model"].values(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    capsys.readouterr()
    assert main(["restore", uri, "--to", str(tmp_path / "x.pt"), "--only", "nothing"]) == 2
    assert "nothing in step 7 is named 'nothing' or below it" in capsys.readouterr().err


@pytest.mark.parametrize("grown", ["model", "checkpoint"])
def test_a_module_whose_keys_differ_from_the_step_is_refused_unless_not_strict(tmp_path, grown):
    """A layer the step lacks would silently keep its initial weights (the module got its own
    values for the keys the step lacks): refused before any I/O; strict=False loads the keys
    both have and lists the others."""
    small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    big = torch.nn.Sequential(*small, torch.nn.Linear(2, 2))
    saved, into = (small, copy.deepcopy(big)) if grown == "model" else (big, copy.deepcopy(small))
    for p in into.parameters():
        torch.nn.init.zeros_(p)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": saved}).wait()
        with pytest.raises(UnsupportedStateError, match="3.bias, 3.weight"):
            ckpt.load({"model": into})
        assert all(not p.any() for p in into.parameters())  # nothing was written
        ckpt.load({"model": into}, strict=False)
        assert torch.equal(into[2].weight, saved[2].weight)
        assert sorted(ckpt.last_load_left_out) == (
            ["model/3.bias (not in step 1)", "model/3.weight (not in step 1)"]
            if grown == "model"
            else ["model/3.bias (not in the state)", "model/3.weight (not in the state)"]
        )


def test_a_saved_state_dict_loads_into_its_module_and_optimizer(tmp_path):
    """``{"model": model.state_dict()}`` saved, ``{"model": model}`` loaded (the README's
    pattern): the module gets the weights through load_state_dict and stays in the state.
    Before, the module was left untouched and replaced in the caller's dict by a new dict."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 4)).sum().backward()
    optim.step()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": net.state_dict(), "optim": optim.state_dict()}).wait()
        into = copy.deepcopy(net)
        for p in into.parameters():
            torch.nn.init.zeros_(p)
        into_optim = torch.optim.AdamW(into.parameters())
        state = {"model": into, "optim": into_optim}
        assert ckpt.load(state) == 1
        assert state["model"] is into and state["optim"] is into_optim
        for a, b in zip(into.state_dict().values(), net.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(
            into_optim.state_dict()["state"][0]["exp_avg"],
            optim.state_dict()["state"][0]["exp_avg"],
        )
        wider = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        with pytest.raises(
            UnsupportedStateError, match=r"model/0.weight: checkpoint has .*\(4, 4\)"
        ):
            ckpt.load({"model": wider})


def test_strict_refuses_state_keys_the_step_lacks_at_every_level(tmp_path):
    """A key nested in a dict of the state that the step lacks would keep its value unseen:
    refused as a top-level key is (strict=False lists it); a value of another kind too."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"t": {"a": torch.ones(3)}}).wait()
        grown = {"t": {"a": torch.zeros(3), "b": torch.zeros(1)}}
        with pytest.raises(
            UnsupportedStateError, match=r"state keys not in the checkpoint: \['t/b'\]"
        ):
            ckpt.load(grown)
        assert not grown["t"]["a"].any()  # refused before any byte was written
        ckpt.load(grown, strict=False)
        assert torch.equal(grown["t"]["a"], torch.ones(3))
        assert ckpt.last_load_left_out == ["t/b (not in step 1)"]
        other = {"t": torch.zeros(3)}
        with pytest.raises(
            UnsupportedStateError, match="t: checkpoint has a dict, state has Tensor"
        ):
            ckpt.load(other)
        assert isinstance(other["t"], torch.Tensor)


@pytest.mark.parametrize(
    "saved, target, says",
    [
        ({"w": [1, 2]}, {"w": torch.zeros(2)}, "w: checkpoint has a list, state has Tensor"),
        ([1, 2], {"w": torch.zeros(2)}, "<root>: checkpoint has a list, state has dict"),
        (None, {"w": torch.zeros(2)}, "the checkpoint holds None, the state a dict"),
    ],
    ids=["list-for-a-tensor", "list-for-the-state", "none-for-the-state"],
)
def test_a_strict_load_refuses_a_sequence_or_none_where_the_state_has_a_tensor(
    tmp_path, saved, target, says
):
    """Reviewer M: a list saved where the state holds a tensor replaced the tensor with the
    list, and a step holding None (or a list) at its root loaded nothing into the state and
    returned the step; as for a number, strict refuses it (strict=False replaces)."""
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.save(1, saved).wait()
        with pytest.raises(UnsupportedStateError, match=re.escape(says)):
            ckpt.load(target)
        assert torch.equal(target["w"], torch.zeros(2))
