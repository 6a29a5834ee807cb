"""A Lightning DDP fit on 2 CPU processes (gloo) checkpointing through CkptstoreCheckpointIO;
run by tests/integrations/test_lightning.py as a script, since Lightning's DDP launcher starts
the second rank by running this file again.

Each rank writes its model and optimizer state when training starts (``start-rank<R>.pt``) and
after step ``--at`` (``step-rank<R>.pt``) into ``--out``."""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

# Run as a script, with tests/helpers first on sys.path: put the repository's root before it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ckptstore.integrations.lightning import CkptstoreCheckpointIO  # noqa: E402


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Dump(Callback):
    def __init__(self, out: str, at: int) -> None:
        self.out, self.at = out, at

    def _dump(self, trainer, name: str) -> None:
        state = {
            "model": copy.deepcopy(trainer.lightning_module.state_dict()),
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "global_step": trainer.global_step,
        }
        torch.save(state, os.path.join(self.out, f"{name}-rank{trainer.global_rank}.pt"))

    def on_train_start(self, trainer, pl_module) -> None:
        self._dump(trainer, "start")

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            self._dump(trainer, "step")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--uri", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--at", type=int, default=0)
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=torch.Generator()))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[CkptstoreCheckpointIO(args.uri)],
        callbacks=[
            ModelCheckpoint(dirpath=args.uri, every_n_train_steps=2, save_top_k=-1),
            Dump(args.out, args.at),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
