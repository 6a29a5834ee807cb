"""``ckptbench export`` at a tiny size: the table's structure, the JSON report, equal outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_table_lists_both_methods_with_time_peak_and_ratios(capsys, tmp_path):
    status = main(
        ["export", "--size", "256KiB", "--tensors", "4", "--repeat", "1", "--warmup", "0"]
        + ["--max-shard-size", "100KB", "--dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("ckptbench export") and "256 KiB float32 in 4 tensors" in lines[0]
    header = lines[2].split()
    assert header[:3] == ["method", "time", "peak"]
    rows = {line.split()[0]: line for line in lines[4:6]}
    assert set(rows) == {"ckptstore", "dcp"}
    for row in rows.values():
        assert row.rstrip().endswith("yes"), row  # the output loaded equal to the state
        assert "MiB" in row
    assert rows["ckptstore"].split()[-2] == "yes" and rows["dcp"].split()[-2] == "no"
    ratios = lines[6]
    for name in ("time_ckptstore_vs_dcp", "peak_rss_ckptstore_vs_dcp"):
        assert name in ratios
    assert os.listdir(tmp_path) == []  # the workspace is removed


def test_json_report_has_figures_for_each_method():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "export", "--json", "--size", "64KiB"]
        + ["--tensors", "2", "--repeat", "2", "--warmup", "0", "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["command"] == "export" and report["config"]["size_bytes"] == 64 * 1024
    for method in ("ckptstore", "dcp"):
        m = report[method]
        assert m["output_equal"] is True
        assert len(m["runs"]) == 2
        assert m["seconds"] > 0 and m["peak_rss_bytes"] > m["rss_growth_bytes"] >= 0
    assert report["ratios"]["time_ckptstore_vs_dcp"] > 0
