"""ckptstore.cli: ls / inspect / verify / restore / gc on real stores made by real saves."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, Store, TierOptions
from ckptstore.cli import main
from tests.helpers import ROOT
from tests.helpers.crafted import sealed
from tests.helpers.dist import run_ranks
from tests.helpers.signals import stop_run
from tests.helpers.wait import wait_until

STEPS = (10, 20, 30)


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return model, optim


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    """The state as a restore should rebuild it: stateful objects as their state dicts."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(optim.state_dict()),
        "step": step,
        "extra": {"name": "run7", "betas": (0.9, 0.999), "blob": b"\x00\x01", "bf16": None},
    }


def _save_steps(uri: str) -> dict[int, dict]:
    """Three steps of a small model + Adam, the first layer changing between steps; small
    chunks so that tensors span several chunk objects and small ones are packed together."""
    model, optim = _model_and_optim()
    saved = {}
    with Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=16384)) as ckpt:
        for step in STEPS:
            with torch.no_grad():
                model[0].weight.add_(0.5)
            bf16 = torch.randn(33, dtype=torch.bfloat16)
            state = {
                "model": model,
                "optim": optim,
                "step": step,
                "extra": {"name": "run7", "betas": (0.9, 0.999), "blob": b"\x00\x01", "bf16": bf16},
            }
            ckpt.save(step, state, metadata={"epoch": step // 10}).wait()
            saved[step] = _snapshot(model, optim, step)
            saved[step]["extra"]["bf16"] = bf16.clone()
    return saved


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    root = tmp_path_factory.mktemp("template") / "store"
    return root, _save_steps(str(root))


@pytest.fixture
def store(template: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the template store (tests corrupt and collect it)."""
    path = tmp_path / "store"
    shutil.copytree(template[0], path)
    return path


@pytest.fixture
def saved(template: tuple[Path, dict]) -> dict[int, dict]:
    return template[1]


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out)


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Equal structure and bit-identical tensors."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(
            actual.contiguous().view(-1).view(torch.uint8),
            expected.contiguous().view(-1).view(torch.uint8),
        ), path
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, path
        assert actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}/{i}")
    else:
        assert actual == expected and type(actual) is type(expected), path


def one_line_error(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ckptstore {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def chunk_of(capsys: pytest.CaptureFixture, store: Path, tensor: str, step: int = 30) -> str:
    """The key of the first chunk holding ``tensor`` in ``step``."""
    code, doc = run_json(capsys, "inspect", store, "--step", step)
    assert code == 0
    (entry,) = [t for t in doc["tensors"] if t["name"] == tensor]
    digest = entry["chunks"][0]
    return f"chunks/{digest[:2]}/{digest}"


def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x40
    path.write_bytes(bytes(data))


def index_of(store: Path, step: int) -> str:
    """The key of the (only) rank index of ``step``, as its manifest names it."""
    doc = json.loads((store / f"commits/{step:020d}.json").read_text())
    (ref,) = doc["ranks"]
    return ref["key"]


# -- ls ------------------------------------------------------------------------------------------


def test_ls_json_latest_is_the_newest_step_whose_manifest_reads(store: Path, capsys) -> None:
    """A reviewer: ``ls --help`` offers ``jq '.latest'`` to scripts, and it named a step whose
    manifest was half written (the text listing marked it ERROR)."""
    from ckptstore.format import commit_key

    manifest = store / commit_key(30)
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    code, doc = run_json(capsys, "ls", store)
    assert code == 1 and doc["latest"] == 20, doc
    assert [s["step"] for s in doc["steps"] if "error" in s] == [30]


def test_ls_lists_committed_steps(store: Path, capsys) -> None:
    code, out, err = run(capsys, "ls", store)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "KIND", "RANKS"]
    assert [line.split()[0] for line in lines[1:]] == ["10", "20", "30"]
    assert all(" state " in line and '{"epoch":' in line for line in lines[1:])

    code, doc = run_json(capsys, "ls", store)
    assert code == 0
    assert doc["uri"] == str(store) and doc["latest"] == 30 and doc["pending"] == []
    assert [s["step"] for s in doc["steps"]] == list(STEPS)
    first = doc["steps"][0]
    assert set(first) >= {
        "step",
        "kind",
        "world_size",
        "created_at",
        "created",
        "raw_bytes",
        "stored_bytes",
        "compression_ratio",
        "user",
        "manifest",
    }
    assert first["kind"] == "state" and first["world_size"] == 1 and first["user"] == {"epoch": 1}
    assert first["created"].endswith("Z") and first["raw_bytes"] > 0
    assert first["compression_ratio"] == pytest.approx(
        first["raw_bytes"] / first["stored_bytes"], rel=1e-3
    )


def test_a_location_without_ckptstore_data_is_an_error_everywhere(tmp_path: Path, capsys) -> None:
    """An empty directory (a mistyped path) is "no ckptstore data here": exit 1, for every
    command, with the error also as JSON on stdout under --json."""
    (tmp_path / "empty").mkdir()
    extra = {"restore": ["--to", tmp_path / "x.pt"], "gc": ["--keep-last", "1"]}
    for command in ("ls", "inspect", "verify", "restore", "gc"):
        code, out, err = run(capsys, command, tmp_path / "empty", *extra.get(command, []))
        assert code == 1 and "no ckptstore data at" in one_line_error(err, command)
        code, out, err = run(capsys, command, tmp_path / "empty", *extra.get(command, []), "--json")
        assert code == 1 and json.loads(out) == {
            "error": one_line_error(err, command).split("error: ", 1)[1],
            "code": 1,
        }


def test_a_tiered_store_before_its_first_durable_step_is_a_store_with_no_steps(tmp_path, capsys):
    """Adversary of stop 76: a tiered job's durable store holding only its identity.json
    (nothing drained yet) was "no ckptstore data ... a mistyped path?", exit 1."""
    from ckptstore.tiers.identity import ensure_identity

    ensure_identity(Store(str(tmp_path / "durable")))
    code, out, err = run(capsys, "ls", tmp_path / "durable")
    assert code == 0, err
    assert "no committed steps in" in out and "listed with --local-dir" in out, out


def test_a_location_beside_a_store_names_the_store(tmp_path: Path, capsys) -> None:
    """Reviewer T: the directory above a store, or its chunks/, was only "a mistyped path or
    prefix?", where Checkpointer.latest() names the store meant."""
    with Checkpointer(tmp_path / "run1") as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    for where, says in (
        (tmp_path, f"(but {tmp_path / 'run1'} holds checkpoints: a mistyped path?)"),
        (tmp_path / "run1" / "chunks", f"(it lies inside the store {tmp_path / 'run1'}"),
    ):
        for command in ("ls", "verify"):
            code, _, err = run(capsys, command, where)
            assert code == 1 and says in one_line_error(err, command)


def test_an_s3_prefix_beside_a_store_names_the_store(s3_uri: str, capsys) -> None:
    """Operator of stop 78: on S3 the prefix above a store, or its chunks/, was only "a mistyped
    path or prefix?", where a local path names the store meant."""
    with Checkpointer(f"{s3_uri}/run1") as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    for where, says in (
        (s3_uri, f"(but {s3_uri}/run1 holds checkpoints: a mistyped prefix?)"),
        (f"{s3_uri}/run1/chunks", f"(it lies inside the store {s3_uri}/run1: a mistyped prefix?)"),
    ):
        for command in ("ls", "verify"):
            code, _, err = run(capsys, command, where)
            assert code == 1 and says in one_line_error(err, command)


def test_a_local_tier_directory_is_named_as_one(tmp_path: Path, capsys) -> None:
    """The --local-dir of a tiered job given where a store is expected: the error says what
    it is, where a rank's own store lies, and how to list every tier."""
    local = tmp_path / "local"
    with Checkpointer(tmp_path / "durable", tiers=TierOptions(local_dir=local)) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    code, _, err = run(capsys, "ls", local)
    line = one_line_error(err, "ls")
    assert code == 1 and "it is a local tier directory" in line, line
    [rank_dir] = local.glob("job-*/rank-*")
    assert str(rank_dir) in line and f"--local-dir {local}" in line
    code, out, _ = run(capsys, "ls", rank_dir)  # its USER column: not the copy's own record
    assert code == 0 and out.splitlines()[1].split()[0] == "1" and "ckptstore_tier" not in out
    for inner in (rank_dir, rank_dir.parent):  # what ls names; it said "none" of them
        code, _, err = run(capsys, "ls", tmp_path / "durable", "--local-dir", inner)
        line = one_line_error(err, "ls")
        assert code == 2 and f"pass the tier directory, --local-dir {local}" in line, line


def test_a_store_with_no_committed_step_lists_empty(tmp_path: Path, capsys) -> None:
    uri = tmp_path / "store"
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    (uri / "commits" / f"{1:020d}.json").unlink()  # its steps/ and chunks/ stay
    code, out, _ = run(capsys, "ls", uri)
    assert code == 0 and "no committed steps" in out
    code, doc = run_json(capsys, "ls", uri)
    assert code == 0 and doc["steps"] == [] and doc["latest"] is None


def test_usage_errors_under_json_are_json_too(capsys) -> None:
    code, out, err = run(capsys, "restore", "X", "--json")
    assert code == 2 and json.loads(out)["code"] == 2
    assert "--to" in json.loads(out)["error"] and "--to" in err


def test_ls_shows_saves_in_flight(store: Path, capsys) -> None:
    import time

    marker = store / "pending" / f"{40:020d}-abc-00000.json"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(
        json.dumps({"step": 40, "attempt": "abc", "rank": 0, "created_at": time.time()})
    )
    code, out, _ = run(capsys, "ls", store)
    assert code == 0 and "pending: step 40 rank 0" in out and "in flight" in out
    code, doc = run_json(capsys, "ls", store)
    assert doc["pending"][0]["step"] == 40 and doc["pending"][0]["stale"] is False


def test_ls_says_a_stale_save_of_a_committed_step_left_only_its_lease(store: Path, capsys):
    """A reviewer: after a kill -9 mid-save and a resume that saved the step again, ls showed
    the dead attempt as a stale save beside the committed step, read as the step incomplete."""
    import time

    marker = store / "pending" / f"{30:020d}-dead-00000.json"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(
        json.dumps({"step": 30, "attempt": "dead", "rank": 0, "created_at": time.time() - 1e6})
    )
    code, out, _ = run(capsys, "ls", store)
    [line] = [line for line in out.splitlines() if line.startswith("pending:")]
    assert "stale (its writer died; step 30 is committed" in line, line


def test_ls_names_an_unreadable_lease_by_its_key_not_as_step_none(store: Path, capsys) -> None:
    lease = store / "leases" / "save" / f"{9:020d}-abc-00000" / "0001.json"
    lease.parent.mkdir(parents=True)
    lease.write_bytes(b"{not json")
    code, out, _ = run(capsys, "ls", store)
    [line] = [line for line in out.splitlines() if line.startswith("pending:")]
    assert "None" not in line and "unreadable" in line and f"{9:020d}-abc-00000" in line, line


def test_a_safetensors_restore_counts_every_skipped_value_it_does_not_name(tmp_path, capsys):
    with Checkpointer(tmp_path / "s") as ckpt:
        values = {f"v{i}": i for i in range(7)}
        ckpt.save(1, {"w": torch.ones(4), **values}).wait()
    code, out, _ = run(
        capsys, "restore", tmp_path / "s", "--to", tmp_path / "hf", "--format", "safetensors"
    )
    assert code == 0 and "skipped 7 non-tensor value(s): " in out and "and 2 more" in out, out


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_tensors_by_name(store: Path, saved: dict, capsys) -> None:
    code, out, _ = run(capsys, "inspect", store)
    assert code == 0
    assert out.startswith("step 30 of ")
    for name in ("model/0.weight", "optim/state/0/exp_avg", "extra/bf16"):
        assert name in out
    assert '{"epoch": 3}' in out and "float32" in out and "[256, 64]" in out

    code, doc = run_json(capsys, "inspect", store, "--step", "20")
    assert code == 0 and doc["step"] == 20 and doc["kind"] == "state"
    assert doc["world_size"] == 1 and doc["user"] == {"epoch": 2}
    assert doc["num_chunks"] > 1 and doc["compression_ratio"] > 0
    expected = saved[20]
    by_name = {t["name"]: t for t in doc["tensors"]}
    names = {f"model/{k}" for k in expected["model"]} | {
        f"optim/state/{p}/{k}" for p, s in expected["optim"]["state"].items() for k in s
    }
    assert set(by_name) == names | {"extra/bf16"}
    weight = by_name["model/0.weight"]
    assert weight["dtype"] == "float32" and weight["shape"] == [256, 64]
    assert weight["raw_bytes"] == 256 * 64 * 4 and len(weight["chunks"]) == 4  # 64 KiB / 16 KiB
    assert by_name["extra/bf16"]["dtype"] == "bfloat16"
    assert doc["ranks"] == [
        {
            "rank": 0,
            "index": doc["ranks"][0]["index"],
            "tensors": len(names) + 1,
            "chunks": doc["num_chunks"],
            "raw_bytes": doc["tensor_bytes"],
            "stored_bytes": doc["ranks"][0]["stored_bytes"],
        }
    ]


def test_inspect_unknown_step_is_missing(store: Path, capsys) -> None:
    code, out, err = run(capsys, "inspect", store, "--step", "15")
    assert code == 1 and out == ""
    assert "step 15 is not committed" in one_line_error(err, "inspect")


# -- verify --------------------------------------------------------------------------------------


def test_verify_all_ok(store: Path, capsys) -> None:
    code, out, err = run(capsys, "verify", store, "--all")
    assert code == 0 and err == ""
    assert "all OK" in out and out.count(": OK") == 3
    code, doc = run_json(capsys, "verify", store)
    assert code == 0 and doc["ok"] is True and doc["problems"] == []
    assert [s["step"] for s in doc["steps"]] == [30]
    assert doc["chunks_checked"] == doc["steps"][0]["chunks"] > 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_verify_names_a_bad_chunk(store: Path, capsys, damage: str) -> None:
    key = chunk_of(capsys, store, "model/0.weight")
    path = store / key
    if damage == "flip":
        flip_byte(path)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.unlink()
    code, out, err = run(capsys, "verify", store)
    assert code == 1
    assert key in out and "model/0.weight" in out and "FAILED" in out
    assert key in one_line_error(err, "verify")
    code, doc = run_json(capsys, "verify", store)
    assert code == 1 and doc["ok"] is False
    (problem,) = doc["problems"]
    assert problem["object"] == key and problem["what"] == "chunk" and problem["step"] == 30
    assert problem["problem"] == ("missing" if damage == "delete" else "corrupt")
    assert "model/0.weight" in problem["tensors"]


def test_verify_reports_every_problem(store: Path, capsys) -> None:
    flipped = chunk_of(capsys, store, "model/0.weight")
    missing = chunk_of(capsys, store, "optim/state/0/exp_avg")
    flip_byte(store / flipped, 0.9)
    (store / missing).unlink()
    index = index_of(store, 20)
    flip_byte(store / index)
    manifest = f"commits/{10:020d}.json"
    flip_byte(store / manifest, 0.3)
    code, doc = run_json(capsys, "verify", store, "--all")
    assert code == 1
    found = {(p["step"], p["object"], p["problem"]) for p in doc["problems"]}
    assert (30, flipped, "corrupt") in found
    assert (30, missing, "missing") in found
    assert (20, index, "corrupt") in found
    assert (10, manifest, "corrupt") in found
    assert [s["ok"] for s in doc["steps"]] == [False, False, False]
    # The corrupt index of step 20 hides its chunks, but the chunks step 30 shares are checked.
    code, out, err = run(capsys, "verify", store, "--all")
    assert code == 1 and all(k in out for k in (flipped, missing, index, manifest))
    one_line_error(err, "verify")


def _keep_last_meanwhile(monkeypatch, module: Any, store: Path) -> None:
    """Verify's chunk checks run after a job's keep_last=1 removed steps 10 and 20, which
    verify had listed (a job saving beside it)."""
    from ckptstore.retention import collect
    from ckptstore.store import Store

    check_all_chunks = module.check_all_chunks

    def meanwhile(*args: Any, **kwargs: Any) -> Any:
        collect(Store(str(store)), keep_last=1)
        return check_all_chunks(*args, **kwargs)

    monkeypatch.setattr(module, "check_all_chunks", meanwhile)


def test_verify_all_passes_over_steps_removed_while_it_verified(store: Path, capsys, monkeypatch):
    """A reviewer: ``verify --all`` beside a job with keep_last reported the steps it removed
    meanwhile as missing objects and exited 1 ('verify || alert' paged for nothing)."""
    import ckptstore.cli.cmd_verify as cmd_verify

    _keep_last_meanwhile(monkeypatch, cmd_verify, store)
    code, out, err = run(capsys, "verify", store, "--all")
    assert code == 0, (out, err)
    assert "step 10: REMOVED while it was verified" in out and "step 20: REMOVED" in out
    assert "step 30: OK" in out and "MISSING" not in out
    _keep_last_meanwhile(monkeypatch, cmd_verify, store)  # nothing left to remove: all OK
    code, doc = run_json(capsys, "verify", store, "--all")
    assert code == 0 and doc["ok"] and doc["removed_while_verified"] == []


def test_verify_all_fails_a_listed_step_whose_commit_is_a_broken_link(store: Path, capsys):
    """An adversary: a commit replaced by a link to nothing read as 'removed while verified'
    and verify said all OK; the step is still listed (latest() names it, load fails)."""
    commit = store / f"commits/{30:020d}.json"
    commit.unlink()
    commit.symlink_to(store / "commits" / "nothing-here")
    code, out, _ = run(capsys, "verify", store, "--all")
    assert code == 1 and "step 30: FAILED" in out and "REMOVED" not in out, out


def test_checkpointer_verify_all_passes_over_steps_removed_meanwhile(
    store: Path, capsys, monkeypatch
):
    import ckptstore._inspect as inspect
    from ckptstore.errors import CheckpointCorruptError

    damaged = chunk_of(capsys, store, "model/0.weight")
    _keep_last_meanwhile(monkeypatch, inspect, store)
    Checkpointer(str(store)).verify("all")  # raised CheckpointNotFoundError: missing chunks
    flip_byte(store / damaged)
    with pytest.raises(CheckpointCorruptError, match=damaged):
        Checkpointer(str(store)).verify("all")


def test_verify_missing_rank_index_and_manifest_step_only(store: Path, capsys) -> None:
    index = index_of(store, 30)
    (store / index).unlink()
    code, doc = run_json(capsys, "verify", store, "--step", "30")
    assert code == 1
    assert [(p["object"], p["problem"], p["what"]) for p in doc["problems"]] == [
        (index, "missing", "rank-index")
    ]
    code, doc = run_json(capsys, "verify", store, "--step", "20")
    assert code == 0 and doc["ok"]


# -- restore -------------------------------------------------------------------------------------


def test_restore_torch_round_trips_bit_exactly(store: Path, saved: dict, tmp_path: Path, capsys):
    out_path = tmp_path / "step20.pt"
    code, out, err = run(capsys, "restore", store, "--step", "20", "--to", out_path)
    assert code == 0 and err == ""
    assert "restored step 20" in out and "torch.load(" in out
    assert_same(torch.load(out_path, weights_only=True), saved[20])
    assert {p.name for p in tmp_path.iterdir()} == {"store", "step20.pt"}  # no temporary left

    latest = tmp_path / "latest.pt"
    code, doc = run_json(capsys, "restore", store, "--to", latest)
    assert code == 0 and doc["step"] == 30 and doc["format"] == "torch"
    assert doc["weights_only"] is True and doc["path"] == str(latest)
    assert doc["tensors"] == 17  # 4 of the model, 3 x 4 of Adam, bf16
    assert_same(torch.load(latest, weights_only=True), saved[30])


def test_restore_refuses_to_overwrite_without_force(store: Path, saved: dict, tmp_path, capsys):
    target = tmp_path / "keep.pt"
    target.write_bytes(b"precious")
    code, out, err = run(capsys, "restore", store, "--to", target)
    assert code == 2 and out == ""
    assert "--force" in one_line_error(err, "restore")
    assert target.read_bytes() == b"precious"
    code, _, _ = run(capsys, "restore", store, "--to", target, "--force")
    assert code == 0
    assert_same(torch.load(target, weights_only=True), saved[30])

    directory = tmp_path / "dcpdir"
    directory.mkdir()
    (directory / "other").write_text("x")
    code, _, err = run(capsys, "restore", store, "--to", directory, "--format", "dcp")
    assert code == 2 and (directory / "other").exists()
    code, _, err = run(capsys, "restore", store, "--to", directory)  # a dir for a file
    assert code == 2 and "directory" in one_line_error(err, "restore")


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_restore_refuses_a_device_a_pipe_or_a_link_as_its_target(store, tmp_path, capsys, fmt):
    """A character device or a pipe reads as an empty file, and the restore was moved over it
    (`--to /dev/null` as root replaced the host's /dev/null); a link was replaced, not written
    through (`--format dcp --force` onto a linked checkpoint wrote it, then failed)."""
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/proc/self/fd/1", tmp_path / "stdout")
    assert run(capsys, "restore", store, "--to", tmp_path / "real", "--format", fmt)[0] == 0
    os.symlink(tmp_path / "real", tmp_path / "linked")
    for name, says in [
        ("fifo", "is a named pipe"),
        ("stdout", "is a symbolic link"),
        ("linked", "is a symbolic link"),
    ][: 2 if fmt == "safetensors" else 3]:  # safetensors are written into a linked directory
        code, out, err = run(
            capsys, "restore", store, "--to", tmp_path / name, "--format", fmt, "--force"
        )
        assert code == 2 and out == "", err
        if fmt != "safetensors":  # its export names a target not a directory its own way
            assert says in one_line_error(err, "restore"), err
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert os.path.islink(tmp_path / "stdout") and os.path.islink(tmp_path / "linked")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("where", "fmt"),
    [
        ("store", "dcp"),
        ("store/commits", "dcp"),
        ("parent", "dcp"),
        ("store/restored.pt", "torch"),
        ("link", "torch"),
        ("store/hf", "safetensors"),
        ("parent", "safetensors"),
    ],
)
def test_restore_never_writes_over_its_own_store(store: Path, tmp_path: Path, where, fmt, capsys):
    """--to the store, inside it, above it, or a link to it: refused even with --force, and
    the store is left byte for byte as it was (a --force restore once deleted it)."""
    os.symlink(store, tmp_path / "link")
    target = {"parent": tmp_path}.get(where, tmp_path / where)
    before = _tree(store)
    code, out, err = run(capsys, "restore", store, "--to", target, "--format", fmt, "--force")
    assert code == 2 and out == ""
    assert "inside it or holds it" in one_line_error(err, "restore")
    assert _tree(store) == before
    assert run(capsys, "verify", store)[0] == 0


def test_restore_force_replaces_a_dcp_checkpoint_but_not_other_files(store, tmp_path, capsys):
    target = tmp_path / "dcp"
    assert run(capsys, "restore", store, "--step", "10", "--to", target, "--format", "dcp")[0] == 0
    code, doc = run_json(capsys, "restore", store, "--to", target, "--format", "dcp", "--force")
    assert code == 0 and doc["step"] == 30 and (target / ".metadata").is_file()

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    code, _, err = run(capsys, "restore", store, "--to", notes, "--format", "dcp", "--force")
    assert code == 2 and "no DCP checkpoint" in one_line_error(err, "restore")
    assert (notes / "todo.txt").read_text() == "mine"

    # A DCP checkpoint with the operator's files beside it: those are not deleted with it.
    (target / "eval_notes.txt").write_text("mine")
    code, _, err = run(capsys, "restore", store, "--to", target, "--format", "dcp", "--force")
    assert code == 2
    assert "holds 'eval_notes.txt' besides a DCP checkpoint" in one_line_error(err, "restore")
    assert (target / "eval_notes.txt").read_text() == "mine" and (target / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_restore_makes_missing_parents_and_refuses_a_file_on_the_way(store, tmp_path, capsys):
    deep = tmp_path / "a" / "b" / "step.pt"
    assert run(capsys, "restore", store, "--to", deep)[0] == 0 and deep.is_file()
    (tmp_path / "plain").write_text("x")
    code, _, err = run(capsys, "restore", store, "--to", tmp_path / "plain" / "c" / "step.pt")
    assert code == 2 and "is a file, not a directory" in one_line_error(err, "restore")


def test_restore_dcp_is_read_by_stock_dcp(store: Path, saved: dict, tmp_path: Path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    target = tmp_path / "dcp"
    target.mkdir()  # an existing empty directory is fine
    code, doc = run_json(
        capsys, "restore", store, "--step", "10", "--to", target, "--format", "dcp"
    )
    assert code == 0 and doc["format"] == "dcp" and doc["step"] == 10
    expected = saved[10]
    state = {
        "model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
        "optim": {
            "state": {
                p: {k: torch.zeros_like(v) for k, v in s.items()}
                for p, s in expected["optim"]["state"].items()
            }
        },
        "extra": {"bf16": torch.zeros(33, dtype=torch.bfloat16)},
    }
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=FileSystemReader(str(target)))
    assert_same(state["model"], expected["model"])
    assert_same(state["optim"]["state"], expected["optim"]["state"])
    assert_same(state["extra"]["bf16"], expected["extra"]["bf16"])


def test_restore_numpy_state_needs_weights_only_false(tmp_path: Path, capsys) -> None:
    uri = tmp_path / "np"
    state = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "t": torch.arange(4.0), "n": 7}
    with Checkpointer(str(uri)) as ckpt:
        ckpt.save(5, state).wait()
    code, out, _ = run(capsys, "restore", uri, "--to", tmp_path / "np.pt")
    assert code == 0 and "weights_only=False" in out and "numpy" in out
    assert_same(torch.load(tmp_path / "np.pt", weights_only=False), state)


# -- DCP steps -----------------------------------------------------------------------------------


def _dcp_restore_available() -> bool:
    try:
        import ckptstore.dcp as ckdcp
    except ImportError:
        return False
    return hasattr(ckdcp, "load_full_state_dict")


@pytest.mark.skipif(
    not _dcp_restore_available(),
    reason="ckptstore.dcp.load_full_state_dict is not there yet (restoring DCP steps needs it)",
)
def test_dcp_step_inspect_verify_restore(tmp_path: Path, capsys) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from ckptstore.dcp import StoreWriter

    uri = str(tmp_path / "dcpstore")
    model, optim = _model_and_optim()
    state = {"model": dict(model.state_dict()), "step": 7, "bf16": torch.randn(9).bfloat16()}
    expected = copy.deepcopy(state)
    with pytest.warns(UserWarning):
        dcp.save(
            state,
            storage_writer=StoreWriter(uri, step=7, encoding=EncodingOptions(chunk_bytes=16384)),
            no_dist=True,
        )

    code, doc = run_json(capsys, "inspect", uri)
    assert code == 0 and doc["kind"] == "dcp" and doc["step"] == 7 and doc["dcp_metadata"]
    names = {t["name"] for t in doc["tensors"]}
    assert {"model.0.weight", "model.2.bias", "bf16"} <= names
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model.0.weight"]["shape"] == [256, 64]
    assert by_name["model.0.weight"]["offset"] == [0, 0] and not by_name["model.0.weight"]["object"]
    assert by_name["step"]["object"] is True  # a non-tensor value, pickled by DCP

    code, doc = run_json(capsys, "verify", uri)
    assert code == 0 and doc["ok"]

    out_pt = tmp_path / "full.pt"
    code, doc = run_json(capsys, "restore", uri, "--to", out_pt)
    assert code == 0 and doc["kind"] == "dcp"
    assert_same(torch.load(out_pt, weights_only=True), expected)

    out_dcp = tmp_path / "plain-dcp"
    code, _ = run_json(capsys, "restore", uri, "--to", out_dcp, "--format", "dcp")
    assert code == 0
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    target["bf16"] = torch.zeros(9, dtype=torch.bfloat16)
    with pytest.warns(UserWarning):
        dcp.load(target, storage_reader=FileSystemReader(str(out_dcp)))
    assert_same(target["model"], expected["model"])
    assert_same(target["bf16"], expected["bf16"])

    metadata = next(str(p.relative_to(uri)) for p in Path(uri).rglob("dcp.metadata") if p.is_file())
    flip_byte(Path(uri) / metadata)
    code, doc = run_json(capsys, "verify", uri)
    assert code == 1
    assert [(p["object"], p["what"]) for p in doc["problems"]] == [(metadata, "dcp-metadata")]


# -- gc ------------------------------------------------------------------------------------------


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_gc_dry_run_then_keep_last(store: Path, saved: dict, tmp_path: Path, capsys) -> None:
    before = _files(store)
    code, out, _ = run(capsys, "gc", store, "--keep-last", "1", "--dry-run")
    assert code == 0 and "would delete steps: 10, 20" in out
    assert "stay until a later gc" in out  # the chunks are seconds old: --grace-s keeps them
    assert _files(store) == before
    now = ("--grace-s", "0")
    code, doc = run_json(capsys, "gc", store, "--keep-last", "1", "--dry-run", *now)
    assert doc["dry_run"] and doc["deleted_steps"] == [10, 20] and doc["kept_steps"] == [30]
    would = doc["deleted_chunks"]
    assert would > 0 and doc["deleted_chunk_bytes"] > 0 and doc["swept"]
    assert _files(store) == before

    code, doc = run_json(capsys, "gc", store, "--keep-last", "1", *now)
    assert code == 0 and not doc["dry_run"] and doc["deleted_chunks"] == would
    after = _files(store)
    chunks = lambda files: {f for f in files if f.startswith("chunks/")}  # noqa: E731
    assert len(chunks(after)) == len(chunks(before)) - would
    _, listing = run_json(capsys, "ls", store)
    assert [s["step"] for s in listing["steps"]] == [30]
    code, out, _ = run(capsys, "verify", store, "--all")
    assert code == 0 and "all OK" in out
    code, _, _ = run(capsys, "restore", store, "--to", tmp_path / "after-gc.pt")
    assert code == 0
    assert_same(torch.load(tmp_path / "after-gc.pt", weights_only=True), saved[30])


def test_gc_blocked_by_a_save_in_flight(store: Path, capsys) -> None:
    import time

    marker = store / "pending" / f"{40:020d}-abc-00000.json"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(
        json.dumps({"step": 40, "attempt": "abc", "rank": 0, "created_at": time.time()})
    )
    chunks_before = {f for f in _files(store) if f.startswith("chunks/")}
    code, out, _ = run(capsys, "gc", store, "--keep-last", "2")
    assert code == 0
    assert "deleted steps: 10" in out and "in flight" in out and "pending/" in out
    assert {f for f in _files(store) if f.startswith("chunks/")} == chunks_before
    assert marker.exists()
    code, doc = run_json(capsys, "gc", store, "--keep-last", "2")
    assert doc["swept"] is False and doc["blocked_by"] == [str(marker.relative_to(store))]


# -- errors and exit codes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate", "x"],
        ["ls"],
        ["verify", "X", "--step", "1", "--all"],
        ["verify", "X", "--step", "soon"],
        ["gc", "X", "--keep-last", "0"],
        ["restore", "X"],
        ["restore", "X", "--to", "y", "--format", "zip"],
        ["ls", "X", "--storage-option", "novalue"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "restore", "gc"])
def test_nonexistent_path_exits_1(command: str, tmp_path: Path, capsys) -> None:
    extra = {"restore": ["--to", tmp_path / "x.pt"], "gc": ["--keep-last", "1"]}.get(command, [])
    code, out, err = run(capsys, command, tmp_path / "nope", *extra)
    assert code == 1 and out == ""
    assert "no ckptstore checkpoints at" in one_line_error(err, command)
    assert not (tmp_path / "nope").exists()


def test_unknown_scheme_and_empty_store(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "ls", "nosuchscheme://bucket/x")
    assert code == 2 and "nosuchscheme" in one_line_error(err, "ls")
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "verify", tmp_path / "empty")
    assert code == 1 and "no ckptstore data at" in one_line_error(err, "verify")


