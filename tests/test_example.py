"""The README's main job: kill -9 mid-run, resume, same losses and data order bit for bit."""

from __future__ import annotations

import json
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
