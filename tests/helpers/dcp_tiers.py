"""The DCP tier tests' state (three tensors of whole chunks and the step), its writer with a
local tier, and one "node" (local dir) per rank."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ckptstore import EncodingOptions, TierOptions
from ckptstore.dcp import StoreWriter

CHUNK = 64 * 1024


def step_state(step: int) -> dict:
    """The state saved as ``step``: 6, 3 and 2 chunks of fresh bytes per step, and the step."""

    def rand(n_chunks: int, seed: int) -> torch.Tensor:
        return torch.rand(n_chunks * CHUNK // 4, generator=torch.Generator().manual_seed(seed))

    return {"w": rand(6, step), "v": rand(3, 100 + step), "b": rand(2, 200 + step), "step": step}


def blank_state() -> dict:
    """A zeroed ``step_state`` to load into."""
    return {
        "w": torch.zeros(6 * CHUNK // 4),
        "v": torch.zeros(3 * CHUNK // 4),
        "b": torch.zeros(2 * CHUNK // 4),
        "step": -1,
    }


def assert_loaded(target: dict, step: int) -> None:
    """``target`` holds ``step_state(step)`` bit for bit."""
    want = step_state(step)
    for key in ("w", "v", "b"):
        assert torch.equal(target[key].view(torch.int32), want[key].view(torch.int32)), key
    assert target["step"] == step


def tier_writer(root: str, local: str, **tiers) -> StoreWriter:
    """A StoreWriter of ``root`` with its local tier in ``local`` (every 2nd save durable);
    ``tiers``: more ``TierOptions`` fields (``durable_every=``, ``peer_copies=``, ...)."""
    tiers.setdefault("durable_every", 2)
    return StoreWriter(
        root,
        tiers=TierOptions(local_dir=local, **tiers),
        encoding=EncodingOptions(chunk_bytes=CHUNK, compression=None),
    )


def log_records(logger: str) -> list[logging.LogRecord]:
    """What ``logger`` logs from here on (INFO and up), in this rank's process."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(logger).addHandler(handler)
    logging.getLogger(logger).setLevel(logging.INFO)
    return records


def node_dir(base: str, rank: int) -> str:
    return str(Path(base) / f"node-{rank}")  # one "node" per rank


def called_late(writer: StoreWriter, method: str, seconds: float) -> None:
    """DCP's calls of ``writer.<method>`` wait ``seconds`` first (on the save's thread, for an
    ``async_save``): a rank's saves in flight reach that call in another order than its script
    made them."""
    call = getattr(writer, method)

    def late(*args, **kwargs):  # "kwargs": DCP looks for it in set_up_storage_writer's
        time.sleep(seconds)
        return call(*args, **kwargs)

    setattr(writer, method, late)