def test_unreadable_manifest_in_ls_exits_1(store: Path, capsys) -> None:
    flip_byte(store / f"commits/{20:020d}.json")
    code, out, err = run(capsys, "ls", store)
    assert code == 1 and "ERROR" in out and f"commits/{20:020d}.json" in out
    one_line_error(err, "ls")
    code, doc = run_json(capsys, "ls", store)
    assert code == 1 and "error" in doc["steps"][1] and "error" not in doc["steps"][0]


# -- S3 (moto server) ----------------------------------------------------------------------------


@pytest.mark.s3
def test_s3_ls_verify_and_storage_options(s3_uri: str, s3_endpoint: str, capsys, monkeypatch):
    import boto3

    with Checkpointer(s3_uri, encoding=EncodingOptions(chunk_bytes=16384)) as ckpt:
        ckpt.save(1, {"w": torch.randn(64, 64), "b": torch.arange(10)}).wait()
    code, doc = run_json(capsys, "ls", s3_uri)
    assert code == 0 and [s["step"] for s in doc["steps"]] == [1]
    code, out, _ = run(capsys, "verify", s3_uri)
    assert code == 0 and "all OK" in out

    bucket, prefix = s3_uri[len("s3://") :].split("/", 1)
    code, doc = run_json(capsys, "inspect", s3_uri)
    digest = next(t for t in doc["tensors"] if t["name"] == "w")["chunks"][0]
    key = f"chunks/{digest[:2]}/{digest}"
    boto3.client("s3", endpoint_url=s3_endpoint).delete_object(Bucket=bucket, Key=f"{prefix}/{key}")
    code, doc = run_json(capsys, "verify", s3_uri)
    assert code == 1 and [(p["object"], p["problem"]) for p in doc["problems"]] == [
        (key, "missing")
    ]

    code, _, err = run(capsys, "ls", "s3://no-such-bucket-ckptstore/x")
    assert code == 1 and "bucket" in one_line_error(err, "ls")

    # Endpoint from --storage-option instead of the environment.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    code, doc = run_json(capsys, "ls", s3_uri, "--storage-option", f"endpoint_url={s3_endpoint}")
    assert code == 0 and [s["step"] for s in doc["steps"]] == [1]


