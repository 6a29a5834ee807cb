"""What the CLI needs and leaves (issue 25, item 5): ``--help``, usage errors, ``ls`` and
``inspect`` of a local store run without importing torch; a mistyped S3 prefix is "no ckptstore
data"; a local store keeps no empty directories behind its deletes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer
from ckptstore.cli import main
from ckptstore.format import _COMMON_ITEMSIZES
from tests.helpers import ROOT

RUN_WITHOUT_TORCH = """
import sys
from ckptstore.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("TORCH_IMPORTED" if "torch" in sys.modules else "NO_TORCH", code)
"""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    uri = tmp_path / "store"
    with Checkpointer(uri) as ckpt:
        state = {"model": {"w": torch.ones(10), "h": torch.zeros(3, dtype=torch.bfloat16)}}
        ckpt.save(1, {**state, "step": 1}).wait()
    return uri


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["ls"], ["restore", "X"], ["ls", "{store}"], ["ls", "{store}",
     "--json"], ["inspect", "{store}"], ["inspect", "{store}", "--json"]],
)  # fmt: skip
def test_answers_without_importing_torch(store: Path, argv: list[str]) -> None:
    args = [a.format(store=store) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_TORCH, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("NO_TORCH"), proc.stdout + proc.stderr
    assert int(last.split()[1] or 0) in (0, 2)


def test_the_dtype_table_read_without_torch_agrees_with_torch() -> None:
    for name, itemsize in _COMMON_ITEMSIZES.items():
        assert getattr(torch, name).itemsize == itemsize, name


@pytest.mark.s3
def test_a_mistyped_s3_prefix_is_no_ckptstore_data(s3_uri: str, capsys) -> None:
    with Checkpointer(s3_uri) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    assert main(["ls", s3_uri]) == 0
    capsys.readouterr()
    assert main(["ls", s3_uri + "-typo", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["code"] == 1 and "no ckptstore data at" in err


def test_a_scheme_with_one_slash_is_refused_with_the_uri_meant(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["ls", "s3:/bucket/run7"]) == 2
    err = capsys.readouterr().err
    assert "did you mean s3://bucket/run7?" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="did you mean memory://run7"):
        Checkpointer("memory:run7")
    assert os.listdir(tmp_path) == []  # no directory named "s3:" or "memory:" was made
    os.makedirs("s3:/bucket")  # a directory that really is named so is a local store
    assert main(["ls", "s3:/bucket"]) == 1  # exists, holds no checkpoints


@pytest.mark.parametrize("typed", ["s3//bucket/run7", "S3://bucket/run7"])
def test_a_scheme_without_its_colon_or_in_capitals_is_refused_with_the_uri_meant(
    tmp_path, monkeypatch, capsys, typed
):
    """A reviewer: ``s3//bucket/run7`` said only "no such path", ``S3://...`` "Protocol not
    known: S3"."""
    monkeypatch.chdir(tmp_path)
    assert main(["ls", typed]) == 2
    err = capsys.readouterr().err
    assert "did you mean s3://bucket/run7?" in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == []


