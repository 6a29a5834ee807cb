"""SIGTERM with ``Checkpointer(handle_sigterm=True)``: pending saves finish, one line per save,
then the process ends as SIGTERM would have (issue 21, item 8). Each case is a real process
that gets a real SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, PreemptionOptions, Store
from ckptstore.catalog import list_steps
from tests.helpers import ROOT

LOOP = """
import signal, sys, time
import torch
from ckptstore import Checkpointer, PreemptionOptions, StorageOptions, Store
from bench.faults import Faults, Fixed, with_faults

mode, uri, put_latency_s, grace_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
if mode == "previous":
    def previous(signum, frame):
        open(uri + ".previous", "w").write(str(signum))
    signal.signal(signal.SIGTERM, previous)
store = with_faults(Store(uri), Faults(latency=Fixed(put_latency_s), ops=frozenset({"put"})))
ckpt = Checkpointer(
    uri,
    storage=StorageOptions(store=store),
    preemption=PreemptionOptions(handle_sigterm=True, sigterm_grace_s=grace_s),
)
state = {"w": torch.arange(4096.0)}
if mode == "aware":
    step = 0
    while not ckpt.preempted and step < 3000:  # a loop that watches for preemption
        step += 1
        if step == 1:
            print("training", flush=True)
        time.sleep(0.01)
    ckpt.save(step, state)
    print(f"left at step {step}", flush=True)
else:
    ckpt.save(1, state)
    print("training", flush=True)
    for _ in range(3000):  # a loop that never looks at ckpt.preempted
        time.sleep(0.01)
    print("never ended", flush=True)
"""


def run_and_terminate(tmp_path: Path, mode: str, *, put_latency_s: float, grace_s: float = 25):
    uri = str(tmp_path / "store")
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, mode, uri, str(put_latency_s), str(grace_s)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "training"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err, uri


def test_a_loop_that_ignores_preemption_exits_once_its_pending_save_is_committed(tmp_path):
    code, out, err, uri = run_and_terminate(tmp_path, "plain", put_latency_s=0.5)
    assert code == -signal.SIGTERM, err
    assert "never ended" not in out
    assert "SIGTERM: preempted; finishing 1 pending save(s)" in err
    assert "step 1 committed" in err
    assert list_steps(Store(uri)) == [1]


def test_a_loop_that_watches_preempted_saves_its_step_and_leaves(tmp_path):
    code, out, err, uri = run_and_terminate(tmp_path, "aware", put_latency_s=0.2)
    assert code == -signal.SIGTERM, err
    left = [line for line in out.splitlines() if line.startswith("left at step")]
    assert left, out
    step = int(left[0].rsplit(" ", 1)[1])
    assert f"step {step} committed" in err
    assert list_steps(Store(uri)) == [step]
    target = {"w": torch.zeros(4096)}
    Checkpointer(uri).load(target)
    assert torch.equal(target["w"], torch.arange(4096.0))


def test_the_handler_installed_before_runs_then_the_process_dies_of_sigterm(tmp_path):
    code, _, err, uri = run_and_terminate(tmp_path, "previous", put_latency_s=0.2)
    assert code == -signal.SIGTERM, err
    assert Path(uri + ".previous").read_text() == str(int(signal.SIGTERM))
    assert list_steps(Store(uri)) == [1]


def test_a_save_that_cannot_finish_within_the_grace_is_named_abandoned(tmp_path):
    code, _, err, uri = run_and_terminate(tmp_path, "plain", put_latency_s=600, grace_s=1)
    assert code == -signal.SIGTERM, err
    assert "step 1 abandoned: not committed within 1s of SIGTERM" in err
    assert list_steps(Store(uri)) == []


def test_installed_only_from_the_main_thread(tmp_path):
    errors: list[BaseException] = []

    def create() -> None:
        try:
            Checkpointer(tmp_path, preemption=PreemptionOptions(handle_sigterm=True))
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join(timeout=60)
    assert len(errors) == 1 and "only from the main thread" in str(errors[0])


def test_close_puts_the_previous_handler_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ckpt = Checkpointer(tmp_path, preemption=PreemptionOptions(handle_sigterm=True))
    assert signal.getsignal(signal.SIGTERM) != before
    assert ckpt.preempted is False
    ckpt.save(1, {"w": torch.ones(3)}).wait()
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_without_handle_sigterm_nothing_is_installed(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path) as ckpt:
        assert signal.getsignal(signal.SIGTERM) == before
        assert ckpt.preempted is False


@pytest.mark.parametrize("grace_s", [-1.0])
def test_a_negative_grace_is_refused(tmp_path, grace_s):
    with pytest.raises(ValueError, match="sigterm_grace_s"):
        Checkpointer(
            tmp_path, preemption=PreemptionOptions(handle_sigterm=True, sigterm_grace_s=grace_s)
        )