# -- as a real process ---------------------------------------------------------------------------


def _cli(*argv: Any) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_subprocess_exit_codes_and_no_traceback(store: Path, tmp_path: Path) -> None:
    done = _cli("verify", tmp_path / "missing")
    assert done.returncode == 1 and done.stdout == ""
    missing = tmp_path / "missing"
    expected = f"ckptstore verify: error: no ckptstore checkpoints at {missing} (no such path)"
    assert done.stderr.strip() == expected

    done = _cli("ls", "nosuchscheme://b/x")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

    flip_byte(store / chunk_of_file(store))
    done = _cli("verify", store, "--all", "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["ok"] is False
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ckptstore verify: error: ") and "corrupt" in line


def chunk_of_file(store: Path) -> str:
    return "chunks/" + sorted(_files(store / "chunks"))[0]


def test_help_has_examples(capsys) -> None:
    for command in ("ls", "inspect", "verify", "restore", "gc"):
        code, out, _ = run(capsys, command, "--help")
        assert code == 0 and "examples:" in out and f"ckptstore {command} " in out
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(c in out for c in ("ls", "inspect", "verify", "restore", "gc"))
    code, out, _ = run(capsys, "restore", "--help")
    assert '"rank0"' in out and "weights_only" in out


def test_progress_bar_only_on_a_terminal(store: Path, tmp_path: Path, capsys, monkeypatch):
    code, _, err = run(capsys, "verify", store)
    assert code == 0 and err == ""  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run(capsys, "verify", store)
    assert code == 0 and "verify" in err and "100%" in err
    code, _, err = run(capsys, "restore", store, "--to", tmp_path / "bar.pt")
    assert code == 0 and "restore step 30" in err and "100%" in err


def test_debug_shows_the_real_exception(tmp_path: Path, capsys) -> None:
    from ckptstore.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="no ckptstore checkpoints"):
        main(["ls", str(tmp_path / "nope"), "--debug"])