def test_a_restore_target_with_a_uri_s_scheme_and_one_slash_is_refused(tmp_path, monkeypatch):
    """Reviewer of stop 60: ``restore --to s3:/bkt/x`` wrote a local ``./s3:/bkt/x`` and exited
    0: a usage error, nothing made."""
    with Checkpointer(tmp_path / "store") as ckpt:
        ckpt.save(1, {"w": torch.zeros(4)}).wait()
    monkeypatch.chdir(tmp_path)
    assert main(["restore", str(tmp_path / "store"), "--to", "s3:/bkt/x"]) == 2
    assert not os.path.lexists(tmp_path / "s3:")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["s3://"], "it names no bucket (s3://BUCKET[/PREFIX])"),
        (["s3://b/run", "-o", "bogus_option=1"], "unknown storage option(s) bogus_option"),
        (["s3://b//run"], "an empty path segment ('//') makes keys that no listing finds (did "),
        (["s3://b/run//7/"], "no listing finds (did you mean s3://b/run/7?)"),
        (["s3:///b/run"], "no listing finds (did you mean s3://b/run?)"),
        (
            ["s3://b/run", "-o", "client_kwargs=endpoint_url=http://h:1"],
            "storage option client_kwargs must be a JSON object",
        ),
        (["s3://b/run", "-o", "config_kwargs=5"], "config_kwargs must be a JSON object"),
    ],
    ids=[
        "no-bucket",
        "unknown-option",
        "empty-segment",
        "empty-segment-inside",
        "three-slashes",
        "client-kwargs-a-string",  # reviewer K: 'unexpected AttributeError'
        "config-kwargs-a-number",
    ],
)
def test_an_s3_uri_without_a_bucket_or_an_unknown_option_is_a_usage_error(argv, said, capsys):
    """Reviewer 1 of stop 57: ``ls s3://`` said "list s3:/commits: the bucket does not exist"
    or "no credentials"; ``-o bogus_option=1`` a ``TypeError`` of aiobotocore's session at the
    first request. Both are the command line's mistakes: exit 2, named, before any request.
    Reviewer of stop 60: ``s3://b//run`` saved under keys beginning ``/run`` that no listing
    found (a restart resumed from nothing, retention never ran); ``s3:///b/run`` listed keys
    with the bucket in front, so gc took every chunk for missing and ``--remove-corrupt``
    deleted every good step: both refused by name too."""
    assert main(["ls", *argv, "--timeout", "3"]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError, match="unknown storage option"):
        Checkpointer("s3://b/run", storage_options={"bogus_option": 1})
    with pytest.raises(ValueError, match="empty path segment"):
        Checkpointer("s3://b//run")


def test_a_local_store_keeps_no_empty_directories(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in range(30):
            ckpt.save(step, {"w": torch.randn(1000), "s": torch.full((8,), float(step))}).wait()
    assert ckpt.steps() == [28, 29]
    empty = [d for d, dirs, files in os.walk(tmp_path) if not dirs and not files]
    assert empty == []
    assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert [d for d, dirs, files in os.walk(tmp_path) if not dirs and not files] == []


def test_options_every_command_takes_may_come_before_it(store: Path, capsys) -> None:
    """``ckptstore --json ls URI`` as ``ckptstore ls URI --json`` (it used to be refused,
    naming --json as unknown)."""
    assert main(["--json", "--timeout", "5", "ls", str(store)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"][0]["step"] == 1
    assert main(["--jsn", "ls", str(store)]) == 2  # a typo is still a usage error
    assert "--jsn" in capsys.readouterr().err


def test_python_dash_m_ckptstore_is_the_command(tmp_path: Path) -> None:
    """Where the package is not pip-installed (no ``ckptstore`` script), ``python -m
    ckptstore`` runs the command, as ``python -m ckptstore.cli`` does."""
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore", "ls", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 1 and done.stderr.startswith("ckptstore ls: error: no ckptstore")


def test_ctrl_c_inside_a_dcp_write_is_an_interruption_not_a_refusal():
    """Reviewer of stop 60: Ctrl-C during ``restore --format dcp`` that DCP caught inside its
    write reached the CLI as a ``CheckpointException`` whose failures held the
    ``KeyboardInterrupt``: reported as "--format dcp cannot hold this state:
    KeyboardInterrupt" (exit 1). The interruption is found inside DCP's failures."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.cli.restore_file import _stopped

    stop = KeyboardInterrupt()
    wrapped = CheckpointException("write", {0: (stop, None)})
    assert _stopped(wrapped) is stop
    assert _stopped(RuntimeError("x")) is None
    assert _stopped(CheckpointException("write", {0: (ValueError("bad"), None)})) is None


@pytest.mark.parametrize(
    "argv, said",
    [
        (["gc", "S", "--verify", "--no-verify"], "--no-verify: not allowed with argument --verify"),
        (["inspect", "S", "--step", str(10**20)], "--step: step must be an int in [0, 1e20)"),
        (["restore", "S", "--to", ""], "--to: is empty"),
    ],
    ids=["verify-twice", "step-too-large", "empty-to"],
)
def test_arguments_that_contradict_or_overflow_are_usage_errors(tmp_path, argv, said, capsys):
    """A reviewer's: `gc --verify --no-verify` ran with --verify; a step past 1e20 was exit 1
    (not the usage error -1 is); `restore --to ''` wrote into the current directory."""
    store = tmp_path / "store"
    with Checkpointer(str(store)) as ckpt:
        ckpt.save(1, {"w": torch.zeros(4)}).wait()
    argv = [str(store) if a == "S" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
