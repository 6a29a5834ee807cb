"""The README's main job: kill -9 mid-run, resume, same losses and data order bit for bit."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore import Store
from ckptstore.catalog import load_manifest, load_rank_index
from tests.helpers import ROOT


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
    # The killed run had tiers (--local-dir, --durable-every 2): saves 10 and 30 go to durable
    # storage too, 20 only to the local directory, from which the run resumes.
    assert "resumed from step 20 from the local tier (newest durable step 10)" in proc.stdout
    assert "equal the uninterrupted run bit for bit" in proc.stdout
    # The job read its tokens through the loader from the two replicas it wrote.
    for replica in ("data-a", "data-b"):
        assert (tmp_path / replica / "manifest.txt").read_text().split()

    runs = json.loads(report.read_text())
    assert runs["source"] == "local"
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


def _train(tmp_path: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_gpt.py"),
        "--ckpt",
        str(tmp_path / "ckpt"),
    ]
    cmd += ["--data", str(tmp_path / "data"), "--workers", "0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode in (0, -signal.SIGKILL), proc.stdout + proc.stderr
    return proc


def _steps(out: str) -> dict[str, str]:
    return {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("step ")}


@pytest.mark.slow
def test_tiers_resume_from_local_then_durable_when_the_local_dir_is_lost(tmp_path):
    """--local-dir: a killed job resumes from its local copy of a step that is not durable yet;
    with the local directory gone (a replaced node) from the newest durable step; both runs
    print the steps an uninterrupted run prints."""
    tiers = ["--steps", "30", "--every", "10", "--local-dir", str(tmp_path / "local")]
    tiers += ["--durable-every", "2"]  # saves 10 and 30 durable, 20 local only
    killed = _train(tmp_path, *tiers, "--crash-at", "25")
    assert killed.returncode == -signal.SIGKILL
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt-at-kill")

    resumed = _train(tmp_path, *tiers)
    assert "resumed from step 20 (source local: " in resumed.stdout, resumed.stdout
    assert "durable steps [10])" in resumed.stdout
    assert "done: 30 steps" in resumed.stdout and "durable steps [10, 30]" in resumed.stdout
    reference = _steps(killed.stdout)
    assert sorted(_steps(resumed.stdout), key=int) == [str(s) for s in range(21, 31)]

    # The node is replaced: its local directory is gone, the durable store holds step 10.
    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt-at-kill", tmp_path / "ckpt")
    from_durable = _train(tmp_path, *tiers)
    assert "resumed from step 10 (source durable: " in from_durable.stdout, from_durable.stdout
    again = _steps(from_durable.stdout)
    assert all(again[s] == reference[s] for s in map(str, range(11, 26)))
    assert all(again[s] == line for s, line in _steps(resumed.stdout).items())


def test_a_corrupt_newest_step_is_resumed_past_and_saved_again(tmp_path):
    """Item 4 of issue 32: one byte flipped in a chunk of the newest step; the restarted job
    resumes from the step before, trains and saves that step number again (it failed with
    ``StepExistsError`` on every restart), and a further restart loads the new save."""
    run = ["--steps", "20", "--every", "10"]
    first = _train(tmp_path, *run)
    assert first.returncode == 0, first.stdout + first.stderr
    ckpt = tmp_path / "ckpt"
    store = Store(str(ckpt))
    ten, twenty = (set(load_rank_index(store, load_manifest(store, s), 0).chunks) for s in (10, 20))
    digest = sorted(twenty - ten)[0]
    path = ckpt / "chunks" / digest[:2] / digest
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    resumed = _train(tmp_path, *run)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step 10 " in resumed.stdout and "done: 20 steps" in resumed.stdout
    assert _steps(resumed.stdout)["20"] == _steps(first.stdout)["20"]
    again = _train(tmp_path, *run)
    assert again.returncode == 0 and "resumed from step 20 " in again.stdout, again.stdout


def test_peer_copies_without_a_process_group_is_a_usage_error(tmp_path):
    proc = _train(
        tmp_path, "--local-dir", str(tmp_path / "local"), "--peer-copies", "1", check=False
    )
    assert proc.returncode == 2
    assert "--peer-copies 1 needs torch.distributed" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "data").exists()


@pytest.mark.slow
def test_a_nan_in_the_model_resumes_from_the_step_before_it_bit_for_bit(tmp_path):
    """The main job with a NaN written into its model at step 15: the saves of steps 20 and 30
    are committed but unhealthy; the rerun resumes from step 10, the step before it, and prints
    what an uninterrupted clean run prints, bit for bit, data order included."""
    run = ["--steps", "30", "--every", "10"]
    blown = _train(tmp_path, *run, "--nan-at", "15")
    assert blown.returncode == 0, blown.stdout + blown.stderr
    assert "step 20 is unhealthy" in blown.stderr and "step 30 is unhealthy" in blown.stderr
    assert "nan" in _steps(blown.stdout)["16"]  # the blow-up is real: the loss went NaN

    resumed = _train(tmp_path, *run)
    assert "resumed from step 10 " in resumed.stdout, resumed.stdout + resumed.stderr
    assert "step 30: unhealthy" in resumed.stderr and "step 20: unhealthy" in resumed.stderr
    assert "steps [20, 30] were not resumed from" in resumed.stdout

    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    shutil.copytree(tmp_path / "data", clean_dir / "data")  # the same token files
    clean = _train(clean_dir, *run)
    reference, again = _steps(clean.stdout), _steps(resumed.stdout)
    assert sorted(again, key=int) == [str(s) for s in range(11, 31)]
    assert all(again[s] == reference[s] for s in again), "resumed run differs from a clean one"
    before = _steps(blown.stdout)
    assert all(before[str(s)] == reference[str(s)] for s in range(1, 16))
