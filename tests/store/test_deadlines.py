"""An S3 endpoint that accepts connections and never answers fails each request within its
deadline, with an error that names the endpoint; ``ckptstore --timeout`` sets that deadline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.faults import Faults, with_faults
from ckptstore.cli import build_parser, main
from ckptstore.errors import StorageError, StorageTimeoutError
from ckptstore.store import RetryPolicy, Store, describe_endpoint
from ckptstore.store.backends import bounded_s3_options
from tests.helpers import ROOT


class HungServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hung-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._listener.close()
        for conn in self._held:  # requests still waiting on us end now
            conn.close()


def _clear_s3fs_instances() -> None:
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()


@pytest.fixture
def hung_endpoint(monkeypatch):
    """The environment points S3 at a server that never answers (fake credentials)."""
    server = HungServer()
    for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    _clear_s3fs_instances()  # no S3FileSystem made for another endpoint may be reused
    try:
        yield server
    finally:
        server.stop()
        _clear_s3fs_instances()  # before monkeypatch restores the environment


def _bounded(fn, limit_s: float):
    """``fn()`` on another thread; the test fails (rather than hangs) past ``limit_s``."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=limit_s)
    finally:
        pool.shutdown(wait=False)  # not past limit_s, even if fn still runs


def _expect_timeout(store: Store, limit_s: float) -> StorageTimeoutError:
    def call() -> BaseException | None:
        try:
            store.list("commits")
        except StorageTimeoutError as exc:
            return exc
        return None

    error = _bounded(call, limit_s)
    assert error is not None, "listing a store whose endpoint never answers returned"
    return error


def test_hung_endpoint_fails_the_request_within_its_budget_naming_the_endpoint(hung_endpoint):
    store = Store("s3://b/x", retry=RetryPolicy(timeout_s=1, total_s=3))
    assert store.endpoint == hung_endpoint.endpoint
    error = _expect_timeout(store, limit_s=60)
    message = str(error)
    assert f"127.0.0.1:{hung_endpoint.port}" in message, message
    assert message.startswith("list s3://b/x/commits: no answer within"), message
    assert "attempts)" in message, message
    assert hung_endpoint.accepted >= 1  # it really reached the server


@pytest.mark.slow
def test_hung_endpoint_with_the_default_policy_fails_the_request(hung_endpoint):
    error = _expect_timeout(Store("s3://b/x"), limit_s=120)
    assert hung_endpoint.endpoint in str(error)


def _cli(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ),
    )


