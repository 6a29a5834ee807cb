"""ckptstore on SeaweedFS (`weed mini`), a production S3 server that enforces conditional writes.

Stores here get the server through ``storage_options`` (explicit endpoint and keys), except the
crash test, whose writer subprocesses find it through the environment (``seaweed_env``).
"""

from __future__ import annotations

import os

import pytest
import torch

from ckptstore import Checkpointer, StepExistsError, Store
from ckptstore.errors import ObjectExistsError

pytestmark = pytest.mark.seaweedfs


def test_storage_options_reach_seaweed_whatever_the_environment(
    seaweed_uri, seaweed_storage_options, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    store = Store(seaweed_uri, storage_options=seaweed_storage_options)
    store.put("a/b", b"payload")
    assert store.get("a/b", 1, 4) == b"ayl"
    assert store.list("") == ["a/b"]
    store.delete("a/b")
    assert not store.exists("a/b")


def test_seaweed_enforces_if_none_match_on_multipart_complete(seaweed_uri, seaweed_storage_options):
    """s3fs writes an object of 2 chunks or more as a multipart upload, whose completion
    carries the If-None-Match: refused too, the first object intact."""
    store = Store(seaweed_uri, storage_options=seaweed_storage_options)
    fs, path = store.backend.fs, store.path("big")
    first = os.urandom(11 * 2**20)
    fs.pipe_file(path, first, mode="create", chunksize=5 * 2**20)
    with pytest.raises(OSError):
        fs.pipe_file(path, os.urandom(11 * 2**20), mode="create", chunksize=5 * 2**20)
    assert store.get("big") == first


def test_put_of_an_existing_key_raises_object_exists(seaweed_uri, seaweed_storage_options):
    """SeaweedFS's 412 names no <Condition> (AWS and moto send If-None-Match), so s3fs raises
    OSError(EINVAL), not FileExistsError: the store must still know it as ObjectExistsError."""
    store = Store(seaweed_uri, storage_options=seaweed_storage_options)
    store.put("k", b"first")
    with pytest.raises(ObjectExistsError, match="already exists"):
        store.put("k", b"second")
    assert store.get("k") == b"first"  # the server refused it, not only the client


def test_second_writer_of_a_committed_step_fails(seaweed_uri, seaweed_storage_options):
    """The manifest's conditional put is refused; the commit reads the manifest back, finds
    another writer's, and says StepExistsError. The first writer's step stays."""
    a = Checkpointer(seaweed_uri, storage_options=seaweed_storage_options)
    b = Checkpointer(seaweed_uri, storage_options=seaweed_storage_options)
    a.save(5, {"w": torch.ones(10)}).wait()
    with pytest.raises(StepExistsError, match="step 5 is already committed"):
        b.save(5, {"w": torch.zeros(10)}).wait()
    a.close()
    b.close()  # its error was reported once, by wait()
    target = {"w": torch.zeros(10)}
    assert Checkpointer(seaweed_uri, storage_options=seaweed_storage_options).load(target) == 5
    assert torch.equal(target["w"], torch.ones(10))


def test_listing_an_emptied_prefix_finds_nothing(seaweed_uri, seaweed_storage_options):
    """SeaweedFS keeps a prefix as a directory after its last object is deleted, and s3fs's
    find() of an emptied prefix returns that directory despite withdirs=False."""
    store = Store(seaweed_uri, storage_options=seaweed_storage_options)
    store.put("d/x", b"1")
    store.put("e", b"2")
    store.delete("d/x")
    assert store.list("d") == []
    store.delete("e")
    assert store.list("") == []


# test_crash's writer, with a lease ttl of its own: a writer killed during retention leaves a
# live gc lease, which holds the next writer's saves until it lapses (120 s by default).
