"""The CLI tells a step's health (issue 33): ``ls`` a HEALTH column, ``inspect`` NaN and Inf
counts and norms per tensor worst first, ``verify`` health beside integrity, ``restore
--healthy`` the newest healthy step; ``--json`` for each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, HealthPolicy
from ckptstore.cli import main


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Step 1 healthy, 2 unhealthy (NaN in model/w, Inf in bf16 model/b), 3 unknown."""
    uri = tmp_path / "store"
    with Checkpointer(uri) as ck:
        ck.save(1, {"model": {"w": torch.full((4,), 2.0), "b": torch.ones(3).bfloat16()}}).wait()
        bad_w = torch.tensor([1.0, float("nan"), float("nan"), 1.0])
        bad_b = torch.tensor([float("inf"), 1.0, 1.0]).bfloat16()
        ck.save(2, {"model": {"w": bad_w, "b": bad_b}}).wait()
    with Checkpointer(uri, health=HealthPolicy(scan=False)) as ck:
        ck.save(3, {"model": {"w": torch.ones(4), "b": torch.ones(3).bfloat16()}}).wait()
    return uri


def test_ls_shows_health(store, capsys):
    assert main(["ls", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "HEALTH" in lines[0].split()
    assert [line.split()[3] for line in lines[1:4]] == ["healthy", "unhealthy", "unknown"]
    assert main(["ls", str(store), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["health"] for s in doc["steps"]] == ["healthy", "unhealthy", "unknown"]
    assert doc["steps"][1]["health_record"]["nan"] == 2
    assert doc["steps"][2]["health_record"] is None


def test_inspect_lists_non_finite_counts_and_norms_worst_first(store, capsys):
    assert main(["inspect", str(store), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "health:        unhealthy: 2 NaN, 1 Inf" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("model/")]
    assert [r[0] for r in rows] == ["model/w", "model/b"]  # 2 non-finite values, then 1
    assert rows[0][-3:-1] == ["2", "0"] and rows[1][-3:-1] == ["0", "1"]
    assert main(["inspect", str(store), "--step", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model/w"]["norm"] == pytest.approx(4.0)  # sqrt(4 * 2^2)
    assert by_name["model/b"]["norm"] == pytest.approx(math.sqrt(3))
    assert doc["health"] == "healthy"


def test_verify_reports_health_beside_integrity(store, capsys):
    assert main(["verify", str(store), "--all"]) == 0  # intact: health is no integrity error
    out = capsys.readouterr().out
    assert "step 2: OK" in out and "health: unhealthy" in out
    assert "unhealthy (intact, but NaN/Inf or a norm jump): step(s) 2" in out
    assert main(["verify", str(store), "--all", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["health"] for s in doc["steps"]] == ["healthy", "unhealthy", "unknown"]


def test_restore_healthy_takes_the_newest_healthy_step(store, tmp_path, capsys):
    out = tmp_path / "r.pt"
    assert main(["restore", str(store), "--healthy", "--to", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 1
    assert "skipped step 3: health unknown" in captured.err
    assert "skipped step 2: unhealthy" in captured.err
    state = torch.load(out, weights_only=True)
    assert torch.equal(state["model"]["w"], torch.full((4,), 2.0))
    code = main(["restore", str(store), "--healthy", "--step", "2", "--to", str(tmp_path / "x")])
    assert code == 1
    assert "step 2: unhealthy" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_restore_of_an_unhealthy_step_warns_naming_the_healthy_one(store, tmp_path, capsys, fmt):
    """New user of stop 78: ``restore`` of a step its save found NaN in said nothing and exited
    0; ``ls`` and ``verify`` said it. It still restores the step asked for, and warns on stderr
    naming the newest healthy step before it; a step of unknown health or healthy, no word."""
    argv = ["restore", str(store), "--format", fmt]
    assert main([*argv, "--step", "2", "--to", str(tmp_path / "two")]) == 0
    err = capsys.readouterr().err
    (warned,) = [line for line in err.splitlines() if line.startswith("warning:")]
    assert "step 2: unhealthy" in warned and "--step 1 (or --healthy)" in warned, err
    for step in ("3", "1"):
        assert main([*argv, "--step", step, "--to", str(tmp_path / step), "--json"]) == 0
        assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_the_unhealthy_warning_never_fails_a_restore_it_follows(
    store, tmp_path, capsys, monkeypatch, fmt
):
    """Adversary of stop 78: the warning read the older steps' manifests, and a read that
    timed out there made a restore already written exit 1 with that error."""
    from ckptstore.errors import StorageTimeoutError
    from ckptstore.format import commit_key
    from ckptstore.store import Store

    get = Store.get

    def times_out(self, key, *args, **kwargs):
        if key == commit_key(1):
            raise StorageTimeoutError(f"{key}: read timed out")
        return get(self, key, *args, **kwargs)

    monkeypatch.setattr(Store, "get", times_out)
    to = tmp_path / "two"
    assert main(["restore", str(store), "--step", "2", "--format", fmt, "--to", str(to)]) == 0
    err = capsys.readouterr().err
    assert to.exists() and "step 2: unhealthy" in err and "could not be read" in err, err
