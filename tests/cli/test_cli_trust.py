"""What the CLI does with damaged stores and full disks (issue 21, item 9): corrupt data exits 1
(never 2, the usage status), a failed restore leaves no empty ``--to`` behind, a full disk is
named, and a verifier that runs out of memory does not call good data corrupt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptstore._inspect
import ckptstore.pipeline
from ckptstore import Checkpointer, EncodingOptions, Store
from ckptstore.catalog import load_manifest, load_rank_index
from ckptstore.cli import main
from ckptstore.format import chunk_key, commit_key


def saved_store(root: Path) -> str:
    uri = str(root / "store")
    with Checkpointer(uri, encoding=EncodingOptions(compression="none")) as ckpt:
        ckpt.save(1, {"model": {"w": torch.arange(1 << 16, dtype=torch.float32)}}).wait()
    return uri


def flip_a_chunk_byte(uri: str) -> None:
    store = Store(uri)
    index = load_rank_index(store, load_manifest(store, 1), 0)
    path = Path(store.path(chunk_key(next(iter(index.chunks)))))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


def test_safetensors_restore_of_corrupt_data_exits_1_and_leaves_no_directory(tmp_path, capsys):
    uri = saved_store(tmp_path)
    flip_a_chunk_byte(uri)
    target = tmp_path / "export"
    code, line = run(capsys, "restore", uri, "--to", target, "--format", "safetensors")
    assert code == 1, line
    assert line.startswith("ckptstore restore: error: ") and "chunk" in line
    assert not target.exists()


def test_a_failed_export_keeps_a_directory_that_was_there(tmp_path, capsys):
    uri = saved_store(tmp_path)
    flip_a_chunk_byte(uri)
    target = tmp_path / "export"
    target.mkdir()
    code, _ = run(capsys, "restore", uri, "--to", target, "--format", "safetensors")
    assert code == 1 and target.is_dir()


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_a_restore_onto_a_full_disk_names_the_path(tmp_path, small_disk, capsys, fmt):
    uri = saved_store(tmp_path)
    (small_disk / "filler").write_bytes(b"\0" * ((4 << 20) - (64 << 10)))
    target = small_disk / "restored"
    code, line = run(capsys, "restore", uri, "--to", target, "--format", fmt)
    assert code == 1
    assert f"cannot write {target}" in line and "No space left" in line
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no temporary left


def test_verify_running_out_of_memory_does_not_call_the_chunk_corrupt(tmp_path, monkeypatch):
    uri = saved_store(tmp_path)

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(ckptstore.pipeline, "fetch_chunk", no_memory)
    [check] = ckptstore._inspect.verify_steps(Store(uri), [1])
    assert check.problems
    assert {p.problem for p in check.problems} == {"unreadable"}
    assert all("out of memory" in p.error for p in check.problems)


def test_exporting_a_step_without_tensors_is_not_a_usage_error(tmp_path, capsys):
    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"step": 1, "note": "no tensors"}).wait()
    target = tmp_path / "export"
    code, line = run(capsys, "restore", uri, "--to", target, "--format", "safetensors")
    assert code == 1 and "holds no tensor to export" in line
    assert not target.exists()


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_a_restore_of_a_damaged_step_names_it_and_the_step_before(tmp_path, capsys, fmt):
    """A reviewer: ``restore`` of a step with a damaged chunk said only which chunk; at 3 a.m.
    the user needs the step it was and the one to try instead."""
    uri = saved_store(tmp_path)
    with Checkpointer(uri, encoding=EncodingOptions(compression="none")) as ckpt:
        ckpt.save(2, {"model": {"w": torch.arange(1 << 16, dtype=torch.float32) + 1}}).wait()
    store = Store(uri)
    index = load_rank_index(store, load_manifest(store, 2), 0)
    path = Path(store.path(chunk_key(next(iter(index.chunks)))))
    os.chmod(path, 0o644)
    path.unlink()
    target = tmp_path / "restored"
    code, line = run(capsys, "restore", uri, "--to", target, "--format", fmt)
    assert code == 1 and not target.exists(), line
    assert line.startswith("ckptstore restore: error: step 2 cannot be restored: "), line
    assert (
        "is missing" in line
        and "; the step before it: --step 1 (not verified: `ckptstore verify " in line
    ), line
    code, _ = run_ok(capsys, "restore", uri, "--to", target, "--format", fmt, "--step", "1")
    assert code == 0 and target.exists()


def test_a_restores_hint_skips_a_step_whose_manifest_does_not_read(tmp_path, capsys):
    """Reviewer K: the hint named the step before, itself unreadable (a truncated manifest),
    sending the user to a second failure; it names the newest step whose manifest reads."""
    uri = saved_store(tmp_path)
    with Checkpointer(uri, encoding=EncodingOptions(compression="none")) as ckpt:
        for step in (2, 3):
            ckpt.save(step, {"model": {"w": torch.arange(64, dtype=torch.float32) + step}}).wait()
    store = Store(uri)
    commit = Path(store.path(commit_key(2)))
    os.chmod(commit, 0o644)
    commit.write_bytes(commit.read_bytes()[:50])
    index = load_rank_index(store, load_manifest(store, 3), 0)
    path = Path(store.path(chunk_key(next(iter(index.chunks)))))
    os.chmod(path, 0o644)
    path.unlink()
    code, line = run(capsys, "restore", uri, "--to", tmp_path / "restored")
    assert (
        code == 1 and "; the step before it: --step 1 (not verified: `ckptstore verify " in line
    ), line
    for fmt in ("torch", "safetensors"):  # new-user reviewer: a manifest's damage named no step
        to = tmp_path / f"restored-{fmt}"
        code, line = run(capsys, "restore", uri, "--step", "2", "--format", fmt, "--to", to)
        assert code == 1 and "error: step 2 cannot be restored: " in line, line
        assert "not valid JSON" in line and "the step before it: --step 1 " in line, line


def run_ok(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("refused", [True, False])
def test_ls_says_whether_a_step_it_could_not_read_is_damaged(
    tmp_path, capsys, monkeypatch, refused
):
    """New-user reviewer: with reads refused (anonymous S3), every row said "access denied"
    and the closing line "step(s) have an unreadable manifest", which reads as damage."""
    from ckptstore.errors import StorageAccessError
    from tests.helpers.crafted import failing_for

    uri = saved_store(tmp_path)
    if refused:

        def denied(store, key):
            return StorageAccessError(f"{key}: access denied or no credentials")

        failing_for(monkeypatch, "get", "commits/", denied)
    else:
        commit = Path(Store(uri).path(commit_key(1)))
        os.chmod(commit, 0o644)
        commit.write_bytes(b"{")
    code, line = run(capsys, "ls", uri)
    assert code == 1, line
    if refused:
        assert "could not be read: the store refused or did not answer" in line, line
    else:
        assert "have an unreadable manifest" in line, line
