"""bench/gpu_summary.py, the one JSON of bench/gpu_check.sh (issue 35): the targets read from the
reports the parts wrote, a part that did not report left unjudged."""

from __future__ import annotations

import json

from bench.gpu_summary import main, summarize


def _write(work, name, report):
    (work / f"{name}.json").write_text(json.dumps(report))


def test_targets_are_read_from_each_part_and_a_missing_part_is_unjudged(tmp_path, capsys):
    (tmp_path / "parts.txt").write_text("test 0 40\nsave 0 200\nfirst 137 240\nrestore 0 90\n")
    (tmp_path / "test.json").write_text("....\n12 passed in 30.1s\n")
    save = {
        "config": {"device": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3"}},
        "ckptstore": {"blocked_s": 0.004},
        "ratios": {"stall_vs_memcpy": 2.5},
    }
    _write(tmp_path, "save", save)
    (tmp_path / "first.json").write_text("")  # killed at its limit: nothing written
    _write(
        tmp_path,
        "restore",
        {"ratios": {"ckptstore_vs_ckptstore_host": 1.1, "ckptstore_vs_dcp": 0.4}},
    )

    out = summarize(tmp_path)

    assert out["parts"]["first"] == {"rc": 137, "seconds": 240}
    assert out["pytest"] == "12 passed in 30.1s"
    assert out["device"]["name"] == "NVIDIA H100 80GB HBM3"
    t = out["targets"]
    assert t["blocked_s"] == {"value": 0.004, "limit": 0.010, "met": True}
    assert t["stall_vs_device_memcpy"]["met"] is False
    assert t["device_restore_vs_host_restore"]["met"] is True
    assert t["device_restore_vs_dcp"]["met"] is False
    assert t["first_stall_vs_later"]["met"] is None and t["loop_step_rate_loss"]["met"] is None
    assert out["reports"]["first"] is None and out["reports"]["save"] == save

    assert main([str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["targets"] == json.loads(json.dumps(t))
    assert main([]) == 2
