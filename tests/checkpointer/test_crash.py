"""Crash consistency: a writer saving in a loop is SIGKILLed at many moments."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptstore import Checkpointer, Store
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.pipeline import fetch_chunk

WRITER = r"""
import sys, torch
from ckptstore import Checkpointer, EncodingOptions
ckpt = Checkpointer(
    sys.argv[1],
    encoding=EncodingOptions(chunk_bytes=256 * 1024),
    keep_last=int(sys.argv[2]) or None,
)
step = (ckpt.latest() or 0) + 1
while True:
    state = {"w": [torch.full((100_000,), float(step) + i) for i in range(6)], "step": step}
    ckpt.save(step, state).wait()
    print(step, flush=True)
    step += 1
"""


def _check_store(root) -> list[int]:
    store = Store(root)
    steps = list_steps(store)
    for step in steps:
        manifest = load_manifest(store, step)
        index = load_rank_index(store, manifest, 0)
        for digest, info in index.chunks.items():
            fetch_chunk(store, digest, info)  # raises if missing or corrupt
        state = {"w": [torch.zeros(100_000) for _ in range(6)], "step": -1}
        Checkpointer(root).load(state, step=step)
        assert state["step"] == step
        for i, t in enumerate(state["w"]):
            assert torch.equal(t, torch.full((100_000,), float(step) + i))
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("keep_last", [0, 2])
@pytest.mark.parametrize(
    "backend", ["local", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)]
)
def test_kill_at_random_moments_leaves_only_whole_steps(tmp_path, request, backend, keep_last):
    if backend == "seaweedfs":
        request.getfixturevalue("seaweed_env")  # the writer inherits the endpoint and keys
        root = request.getfixturevalue("seaweed_uri")
    else:
        root = str(tmp_path)
    rng = random.Random(1234 + keep_last)
    committed_before = 0
    for _round in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, root, str(keep_last)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            # wait until it has started saving, then kill after a random delay
            first = proc.stdout.readline()
            assert first.strip().isdigit(), f"writer did not start: {first!r}"
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        steps = _check_store(root)
        assert steps, "no committed step survived"
        assert steps[-1] >= committed_before
        committed_before = steps[-1]
        if keep_last:
            assert len(steps) <= keep_last + 1  # +1: killed between commit and retention
    # the store can be saved into again after all of that
    with Checkpointer(root) as ckpt:
        next_step = ckpt.latest() + 1
        ckpt.save(next_step, {"w": [torch.ones(3)], "step": next_step}).wait()
        assert ckpt.latest() == next_step


EXITER = r"""
import sys, torch
from ckptstore import Checkpointer, EncodingOptions
ckpt = Checkpointer(
    sys.argv[1], encoding=EncodingOptions(compression="zstd", chunk_bytes=4 * 2**20)
)
if sys.argv[2] == "break":  # every write of the save's background stages fails
    def put(*args, **kwargs):
        raise OSError("disk gone")
    ckpt.store.put = put
ckpt.save(7, {"w": torch.arange(16 * 2**20, dtype=torch.float32)})
results = open(sys.argv[1] + ".txt", "w")  # never closed: finalization would flush it
results.write("kept")
print("save returned", flush=True)
"""


def test_a_save_still_persisting_at_exit_is_committed(tmp_path):
    """A script whose last act is save() (no wait, no close) still gets its step committed."""
    root = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-c", EXITER, str(root), "ok"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "save returned"
    assert list_steps(Store(root)) == [7]
    target = {"w": torch.zeros(16 * 2**20)}
    assert Checkpointer(root).load(target) == 7
    assert torch.equal(target["w"], torch.arange(16 * 2**20, dtype=torch.float32))


def test_a_save_failing_at_exit_says_so_in_one_line(tmp_path):
    root = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-c", EXITER, str(root), "break"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if "failed at exit" in line]
    assert len(errors) == 1 and str(root) in errors[0] and "disk gone" in errors[0]
    assert done.returncode == 1, done.stderr  # a scheduler does not read it as a success
    assert (tmp_path / "store.txt").read_text() == "kept"  # what the script left open, flushed
    assert "Traceback" not in done.stderr
    assert list_steps(Store(root)) == []  # nothing half-written is visible
