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
# Vendored from Lightning-AI/pytorch-lightning, tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py
# at tag 2.6.5 (commit be98784a1a03581b7051a355ae1084fd352d7cea; the installed lightning is
# 2.6.6, a tag the mirror used here lacks): test_checkpoint_plugin_called, unmodified (ruff
# format re-wrapped its lines). Changed: the plugin fixture only: ``CustomCheckpointIO`` is
# ckptstore's plugin on a store outside ``tmp_path`` (local and moto S3), instead of upstream's
# torch.save/torch.load one. The other tests of that file are not vendored
# (test_async_checkpoint_plugin needs pytest-rerunfailures' ``flaky`` marker; the third does not
# involve a plugin's saves).

from pathlib import Path
from unittest.mock import MagicMock

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import SingleDeviceStrategy

from ckptstore.integrations.lightning import CkptstoreCheckpointIO
from tests.helpers.lightning_upstream import StoreOfTest, use_store


@pytest.fixture(autouse=True, params=["local", "s3"])
def ckptstore_io(request, tmp_path_factory, monkeypatch):
    uri = (
        request.getfixturevalue("s3_uri")
        if request.param == "s3"
        else str(tmp_path_factory.mktemp("store"))
    )
    yield from use_store(uri, monkeypatch)


class CustomCheckpointIO(CkptstoreCheckpointIO):
    def __init__(self) -> None:
        super().__init__(StoreOfTest.uri)
        StoreOfTest.plugins.append(self)


def test_checkpoint_plugin_called(tmp_path):
    """Ensure that the custom checkpoint IO plugin and torch checkpoint IO plugin is called when saving/loading."""
    checkpoint_plugin = CustomCheckpointIO()
    checkpoint_plugin = MagicMock(wraps=checkpoint_plugin, spec=CustomCheckpointIO)

    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        strategy=SingleDeviceStrategy("cpu", checkpoint_io=checkpoint_plugin),
        callbacks=ck,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        limit_test_batches=1,
    )
    trainer.fit(model)

    ckpt_files = {fn.name for fn in Path(tmp_path).glob("*.ckpt")}
    assert ckpt_files == {"epoch=1-step=2.ckpt", "last.ckpt"}
    assert trainer.checkpoint_callback.best_model_path == str(tmp_path / "epoch=1-step=2.ckpt")
    assert trainer.checkpoint_callback.last_model_path == str(tmp_path / "last.ckpt")
    assert checkpoint_plugin.save_checkpoint.call_count == 4
    assert checkpoint_plugin.remove_checkpoint.call_count == 1

    trainer.test(model, ckpt_path=ck.last_model_path)
    checkpoint_plugin.load_checkpoint.assert_called_with(
        str(tmp_path / "last.ckpt"), weights_only=None
    )

    checkpoint_plugin.reset_mock()
    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        strategy=SingleDeviceStrategy("cpu"),
        plugins=[checkpoint_plugin],
        callbacks=ck,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        limit_test_batches=1,
    )
    trainer.fit(model)

    ckpt_files = {fn.name for fn in Path(tmp_path).glob("*.ckpt")}
    assert ckpt_files == {
        "epoch=1-step=2.ckpt",
        "last.ckpt",
        "epoch=1-step=2-v1.ckpt",
        "last-v1.ckpt",
    }
    assert trainer.checkpoint_callback.best_model_path == str(tmp_path / "epoch=1-step=2-v1.ckpt")
    assert trainer.checkpoint_callback.last_model_path == str(tmp_path / "last-v1.ckpt")
    assert checkpoint_plugin.save_checkpoint.call_count == 4
    assert checkpoint_plugin.remove_checkpoint.call_count == 1

    trainer.test(model, ckpt_path=ck.last_model_path)
    checkpoint_plugin.load_checkpoint.assert_called_once()
    checkpoint_plugin.load_checkpoint.assert_called_with(
        str(tmp_path / "last-v1.ckpt"), weights_only=None
    )
