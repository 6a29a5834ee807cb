# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Vendored from Lightning-AI/pytorch-lightning,
# tests/tests_pytorch/checkpointing/test_model_checkpoint.py at tag 2.6.5 (commit
# be98784a1a03581b7051a355ae1084fd352d7cea; the installed lightning is 2.6.6, a tag the mirror
# used here lacks): the ModelCheckpoint tests below and the model class they use, unmodified.
# Changed: the plugin fixture only (``ckptstore_io``, autouse): each Trainer's default
# CheckpointIO is ckptstore's plugin on a store outside ``tmp_path``. Chosen: the tests whose
# checkpoints go through the CheckpointIO only (listings, top-k removal, ``-v1`` names,
# ``save_last``, resuming with ``ckpt_path=<file>``); upstream's tests that open the files with
# ``torch.load`` themselves are left out (here the files are pointers). ruff format re-wrapped
# upstream's 120-column lines to this project's 100.

# ruff: noqa: B007 (upstream's loop variable)
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomIterableDataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data.dataloader import DataLoader

from tests.helpers.lightning_upstream import use_store


@pytest.fixture(autouse=True)
def ckptstore_io(tmp_path_factory, monkeypatch):
    yield from use_store(str(tmp_path_factory.mktemp("store")), monkeypatch)


class LogInTwoMethods(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("early_stop_on", out["loss"])
        return out

    def on_validation_epoch_end(self):
        self.log("val_acc", torch.tensor(1.23))


def test_model_checkpoint_save_last_none_monitor(tmp_path, caplog):
    """Test that it is possible to save all checkpoints when monitor=None."""
    seed_everything()
    model = LogInTwoMethods()

    epochs = 2
    checkpoint_callback = ModelCheckpoint(
        monitor=None, dirpath=tmp_path, save_top_k=-1, save_last=True
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[checkpoint_callback],
        limit_train_batches=10,
        limit_val_batches=10,
        max_epochs=epochs,
        logger=False,
    )
    trainer.fit(model)

    # these should not be set if monitor is None
    assert checkpoint_callback.monitor is None
    assert checkpoint_callback.best_model_path == str(tmp_path / "epoch=1-step=20.ckpt")
    assert checkpoint_callback.last_model_path == str(tmp_path / "last.ckpt")
    assert checkpoint_callback.best_model_score is None
    assert checkpoint_callback.best_k_models == {}
    assert checkpoint_callback.kth_best_model_path == ""

    # check that the correct ckpts were created
    expected = [f"epoch={i}-step={j}.ckpt" for i, j in zip(range(epochs), [10, 20])]
    expected.append("last.ckpt")
    assert set(os.listdir(tmp_path)) == set(expected)
    assert os.path.isfile(tmp_path / "last.ckpt")


def test_ckpt_every_n_train_steps(tmp_path):
    """Tests that the checkpoints are saved every n training steps."""
    model = LogInTwoMethods()
    every_n_train_steps = 16
    max_epochs = 2
    epoch_length = 64
    checkpoint_callback = ModelCheckpoint(
        filename="{step}",
        every_n_epochs=0,
        every_n_train_steps=every_n_train_steps,
        dirpath=tmp_path,
        save_top_k=-1,
        save_last=False,
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        enable_progress_bar=False,
        callbacks=[checkpoint_callback],
        logger=False,
    )

    trainer.fit(model)
    expected = [
        f"step={i}.ckpt"
        for i in range(every_n_train_steps, max_epochs * epoch_length + 1, every_n_train_steps)
    ]
    assert set(os.listdir(tmp_path)) == set(expected)


def test_model_checkpoint_topk_all(tmp_path):
    """Test that save_top_k=-1 tracks the best models when monitor key is provided."""
    seed_everything(1000)
    epochs = 3

    model = BoringModel()
    checkpoint_callback = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}", monitor="epoch", mode="max", save_top_k=-1
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[checkpoint_callback],
        max_epochs=epochs,
        logger=False,
        val_check_interval=1.0,
    )
    trainer.fit(model)

    assert checkpoint_callback.monitor == "epoch"
    assert checkpoint_callback.best_model_path == str(tmp_path / "epoch=2.ckpt")
    assert checkpoint_callback.best_model_score == epochs - 1
    assert len(os.listdir(tmp_path)) == len(checkpoint_callback.best_k_models) == epochs
    assert set(checkpoint_callback.best_k_models.keys()) == {
        str(tmp_path / f"epoch={i}.ckpt") for i in range(epochs)
    }
    assert checkpoint_callback.kth_best_model_path == str(tmp_path / "epoch=0.ckpt")