# -- several ranks -------------------------------------------------------------------------------


def _rank_state(rank: int) -> dict:
    return {"w": torch.full((40, 40), float(rank)), "shared": torch.arange(100.0), "rank": rank}


def _save_as_rank(rank: int, world: int, root: str) -> None:
    with Checkpointer(root) as ckpt:
        ckpt.save(3, _rank_state(rank)).wait()


@pytest.mark.dist
def test_two_ranks_inspect_verify_restore(tmp_path: Path, capsys) -> None:
    root = tmp_path / "store"
    run_ranks(_save_as_rank, 2, str(root))
    code, doc = run_json(capsys, "inspect", root)
    assert code == 0 and doc["world_size"] == 2 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert sorted((t["rank"], t["name"]) for t in doc["tensors"]) == [
        (0, "shared"),
        (0, "w"),
        (1, "shared"),
        (1, "w"),
    ]
    code, out, _ = run(capsys, "inspect", root)
    assert "RANK" in out
    assert re.search(r"tensors: +4 \(.*\), each rank's shard counted", out), out  # DCP migrator
    code, doc = run_json(capsys, "verify", root)
    assert code == 0 and doc["steps"][0]["ranks"] == 2
    code, out, _ = run(capsys, "restore", root, "--to", tmp_path / "all.pt")
    assert code == 0 and '"rank<r>"' in out
    assert_same(
        torch.load(tmp_path / "all.pt", weights_only=True),
        {"rank0": _rank_state(0), "rank1": _rank_state(1)},
    )
    # safetensors holds one state: the line says whose, and --rank picks another
    code, out, _ = run(
        capsys, "restore", root, "--to", tmp_path / "r1", "--format", "safetensors", "--rank", "1"
    )
    assert code == 0 and "rank 1's state of 2 ranks" in out
    # Reviewer of stop 60: a rank the step has none of read as damage (exit 1) and left --to
    code, _, err = run(
        capsys, "restore", root, "--to", tmp_path / "r5", "--format", "safetensors", "--rank", "5"
    )
    assert code == 2 and "rank 5: step 3 was saved by 2 rank(s), 0-1" in err, err
    assert not (tmp_path / "r5").exists()


