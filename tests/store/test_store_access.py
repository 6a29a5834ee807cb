"""A store this process may not read is an error naming the path, never an empty store.

The store directory belongs to another user (``nobody``) and has mode 700. As root the kernel
would let this process read it anyway, so the checks run in a child process that has given up
the capabilities which bypass file permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); as any
other user the directory is simply made unreadable. Either way the kernel refuses for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, TierOptions
from tests.helpers import ROOT

NOBODY = 65534

# Runs its arguments as a Python command line, without the capabilities that let root read
# any file (dropped from the bounding set, so the exec below does not get them back).
_LAUNCHER = textwrap.dedent(
    """
    import ctypes, os, sys
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                sys.exit(77)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    """
)
_CANNOT_DROP = 77


@pytest.fixture
def locked_store(tmp_path: Path):
    """A store with one committed step, in a directory this test's children may not read."""
    parent = tmp_path / "shared"
    parent.mkdir()
    store = parent / "store"
    with Checkpointer(store) as ckpt:
        ckpt.save(5, {"w": torch.arange(4.0)}).wait()
    # The children must reach the parent; only the store itself is locked.
    for path in (tmp_path, parent):
        path.chmod(0o755)
    if os.geteuid() == 0:
        for dirpath, dirnames, filenames in os.walk(store):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, NOBODY, NOBODY)
        store.chmod(0o700)
    else:
        store.chmod(0o000)
    probe = _run_locked_out("-c", f"import os; os.listdir({str(store)!r})")
    if probe.returncode == _CANNOT_DROP or probe.returncode == 0:
        store.chmod(0o755)
        pytest.skip("no way to make a directory unreadable to a child process here")
    assert "PermissionError" in probe.stderr, probe.stderr
    try:
        yield store
    finally:
        store.chmod(0o755)
        shutil.rmtree(store, ignore_errors=True)


def _run_locked_out(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_an_unreadable_store_is_an_access_error_not_an_empty_store(locked_store: Path):
    code = textwrap.dedent(
        f"""
        import json
        from ckptstore import Checkpointer
        from ckptstore.errors import StorageAccessError
        from ckptstore.store import Store

        out = {{}}
        store = Store({str(locked_store)!r})
        for name, call in [
            ("list", lambda: store.list("commits")),
            ("exists", lambda: store.exists("commits")),
            ("latest", lambda: Checkpointer({str(locked_store)!r}).latest()),
            ("steps", lambda: Checkpointer({str(locked_store)!r}).steps()),
        ]:
            try:
                out[name] = ["returned", repr(call())]
            except StorageAccessError as exc:
                out[name] = ["StorageAccessError", str(exc)]
            except Exception as exc:
                out[name] = [type(exc).__name__, str(exc)]
        print(json.dumps(out))
        """
    )
    done = _run_locked_out("-c", code)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (kind, message) in results.items():
        assert kind == "StorageAccessError", (name, kind, message)
        assert str(locked_store) in message and "permission denied" in message, (name, message)


def test_ckptstore_ls_of_an_unreadable_store_exits_1_with_one_line(locked_store: Path):
    for command in (["ls"], ["gc", "--keep-last", "1"], ["verify"]):
        done = _run_locked_out("-m", "ckptstore.cli", command[0], str(locked_store), *command[1:])
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert done.stdout == ""
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"ckptstore {command[0]}: error: "), line
        assert str(locked_store) in line and "permission denied" in line, line


