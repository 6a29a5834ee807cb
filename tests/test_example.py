"""The README's main job: kill -9 mid-run, resume, same losses and data order bit for bit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "kill_and_resume.py"),
            "--root",
            str(tmp_path),
            "--steps",
            "40",
            "--every",
            "10",
            "--crash-at",
            "27",
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from committed step 20" in proc.stdout
    assert "equal the uninterrupted run bit for bit" in proc.stdout
    # The job read its tokens through the loader from the two replicas it wrote.
    for replica in ("data-a", "data-b"):
        assert (tmp_path / replica / "manifest.txt").read_text().split()

    runs = json.loads(report.read_text())
    reference, after = runs["reference"], runs["after"]
    assert sorted(map(int, after)) == list(range(21, 41))
    batches = [reference[str(s)][1] for s in range(1, 41)]
    assert len(set(batches)) == len(batches)  # every step reads another batch
    # The resumed run continued the data order where the loader's checkpointed state left it:
    # a loader restarted from its beginning would read the batches of steps 1-20 again.
    assert [after[str(s)][1] for s in range(21, 41)] == batches[20:]
    assert not {after[str(s)][1] for s in range(21, 41)} & set(batches[:20])


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_as_sigterm_would(tmp_path):
    """The main job under a scheduler's SIGTERM: it saves the step it is at, commits it and
    exits 143; the next run resumes from that step."""
    ckpt = str(tmp_path / "ckpt")
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--ckpt", ckpt]
    cmd += ["--every", "50", "--data", str(tmp_path / "a"), "--data", str(tmp_path / "b")]
    proc = subprocess.Popen([*cmd, "--steps", "200"], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(10_000):  # bounded: the run prints far fewer lines before step 12
            line = proc.stdout.readline()
            if not line or line.startswith("step 12 "):
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, out
    preempted = [ln for ln in out.splitlines() if ln.startswith("preempted (SIGTERM) at step")]
    assert preempted, out
    step = int(preempted[0].split("at step ")[1].split(":")[0])
    assert 12 <= step < 50
    resumed = subprocess.run(
        [*cmd, "--steps", str(step + 2)], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from step {step} " in resumed.stdout
