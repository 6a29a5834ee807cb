"""The README's main job: kill -9 mid-run, resume, same losses bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
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
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from committed step 20" in proc.stdout
    assert "equal the uninterrupted run bit for bit" in proc.stdout