def test_ckptstore_ls_of_a_hung_endpoint_exits_1_with_one_line(hung_endpoint):
    done = _cli("ls", "s3://b/x", "--timeout", "3", timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()  # no traceback, no retry warnings
    assert line.startswith("ckptstore ls: error: list s3://b/x/commits: no answer within"), line
    assert hung_endpoint.endpoint in line, line


LATE_RETRY = """
import logging, sys, threading, time
from ckptstore.cli import main

def late():  # a request of the command still waiting when its error is printed
    time.sleep(1.0)
    logging.getLogger("ckptstore.store.core").warning(
        "size s3://b/x/chunks/ab/ab: attempt 1 timed out", extra={"ckptstore_retry": True}
    )

request = threading.Thread(target=late)
request.start()
sys.argv = ["ckptstore", "ls", sys.argv[1]]
status = main()
request.join(timeout=30)
sys.exit(status)
"""


def test_a_request_that_outlives_the_command_adds_no_line_after_its_error(tmp_path):
    """The command's handler (which keeps retry warnings off stderr) was gone once it printed
    its error; a request still in flight then logged through logging.lastResort, bare, one
    line per chunk after the one-line error."""
    done = subprocess.run(
        [sys.executable, "-c", LATE_RETRY, str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ckptstore ls: error: "), line


def test_retry_warnings_are_shown_with_verbose(hung_endpoint, capsys):
    code = main(["ls", "s3://b/x", "--timeout", "1", "-v"])
    err = capsys.readouterr().err
    assert code == 1
    assert "attempt 1 timed out" in err and hung_endpoint.endpoint in err
    assert err.strip().splitlines()[-1].startswith("ckptstore ls: error: ")


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "restore", "gc"])
def test_every_command_takes_timeout(command: str):
    extra = {"restore": ["--to", "x.pt"], "gc": ["--keep-last", "1"]}.get(command, [])
    args = build_parser().parse_args([command, "s3://b/x", *extra, "--timeout", "2.5"])
    assert args.timeout == 2.5
    assert build_parser().parse_args([command, "s3://b/x", *extra]).timeout is None


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf"])
def test_bad_timeout_is_a_usage_error(value: str, capsys):
    assert main(["ls", "s3://b/x", "--timeout", value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--timeout" in line


def test_timeout_reaches_the_store(tmp_path: Path, monkeypatch):
    from ckptstore.cli import common as cli

    seen = []
    real = cli.Store

    def spy(*args, **kwargs):
        seen.append(kwargs.get("retry"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "Store", spy)
    (tmp_path / "s" / "commits").mkdir(parents=True)
    (tmp_path / "s" / "commits" / f"{1:020d}.json").write_text("{}")
    args = build_parser().parse_args(["ls", str(tmp_path / "s"), "--timeout", "4"])
    cli.open_store(args)
    assert seen[-1] == RetryPolicy.within(4.0)
    assert seen[-1].total_s == 4.0 and seen[-1].timeout_s == 4.0


# -- the policy itself (no network) ---------------------------------------------------------------


def test_policy_defaults_bound_a_request():
    policy = RetryPolicy()
    assert policy.timeout_s <= policy.total_s <= 60
    assert policy.budget_s() == policy.total_s
    assert policy.budget_s(64 * 2**20) == policy.total_s + 32  # 64 MiB at 2 MiB/s
    assert RetryPolicy.within(60).timeout_s == RetryPolicy.timeout_s
    assert RetryPolicy.within(3).timeout_s == 3
    unbounded = RetryPolicy(total_s=None, attempts=2, timeout_s=1, max_delay_s=0.5)
    assert unbounded.budget_s() == 2.5
    with pytest.raises(ValueError, match="total_s"):
        RetryPolicy(total_s=0)


def test_a_hung_request_stops_retrying_at_its_budget():
    faults = Faults(hang_rate=1.0, ops=frozenset({"get"}))
    store = with_faults(
        Store(
            "memory://deadline-hang",
            retry=RetryPolicy(attempts=50, timeout_s=0.2, total_s=0.7, base_delay_s=0.001),
        ),
        faults,
    )
    store.put("k", b"v")
    try:
        with pytest.raises(StorageTimeoutError, match=r"no answer within 0\.\ds \([34] attempts\)"):
            _bounded(lambda: store.get("k"), 30)
    finally:
        faults.release()
    assert faults.counts["hangs"] <= 4  # not 50 attempts


def test_quick_transient_errors_still_use_every_attempt():
    store = with_faults(
        Store(
            "memory://deadline-errors",
            retry=RetryPolicy(attempts=4, base_delay_s=0.001, total_s=30),
        ),
        Faults(error_rate=1.0),
    )
    with pytest.raises(StorageError, match="failed after 4 attempts"):
        store.put("k", b"v")


class _FailingFirst:
    """A backend whose ``put_once`` and ``get`` raise ``make()`` the first ``times`` calls."""

    def __init__(self, inner, make, times: int) -> None:
        self._inner, self._make, self.left, self.calls = inner, make, times, 0

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if name not in ("put_once", "get"):
            return value

        def call(*args, **kwargs):
            self.calls += 1
            if self.left > 0:
                self.left -= 1
                raise self._make()
            return value(*args, **kwargs)

        return call


def test_a_store_busy_for_longer_than_the_attempts_is_retried_until_the_deadline():
    """Reviewer (a proxy answering 503 SlowDown for 2-4 s): 5 attempts with backoffs from
    50 ms spent ~0.75 s, and a save failed with timeout_s=30; a busy store is now retried for
    as long as the request's deadline allows, other quick errors `attempts` times."""
    store = Store("memory://busy", retry=RetryPolicy(attempts=3, base_delay_s=0.001, total_s=30))
    busy = _FailingFirst(store.backend, lambda: _ServerError(503, "SlowDown"), 8)
    store.backend = busy
    store.put("k", b"v")  # the 9th attempt
    assert busy.calls == 9 and store.get("k") == b"v"
    short = Store("memory://busy-short", retry=RetryPolicy(base_delay_s=0.001, total_s=0.5))
    short.backend = _FailingFirst(short.backend, lambda: _ServerError(503, "SlowDown"), 10**6)
    with pytest.raises(StorageError, match="SlowDown"):
        _bounded(lambda: short.put("k", b"v"), 30)  # still bounded by total_s
    # Not busy: 501 NotImplemented (a wrong endpoint), a local file system's EBUSY (an
    # adversary: both took 30 s, where they failed after `attempts`)
    for error in (lambda: _ServerError(501, "NotImplemented"), lambda: OSError(16, "busy")):
        other = Store("memory://other", retry=RetryPolicy(attempts=3, base_delay_s=0.001))
        other.backend = _FailingFirst(other.backend, error, 10**6)
        with pytest.raises(StorageError, match="after 3 attempts"):
            other.put("k", b"v")


class _ServerError(Exception):
    """botocore's ClientError as s3fs keeps it: the server's status and code."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def test_a_body_cut_off_mid_way_is_read_again():
    """Reviewer (a proxy resetting one chunk's GET mid-body): aiohttp's ClientPayloadError was
    not taken for transient, and one reset failed the load in one attempt."""

    class ClientPayloadError(Exception):  # aiohttp's name, as s3fs raises it
        pass

    store = Store("memory://cut", retry=RetryPolicy(base_delay_s=0.001))
    store.put("k", b"value")
    cut = _FailingFirst(
        store.backend, lambda: ClientPayloadError("Response payload is not completed"), 1
    )
    store.backend = cut
    assert store.get("k") == b"value" and cut.calls == 2


def test_s3_client_timeouts_follow_the_attempt_deadline(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    _clear_s3fs_instances()
    try:
        store = Store("s3://b/x", retry=RetryPolicy(timeout_s=4, total_s=12))
        config = store.backend.fs.config_kwargs
        assert config["read_timeout"] == 4 and config["connect_timeout"] == 4
        assert config["retries"] == {"total_max_attempts": 1}
    finally:
        _clear_s3fs_instances()
    mine = {"config_kwargs": {"read_timeout": 99, "retries": {"max_attempts": 3}}, "anon": True}
    merged = bounded_s3_options(mine, RetryPolicy())
    assert merged["config_kwargs"] == {
        "read_timeout": 99,
        "retries": {"max_attempts": 3},
        "connect_timeout": 5.0,
    }
    assert merged["anon"] is True and mine["config_kwargs"] == {
        "read_timeout": 99,
        "retries": {"max_attempts": 3},
    }


def test_endpoint_descriptions(monkeypatch, tmp_path: Path):
    import fsspec

    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)

    def s3(**options) -> str:
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        return describe_endpoint(fs, "b/x")

    assert s3() == "AWS S3"
    assert s3(endpoint_url="http://minio:9000") == "http://minio:9000"
    assert s3(client_kwargs={"endpoint_url": "http://ceph:7480"}) == "http://ceph:7480"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:1")
    assert s3() == "http://env:1"
    assert Store(tmp_path).endpoint == str(tmp_path)
    assert Store("memory://x").endpoint == "memory"


def test_the_bench_workspace_on_a_hung_endpoint_fails_within_its_deadline(hung_endpoint):
    """``ckptbench save`` sized its workspace through a bare s3fs call with no deadline: it
    hung for minutes, deaf to Ctrl-C. Its requests now go through a store with a deadline;
    since stop 83 the workspace lists its prefix once as it is made, and fails there, naming
    the endpoint, before the run writes anything."""
    from bench._ckpt_common import Workspace

    def made() -> BaseException | None:
        try:
            Workspace("s3://b/x", command="test", timeout_s=2)
        except StorageTimeoutError as exc:
            return exc
        return None

    error = _bounded(made, limit_s=60)
    assert error is not None and hung_endpoint.endpoint in str(error)
    assert "store 's3://b/x' is not usable" in str(error)