def test_unknown_format_version_is_reported(store: Path, capsys) -> None:
    path = store / f"commits/{20:020d}.json"
    text = path.read_text()
    assert '"format_version":2,' in text
    path.write_bytes(sealed({**json.loads(text), "format_version": 99}))  # a newer writer's
    code, _, err = run(capsys, "inspect", store, "--step", "20")
    assert code == 1 and "upgrade ckptstore" in one_line_error(err, "inspect")
    code, doc = run_json(capsys, "verify", store, "--step", "20")
    assert code == 1
    assert [(p["object"], p["problem"]) for p in doc["problems"]] == [
        (f"commits/{20:020d}.json", "unsupported")
    ]
    code, doc = run_json(capsys, "ls", store)
    assert code == 1 and "format version 99" in doc["steps"][1]["error"]


# -- the reader of stdout goes away (`ckptstore ... | head -1`) ---------------------------------


def _cli_reader_gone(*argv: Any, unbuffered: bool) -> subprocess.CompletedProcess:
    """Run the command with stdout a pipe whose read end is already closed: every write to it
    fails with EPIPE, as after `| head -1` has read its line (deterministically)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "ckptstore.cli", *map(str, argv)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    "argv",
    [["inspect"], ["ls"], ["inspect", "--json"], ["inspect", "--debug"]],
    ids=["inspect", "ls", "inspect-json", "inspect-debug"],
)
def test_reader_of_stdout_gone_is_a_normal_end(store: Path, argv: list, unbuffered: bool):
    done = _cli_reader_gone(argv[0], store, *argv[1:], unbuffered=unbuffered)
    assert (done.returncode, done.stderr) == (0, "")


def test_head_of_inspect_is_a_normal_end(store: Path) -> None:
    done = subprocess.run(
        f"set -o pipefail; {sys.executable} -m ckptstore.cli inspect {store} | head -1",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("step 30")


def test_restore_only_takes_whole_name_segments(tmp_path: Path, capsys) -> None:
    uri = tmp_path / "store"
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"model": {"w": torch.ones(2)}, "model_ema": {"w": torch.zeros(2)}}).wait()
    out = tmp_path / "model.pt"
    assert run(capsys, "restore", str(uri), "--to", str(out), "--only", "model")[0] == 0
    assert list(torch.load(out, weights_only=True)) == ["model"]
    code, _, err = run(capsys, "restore", str(uri), "--to", str(out) + "x", "--only", "model/w")
    assert code == 0 and list(torch.load(str(out) + "x", weights_only=True)) == ["model"]


def test_restore_refuses_safetensors_options_for_other_formats(store: Path, tmp_path: Path, capsys):
    code, _, err = run(
        capsys, "restore", str(store), "--to", str(tmp_path / "a.pt"), "--dtype", "bfloat16"
    )
    assert code == 2 and "--dtype: only with --format safetensors" in err
    assert not (tmp_path / "a.pt").exists()


def test_restore_as_dcp_of_a_state_dcp_cannot_hold_says_why_in_one_line(tmp_path, capsys):
    """Keys "a.b" and "a"/"b" both flatten to "a.b" in DCP: the cause, not a cut traceback
    called a write failure; nothing is left at --to."""
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.save(1, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}).wait()
    code, _, err = run(
        capsys, "restore", tmp_path / "s", "--to", tmp_path / "out", "--format", "dcp"
    )
    line = one_line_error(err, "restore")
    assert code == 1 and "--format dcp cannot hold this state" in line
    assert "duplicated flatten key a.b" in line
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_names_a_terminal_would_act_on_print_as_escapes(tmp_path, capsys):
    """A step's tensor names reached the terminal raw: a name holding escape sequences printed
    a fake green "all OK" line and retitled the window."""
    uri = str(tmp_path / "s")
    name = "x\n\x1b[1;32mverified 1 step(s): all OK\x1b[0m\x1b]0;pwned\x07"
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {name: torch.zeros(4), "plain": torch.ones(2)}).wait()
    code, out, _ = run(capsys, "inspect", uri)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "x\\n\\x1b[1;32mverified" in out and "plain" in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_restore_stopped_while_it_writes_leaves_no_temporary(store, tmp_path, signum):
    """SIGTERM (timeout, Slurm) and SIGHUP (a closed ssh session) left a hidden temporary as
    large as the state beside the target; Ctrl-C inside torch.save was reported as a disk
    error. The write is held at its fsync so that the signal lands in it."""
    target = tmp_path / "out.pt"
    temporaries = lambda: [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # noqa: E731
    _, err = stop_run(
        ["restore", str(store), "--to", str(target)],
        temporaries,
        signum,
        module="ckptstore.cli",
        prelude="import os, time; os.fsync = lambda fd: time.sleep(60)",
    )
    assert temporaries() == [] and not target.exists()
    assert "Traceback" not in err and "cannot write" not in err


def test_a_restore_after_one_killed_removes_what_the_killed_one_left(store, tmp_path, capsys):
    """``kill -9`` (the OOM killer) leaves the temporary as large as the state beside the
    target; the next restore to that target removes it (its process is gone), but never the
    two halves of a DCP directory swap a kill interrupted (the old checkpoint is there)."""
    target = tmp_path / "out.pt"
    temporaries = lambda: sorted(p for p in os.listdir(tmp_path) if ".tmp-" in p)  # noqa: E731
    start = (
        "import os, runpy, sys, time; os.fsync = lambda fd: time.sleep(60); "
        f"sys.argv = ['ckptstore', 'restore', {str(store)!r}, '--to', {str(target)!r}]; "
        "runpy.run_module('ckptstore.cli', run_name='__main__')"
    )
    proc = subprocess.Popen([sys.executable, "-c", start], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is not None or temporaries(), timeout_s=120)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    (left,) = temporaries()
    assert f"-{proc.pid}-" in left
    swapped = tmp_path / "old.dcp"
    halves = [f".old.dcp.tmp-{left.split('.tmp-')[1].split('-')[0]}-{proc.pid}-0123abcd"]
    halves.append(halves[0] + ".old")
    for name in halves:
        (tmp_path / name).mkdir()
    # Another container's (another machine tag): its pid says nothing here (reviewer, stop 60)
    elsewhere = f".out.pt.tmp-{'f' * 8}-{proc.pid}-0123abcd"
    (tmp_path / elsewhere).write_bytes(b"x")
    code, _, err = run(capsys, "restore", store, "--to", target)
    assert code == 0 and target.is_file()
    assert f"removed {tmp_path / left}, left by a restore that was killed" in err
    assert temporaries() == sorted([*halves, elsewhere])
    (tmp_path / elsewhere).unlink()
    code, _, err = run(capsys, "restore", store, "--to", swapped, "--format", "dcp")
    assert code == 0 and swapped.is_dir()
    assert "left the previous checkpoint at" in err and temporaries() == sorted(halves)


def test_verify_names_a_damaged_store_identity(store, capsys):
    """identity.json, which every tiered job reads at open, was checked by nothing: a damaged
    one stopped every tiered job while verify --all said all OK."""
    assert run(capsys, "verify", store, "--all")[0] == 0
    (store / "identity.json").write_text("garbage")
    code, out, err = run(capsys, "verify", store, "--all")
    assert code == 1 and "identity.json: not valid JSON" in err and "IDENTITY" in out
    code, doc = run_json(capsys, "verify", store)
    assert code == 1 and "every tiered job fails" in doc["identity_problem"]
    assert "moved aside" in doc["identity_problem"]  # recorded again: no copy is lost


def test_ls_with_local_dir_lists_every_tier_beside_a_damaged_store_identity(tmp_path, capsys):
    """Operator of stop 77: ``ls URI --local-dir D`` of a store whose identity.json was damaged
    exited 1 listing no step, while plain ``ls`` listed them. It lists the steps and the local
    copies (by the store's location, as a store that records no identity), names the damage,
    and exits 1."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=2)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.ones(3)}).wait()
    (durable / "identity.json").write_text("garbage")
    code, out, err = run(capsys, "ls", durable, "--local-dir", local)
    assert code == 1 and "identity.json: not valid JSON" in one_line_error(err, "ls"), err
    rows = {
        line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])
    }
    assert "durable" in rows["1"] and str(local) in rows["2"], out
    code, doc = run_json(capsys, "ls", durable, "--local-dir", local)
    assert code == 1 and "location alone" in doc["identity_problem"]
    assert [s["step"] for s in doc["steps"]] == [1, 2]


