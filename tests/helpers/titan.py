"""One rank of a tiny torchtitan training job, run as ``python -m tests.helpers.titan SPEC``.

Its parts are torchtitan 0.3.0's own, built as its ``Trainer.__init__`` builds them: the model
sharded with FSDP2 (``fully_shard`` over a CPU mesh of every rank), ``OptimizersContainer`` and
``LRSchedulersContainer`` from their configs, a ``ParallelAwareDataloader`` over a stateful
dataset, the trainer's train state (``step``, ``ntokens_seen``), and the checkpoint manager from
``checkpoint.build(...)`` with the trainer's arguments. The loop is ``Trainer.train``'s:
``load(step=load_step)``, then per step zero_grad, forward, backward, clip,
``maybe_wait_for_staging()``, optimizer and scheduler steps, ``save(step, last_step=...)``;
``close()``. (torchtitan's ``Trainer`` itself cannot run here: it sets a CUDA device.)

SPEC is a JSON object: ``out`` (a directory for this rank's results), ``steps``, ``checkpoint``
(``CkptstoreCheckpointManager.Config`` fields; ``null``: checkpointing disabled), ``dump``
(the trainer's dump folder), ``kill_at`` (a step after whose save the rank SIGKILLs itself),
``hf_adapter`` (the model's state dict adapter: ``TinyAdapter``; else none), ``local_dir``
(``TierOptions(local_dir=..., durable_every=2)``; else no tiers).
Each rank appends ``<step> <loss as float.hex>`` to ``out/losses-<rank>.txt``, ``start
<step>`` once loaded and ``staging <step>`` after a save that left its staging running;
before ``close()``, ``checkpoint_process 1`` when DCP's checkpoint process is alive (an async
save ran there), else ``checkpoint_process 0``; at the end rank 0 writes the full parameters to
``out/params.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor as async_process_executor
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager
from ckptstore.options import StorageOptions, TierOptions

VOCAB, WIDTH, SEQ = 64, 32, 16


class Tokens(IterableDataset, Stateful):
    """Deterministic token sequences per data-parallel rank; its position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.sample = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.dp_rank + self.sample)
            self.sample += 1
            seq = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield seq[:-1], seq[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample = state["sample"]


class TrainState(Stateful):
    """The trainer's own train state (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.output = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.output(h)


class TinyAdapter(StateDictAdapter):
    """A model's Hugging Face names (``model.embed_tokens.weight``) on torchtitan's own adapter
    base: what ``last_save_in_hf`` exports by."""

    RENAMES = (("tok_embeddings.", "embed_tokens."),)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state_dict.items():
            for ours, theirs in self.RENAMES:
                key = key.replace(ours, theirs)
            out[f"model.{key}"] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in hf_state_dict.items():
            key = key.removeprefix("model.")
            for ours, theirs in self.RENAMES:
                key = key.replace(theirs, ours)
            out[key] = value
        return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.state_dict().items():
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def main(spec: dict[str, Any]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = spec["out"]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, f"losses-{rank}.txt"), "a")  # noqa: SIM115 - kept to the end

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model_parts = [model]
    optimizers = default_adamw(lr=1e-2).build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=spec["steps"]
    )
    dataloader = ParallelAwareDataloader(
        Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=4
    )
    train_state = TrainState()

    ckpt = spec.get("checkpoint")
    tiers = (
        TierOptions(local_dir=spec["local_dir"], durable_every=2) if "local_dir" in spec else None
    )
    config = CkptstoreCheckpointManager.Config(
        **(ckpt or {"enable": False}), storage=StorageOptions(timeout_s=20.0), tiers=tiers
    )
    checkpointer = config.build(
        dataloader=dataloader,
        model_parts=model_parts,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=TinyAdapter(None, None) if spec.get("hf_adapter") else None,
        base_folder=spec["dump"],
    )
    checkpointer.load(step=config.load_step)
    print(f"start {train_state.step}", file=log, flush=True)

    batches = iter(dataloader)
    while train_state.step < spec["steps"]:
        train_state.step += 1
        optimizers.zero_grad()
        tokens, labels = next(batches)
        train_state.ntokens_seen += tokens.numel()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        print(f"{train_state.step} {global_loss.item().hex()}", file=log, flush=True)
        checkpointer.save(train_state.step, last_step=train_state.step == spec["steps"])
        if getattr(checkpointer, "staging_future", None) is not None:
            # Staging runs on while the next step computes (maybe_wait_for_staging above).
            print(f"staging {train_state.step}", file=log, flush=True)
        if train_state.step == spec.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)

    # Whether DCP's checkpoint process (AsyncCheckpointerType.PROCESS) ran this run's async
    # saves: it is started by the first such save and lives until the trainer exits.
    process = async_process_executor._CHECKPOINT_PROCESS
    alive = process is not None and process._save_process.is_alive()
    print(f"checkpoint_process {int(alive)}", file=log, flush=True)
    checkpointer.close()
    params = full_params(model)
    if rank == 0:
        torch.save(
            {"params": params, "ntokens_seen": train_state.ntokens_seen},
            os.path.join(out, "params.pt"),
        )
    dist.barrier()
    dist.destroy_process_group()
    log.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    # torch 2.14's gloo worker threads can still be releasing the tensors of the last collective
    # when the interpreter finalizes; a thread that needs the GIL then aborts the process
    # (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291). All
    # this job reports is written and closed above, so it leaves without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
