"""``ckptbench interference`` on a tiny state: the loss is split into time in save() and the rest."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.cli import build_parser, main
from bench.interference import _print, _print_gpu, spread
from tests.helpers import ROOT
from tests.helpers.signals import stop_run


def test_interference_reports_both_parts_of_the_loss(capsys, tmp_path):
    import torch

    from ckptstore import Checkpointer

    with Checkpointer(tmp_path / "store" / "gpu") as ckpt:  # a job's, where the bench once saved
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((4,), float(step))}).wait()
    code = main(
        [
            "interference",
            "--uri", str(tmp_path / "store"),
            "--size", "2MiB", "--tensors", "2", "--steps", "6", "--step-s", "0.01",
            "--kinds", "gpu,python", "--json",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 6 and set(report["kinds"]) == {"gpu", "python"}
    # Each kind saved steps 0.. into a store of its own under a workspace it then removed
    # (reviewer U: they went to URI/KIND, where keep_last=1 deleted a job's steps 1 and 2).
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["gpu"]
    with Checkpointer(tmp_path / "store" / "gpu") as ckpt:
        assert ckpt.steps() == [1, 2]
    for r in report["kinds"].values():
        assert r["saves_committed"] + r["saves_skipped"] == 6
        assert r["saves_committed"] >= 1  # the first save always starts
        assert 0.0 < r["blocked_fraction"] < 1.0 and r["blocked_s_median"] > 0
        assert r["loss_fraction"] < 1.0 and r["background_loss_fraction"] < 1.0
        assert r["baseline_steps_per_s"] > 0 and r["saving_steps_per_s"] > 0


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--kinds", "tpu"], "tpu"),
        (["--steps", "0"], "--steps must be >= 2, got 0"),  # it named --tensors too
        (["--tensors", "0"], "--tensors must be >= 1, got 0"),
        (["--baseline-runs", "1"], "--baseline-runs"),
    ],
)
def test_interference_rejects_bad_flags(capsys, bad, named):
    assert main(["interference", "--size", "1MiB", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ckptbench interference: error:") and "\n" not in err
    assert named in err and ("--tensors" not in err or bad[0] == "--tensors"), err


def test_help_is_plain_text_and_every_option_is_explained(capsys):
    """No reST ``literals`` in any subcommand's --help, and no option without a help text."""
    from bench.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert "``" not in command.format_help(), name
        bare = [a.option_strings for a in command._actions if a.option_strings and not a.help]
        assert bare == [], name
    with pytest.raises(SystemExit) as exc:
        main(["interference", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and 'when_busy="skip"' in out
    assert "equal float32 tensors" in out and "ckptstore codec" in out


def test_skipped_save_warnings_stay_out_of_the_table(tmp_path):
    """As a process, the way a user runs it: stdout is the table alone, and the Checkpointer's
    warning per skipped save (which the table counts) is not printed on stderr either."""
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.cli", "interference",
            "--uri", str(tmp_path / "store"),
            "--size", "8MiB", "--tensors", "2", "--steps", "8", "--step-s", "0.001",
            "--kinds", "gpu",
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    title, header, row, legend = done.stdout.splitlines()
    assert legend.startswith("±: noise")
    assert title.startswith("state 8 MiB, 8 steps") and header.split()[:2] == ["kind", "base"]
    kind, *_, saved, skipped, _blocked = row.split()
    assert kind == "gpu" and int(saved) + int(skipped) == 8
    assert int(skipped) > 0  # a save of 8 MiB outlasts a 1 ms step: there were warnings to keep
    assert "skipping save" not in done.stderr


def test_other_library_warnings_still_reach_the_log(caplog, monkeypatch, tmp_path):
    """Only the skipped-save warnings are left out (counted); any other ckptstore warning is
    logged once the run is over."""
    import bench.interference as interference

    class SlowStoreCheckpointer(interference.Checkpointer):
        def save(self, step, state, **kwargs):
            logging.getLogger("ckptstore.store").warning("store answered slowly (step %d)", step)
            return super().save(step, state, **kwargs)

    monkeypatch.setattr(interference, "Checkpointer", SlowStoreCheckpointer)
    args = argparse.Namespace(
        uri=str(tmp_path / "store"), size="8MiB", tensors=2, steps=4, step_s=0.001,
        kinds="gpu", compression="auto", nice=0, json=True, baseline_runs=2,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert interference.run(args) == 0
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ckptstore")]
    assert messages == [f"store answered slowly (step {i})" for i in range(4)]


def test_readme_lists_every_bench_command_and_how_buckets_are_created():
    from bench.cli import WORKLOADS

    readme = (ROOT / "README.md").read_text()
    (listing,) = [line for line in readme.splitlines() if line.startswith("ckptbench save")]
    listed = listing.split("#")[0].removeprefix("ckptbench").split("|")
    assert [name.strip() for name in listed] == list(WORKLOADS)
    assert "S3 buckets are not created by ckptstore or ckptbench" in readme


# -- issue 32, item 6: defaults, noise, temporary files ------------------------------------------


def test_the_defaults_fit_well_within_two_minutes_of_steps():
    """What the defaults ask for, counted not timed: every run's steps at their target time,
    each kind run once with saves and --baseline-runs times without, is at most a minute, half
    of the two-minute budget (the rest for the saves and the loops they slow). The old defaults
    (256 MiB, 80 steps of 0.2 s, 2 baselines) asked for 144 s of steps alone."""
    args = build_parser().parse_args(["interference"])
    assert args.size == "64MiB" and args.baseline_runs >= 2
    kinds = args.kinds.split(",")
    assert args.steps * args.step_s * (args.baseline_runs + 1) * len(kinds) <= 60


def test_every_loss_has_the_spread_of_the_baseline_runs_beside_it(capsys, tmp_path):
    code = main(
        [
            "interference", "--uri", str(tmp_path / "store"), "--size", "1MiB", "--tensors", "1",
            "--steps", "3", "--step-s", "0.005", "--kinds", "gpu,python", "--baseline-runs", "3",
            "--json",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["baseline_runs"] == 3
    for r in report["kinds"].values():
        runs = r["baseline_runs_steps_per_s"]
        assert len(runs) == 3 and r["baseline_steps_per_s"] == pytest.approx(statistics.mean(runs))
        noise = (max(runs) - min(runs)) / statistics.mean(runs)
        assert r["loss_noise_fraction"] == pytest.approx(noise) == spread(runs)
        assert r["loss_within_noise"] == (abs(r["loss_fraction"]) <= r["loss_noise_fraction"])
        assert r["background_noise_fraction"] >= 0
        assert r["background_within_noise"] == (
            abs(r["background_loss_fraction"]) <= r["background_noise_fraction"]
        )


def _row(kind: str, loss: float, loss_noise: float, bg: float, bg_noise: float) -> dict:
    return {
        "baseline_steps_per_s": 5.0, "saving_steps_per_s": 4.0, "loss_fraction": loss,
        "loss_noise_fraction": loss_noise, "blocked_fraction": 0.05,
        "background_loss_fraction": bg, "background_noise_fraction": bg_noise,
        "saves_committed": 3, "saves_skipped": 7, "blocked_s_median": 0.02,
    }  # fmt: skip


def test_the_table_says_which_loss_figures_are_within_noise(capsys):
    """The issue's "loss -123%" from 10 steps: printed with its noise and marked as noise; a
    loss larger than the spread is printed with it, unmarked."""
    out = {
        "state_bytes": 64 << 20, "steps": 10, "step_s": 0.2, "baseline_runs": 3,
        "kinds": {"gpu": _row("gpu", -1.23, 1.5, 0.02, 0.01), "cpu": _row("cpu", 0.5, 0.1, 0.4, 0.6)},
    }  # fmt: skip
    _print(out, as_json=False)
    title, header, gpu, cpu, legend = capsys.readouterr().out.splitlines()
    assert "-123.0% ±150.0% (noise)" in gpu and "2.0% ±1.0%" in gpu
    assert gpu.count("(noise)") == 1
    assert "50.0% ±10.0%" in cpu and "40.0% ±60.0% (noise)" in cpu and cpu.count("(noise)") == 1
    assert "spread of 3 runs without saves" in legend
    gpu_out = {
        "device": {"device": "NVIDIA H100"}, "state_bytes": 1 << 30, "steps": 400, "every": 40,
        "baseline_steps_per_s": 10.0, "baseline_runs": 2,
        "methods": {
            "ckptstore": {"steps_per_s": 9.9, "loss_fraction": 0.01, "loss_noise_fraction": 0.03},
            "dcp_async": {"steps_per_s": 5.0, "loss_fraction": 0.5, "loss_noise_fraction": 0.03},
        },
    }  # fmt: skip
    _print_gpu(gpu_out, as_json=False)
    _, _, ours, dcp, legend = capsys.readouterr().out.splitlines()
    assert "1.0% ±3.0% (noise)" in ours and "50.0% ±3.0%" in dcp and "(noise)" not in dcp


def _ckptbench_dirs(tmp: Path) -> list[Path]:
    return [p for p in tmp.iterdir() if p.name.startswith("ckptbench-")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_run_stopped_by_a_signal_leaves_no_temporary_files(tmp_path, signum):
    """A real run, stopped while it saves into its temporary store (a file is there): it ends
    with 128 + SIGTERM (143) or 130 for Ctrl-C, and the store is gone. Bounded: two minutes to
    see the store, two to end."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    argv = [
        "ckptbench", "interference", "--size", "16MiB", "--tensors", "2", "--steps", "2000",
        "--step-s", "0.005", "--kinds", "gpu", "--baseline-runs", "2",
    ]  # fmt: skip
    stop_run(
        argv[1:],
        lambda: any(f.is_file() for d in _ckptbench_dirs(tmp) for f in d.rglob("*")),
        signum,
        env,
    )
    assert _ckptbench_dirs(tmp) == []


def test_an_error_mid_run_leaves_no_temporary_files(tmp_path, monkeypatch, capsys):
    import bench.interference as interference

    class FailingCheckpointer(interference.Checkpointer):
        def save(self, step, state, **kwargs):
            if step == 2:
                raise OSError("disk full (injected)")
            return super().save(step, state, **kwargs)

    monkeypatch.setattr(interference, "Checkpointer", FailingCheckpointer)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = main(
        ["interference", "--size", "1MiB", "--tensors", "1", "--steps", "4", "--step-s", "0.001",
         "--kinds", "gpu", "--baseline-runs", "2"]
    )  # fmt: skip
    assert code == 1
    assert "disk full (injected)" in capsys.readouterr().err
    assert _ckptbench_dirs(tmp_path) == []
