"""``python -m bench.fault_trial`` (issue 32) for two rounds of each front-end: a tiered job of
4 ranks as 2 nodes is struck, restarted and checked, with no violation and no hang.

Seed 6 strikes rank 1 (SIGKILL) and wipes node 0's ``local_dir`` (its ranks restore from their
peer copies or durable storage), then SIGTERMs node 1. ``--after-load``: the faults come in the
save loop, once every rank loaded (see the trial's report for faults during the load)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

BOUND_S = 60  # each rank's end after a fault


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("frontend", ["checkpointer", "dcp"])
def test_two_struck_rounds_restore_every_reported_durable_step_unmixed(frontend, tmp_path):
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.fault_trial", "--frontend", frontend,
            "--rounds", "2", "--seed", "6", "--after-load", "--json",
            "--bound-s", str(BOUND_S), "--dir", str(tmp_path / "trial"),
        ],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )  # fmt: skip
    assert done.stdout.strip(), done.stderr
    summary = json.loads(done.stdout)
    assert summary["violations"] == [], summary
    assert summary["hangs"] == [], summary
    assert done.returncode == 0, done.stderr
    assert summary["rounds"] == 2 and summary["jobs"] == 3
    assert summary["faults"] == {"kill-rank": 1, "term-node": 1} and summary["wipes"] == 1
    # Every restart loaded on all 4 ranks (the first job found the store empty).
    loads = summary["loads"]
    assert loads.pop("nothing") == 4 and sum(loads.values()) == 8, summary