def test_ckptstore_ls_below_an_unreadable_directory_is_not_no_such_path(locked_store: Path):
    inner = locked_store / "commits"  # exists, but this process may not look inside the store
    done = _run_locked_out("-m", "ckptstore.cli", "ls", str(inner))
    assert done.returncode == 1, (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert "permission denied" in line and "no such path" not in line, line


@pytest.fixture
def web_server():
    """A plain HTTP server on loopback: it answers every S3 request 404 with an HTML page."""
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def test_an_endpoint_that_is_not_s3_is_an_error_not_an_empty_store(web_server, monkeypatch, capsys):
    """Reviewer K: a web server (or another service's port) at the endpoint answered every
    listing 404, read as an empty store: latest() was None, so a job started afresh beside
    its checkpoints, and `ls` blamed a mistyped prefix. S3 lists an empty prefix as empty."""
    from ckptstore.cli import main
    from ckptstore.errors import StorageError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    options = {"client_kwargs": {"endpoint_url": web_server}}
    with pytest.raises(StorageError, match="is it an S3 endpoint") as caught:
        Checkpointer("s3://bucket/run", storage_options=options).latest()
    assert web_server in str(caught.value)
    assert main(["ls", "s3://bucket/run", "-o", f"endpoint_url={web_server}"]) == 1
    err = capsys.readouterr().err
    assert "is it an S3 endpoint" in err and err.count("\n") == 1, err


def test_an_endpoint_fixed_in_the_environment_is_used_by_the_next_store(
    s3_uri, s3_endpoint, web_server, monkeypatch
):
    """Reviewer O: fsspec hands back the filesystem made earlier with the same arguments, so
    an AWS_ENDPOINT_URL (or credentials) fixed in the process went unused by every later store,
    and its error named the new endpoint while the requests went to the old one."""
    from ckptstore.errors import StorageError

    monkeypatch.setenv("AWS_ENDPOINT_URL", web_server)
    with pytest.raises(StorageError, match="is it an S3 endpoint") as caught:
        Checkpointer(s3_uri).latest()
    assert web_server in str(caught.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # fixed
    with Checkpointer(s3_uri) as ckpt:
        assert ckpt.latest() is None
        ckpt.save(1, {"w": torch.arange(4.0)}).wait()
        assert ckpt.latest() == 1


def test_credentials_fixed_in_the_credentials_file_are_used_by_the_next_store(
    s3_uri, s3_endpoint, tmp_path, monkeypatch
):
    """Reviewer P: the same with the AWS credentials file rewritten (AWS_* unchanged)."""
    from ckptstore import Store
    from tests.helpers.s3proxy import s3_relay

    credentials = tmp_path / "credentials"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    with s3_relay(s3_endpoint) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
        for key in ("OLDKEY", "NEWKEY"):
            credentials.write_text(
                f"[default]\naws_access_key_id = {key}\naws_secret_access_key = s\n"
            )
            Store(s3_uri).list("commits")
            assert relay.access_keys[-1] == key


def test_a_job_on_a_bucket_not_made_yet_has_nothing_to_resume(s3_endpoint, caplog, tmp_path):
    """Two reviewers: the README's resume (``if ckpt.latest() is not None``) raised on a bucket
    that did not exist yet ("the bucket does not exist"), where the store makes it at the first
    save (SeaweedFS); a missing local directory was already "nothing to resume". Every front-end
    says None, with one WARNING naming the bucket; ``ls`` of it stays an error."""
    import logging
    import uuid

    import torch.distributed.checkpoint as dcp  # noqa: F401 - StoreReader's DCP

    from ckptstore.catalog import list_steps
    from ckptstore.dcp import StoreReader, resume
    from ckptstore.errors import BucketNotFoundError, CheckpointNotFoundError
    from ckptstore.store import Store

    uri = f"s3://not-made-{uuid.uuid4().hex[:8]}/run42"
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert Checkpointer(uri).latest() is None
        assert StoreReader(uri).latest() is None
        assert resume({"w": torch.zeros(2)}, StoreReader(uri), no_dist=True) is None
    said = [r.getMessage() for r in caplog.records if "nothing to resume" in r.getMessage()]
    assert len(said) == 1 and uri.split("/")[2] in said[0], said
    with pytest.raises(BucketNotFoundError, match="the bucket does not exist at http://"):
        list_steps(Store(uri))  # and where it looked (a reviewer: the endpoint was not named)
    # load() there is no checkpoint, as in an empty store (reviewer: a StorageError, which a
    # first run's `except CheckpointNotFoundError` missed), naming the bucket
    for fallback in (False, True):
        with Checkpointer(uri) as ckpt, pytest.raises(CheckpointNotFoundError) as caught:
            ckpt.load({"w": torch.zeros(2)}, fallback=fallback)
        assert "no committed checkpoint" in str(caught.value)
        assert "the bucket does not exist" in str(caught.value)
    # With tiers too (an adversary: BucketNotFoundError there), nothing to resume either
    tiers = TierOptions(local_dir=str(tmp_path / "local"))
    with Checkpointer(uri, tiers=tiers) as ckpt:
        assert ckpt.latest() is None
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load({"w": torch.zeros(2)}, fallback=True)
    assert resume({"w": torch.zeros(2)}, StoreReader(uri, tiers=tiers), no_dist=True) is None
