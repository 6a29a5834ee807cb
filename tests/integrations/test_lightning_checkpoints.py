"""What Lightning's ModelCheckpoint and Trainer do with checkpoint files, done through
``CkptstoreCheckpointIO``: which saves, loads and removals Lightning asks of the plugin, which
pointer files it leaves in ``dirpath`` (and that they are all it leaves there: the data is in the
store), which store steps they name and what each of them loads.

Real ``lightning.pytorch.Trainer`` runs of Lightning's demo ``BoringModel`` on the CPU, no
validation loop; the store is a local directory beside ``dirpath`` or a bucket on the moto server.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel, RandomIterableDataset  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

from ckptstore.catalog import load_manifest  # noqa: E402
from ckptstore.health import status  # noqa: E402
from ckptstore.integrations import _pointer  # noqa: E402
from ckptstore.integrations.lightning import CkptstoreCheckpointIO  # noqa: E402
from ckptstore.store import Store  # noqa: E402
from tests.helpers.states import assert_same  # noqa: E402


class Recording(CkptstoreCheckpointIO):
    """The plugin, with a log of what Lightning called: ``("save", file name, global step)``,
    ``("load", file name)``, ``("remove", file name)``."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.calls: list[tuple] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append(("save", Path(path).name, checkpoint["global_step"]))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.calls.append(("load", Path(str(path)).name))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path):
        self.calls.append(("remove", Path(path).name))
        super().remove_checkpoint(path)

    def take_calls(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> str:
    """The store's URI: a directory that is not ``dirpath``, or a fresh moto bucket."""
    if request.param == "s3":
        return request.getfixturevalue("s3_uri")
    return str(tmp_path / "store")


@pytest.fixture
def plugin(store):
    """Makes recording plugins on ``store``; closes them after the test."""
    made: list[Recording] = []

    def make() -> Recording:
        made.append(Recording(store))
        return made[-1]

    yield make
    for io in made:
        io.close()


def _trainer(io: Recording, *callbacks: Callback, as_strategy: bool = False, **options):
    """A quiet CPU Trainer saving through ``io``: given as a plugin, or as the checkpoint IO of
    a ``SingleDeviceStrategy``."""
    if as_strategy:
        options["strategy"] = SingleDeviceStrategy("cpu", checkpoint_io=io)
    else:
        options["plugins"] = [io]
    return L.Trainer(
        accelerator="cpu",
        callbacks=list(callbacks),
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _every(dirpath: Path, n: int = 2, **options) -> ModelCheckpoint:
    """Saves ``{dirpath}/step=N.ckpt`` every ``n`` training steps."""
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=n, **options)


def _pointers(io: Recording, *dirpaths: Path) -> dict[str, int]:
    """``{file name: store step}`` of every file in ``dirpaths``, each checked to be a pointer
    (not a link, not checkpoint data) into ``io``'s store; the pointers name exactly the
    store's committed steps, each the step saved at that path."""
    found: dict[str, int] = {}
    by_path: dict[str, int] = {}
    for dirpath in dirpaths:
        for name in sorted(os.listdir(dirpath)):
            path = str(dirpath / name)
            assert not os.path.islink(path), path
            data = _pointer.read(path)
            assert data is not None and _pointer.is_pointer(data), f"{path} is not a pointer"
            pointer = _pointer.decode(data, path)
            assert pointer.store == _pointer.store_id(io.uri), path
            found[name] = by_path[path] = pointer.step
    assert sorted(io.steps().items()) == sorted((step, path) for path, step in by_path.items())
    return found


def _assert_loads(io: Recording, path: Path, global_step: int, epoch: int, saved: dict) -> None:
    """The checkpoint at ``path`` is the one of ``global_step`` and ``epoch``, with the model and
    optimizer state ``saved`` (loaded by the test: not in ``io.calls``)."""
    checkpoint = CkptstoreCheckpointIO.load_checkpoint(io, str(path))
    assert (checkpoint["global_step"], checkpoint["epoch"]) == (global_step, epoch), path
    assert_same(checkpoint["state_dict"], saved["model"], f"{path.name}: model")
    assert_same(checkpoint["optimizer_states"][0], saved["optimizer"], f"{path.name}: optimizer")


class Snapshots(Callback):
    """Copies of the model's and the optimizer's state where a fit starts (``start``, with
    ``global_step`` and ``epoch`` there) and after each global step in ``steps`` (``at[step]``)."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)
        self.at: dict[int, dict] = {}
        self.start: dict | None = None
        self.global_step = self.epoch = -1

    @staticmethod
    def _state(trainer) -> dict:
        return copy.deepcopy(
            {
                "model": trainer.lightning_module.state_dict(),
                "optimizer": trainer.optimizers[0].state_dict(),
            }
        )

    def on_train_start(self, trainer, pl_module) -> None:
        self.global_step, self.epoch = trainer.global_step, trainer.current_epoch
        self.start = self._state(trainer)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step in self.steps:
            self.at[trainer.global_step] = self._state(trainer)


def test_lightning_calls_the_plugin_to_save_load_and_remove(plugin, tmp_path):
    """One save per checkpoint (top-k file and ``last.ckpt``), one remove per superseded top-k
    file, one load per ``ckpt_path``: as a plugin, and as the checkpoint IO of a strategy."""
    io, ckpts, first = plugin(), tmp_path / "ckpts", Snapshots(2)
    checkpoint = ModelCheckpoint(dirpath=ckpts, save_last=True)
    trainer = _trainer(io, first, checkpoint, max_epochs=2, limit_train_batches=1)
    trainer.fit(BoringModel())
    assert io.take_calls() == [
        ("save", "epoch=0-step=1.ckpt", 1),
        ("save", "last.ckpt", 1),
        ("save", "epoch=1-step=2.ckpt", 2),
        ("remove", "epoch=0-step=1.ckpt"),
        ("save", "last.ckpt", 2),
    ]
    assert checkpoint.best_model_path == str(ckpts / "epoch=1-step=2.ckpt")
    # Global step 1 went to steps 1 and 2 of the store, global step 2 to steps 3 and 4; steps 1
    # (its file removed) and 2 (last.ckpt overwritten) are unlisted.
    assert _pointers(io, ckpts) == {"epoch=1-step=2.ckpt": 3, "last.ckpt": 4}

    for ckpt_path, run in [(checkpoint.last_model_path, "test"), ("best", "validate")]:
        fresh = BoringModel()
        getattr(trainer, run)(fresh, ckpt_path=ckpt_path, verbose=False)
        assert_same(fresh.state_dict(), first.at[2]["model"], run)
    assert io.take_calls() == [("load", "last.ckpt"), ("load", "epoch=1-step=2.ckpt")]
    assert list(io.steps()) == [3, 4], "testing and validating saved nothing"

    again, second = ModelCheckpoint(dirpath=ckpts, save_last=True), Snapshots(2)
    trainer = _trainer(io, second, again, as_strategy=True, max_epochs=2, limit_train_batches=1)
    trainer.fit(BoringModel())
    assert io.take_calls() == [
        ("save", "epoch=0-step=1.ckpt", 1),
        ("save", "last-v1.ckpt", 1),
        ("save", "epoch=1-step=2-v1.ckpt", 2),
        ("remove", "epoch=0-step=1.ckpt"),
        ("save", "last-v1.ckpt", 2),
    ]
    assert _pointers(io, ckpts) == {
        "epoch=1-step=2.ckpt": 3,
        "last.ckpt": 4,
        "epoch=1-step=2-v1.ckpt": 7,
        "last-v1.ckpt": 8,
    }
    trainer.test(BoringModel(), ckpt_path=again.last_model_path, verbose=False)
    assert io.take_calls() == [("load", "last-v1.ckpt")]
    for name, run in [("last.ckpt", first), ("last-v1.ckpt", second)]:
        _assert_loads(io, ckpts / name, 2, 1, run.at[2])  # saved at the end of epoch 1


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_every_n_train_steps_saves_a_pointer_at_each_nth_step(plugin, tmp_path):
    io, ckpts, run = plugin(), tmp_path / "ckpts", Snapshots(3, 6, 9)
    _trainer(io, run, _every(ckpts, 3, save_top_k=-1), max_steps=10).fit(BoringModel())
    assert io.take_calls() == [("save", f"step={s}.ckpt", s) for s in (3, 6, 9)]
    assert _pointers(io, ckpts) == {"step=3.ckpt": 3, "step=6.ckpt": 6, "step=9.ckpt": 9}
    for step in (3, 6, 9):
        _assert_loads(io, ckpts / f"step={step}.ckpt", step, 0, run.at[step])
    # ModelCheckpoint's own state holds kth_value=inf (no monitor): not a blow-up
    store = Store(io.uri)
    assert [status(load_manifest(store, s).health) for s in (3, 6, 9)] == ["healthy"] * 3


SCORES = {2: 5.0, 4: 1.0, 6: 4.0, 8: 2.0, 10: 3.0}  # global step -> "score" (lower is better)


class Scored(BoringModel):
    def training_step(self, batch, batch_idx):
        self.log("score", SCORES.get(self.global_step + 1, 100.0))  # the step being taken
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "top_k, saved, kept",
    # step 10 (score 3.0) is not among the best two: with top-2 it is not even saved
    [(2, [2, 4, 6, 8], [4, 8]), (-1, [2, 4, 6, 8, 10], [2, 4, 6, 8, 10])],
    ids=["top-2", "all"],
)
def test_save_top_k_keeps_the_best_pointers_and_only_their_steps(
    plugin, tmp_path, top_k, saved, kept
):
    io, ckpts, run = plugin(), tmp_path / "ckpts", Snapshots(*SCORES)
    checkpoint = _every(ckpts, monitor="score", save_top_k=top_k)
    _trainer(io, run, checkpoint, max_steps=10).fit(Scored())
    calls = io.take_calls()
    assert [call[2] for call in calls if call[0] == "save"] == saved
    removed = [call[1] for call in calls if call[0] == "remove"]
    assert removed == [f"step={s}.ckpt" for s in saved if s not in kept]
    assert checkpoint.best_model_path == str(ckpts / "step=4.ckpt")
    assert {Path(p).name: float(v) for p, v in checkpoint.best_k_models.items()} == {
        f"step={s}.ckpt": SCORES[s] for s in kept
    }
    assert _pointers(io, ckpts) == {f"step={s}.ckpt": s for s in kept}
    for step in kept:
        _assert_loads(io, ckpts / f"step={step}.ckpt", step, 0, run.at[step])


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_save_last_versions_on_a_rerun_and_resuming_from_last_keeps_the_old_last(plugin, tmp_path):
    io, ckpts = plugin(), tmp_path / "ckpts"

    def fit(run: Snapshots, max_steps: int, **how) -> None:
        checkpoint = _every(ckpts, save_top_k=1, save_last=True)
        _trainer(io, run, checkpoint, max_steps=max_steps).fit(BoringModel(), **how)

    first = Snapshots(4)
    fit(first, 4)
    assert io.take_calls() == [
        ("save", "step=2.ckpt", 2),
        ("save", "last.ckpt", 2),
        ("save", "step=4.ckpt", 4),
        ("remove", "step=2.ckpt"),
        ("save", "last.ckpt", 4),
    ]
    assert _pointers(io, ckpts) == {"last.ckpt": 5, "step=4.ckpt": 4}

    # A new run into the same dirpath: its last checkpoint is last-v1.ckpt; last.ckpt stays.
    second = Snapshots(2)
    fit(second, 2)
    assert io.take_calls() == [("save", "step=2.ckpt", 2), ("save", "last-v1.ckpt", 2)]
    assert _pointers(io, ckpts) == {
        "last-v1.ckpt": 7,
        "last.ckpt": 5,
        "step=2.ckpt": 6,
        "step=4.ckpt": 4,
    }

    # ckpt_path="last" is the newest last*.ckpt: the second run's, at global step 2.
    resumed = Snapshots(6)
    fit(resumed, 6, ckpt_path="last")
    # The callback's state comes back with it: its best file (the second run's step=2.ckpt) goes
    # when a newer one is saved; step=4.ckpt of the first run is taken, so it saves step=4-v1.
    assert io.take_calls() == [
        ("load", "last-v1.ckpt"),
        ("save", "step=4-v1.ckpt", 4),
        ("remove", "step=2.ckpt"),
        ("save", "last-v1.ckpt", 4),
        ("save", "step=6.ckpt", 6),
        ("remove", "step=4-v1.ckpt"),
        ("save", "last-v1.ckpt", 6),
    ]
    assert (resumed.global_step, resumed.epoch) == (2, 0)
    assert_same(resumed.start, second.at[2])
    assert _pointers(io, ckpts) == {
        "last-v1.ckpt": 11,
        "last.ckpt": 5,
        "step=4.ckpt": 4,
        "step=6.ckpt": 10,
    }
    _assert_loads(io, ckpts / "last-v1.ckpt", 6, 0, resumed.at[6])
    _assert_loads(io, ckpts / "last.ckpt", 4, 0, first.at[4])


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_second_fit_of_the_same_trainer_versions_the_file_names(plugin, tmp_path):
    io, ckpts, run = plugin(), tmp_path / "ckpts", Snapshots(2, 4, 6, 8)
    # One file name for every save, every save kept (ranked by its step): Lightning versions the
    # name rather than overwrite a file.
    checkpoint = ModelCheckpoint(
        dirpath=ckpts,
        filename="run",
        every_n_train_steps=2,
        save_top_k=-1,
        monitor="step",
        mode="max",
    )
    trainer = _trainer(io, run, checkpoint, max_steps=4)
    model = BoringModel()
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(model)
    names = {2: "run.ckpt", 4: "run-v1.ckpt", 6: "run-v2.ckpt", 8: "run-v3.ckpt"}
    assert io.take_calls() == [("save", names[s], s) for s in (2, 4, 6, 8)]
    assert _pointers(io, ckpts) == {name: step for step, name in names.items()}
    for step, name in names.items():  # the second fit starts a new epoch
        _assert_loads(io, ckpts / name, step, 0 if step <= 4 else 1, run.at[step])

    trainer.fit(model)  # nothing left to train: nothing saved
    assert io.take_calls() == []
    assert list(io.steps()) == [2, 4, 6, 8]


@pytest.mark.parametrize("folder", ["same", "other"])
def test_resuming_from_a_pointer_restores_step_and_epoch_and_keeps_that_pointer(
    plugin, tmp_path, folder
):
    io, ckpts, first = plugin(), tmp_path / "first", Snapshots(4)
    # 3 batches an epoch: global step 4 is the first batch of epoch 1
    _trainer(io, first, _every(ckpts, save_top_k=1), max_steps=4, limit_train_batches=3).fit(
        BoringModel()
    )
    assert io.take_calls() == [
        ("save", "step=2.ckpt", 2),
        ("save", "step=4.ckpt", 4),
        ("remove", "step=2.ckpt"),
    ]
    assert _pointers(io, ckpts) == {"step=4.ckpt": 4}

    again, resumed = ckpts if folder == "same" else tmp_path / "second", Snapshots(8)
    trainer = _trainer(io, resumed, _every(again, save_top_k=1), max_steps=8, limit_train_batches=3)
    trainer.fit(BoringModel(), ckpt_path=ckpts / "step=4.ckpt")
    assert (resumed.global_step, resumed.epoch) == (4, 1)
    assert_same(resumed.start, first.at[4])
    assert trainer.global_step == 8
    # Lightning never removes the checkpoint it resumed from: its pointer and its step stay.
    assert io.take_calls() == [
        ("load", "step=4.ckpt"),
        ("save", "step=6.ckpt", 6),
        ("save", "step=8.ckpt", 8),
        ("remove", "step=6.ckpt"),
    ]
    if folder == "same":
        assert _pointers(io, ckpts) == {"step=4.ckpt": 4, "step=8.ckpt": 8}
    else:
        assert _pointers(io, ckpts, again) == {"step=4.ckpt": 4, "step=8.ckpt": 8}
        assert os.listdir(ckpts) == ["step=4.ckpt"] and os.listdir(again) == ["step=8.ckpt"]
    _assert_loads(io, again / "step=8.ckpt", 8, 2, resumed.at[8])
    _assert_loads(io, ckpts / "step=4.ckpt", 4, 1, first.at[4])


class Endless(BoringModel):
    """Trains on an iterable dataset with no length (a billion batches, made as they are read)."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RandomIterableDataset(32, 10**9), batch_size=2)


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_resuming_a_max_steps_run_on_an_endless_dataloader(plugin, tmp_path):
    io, ckpts, first = plugin(), tmp_path / "ckpts", Snapshots(4)
    _trainer(io, first, _every(ckpts, save_top_k=-1), max_steps=4).fit(Endless())
    assert _pointers(io, ckpts) == {"step=2.ckpt": 2, "step=4.ckpt": 4}

    resumed = Snapshots(6)
    trainer = _trainer(io, resumed, _every(ckpts, save_top_k=-1), max_steps=6)
    trainer.fit(Endless(), ckpt_path=ckpts / "step=4.ckpt")
    assert (resumed.global_step, resumed.epoch, trainer.global_step) == (4, 0, 6)
    assert_same(resumed.start, first.at[4])
    assert _pointers(io, ckpts) == {"step=2.ckpt": 2, "step=4.ckpt": 4, "step=6.ckpt": 6}
    _assert_loads(io, ckpts / "step=6.ckpt", 6, 0, resumed.at[6])


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_removing_a_last_link_keeps_the_step_its_target_names(plugin, tmp_path):
    """save_last="link" with a last name per step: Lightning links last-step=N.ckpt to
    step=N.ckpt and removes the previous link through the plugin. Removing a link removes the
    link: the kept top-k file it named still loads (the plugin read the pointer through the link
    and dropped that file's step)."""
    io, ckpts = plugin(), tmp_path / "ckpts"
    checkpoint = _every(ckpts, save_top_k=-1, save_last="link")
    checkpoint.CHECKPOINT_NAME_LAST = "last-{step}"
    run = Snapshots(2, 4, 6)
    _trainer(io, run, checkpoint, max_steps=6).fit(BoringModel())
    assert ("remove", "last-step=4.ckpt") in io.take_calls()
    assert sorted(os.listdir(ckpts)) == [
        "last-step=6.ckpt",
        "step=2.ckpt",
        "step=4.ckpt",
        "step=6.ckpt",
    ]
    assert os.readlink(ckpts / "last-step=6.ckpt") == "step=6.ckpt"
    for step in (2, 4, 6):
        _assert_loads(io, ckpts / f"step={step}.ckpt", step, 0, run.at[step])
    assert sorted(io.steps()) == [2, 4, 6]


class _NaNFrom(Callback):
    """Turns the model's weights to NaN after global step ``step``: every later save is
    unhealthy."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.fill_(float("nan"))


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_saves_skipped_as_unhealthy_replace_no_healthy_checkpoint(store, tmp_path):
    """HealthPolicy(on_unhealthy="skip") through the plugin: the top-k file Lightning replaces
    and the last.ckpt it overwrites keep their healthy steps until a save that replaces them
    commits; a skipped save commits nothing, so they stay (the plugin dropped both at once:
    the store ended empty, every pointer dangling), and it leaves no pointer naming it."""
    from ckptstore import HealthPolicy

    io = Recording(store)
    io._options["health"] = HealthPolicy(ignore=("callbacks/",), on_unhealthy="skip")
    ckpts = tmp_path / "ckpts"
    run = Snapshots(2)
    checkpoint = _every(ckpts, save_top_k=1, save_last=True)
    try:
        _trainer(io, run, _NaNFrom(3), checkpoint, max_steps=6).fit(BoringModel())
        assert ("remove", "step=2.ckpt") in io.take_calls()
        assert sorted(os.listdir(ckpts)) == ["last.ckpt"]  # its step=4 and 6: never committed
        _assert_loads(io, ckpts / "last.ckpt", 2, 0, run.at[2])
        assert len(io.steps()) == 2  # step=2.ckpt's save stays too: nothing replaced it
        loaded = io.load_checkpoint("latest")
        assert loaded["global_step"] == 2
    finally:
        io.close()


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_resumed_save_last_link_run_leaves_no_step_unnamed(plugin, tmp_path):
    """Stop 78's note: with save_last="link", a resumed run that ends before its next top-k
    save saves last.ckpt in full (a pointer replaces the link); the run resumed from it links
    last.ckpt to its first top-k file by os.remove, not through the plugin, and the step the
    pointer named stayed in the store with no file naming it: a checkpoint's space per resume.
    The plugin that loaded (or wrote) that pointer unlists its step at teardown, unless a file
    beside it names that save (a user copied or moved the pointer: the adversary of the fix
    lost both); a pointer copied elsewhere that a link replaces keeps its step too."""
    ckpts = tmp_path / "ckpts"

    def fit(max_steps: int, resume: str | None = "last.ckpt") -> Recording:
        io = plugin()
        checkpoint = _every(ckpts, save_top_k=-1, save_last="link")
        path = str(ckpts / resume) if resume else None
        _trainer(io, checkpoint, max_steps=max_steps).fit(BoringModel(), ckpt_path=path)
        io.teardown()
        return io

    fit(4, resume=None)
    assert os.readlink(ckpts / "last.ckpt") == "step=4.ckpt"
    fit(5)  # no top-k save: last.ckpt saved in full, as step 5
    assert not os.path.islink(ckpts / "last.ckpt")
    io = fit(6)
    assert ("save", "step=6.ckpt", 6) in io.take_calls()
    assert os.readlink(ckpts / "last.ckpt") == "step=6.ckpt"
    assert sorted(io.steps()) == [2, 4, 6]  # step 5 unlisted: nothing names it
    fit(7)  # last.ckpt in full again, as step 7; the user keeps a copy of it
    shutil.copy(ckpts / "last.ckpt", ckpts / "backup.ckpt")
    io = fit(8)
    assert os.readlink(ckpts / "last.ckpt") == "step=8.ckpt"
    assert sorted(io.steps()) == [2, 4, 6, 7, 8]
    assert io.load_checkpoint(str(ckpts / "backup.ckpt"))["global_step"] == 7
    fit(9)  # and moves this one away before resuming from it
    os.rename(ckpts / "last.ckpt", ckpts / "mine.ckpt")
    io = fit(10, resume="mine.ckpt")
    assert sorted(io.steps()) == [2, 4, 6, 7, 8, 9, 10]
    assert io.load_checkpoint(str(ckpts / "mine.ckpt"))["global_step"] == 9
    copied = plugin()
    shutil.copy(ckpts / "step=4.ckpt", tmp_path / "elsewhere.ckpt")
    os.rename(tmp_path / "elsewhere.ckpt", ckpts / "copy4.ckpt")
    assert copied.load_checkpoint(str(ckpts / "copy4.ckpt"))["global_step"] == 4
    os.remove(ckpts / "copy4.ckpt")
    os.symlink("step=6.ckpt", ckpts / "copy4.ckpt")
    copied.teardown()
    assert sorted(copied.steps()) == [2, 4, 6, 7, 8, 9, 10]  # saved as step=4.ckpt: kept
