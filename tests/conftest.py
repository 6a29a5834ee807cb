"""Shared fixtures: a moto S3 server on 127.0.0.1 and one store URI per backend."""

from __future__ import annotations

import os
import uuid

import pytest


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


@pytest.fixture(params=["memory", "local", "s3"])
def store_uri(request, tmp_path):
    """The same test against memory://, a local directory and S3 on moto."""
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex[:12]}"
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_uri")
