"""ckptstore.integrations.lightning with the real Lightning Trainer and ModelCheckpoint."""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import enum
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import ROOT

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from bench.faults import Faults, with_faults  # noqa: E402
from ckptstore import (  # noqa: E402
    CheckpointCorruptError,
    Checkpointer,
    CheckpointNotFoundError,
    EncodingOptions,
    RetryPolicy,
    StorageOptions,
    Store,
    TierOptions,
    UnsupportedStateError,
)
from ckptstore.catalog import list_steps  # noqa: E402
from ckptstore.integrations._pickled import MARKER, unwrap, wrap  # noqa: E402
from ckptstore.integrations.lightning import CkptstoreCheckpointIO  # noqa: E402


class TinyModel(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(width, 1)
        # Never trained: its chunks are the same in every step (deduplicated, shared).
        self.register_buffer("frozen", torch.randn(256 * 1024 // 4))

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _loader(width: int = 8) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.randn(64, width, generator=torch.Generator()))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(io, dirpath: str, *, max_steps: int, callbacks=(), **checkpoint) -> L.Trainer:
    every = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, **checkpoint)
    return L.Trainer(
        max_steps=max_steps,
        plugins=[io],
        callbacks=[every, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )


def _snapshot(trainer: L.Trainer) -> dict:
    return {
        "model": copy.deepcopy(trainer.lightning_module.state_dict()),
        "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
        "global_step": trainer.global_step,
    }


class Capture(Callback):
    """The model and optimizer state after step ``at`` (0: when training starts)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.state: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if self.at == 0:
            self.state = _snapshot(trainer)

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.at and trainer.global_step == self.at:
            self.state = _snapshot(trainer)


def _assert_identical(actual, expected, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(_bytes(actual), _bytes(expected)), path
    elif isinstance(expected, dict):
        assert sorted(map(str, actual)) == sorted(map(str, expected)), path
        for key in expected:
            _assert_identical(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_identical(a, e, f"{path}/{i}")
    else:
        assert actual == expected, path


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path):
    if request.param == "s3":
        return request.getfixturevalue("s3_uri")
    return str(tmp_path / "store")


def test_fit_saves_steps_and_resume_restores_them_bit_for_bit(uri):
    io = CkptstoreCheckpointIO(uri)
    at_six = Capture(at=6)
    _trainer(io, uri, max_steps=6, callbacks=[at_six], save_top_k=-1).fit(TinyModel(), _loader())
    saved = io.steps()
    assert list(saved) == [2, 4, 6]
    assert saved[6] == f"{uri}/epoch=0-step=6.ckpt"

    resumed = CkptstoreCheckpointIO(uri)
    at_start = Capture()
    trainer = _trainer(resumed, uri, max_steps=8, callbacks=[at_start], save_top_k=-1)
    trainer.fit(TinyModel(), _loader(), ckpt_path=saved[6])
    _assert_identical(at_start.state, at_six.state)
    assert list(resumed.steps()) == [2, 4, 6, 8]

    by_step = resumed.load_checkpoint(6)
    assert resumed.load_checkpoint("latest")["global_step"] == 8
    _assert_identical(by_step["state_dict"], at_six.state["model"])
    _assert_identical(by_step["optimizer_states"][0], at_six.state["optimizer"])
    resumed.close()


def test_every_save_is_its_own_step_and_each_path_loads_what_was_saved_there(tmp_path):
    uri, ckpts = str(tmp_path / "store"), tmp_path / "ckpts"
    io = CkptstoreCheckpointIO(uri)
    first = Capture(at=4)
    fit = {"max_steps": 4, "save_top_k": 1, "save_last": True}
    _trainer(io, str(ckpts), callbacks=[first], **fit).fit(TinyModel(), _loader())
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    # last.ckpt, saved at global steps 2 and 4 beside the top-k file, is step 3, then step 5;
    # step 2 went with epoch=0-step=2.ckpt, step 3 when last.ckpt was overwritten.
    assert io.steps() == {4: str(ckpts / "epoch=0-step=4.ckpt"), 5: str(ckpts / "last.ckpt")}

    # A second fit through the same plugin into the same directory, other weights, same steps.
    second, model = Capture(at=4), TinyModel()
    with torch.no_grad():
        model.layer.weight.add_(1.0)
    _trainer(io, str(ckpts), callbacks=[second], **fit).fit(model, _loader())
    assert sorted(os.listdir(ckpts)) == [
        "epoch=0-step=4-v1.ckpt",
        "epoch=0-step=4.ckpt",
        "last-v1.ckpt",
        "last.ckpt",
    ]
    assert list(io.steps()) == [4, 5, 8, 9]
    for name, saved in [
        ("epoch=0-step=4.ckpt", first),
        ("last.ckpt", first),
        ("epoch=0-step=4-v1.ckpt", second),
        ("last-v1.ckpt", second),
    ]:
        loaded = io.load_checkpoint(str(ckpts / name))
        assert loaded["global_step"] == 4, name
        _assert_identical(loaded["state_dict"], saved.state["model"], name)
        _assert_identical(loaded["optimizer_states"][0], saved.state["optimizer"], name)
    io.close()


def test_ckpt_path_last_resumes_from_the_newest_save(tmp_path):
    uri, ckpts = str(tmp_path / "store"), str(tmp_path / "ckpts")
    at_four = Capture(at=4)
    io = CkptstoreCheckpointIO(uri)
    _trainer(io, ckpts, max_steps=4, callbacks=[at_four], save_last=True).fit(
        TinyModel(), _loader()
    )
    io.close()

    resumed, at_start = CkptstoreCheckpointIO(uri), Capture()
    trainer = _trainer(resumed, ckpts, max_steps=6, callbacks=[at_start], save_last=True)
    trainer.fit(TinyModel(), _loader(), ckpt_path="last")
    _assert_identical(at_start.state, at_four.state)
    assert resumed.load_checkpoint("last")["global_step"] == 6
    assert resumed.load_checkpoint(f"{ckpts}/last.ckpt")["global_step"] == 6
    resumed.close()


def test_a_pointer_is_refused_once_its_save_is_gone(tmp_path):
    uri = str(tmp_path / "store")
    saved, kept = str(tmp_path / "saved.ckpt"), str(tmp_path / "copy.ckpt")
    io = CkptstoreCheckpointIO(uri)
    io.save_checkpoint({"global_step": 3, "w": torch.ones(4)}, saved)
    io.teardown()
    shutil.copy(saved, kept)
    io.remove_checkpoint(saved)
    assert not os.path.exists(saved) and list(io.steps()) == []
    with pytest.raises(
        CheckpointNotFoundError, match=r"copy.ckpt points to step 3 of .*not committed"
    ):
        io.load_checkpoint(kept)
    io.close()

    again = CkptstoreCheckpointIO(uri)  # saves global step 3 as step 3 again, other weights
    again.save_checkpoint({"global_step": 3, "w": torch.zeros(4)}, str(tmp_path / "new.ckpt"))
    with pytest.raises(CheckpointNotFoundError, match=r"copy.ckpt .* now holds another save"):
        again.load_checkpoint(kept)
    assert torch.equal(again.load_checkpoint(str(tmp_path / "new.ckpt"))["w"], torch.zeros(4))
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*missing.ckpt"):
        again.load_checkpoint(str(tmp_path / "missing.ckpt"))
    (tmp_path / "empty.ckpt").write_bytes(b"")  # a save killed as it wrote a torch file
    with pytest.raises(CheckpointCorruptError, match=r"empty.ckpt is empty: neither"):
        again.load_checkpoint(str(tmp_path / "empty.ckpt"))
    again.close()
    shutil.move(uri, str(tmp_path / "moved"))
    gone = CkptstoreCheckpointIO(uri)
    with pytest.raises(CheckpointNotFoundError, match=r"new.ckpt points to .*holds nothing: moved"):
        gone.load_checkpoint(str(tmp_path / "new.ckpt"))
    gone.close()


def test_a_torch_checkpoint_file_loads_through_the_plugin(tmp_path):
    path = tmp_path / "torch.ckpt"
    torch.save({"global_step": 7, "w": torch.arange(3.0)}, path)
    io = CkptstoreCheckpointIO(str(tmp_path / "store"))
    loaded = io.load_checkpoint(str(path))
    assert loaded["global_step"] == 7 and torch.equal(loaded["w"], torch.arange(3.0))
    # Reviewer X: a file that is neither was torch's raw KeyError or UnpicklingError
    for name, data in (("text", b"hello world"), ("binary", b"\x00\x01garbage")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointCorruptError, match=rf"{name} is neither a ckptstore pointer"):
            io.load_checkpoint(str(tmp_path / name))
    torch.save({"global_step": 7, "args": argparse.Namespace(lr=0.1)}, tmp_path / "objects.ckpt")
    with pytest.raises(Exception, match="not an allowed global"):  # torch's word on objects
        io.load_checkpoint(str(tmp_path / "objects.ckpt"))
    io.close()


def test_remove_checkpoint_drops_the_step_and_keeps_chunks_other_steps_use(tmp_path):
    uri = str(tmp_path / "store")
    io = CkptstoreCheckpointIO(uri, encoding=EncodingOptions(chunk_bytes=64 * 1024))
    _trainer(io, uri, max_steps=6, save_top_k=-1).fit(TinyModel(), _loader())
    chunks_before = set(io.checkpointer.store.list("chunks"))
    kept = {s: io.load_checkpoint(s) for s in (2, 6)}

    io.remove_checkpoint(f"{uri}/epoch=0-step=4.ckpt")
    assert list_steps(io.checkpointer.store) == [2, 6]
    io.teardown()  # waits for the chunk sweep
    chunks_after = set(io.checkpointer.store.list("chunks"))
    assert chunks_after < chunks_before, "step 4's own chunks are swept"
    io.close()

    with Checkpointer(uri) as check:
        check.verify("all")
    reopened = CkptstoreCheckpointIO(uri)
    for step, checkpoint in kept.items():
        _assert_identical(reopened.load_checkpoint(f"{uri}/epoch=0-step={step}.ckpt"), checkpoint)
    reopened.close()


def test_teardown_raises_a_failed_background_save(tmp_path):
    uri = str(tmp_path / "store")
    failing = with_faults(
        Store(uri, retry=RetryPolicy(attempts=2, base_delay_s=0.01)),
        Faults(error_rate=1.0, ops=frozenset({"put"})),
    )
    io = CkptstoreCheckpointIO(uri, storage=StorageOptions(store=failing))
    io.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, f"{uri}/a.ckpt")
    with pytest.raises(Exception, match="injected"):
        io.teardown()
    assert list_steps(Store(uri)) == []
    io.close()


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Config:
    mode: Mode
    scale: torch.Tensor
    root: Path


def test_values_the_state_refuses_are_pickled_beside_verified_tensors(tmp_path):
    uri = str(tmp_path / "store")
    config = Config(Mode.FAST, torch.arange(6.0), Path("/data"))
    checkpoint = {"global_step": 3, "hyper_parameters": {"config": config, "modes": {Mode.FAST: 1}}}
    io = CkptstoreCheckpointIO(uri)
    io.save_checkpoint(checkpoint, f"{uri}/manual.ckpt")
    io.teardown()

    with pytest.raises(UnsupportedStateError, match=r"pickled .*Config.*weights_only=False"):
        io.load_checkpoint(3)
    loaded = io.load_checkpoint(3, weights_only=False)["hyper_parameters"]
    assert loaded["modes"] == {Mode.FAST: 1}
    assert loaded["config"].mode is Mode.FAST and loaded["config"].root == Path("/data")
    assert torch.equal(loaded["config"].scale, config.scale)
    with torch.serialization.safe_globals([Config, Mode]):
        assert io.load_checkpoint(3)["hyper_parameters"]["config"].mode is Mode.FAST
    io.close()
    # The tensor inside the dataclass is saved as a state tensor, not as bytes of the pickle.
    marker = wrap(config)
    assert torch.equal(marker["tensors"][0], config.scale)
    assert config.scale.numpy().tobytes() not in marker[MARKER]


def _global(module: bytes, name: bytes) -> bytes:
    return b"c" + module + b"\n" + name + b"\n"


_RANGE_2_40 = _global(b"builtins", b"range") + b"\x8a\x06" + (1 << 40).to_bytes(6, "little")
_RANGE_2_40 += b"\x85R"  # range(2**40): lazy, but a consumer of it would not be


def _reduce_blob(module: bytes, name: bytes, arg: int) -> bytes:
    """A pickle (protocol 2) calling ``module.name(arg)``."""
    return (
        b"\x80\x02c" + module + b"\n" + name + b"\n" + b"\x8a\x08" + arg.to_bytes(8, "little")
        + b"\x85R."
    )  # fmt: skip


@pytest.mark.parametrize(
    ("blob", "error"),
    [
        (_reduce_blob(b"builtins", b"bytearray", 1 << 40), "pickled builtins.bytearray"),
        (_reduce_blob(b"builtins", b"set", 1 << 40), "pickled builtins.set"),
        (b"\x80\x02K\x07Q.", "a pickled value names tensor 7 of the 0 saved with it"),
        (  # a safe constructor given arguments it refuses: was a raw TypeError
            b"\x80\x02" + _global(b"builtins", b"complex") + _RANGE_2_40 + b"\x85R.",
            r"does not load with weights_only=True \(TypeError: complex\(\) ",
        ),
        (b"\x80\x02]q\x00(K\x01", "does not load with weights_only=True"),  # cut short
    ],
    ids=["bytearray-2**40", "set", "persistent-id", "complex-of-range", "truncated"],
)
def test_a_crafted_pickled_value_is_refused_before_it_allocates(blob, error):
    """Adversary: a blob in a step's state calling bytearray(2**40) (a TiB) or naming a tensor
    that was not saved with it (was a bare IndexError). Sets and bytearrays that ``wrap``
    pickles have opcodes of their own: they still load."""
    with pytest.raises((UnsupportedStateError, CheckpointCorruptError), match=error):
        unwrap({MARKER: blob, "tensors": []}, weights_only=True)
    kept = [{1, 2}, frozenset({3}), bytearray(b"ab"), range(4)]
    assert all(MARKER in wrap(value) for value in kept[:3])  # pickled, not state values
    loaded = [unwrap(wrap(value), weights_only=True) for value in kept]
    assert loaded == kept and list(map(type, loaded)) == list(map(type, kept))


def test_values_a_state_would_give_back_as_another_type_are_pickled_whole():
    """Reviewer (exact resume): a bytearray went to the state as bytes, a complex64 numpy
    scalar failed the save; the state refuses both, so ``wrap`` pickles them as torch.save
    would, and they load back with their types (a numpy scalar, like torch.load's, only with
    weights_only=False). Fix adversary: a float32 numpy scalar and numpy keys (hparams) stay
    state values, as before, so a resume at the default weights_only loads them."""
    value = {"z": np.complex64(1j), "raw": bytearray(b"ab"), "n": np.float32(0.5)}
    keyed = {np.str_("cat"): 1}
    wrapped = wrap(value)
    assert MARKER in wrapped["z"] and MARKER in wrapped["raw"] and wrapped["n"] is value["n"]
    assert wrap(keyed) == keyed
    loaded = unwrap(wrapped, weights_only=False)
    assert loaded == value and type(loaded["z"]) is np.complex64
    assert type(loaded["raw"]) is bytearray
    with pytest.raises(UnsupportedStateError, match="numpy.*weights_only=False"):
        unwrap(wrapped, weights_only=True)


class _MovedOn:
    """A user's class allowed with add_safe_globals whose __setstate__ refuses an old state."""

    refuse = False

    def __init__(self, version: str) -> None:
        self.version = version

    def __setstate__(self, state: dict) -> None:
        if _MovedOn.refuse:
            raise ValueError(f"DataConfig {state['version']} is too old")
        self.__dict__.update(state)


def test_a_safe_global_of_the_users_own_raising_is_not_called_corrupt(monkeypatch):
    """Adversary of stop 79's fix: the user's own class (allowed with add_safe_globals, as the
    refusal advises) raising in __setstate__ was reported as CheckpointCorruptError, the bytes
    intact: its own error goes to the user, as with weights_only=False."""
    marker = wrap(_MovedOn("v1"))
    with torch.serialization.safe_globals([_MovedOn]):
        assert unwrap(marker, weights_only=True).version == "v1"
        monkeypatch.setattr(_MovedOn, "refuse", True)
        with pytest.raises(ValueError, match="DataConfig v1 is too old") as info:
            unwrap(marker, weights_only=True)
        assert not isinstance(info.value, CheckpointCorruptError)


@pytest.mark.parametrize(
    ("blob", "error"),
    [
        (b"\x80\x02" + _global(b"torch", b"Size") + _RANGE_2_40 + b"\x85R.", "torch.Size of no"),
        (b"\x80\x02" + _global(b"collections", b"Counter") + _RANGE_2_40 + b"\x85R.", "Counter of"),
        (  # BUILD on torch's layout lookup: would set its table for every later torch.load
            b"\x80\x02"
            + _global(b"torch.serialization", b"_get_layout")
            + b"}X\x05\x00\x00\x00cache}sb0N.",
            "sets attributes of torch.serialization._get_layout",
        ),
        (
            b"\x80\x02" + _global(b"collections", b"Counter") + b"}X\x06\x00\x00\x00updateNsb0N.",
            "sets attributes of collections.Counter",
        ),
    ],
    ids=["size-of-range-2**40", "counter-of-range-2**40", "build-layout", "build-counter"],
)
def test_the_plain_values_torch_resolves_are_checked_and_never_changed(blob, error):
    """Adversary of stop 78: the globals added for torch's plain values were the real ones: a
    blob built torch.Size or a Counter of range(2**40) (TiBs, in the torchtitan state check
    too), or set attributes of torch's layout table or of Counter for the whole process. Each
    is a checked constructor, and a BUILD on it is refused."""
    from ckptstore.integrations._pickled import check_pickled_state

    with pytest.raises(UnsupportedStateError, match=error):
        unwrap({MARKER: blob, "tensors": []}, weights_only=True)
    with pytest.raises(UnsupportedStateError, match=error):
        check_pickled_state(blob, "a dataloader's state")
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert collections.Counter("aab") == {"a": 2, "b": 1}


def test_torchs_own_plain_values_load_with_weights_only_as_torch_load_does():
    """Lightning user of stop 78: a ``torch.dtype`` in a model's hyper-parameters (common)
    was refused at resume, though ``torch.load(weights_only=True)`` loads dtypes, devices and
    sizes; and the fix the error named, ``add_safe_globals([torch.bfloat16])``, raised an
    AttributeError on every later load."""
    import collections

    import torch.serialization

    hparams = {
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "shape": torch.Size([2, 3]),
        "layout": torch.strided,
        "counts": collections.Counter("aab"),
    }
    assert unwrap(wrap(hparams), weights_only=True) == hparams
    saved = torch.serialization.get_safe_globals()
    try:
        torch.serialization.add_safe_globals([torch.float16])
        value = {"dtype": torch.float16}
        assert unwrap(wrap(value), weights_only=True) == value
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


CHILD = """
from {module} import CkptstoreCheckpointIO, TinyModel, _loader, _trainer
io = CkptstoreCheckpointIO({uri!r})
_trainer(io, {uri!r}, max_steps=100_000, save_top_k=-1).fit(TinyModel(), _loader())
"""


def test_kill_9_mid_fit_leaves_only_complete_steps(tmp_path):
    uri = str(tmp_path / "store")
    script = CHILD.format(module=__name__, uri=uri)  # this module, in the child
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "child.log"
    store = Store(uri)
    with open(log, "wb") as out:
        child = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=out)
    try:
        deadline = time.monotonic() + 120
        while len(list_steps(store)) < 2:
            assert child.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "no step committed within 120 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    steps = list_steps(store)
    assert steps and all(s % 2 == 0 for s in steps)
    with Checkpointer(uri) as check:
        check.verify("all")
    io = CkptstoreCheckpointIO(uri)
    for step in steps:
        assert io.load_checkpoint(step)["global_step"] == step
    pointers = sorted(Path(uri).glob("*.ckpt"))
    assert len(pointers) >= len(steps)
    for pointer in pointers:
        loaded = io.load_checkpoint(str(pointer))
        named = int(pointer.name.rsplit("-step=", 1)[1].split(".")[0])
        if named in steps:
            assert loaded["global_step"] == named
        else:  # the save the kill interrupted: the newest committed before it, as torch IO
            assert loaded["global_step"] == max(s for s in steps if s < named), pointer.name
    io.close()


def _ddp_fit(tmp_path, out: str, *args: str) -> None:
    (tmp_path / out).mkdir()
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "helpers" / "lightning_ddp.py"),
        "--out",
        str(tmp_path / out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*cmd, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_ddp_rank_0_saves_and_every_rank_resumes_the_same_state(tmp_path):
    uri = str(tmp_path / "store")
    _ddp_fit(tmp_path, "first", "--uri", uri, "--max-steps", "4", "--at", "4")
    assert list_steps(Store(uri)) == [2, 4]
    saved = [torch.load(tmp_path / "first" / f"step-rank{r}.pt") for r in (0, 1)]
    _assert_identical(saved[1], saved[0])  # DDP: the ranks hold the same state

    _ddp_fit(tmp_path, "resumed", "--uri", uri, "--max-steps", "6", "--resume", "latest")
    assert list_steps(Store(uri)) == [2, 4, 6]
    for rank in (0, 1):
        loaded = torch.load(tmp_path / "resumed" / f"start-rank{rank}.pt")
        assert loaded["global_step"] == 4
        _assert_identical(loaded, saved[0])


def test_importing_ckptstore_does_not_import_lightning_and_a_missing_lightning_is_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    quiet = subprocess.run(
        [sys.executable, "-c", "import ckptstore, sys; print('lightning' in sys.modules)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert quiet.stdout.strip() == "False", quiet.stderr
    blocked = (
        "import sys\n"
        "sys.modules.update(lightning=None, lightning_fabric=None)\n"
        "import ckptstore.integrations.lightning\n"
    )
    missing = subprocess.run(
        [sys.executable, "-c", blocked], env=env, capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == (
        "ImportError: ckptstore.integrations.lightning needs Lightning: pip install lightning"
    )


def test_a_pointer_left_pending_by_a_kill_loads_the_newest_save_before_it(tmp_path, caplog):
    """A pointer at a new path is written as its save starts (Lightning versions names by the
    files there and links last.ckpt to it at once); a kill before the commit left it naming a
    save that never committed, and ckpt_path="last" failed on every restart. It now loads the
    newest save committed before it, as the torch file Lightning would have left; with none, it
    says there is nothing to resume."""
    from ckptstore.integrations._pointer import Pointer, store_id, write

    uri = str(tmp_path / "store")
    io = CkptstoreCheckpointIO(uri)
    io.save_checkpoint({"global_step": 2, "w": torch.ones(4)}, str(tmp_path / "step=2.ckpt"))
    io.teardown()
    interrupted = Pointer(store_id(uri), 5, "a-save-that-never-committed", 5, pending=True)
    write(str(tmp_path / "step=5.ckpt"), interrupted)
    os.symlink("step=5.ckpt", tmp_path / "last.ckpt")  # save_last="link"
    caplog.set_level(logging.WARNING, logger="ckptstore")
    loaded = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert loaded["global_step"] == 2 and torch.equal(loaded["w"], torch.ones(4))
    assert any(
        "interrupted before it committed: loading step 2" in r.getMessage() for r in caplog.records
    )
    io.close()

    fresh = CkptstoreCheckpointIO(str(tmp_path / "empty"))
    first = Pointer(store_id(str(tmp_path / "empty")), 2, "never", 2, pending=True)
    write(str(tmp_path / "first.ckpt"), first)
    with pytest.raises(CheckpointNotFoundError, match="no earlier step is committed: nothing to"):
        fresh.load_checkpoint(str(tmp_path / "first.ckpt"))
    # Reviewer W: every restart of a job killed in its first save failed on the same file.
    assert not (tmp_path / "first.ckpt").exists()
    fresh.close()


def test_a_save_to_a_last_link_replaces_the_link_and_keeps_the_step_it_named(tmp_path):
    """Lightning user of stop 78: with save_last="link", a resumed run's first last.ckpt save
    is a save to the link's path; the plugin took the linked top-k file's pointer for the one
    replaced and unlisted its step once the save committed: that file no longer loaded. The
    save replaces the link alone."""
    uri = str(tmp_path / "store")
    io = CkptstoreCheckpointIO(uri)
    io.save_checkpoint({"global_step": 28, "w": torch.ones(4)}, str(tmp_path / "step=28.ckpt"))
    io.teardown()
    io.close()
    os.symlink("step=28.ckpt", tmp_path / "last.ckpt")
    resumed = CkptstoreCheckpointIO(uri)
    resumed.save_checkpoint({"global_step": 32, "w": torch.zeros(4)}, str(tmp_path / "last.ckpt"))
    resumed.teardown()
    assert not os.path.islink(tmp_path / "last.ckpt")
    assert resumed.load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 32
    kept = resumed.load_checkpoint(str(tmp_path / "step=28.ckpt"))
    assert kept["global_step"] == 28 and torch.equal(kept["w"], torch.ones(4))
    assert sorted(resumed.steps()) == [28, 32]
    resumed.close()


def test_a_step_whose_pointer_was_overwritten_before_a_kill_goes_with_the_next_overwrite(
    tmp_path,
):
    """Stop 83's Lightning user: last.ckpt overwritten (its new save committed, the pointer
    rewritten) and the process killed before the step it had named was unlisted: that step
    stayed listed for good, named by nothing, one more per kill. The new pointer names it,
    and the next process's overwrite of last.ckpt unlists it."""
    uri, last = str(tmp_path / "store"), str(tmp_path / "last.ckpt")
    io = CkptstoreCheckpointIO(uri)
    for global_step in (2, 4):
        io.save_checkpoint({"global_step": global_step, "w": torch.ones(4)}, last)
        io.checkpointer.wait()
    io._wait_saves()  # the pointer names step 4's save; step 2 would go at the next save
    assert sorted(io.steps()) == [2, 4]
    io.checkpointer.close()  # killed here: no teardown, no further save
    for round_ in (1, 2):  # two more kills at the same point, then a clean end
        resumed = CkptstoreCheckpointIO(uri)
        assert resumed.load_checkpoint(last)["global_step"] == 2 + 2 * round_
        resumed.save_checkpoint({"global_step": 4 + 2 * round_, "w": torch.zeros(4)}, last)
        resumed.checkpointer.wait()
        resumed._wait_saves()
        resumed.checkpointer.close()
    final = CkptstoreCheckpointIO(uri)
    final.save_checkpoint({"global_step": 10, "w": torch.zeros(4)}, last)
    final.teardown()
    assert sorted(final.steps()) == [10]
    assert final.load_checkpoint(last)["global_step"] == 10
    final.close()


def test_the_cli_given_a_pointer_file_names_its_store_and_step(tmp_path, capsys):
    """Lightning user of stop 78: ``ckptstore ls ckpts/last.ckpt`` (the file a Lightning user
    has) said only "a file, not a store directory"; it names the store and step it points to.
    A file that is no pointer is still "a file"."""
    from ckptstore.cli import main

    uri = str(tmp_path / "store")
    io = CkptstoreCheckpointIO(uri)
    io.save_checkpoint({"global_step": 7, "w": torch.ones(4)}, str(tmp_path / "last.ckpt"))
    io.teardown()
    io.close()
    for command in ("ls", "verify", "inspect"):
        assert main([command, str(tmp_path / "last.ckpt")]) == 1
        err = capsys.readouterr().err
        assert f"a pointer to step 7 of the store {uri}" in err and f"give {uri} --step 7" in err
    (tmp_path / "other.ckpt").write_bytes(b"\x80\x02 not a pointer")
    assert main(["ls", str(tmp_path / "other.ckpt")]) == 1
    assert "(a file, not a store directory)" in capsys.readouterr().err
    os.mkfifo(tmp_path / "fifo.ckpt")  # adversary of stop 78: the look into the file hung
    assert main(["ls", str(tmp_path / "fifo.ckpt")]) == 1
    assert "(not a store directory)" in capsys.readouterr().err


def test_a_pointer_whose_save_is_in_flight_in_another_process_loads_that_save(tmp_path):
    """Reviewer W: a pointer read while its save was still committing (another plugin, as a
    second process reads last.ckpt) loaded the save before it, warning of an interrupted save
    that committed a moment later."""
    uri = str(tmp_path / "store")
    slow = with_faults(
        Store(uri), Faults(latency=None, slow_rate=1.0, slow_s=0.5, ops=frozenset({"put"}))
    )
    writer = CkptstoreCheckpointIO(uri, storage=StorageOptions(store=slow))
    writer.save_checkpoint({"global_step": 2, "w": torch.ones(4)}, str(tmp_path / "a.ckpt"))
    writer.teardown()
    writer.save_checkpoint({"global_step": 5, "w": torch.full((4,), 5.0)}, str(tmp_path / "b.ckpt"))
    assert json.loads((tmp_path / "b.ckpt").read_text())["pending"]
    reader = CkptstoreCheckpointIO(uri)
    loaded = reader.load_checkpoint(str(tmp_path / "b.ckpt"))
    assert loaded["global_step"] == 5 and torch.equal(loaded["w"], torch.full((4,), 5.0))
    reader.close()
    writer.teardown()
    writer.close()


@pytest.mark.parametrize("failing", [False, True])
def test_a_pointer_whose_save_waits_behind_another_loads_that_save(
    tmp_path, monkeypatch, caplog, failing
):
    """Reviewer X: a save queued behind the retention of the save before it holds no lease;
    once its pending pointer was QUEUED_SAVE_S old, another process's load took it for an
    interrupted save and loaded the step before it. The writer rewrites it while it waits;
    reviewer Q: a rewrite that failed once with an error other than OSError (gcsfs's
    HttpError) ended the rewrites for good."""
    from ckptstore.integrations import _pointer, lightning
    from ckptstore.save import session

    write, failed = _pointer.write, []

    def write_failing_once(path, pointer):
        if failing and not failed and threading.current_thread().name.endswith("-pending"):
            failed.append(path)
            raise RuntimeError("the pointer's store answered 503")
        return write(path, pointer)

    monkeypatch.setattr(_pointer, "write", write_failing_once)

    monkeypatch.setattr(lightning, "QUEUED_SAVE_S", 1.0)
    monkeypatch.setattr(lightning, "REFRESH_PENDING_S", 0.2)
    collect, slowed = session.collect, []

    def slow_collect(*args, **kwargs):  # the first save's retention, re-hashing on S3 say
        report = collect(*args, **kwargs)
        if not slowed:
            slowed.append(True)
            time.sleep(3.0)
        return report

    monkeypatch.setattr(session, "collect", slow_collect)
    uri = str(tmp_path / "store")
    writer = CkptstoreCheckpointIO(uri, keep_last=2)
    writer.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, str(tmp_path / "a.ckpt"))
    writer.save_checkpoint({"global_step": 2, "w": torch.full((4,), 2.0)}, str(tmp_path / "b.ckpt"))
    reader = CkptstoreCheckpointIO(uri)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        loaded = reader.load_checkpoint(str(tmp_path / "b.ckpt"))
    assert slowed and loaded["global_step"] == 2 and torch.equal(loaded["w"], torch.full((4,), 2.0))
    assert "interrupted" not in caplog.text
    assert bool(failed) is failing and ("503" in caplog.text) is failing
    reader.close()
    writer.teardown()
    writer.close()
    assert not json.loads((tmp_path / "b.ckpt").read_text()).get("pending")


def test_tiers_are_refused_by_name(tmp_path):
    """A pointer to a step only a local tier held named no durable step after a kill: every
    restart failed. The plugin takes no tiers."""
    for options in ({"tiers": TierOptions(local_dir=tmp_path / "local")}, {"local_dir": "L"}):
        with pytest.raises(ValueError, match="does not take tiers"):
            CkptstoreCheckpointIO(tmp_path / "store", **options)
    CkptstoreCheckpointIO(tmp_path / "store", tiers=TierOptions())  # no local_dir: no tiers