def test_verify_tells_chunks_the_store_did_not_answer_for_from_damaged_ones(
    store, capsys, monkeypatch
):
    """Reviewer Y: through a stalled endpoint, verify --all called every step FAILED, as it
    would a damaged one: a `verify || alert` hook could not tell the store from the data."""
    from ckptstore import pipeline
    from ckptstore.errors import StorageTimeoutError

    fetch = pipeline.fetch_chunk

    def stalled(s, digest, *args, **kwargs):
        raise StorageTimeoutError(f"get {s.url(digest)}: no answer within 5.0s")

    monkeypatch.setattr(pipeline, "fetch_chunk", stalled)
    code, out, err = run(capsys, "verify", store, "--all")
    assert code == 1 and "FAILED" not in out
    assert re.search(r"step \d+: NOT VERIFIED \(\d+ object\(s\) not read\)", out)
    assert re.search(r": \d+ step\(s\) not verified \(the reads failed \(the store did not", out)
    assert "this says nothing of the checkpoint" in err
    monkeypatch.setattr(pipeline, "fetch_chunk", fetch)
    assert run(capsys, "verify", store, "--all")[0] == 0


def test_gc_remove_corrupt_deletes_nothing_when_this_process_cannot_check_the_chunks(
    store, capsys, monkeypatch
):
    """Resource reviewer: under a thread limit, chunk checks failed with RuntimeError("can't
    start new thread"), counted as corrupt: `gc --verify --remove-corrupt` deleted good steps,
    the newest one once, and `verify` called intact chunks CORRUPT."""
    from ckptstore import pipeline
    from ckptstore.catalog import list_steps
    from ckptstore.store import Store

    steps = list_steps(Store(str(store)))

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pipeline, "fetch_chunk", no_thread)
    code, out, err = run(capsys, "gc", store, "--verify", "--remove-corrupt")
    assert code == 1 and "nothing deleted" in err
    code, out, err = run(capsys, "verify", store, "--all")
    assert code == 1 and "FAILED" not in out and "CORRUPT" not in out
    assert list_steps(Store(str(store))) == steps
    monkeypatch.undo()
    assert run(capsys, "verify", store, "--all")[0] == 0


