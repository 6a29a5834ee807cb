"""``ckptbench interference`` on a tiny state: the loss is split into time in save() and the rest."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import pytest

from bench.cli import main
from tests.helpers import ROOT


def test_interference_reports_both_parts_of_the_loss(capsys, tmp_path):
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
    # each kind saved steps 0.. into its own store: none collided with the other's
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["gpu", "python"]
    for r in report["kinds"].values():
        assert r["saves_committed"] + r["saves_skipped"] == 6
        assert r["saves_committed"] >= 1  # the first save always starts
        assert 0.0 < r["blocked_fraction"] < 1.0 and r["blocked_s_median"] > 0
        assert r["loss_fraction"] < 1.0 and r["background_loss_fraction"] < 1.0
        assert r["baseline_steps_per_s"] > 0 and r["saving_steps_per_s"] > 0


@pytest.mark.parametrize("bad", [["--kinds", "tpu"], ["--steps", "1"]])
def test_interference_rejects_bad_flags(capsys, bad):
    assert main(["interference", "--size", "1MiB", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ckptbench interference: error:") and "\n" not in err


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
    title, header, row = done.stdout.splitlines()
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
        kinds="gpu", compression="auto", nice=0, json=True,
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
