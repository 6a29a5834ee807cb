"""``ckptbench interference`` on a tiny state: the loss is split into time in save() and the rest."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.cli import main


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