def test_gc_on_a_store_with_no_room_left_says_what_to_free(store, capsys, monkeypatch):
    """Resource reviewer: on a store with no byte or inode left, gc failed at its clock probe
    or lease renewal with a bare "no space left on device", after it had unlisted the steps
    it dropped: the README's remedy (gc) seemed not to work, and nothing said what to do."""
    from ckptstore.errors import StorageFullError
    from tests.helpers.crafted import failing_for

    def full(store, key):
        return StorageFullError(f"put {store.url(key)}: no space left on device")

    failing_for(monkeypatch, "put", "leases/clock", full)
    code, _, err = run(capsys, "gc", store, "--keep-last", "1", "--no-verify")
    line = one_line_error(err, "gc")
    assert code == 1 and "no space left on device" in line
    assert "free a little room beside the store, then run gc again" in line
    monkeypatch.undo()
    assert run(capsys, "gc", store, "--keep-last", "1", "--no-verify")[0] == 0


def test_verify_says_an_identity_it_could_not_read_is_not_read_not_damaged(
    store, capsys, monkeypatch
):
    """Reviewer G: a timeout reading identity.json (a stalled endpoint) was reported as a
    damaged identity, with the advice to restore the store from a backup or delete it."""
    from ckptstore.cli import cmd_verify
    from ckptstore.errors import StorageAccessError, StorageTimeoutError

    def stalled(s):
        raise StorageTimeoutError(f"get {s.url('identity.json')}: no answer within 5.0s")

    monkeypatch.setattr(cmd_verify, "read_identity", stalled)
    code, doc = run_json(capsys, "verify", store)
    assert code == 1 and "not read (the store did not answer)" in doc["identity_problem"]
    assert "backup" not in doc["identity_problem"]

    def refused(s):  # reviewer I: a refusal is no timeout: "run verify again" misleads
        raise StorageAccessError(f"get {s.url('identity.json')}: AccessDenied (403)")

    monkeypatch.setattr(cmd_verify, "read_identity", refused)
    code, doc = run_json(capsys, "verify", store)
    assert code == 1 and "AccessDenied" in doc["identity_problem"]
    assert "again" not in doc["identity_problem"] and "backup" not in doc["identity_problem"]


def _killed_puts_temporary(store: Path) -> Path:
    """A chunk put's temporary under ``store``, an hour old (its writer died mid-put)."""
    chunk_dir = store / "chunks" / "ab"
    chunk_dir.mkdir(parents=True)
    tmp = chunk_dir / f"ab{'0' * 30}.tmp-{'1' * 32}"
    tmp.write_bytes(b"x" * 1024)
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    return tmp


def test_a_store_holding_only_a_killed_saves_temporaries_is_still_a_store(tmp_path, capsys):
    """A first save killed mid-put leaves temporaries only (its lease and chunks swept): every
    command called the path "a mistyped path", and gc refused to remove them."""
    tmp = _killed_puts_temporary(tmp_path / "s")
    code, out, _ = run(capsys, "ls", tmp_path / "s")
    assert code == 0 and "no committed steps" in out
    assert run(capsys, "gc", tmp_path / "s", "--keep-last", "1")[0] == 0
    assert not tmp.exists()


def test_a_directory_holding_a_store_with_temporaries_is_not_a_store(tmp_path, capsys):
    """Reviewer G: a parent directory of stores, one holding a killed save's temporary, was
    taken for a store (``ls``: no committed steps, exit 0) and ``gc`` of it deleted the nested
    store's temporary. A store's temporaries are those of its own layout."""
    tmp = _killed_puts_temporary(tmp_path / "runs" / "run2")
    code, _, err = run(capsys, "ls", tmp_path / "runs")
    assert code == 1 and "no ckptstore data" in err
    assert run(capsys, "gc", tmp_path / "runs")[0] == 1 and tmp.exists()


def test_inspect_prints_a_steps_health_reasons_as_text_not_terminal_codes(store: Path, capsys):
    """Hostile-checkpoint adversary: a manifest's health reasons reached the terminal as they
    were (escape codes clear the screen, set its title, or fake a line); tensor names were
    already escaped."""
    path = store / f"commits/{30:020d}.json"
    doc = json.loads(path.read_text())
    doc["health"].update(healthy=False, nan=1, reasons=["\x1b[2J\x1b]0;owned\x07\nOK fake"])
    path.unlink()
    path.write_bytes(sealed(doc))
    code, out, err = run(capsys, "inspect", store, "--step", "30")
    assert "\x1b" not in out + err and "\x07" not in out + err, out + err
    (health,) = [line for line in out.splitlines() if line.lstrip().startswith("health")]
    assert "\\x1b[2J" in health and "\\nOK fake" in health, health


def test_inspect_of_a_health_record_missing_its_norm_says_what_it_has(store: Path, capsys):
    """A fuzzer: a manifest whose health record lacked ``sumsq`` (resealed) passed ls and
    verify, and ``inspect`` died with "unexpected KeyError: 'sumsq'"."""
    path = store / f"commits/{30:020d}.json"
    doc = json.loads(path.read_text())
    assert "sumsq" in doc["health"]
    del doc["health"]["sumsq"]
    path.unlink()
    path.write_bytes(sealed(doc))
    code, out, err = run(capsys, "inspect", store, "--step", "30")
    assert code == 0 and err == "", err
    assert "0 NaN, 0 Inf" in out and "norm" not in out.split("NaN")[1].split("\n")[0], out


