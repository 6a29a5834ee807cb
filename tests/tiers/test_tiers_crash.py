"""Tiers under SIGKILL: a writer with a local tier and durable_every=2, killed at random moments
(mid-save, mid-drain), resumed each time from the tiers; every committed step of every tier
stays whole and loadable, and drains after a kill complete."""

from __future__ import annotations

import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, Store
from ckptstore.catalog import list_steps

WRITER = r"""
import sys, torch
from ckptstore import Checkpointer, EncodingOptions, TierOptions
from ckptstore.errors import CheckpointNotFoundError
root, local, until = sys.argv[1], sys.argv[2], int(sys.argv[3])
ckpt = Checkpointer(
    root,
    tiers=TierOptions(local_dir=local, durable_every=2),
    encoding=EncodingOptions(chunk_bytes=256 * 1024),
    keep_last=3,
)
state = {"w": [torch.zeros(100_000) for _ in range(6)], "step": 0}
try:
    step = ckpt.load(state, fallback=True) + 1
    print("resumed", step - 1, ckpt.last_load.source, flush=True)
except CheckpointNotFoundError:
    step = 1
while step <= until:
    state = {"w": [torch.full((100_000,), float(step) + i) for i in range(6)], "step": step}
    ckpt.save(step, state).wait()
    print(step, flush=True)
    step += 1
ckpt.close()
print("closed", flush=True)
"""


def _check(store_root: Path) -> list[int]:
    store = Store(str(store_root))
    steps = list_steps(store)
    for step in steps:
        state = {"w": [torch.zeros(100_000) for _ in range(6)], "step": -1}
        _load(store_root, state, step)
        assert state["step"] == step
        for i, t in enumerate(state["w"]):
            assert torch.equal(t, torch.full((100_000,), float(step) + i)), (store_root, step)
    return steps


def _copies(local: Path) -> Path:
    (found,) = local.glob("job-*/rank-00000")
    return found


def _first_line(proc: subprocess.Popen, bound_s: float = 120.0) -> str:
    """The writer's first line (where it resumed from, or its first step), within ``bound_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], bound_s)
    assert ready, f"the writer printed nothing in {bound_s:.0f}s"
    return proc.stdout.readline()


def _load(root: Path, state: dict, step: int) -> None:
    with Checkpointer(root) as ckpt:
        ckpt.load(state, step=step)


@pytest.mark.slow
def test_kills_leave_every_tier_whole_and_later_drains_complete(tmp_path):
    rng = random.Random(22)
    durable, local = tmp_path / "durable", tmp_path / "local"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    cmd = [sys.executable, str(script), str(durable), str(local)]
    resumed_from_local = 0
    for _ in range(5):
        proc = subprocess.Popen(
            cmd + ["1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        first = _first_line(proc)  # on a loaded machine the import alone takes seconds
        time.sleep(rng.uniform(0.8, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        resumed_from_local += first.startswith("resumed") and "local" in first
        _check(durable)
        _check(_copies(local))
    assert resumed_from_local >= 1  # the tier was used, not only durable storage
    before = list_steps(Store(str(durable)))
    # A last run to a few steps past the newest: it drains, and every tier stays whole.
    newest = max(list_steps(Store(str(_copies(local)))) + before + [0])
    proc = subprocess.run(
        cmd + [str(newest + 4)], capture_output=True, text=True, timeout=300, check=True
    )
    assert "closed" in proc.stdout
    after = _check(durable)
    assert max(after) > max(before + [0])  # a drain after the kills completed
    assert _check(_copies(local))