def test_checkpoint_repeated_strategy(tmp_path):
    """This test validates checkpoint can be called several times without increasing internally its global step if
    nothing run."""
    checkpoint_callback = ModelCheckpoint(
        monitor="val_loss", dirpath=tmp_path, filename="{epoch:02d}"
    )

    class ExtendedBoringModel(BoringModel):
        def validation_step(self, batch, batch_idx):
            loss = self.step(batch)
            self.log("val_loss", loss)

    model = ExtendedBoringModel()
    trainer_kwargs = {
        "max_epochs": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
        "default_root_dir": tmp_path,
        "logger": CSVLogger(tmp_path),
    }
    trainer = Trainer(**trainer_kwargs, callbacks=[checkpoint_callback])
    trainer.fit(model)
    assert set(os.listdir(tmp_path)) == {"epoch=00.ckpt", "lightning_logs"}

    for idx in range(4):
        # load from checkpoint
        trainer = Trainer(**trainer_kwargs)
        trainer.fit(model, ckpt_path=checkpoint_callback.best_model_path)
        trainer.test(ckpt_path=checkpoint_callback.best_model_path, verbose=False)

        assert set(os.listdir(tmp_path)) == {"epoch=00.ckpt", "lightning_logs"}

    # no new versions created after the initial fit, because the ones that resume from ckpt do not log anything
    assert set(os.listdir(tmp_path / "lightning_logs")) == {"version_0"}


def test_ckpt_version_after_rerun_same_trainer(tmp_path):
    """Check that previous checkpoints are renamed to have the correct version suffix when the same trainer instance is
    used."""
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = Trainer(
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        callbacks=[mc],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(BoringModel())

    ckpt_range = range(mc.STARTING_VERSION, trainer.max_epochs + mc.STARTING_VERSION - 1)
    expected = {"test.ckpt", *(f"test-v{i}.ckpt" for i in ckpt_range)}
    # check best_k_models state
    assert {Path(f).name for f in mc.best_k_models} == expected
    # check created ckpts
    assert set(os.listdir(tmp_path)) == expected


def test_resume_training_preserves_old_ckpt_last(tmp_path):
    """Ensures that the last saved checkpoint is not deleted from the previous folder when training is resumed from the
    old checkpoint."""
    model = BoringModel()
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "max_epochs": 1,
        "limit_train_batches": 3,
        "limit_val_batches": 0,
        "enable_model_summary": False,
        "logger": False,
    }
    mc_kwargs = {
        "filename": "{step}",
        "monitor": "step",
        "mode": "max",
        "save_last": True,
        "save_top_k": 2,
        "every_n_train_steps": 1,
    }
    trainer = Trainer(**trainer_kwargs, callbacks=ModelCheckpoint(**mc_kwargs))
    trainer.fit(model)
    # Make sure that the last checkpoint file exists in the dirpath passed (`tmp_path`)
    assert set(os.listdir(tmp_path / "checkpoints")) == {"last.ckpt", "step=2.ckpt", "step=3.ckpt"}

    # Training it for 2 epochs for extra surety, that nothing gets deleted after multiple epochs
    trainer_kwargs["max_epochs"] += 1
    mc_kwargs["dirpath"] = tmp_path / "new"
    trainer = Trainer(**trainer_kwargs, callbacks=ModelCheckpoint(**mc_kwargs))
    trainer.fit(model, ckpt_path=(tmp_path / "checkpoints" / "step=2.ckpt"))
    # Ensure that the file is not deleted from the old folder
    assert os.path.isfile(tmp_path / "checkpoints" / "last.ckpt")