def _removed_while_read(monkeypatch, uri: str, new_step: int) -> None:
    """The first step restore reads is dropped as it reads it: another process saves
    ``new_step`` with keep_last=1, which deletes the step's manifest, then its chunks."""
    from ckptstore.steps import StepView

    read = StepView.load_plain
    calls = []

    def dropped_first(self, *args, **kwargs):
        if not calls:
            calls.append(self.step)
            with Checkpointer(uri, keep_last=1) as other:
                other.save(new_step, {"w": torch.full((4096,), float(new_step))}).wait()
        return read(self, *args, **kwargs)

    monkeypatch.setattr(StepView, "load_plain", dropped_first)


def _three_steps(uri: str) -> None:
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()


def test_a_restore_whose_step_a_job_removes_meanwhile_restores_the_newest(
    tmp_path, monkeypatch, capsys
):
    """Adversary of stop 75: ``restore`` beside a job with keep_last failed 2 times in 30 with
    "chunk ... is missing" and a hint to try the step before (the newer one was there): the
    job's retention had removed the step as it was read. The newest step is restored instead,
    as Checkpointer.load() does; a step named by --step says it was removed, not damaged."""
    uri = str(tmp_path / "store")
    _three_steps(uri)
    _removed_while_read(monkeypatch, uri, 4)
    code, out, err = run(capsys, "restore", uri, "--to", tmp_path / "out.pt")
    assert code == 0, err
    assert "step 3 was removed while it was restored" in err and "restored step 4" in out
    assert torch.equal(torch.load(tmp_path / "out.pt")["w"], torch.full((4096,), 4.0))

    named = str(tmp_path / "named")
    _three_steps(named)
    _removed_while_read(monkeypatch, named, 4)
    code, out, err = run(capsys, "restore", named, "--step", "3", "--to", tmp_path / "3.pt")
    assert code == 1 and err.count("\n") == 1, err
    assert "step 3 of" in err and "was removed while it was restored (keep_last or gc" in err
    assert "the step before it" not in err and not (tmp_path / "3.pt").exists()


def _removed_while_verified(monkeypatch, uri: str, new_steps: list[int]) -> None:
    """The steps verify checks are dropped as it reads their chunks, once per step of
    ``new_steps``: another process saves it with keep_last=1."""
    import ckptstore.cli.cmd_verify as cmd_verify

    check = cmd_verify.check_all_chunks
    left = list(new_steps)

    def dropped(*args, **kwargs):
        if left:
            with Checkpointer(uri, keep_last=1) as other:
                step = left.pop(0)
                other.save(step, {"w": torch.full((4096,), float(step))}).wait()
        return check(*args, **kwargs)

    monkeypatch.setattr(cmd_verify, "check_all_chunks", dropped)


@pytest.mark.parametrize("which", [[], ["--all"]])
def test_a_verify_whose_steps_a_job_removes_meanwhile_verifies_the_newest(
    tmp_path, monkeypatch, capsys, which
):
    """CLI operator adversary of stop 80: ``verify URI`` beside a job with keep_last failed
    (exit 1, "removed while it was verified") in 6 of 12 runs of a health check on a healthy
    store; ``verify --all`` whose every step went said "verified 0 step(s): all OK", having
    checked nothing. Both verify the newest again (3 times at most); a step named by --step
    removed meanwhile still fails saying so."""
    uri = str(tmp_path / "store")
    _three_steps(uri)
    _removed_while_verified(monkeypatch, uri, [4])
    code, out, err = run(capsys, "verify", uri, *which)
    assert code == 0, err
    assert "were removed while they were verified" in err, err
    assert "step 4: OK" in out and "verified 1 step(s)" in out, out
    _removed_while_verified(monkeypatch, uri, [5, 6, 7])
    code, out, err = run(capsys, "verify", uri, *which)
    assert code == 1 and err.strip().endswith("verify a step still kept (ckptstore ls)"), err
    assert "all OK" not in out, out

    named = str(tmp_path / "named")
    _three_steps(named)
    _removed_while_verified(monkeypatch, named, [4])
    code, out, err = run(capsys, "verify", named, "--step", "3")
    assert code == 1 and err.count("\n") == 1, err
    assert "step(s) 3 of" in err and "were removed while they were verified" in err, err


def _removed_while_exported(monkeypatch, uri: str, new_step: int) -> None:
    """As ``_removed_while_read``, for the safetensors export: the first step it writes is
    dropped as its chunks are read."""
    import ckptstore.export as export

    write = export._write_files
    calls = []

    def dropped_first(*args, **kwargs):
        if not calls:
            calls.append(1)
            with Checkpointer(uri, keep_last=1) as other:
                other.save(new_step, {"w": torch.full((4096,), float(new_step))}).wait()
        return write(*args, **kwargs)

    monkeypatch.setattr(export, "_write_files", dropped_first)


def test_a_safetensors_export_whose_step_a_job_removes_meanwhile_exports_the_newest(
    tmp_path, monkeypatch, capsys
):
    """Adversary of stop 77: ``restore --format safetensors`` beside a job with keep_last=1
    named a missing chunk as damage (with a hint to an older step, also gone) where ``--format
    torch`` restores the newest step; and an export complete before the step went exited 1,
    reading the step again only to print a note. Now the export takes the newest step, and a
    step named by --step says it was removed."""
    from safetensors.torch import load_file

    uri = str(tmp_path / "store")
    _three_steps(uri)
    _removed_while_exported(monkeypatch, uri, 4)
    out_dir = tmp_path / "hf"
    code, out, err = run(capsys, "restore", uri, "--to", out_dir, "--format", "safetensors")
    assert code == 0, err
    assert "exported step 4" in out and "step 3 of" in err and "was removed while" in err
    assert torch.equal(load_file(out_dir / "model.safetensors")["w"], torch.full((4096,), 4.0))
    assert sorted(os.listdir(out_dir)) == ["model.safetensors"]  # no temporary left behind

    named = str(tmp_path / "named")
    _three_steps(named)
    _removed_while_exported(monkeypatch, named, 4)
    code, out, err = run(
        capsys, "restore", named, "--step", "3", "--to", tmp_path / "hf3", "--format", "safetensors"
    )
    assert code == 1 and err.count("\n") == 1, err
    assert "step 3 of" in err and "was removed while it was exported (keep_last or gc" in err
    assert "the step before it" not in err and not (tmp_path / "hf3" / "model.safetensors").exists()


def test_a_safetensors_export_done_before_its_step_is_removed_succeeds(
    tmp_path, monkeypatch, capsys
):
    """The same adversary: the step removed right after the export wrote its files failed the
    command (exit 1, "step 1 is not committed"), the export whole on disk."""
    import ckptstore.cli.cmd_restore as cmd_restore

    uri = str(tmp_path / "store")
    _three_steps(uri)
    export = cmd_restore.export_safetensors

    def then_removed(*args, **kwargs):
        result = export(*args, **kwargs)
        with Checkpointer(uri, keep_last=1) as other:
            other.save(4, {"w": torch.full((4096,), 4.0)}).wait()
        return result

    monkeypatch.setattr(cmd_restore, "export_safetensors", then_removed)
    code, out, err = run(capsys, "restore", uri, "--to", tmp_path / "hf", "--format", "safetensors")
    assert code == 0 and "exported step 3" in out, err


def test_a_path_with_a_space_at_its_end_is_quoted_where_it_is_not_found(store, tmp_path, capsys):
    """A new user: ``ls "st_local "`` said "no ckptstore checkpoints at st_local  (no such
    path)", the space unseen. Since stop 79 a store URI with whitespace around it is refused
    (a writer given one saved into another store than the one meant): quoted, a usage error."""
    code, _, err = run(capsys, "ls", f"{store} ")
    assert code == 2 and f"store URI '{store} ' begins or ends with whitespace" in err, err