def test_save_last_versioning(tmp_path):
    model = BoringModel()
    for _ in range(2):
        mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True)
        trainer = Trainer(
            max_epochs=2,
            callbacks=mc,
            limit_train_batches=1,
            limit_val_batches=0,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
        )
        trainer.fit(model)
    assert {"last.ckpt", "last-v1.ckpt"} == set(os.listdir(tmp_path))
    # 'last.ckpt' is not a symlink since `save_top_k=0` didn't save any other checkpoints to link to
    assert all(not os.path.islink(tmp_path / path) for path in set(os.listdir(tmp_path)))


@pytest.mark.parametrize("same_resume_folder", [True, False])
def test_resume_and_old_checkpoint_files_remain(same_resume_folder, tmp_path):
    """Test that checkpoints saved in the resume-folder won't be deleted under the save-top-k mechanism."""
    model = BoringModel()
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "limit_train_batches": 10,
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }
    first = tmp_path / "first"
    second = tmp_path / "second"
    new_dirpath = first if same_resume_folder else second

    # Generate checkpoints in the first folder
    callback = ModelCheckpoint(
        dirpath=first, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2
    )
    trainer = Trainer(callbacks=callback, max_steps=5, **trainer_kwargs)
    trainer.fit(model)
    assert set(os.listdir(first)) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}

    # Continue training from checkpoint
    callback = ModelCheckpoint(
        dirpath=new_dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2
    )
    trainer = Trainer(callbacks=callback, max_steps=8, **trainer_kwargs)
    trainer.fit(model, ckpt_path=str(first / "epoch=0-step=4.ckpt"))
    if same_resume_folder:
        assert set(os.listdir(first)) == {
            "epoch=0-step=4.ckpt",  # do not delete checkpoint from which we resume from
            "epoch=0-step=6.ckpt",
            "epoch=0-step=8.ckpt",
        }
    else:
        assert set(os.listdir(first)) == {
            "epoch=0-step=2.ckpt",
            "epoch=0-step=4.ckpt",
        }  # no files deleted
        assert set(os.listdir(second)) == {"epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}


def test_load_with_inf_data_loader(tmp_path):
    """Test loading from a checkpoint with a dataloader that does not have a length."""
    # Test for https://github.com/Lightning-AI/pytorch-lightning/issues/20565
    dataset = RandomIterableDataset(size=32, count=10)

    class ModelWithIterableDataset(BoringModel):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(dataset)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(dataset)

    model = ModelWithIterableDataset()
    with pytest.raises(TypeError):
        len(model.train_dataloader())

    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "max_epochs": 2,
        "limit_train_batches": 2,
        "limit_val_batches": None,
        "check_val_every_n_epoch": 1,
        "enable_model_summary": False,
        "logger": False,
    }
    mc_kwargs = {
        "save_last": True,
        "every_n_train_steps": 1,
    }
    trainer = Trainer(**trainer_kwargs, callbacks=ModelCheckpoint(**mc_kwargs))
    trainer.fit(model)

    checkpoint_path = tmp_path / "checkpoints" / "epoch=1-step=4.ckpt"
    assert checkpoint_path.name in os.listdir(tmp_path / "checkpoints")

    # Resume from checkpoint and run for more epochs
    trainer_kwargs["max_epochs"] = 4
    trainer = Trainer(**trainer_kwargs, callbacks=ModelCheckpoint(**mc_kwargs))
    trainer.fit(model, ckpt_path=checkpoint_path)
