"""S3 faults seen through the HTTP stack, on the moto server: a relay on loopback answers chosen
requests with a SlowDown or loses their answer after they landed (``tests.helpers.s3proxy``)."""

from __future__ import annotations

import uuid

import boto3
import numpy as np
import pytest

from ckptstore import RetryPolicy, Store
from tests.helpers.s3proxy import Fault, s3_relay


def _bucket(endpoint: str) -> str:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket


def _through(relay, bucket: str) -> Store:
    """A store of ``bucket`` whose requests go through ``relay``, retried three times."""
    return Store(
        f"s3://{bucket}/run",
        storage_options={"endpoint_url": relay.endpoint},
        retry=RetryPolicy(attempts=3, timeout_s=20, base_delay_s=0.05),
    )


def test_a_key_written_after_its_prefix_was_listed_is_read(s3_endpoint):
    """s3fs answered a whole-object read of a key under a prefix it had listed "not found"
    without asking: a commit whose answer was lost read back as absent ("step 2 not
    committed" for a committed step), a lost write race as a StorageError."""
    bucket = _bucket(s3_endpoint)
    store = Store(f"s3://{bucket}/run")
    store.put("commits/1.json", b"one")
    assert store.list("commits") == ["commits/1.json"]
    boto3.client("s3").put_object(Bucket=bucket, Key="run/commits/2.json", Body=b"two")
    assert store.get("commits/2.json") == b"two"


def test_a_throttled_put_is_sent_again_whole(s3_endpoint):
    """s3fs retried a SlowDown itself with the body it had read to its end: Content-Length N,
    0 bytes sent, a wait for the read timeout per retry. The store's retry sends it whole."""
    bucket = _bucket(s3_endpoint)
    with s3_relay(s3_endpoint) as relay:
        relay.faults.append(Fault("PUT", "/blob", "slowdown"))
        store = _through(relay, bucket)
        body = np.random.default_rng(0).bytes(1 << 20)
        store.put("blob", body)
        puts = [(declared, got) for method, path, declared, got in relay.seen if method == "PUT"]
    assert Store(f"s3://{bucket}/run").get("blob") == body
    assert len(puts) == 2 and all(got == declared == len(body) for declared, got in puts), puts


@pytest.mark.parametrize("key", ["chunks/ab/cd", "commits/00000000000000000001.json"])
def test_a_create_only_put_answered_conflict_is_sent_again(s3_endpoint, key):
    """S3 answers 409 ConditionalRequestConflict to a create-only put while another to the same
    key is in flight (two ranks writing one chunk) and asks for a retry (storage adversary: one
    409 failed the whole save)."""
    bucket = _bucket(s3_endpoint)
    with s3_relay(s3_endpoint) as relay:
        relay.faults.append(Fault("PUT", key, "conflict"))
        store = _through(relay, bucket)
        store.put(key, b"body", shared=key.startswith("chunks"))
        assert [m for m, path, *_ in relay.seen if key in path] == ["PUT", "PUT"]
    assert Store(f"s3://{bucket}/run").get(key) == b"body"


@pytest.mark.parametrize("key", ["leases/save/a.json", "indexes/ab/rank-00000.json"])
def test_a_small_put_whose_answer_was_lost_after_it_landed_succeeds(s3_endpoint, key):
    """The HTTP client sends a put again below the store when the connection drops after the
    object landed: the store's first attempt hears "already exists" for its own object."""
    bucket = _bucket(s3_endpoint)
    with s3_relay(s3_endpoint) as relay:
        relay.faults.append(Fault("PUT", key, "drop_after"))
        store = _through(relay, bucket)
        store.put(key, b'{"mine": 1}')
    assert Store(f"s3://{bucket}/run").get(key) == b'{"mine": 1}'


def test_an_object_of_100_mib_or_more_goes_up_in_parts(s3_uri):
    """s3fs uploads a body of 100 MiB or more in parts, slicing it: a slice of the store's
    body was a memoryview, which botocore refuses ("Parameter validation failed")."""
    store = Store(s3_uri)
    body = np.random.default_rng(1).integers(0, 255, (100 << 20) + 4096, dtype=np.uint8)
    store.put("chunks/big", body, shared=True)
    assert store.get("chunks/big") == body.tobytes()
    with pytest.raises(Exception, match="already exists"):
        store.put("chunks/big", body, shared=True)  # the parts' completion is conditional too


def test_a_read_the_s3_client_dropped_unanswered_is_a_storage_error(s3_endpoint, monkeypatch):
    """fsspec answers None for a request whose coroutine was cancelled (its event loop
    stopping as the interpreter exits): a read took None for the object's bytes and failed
    later as "object of type 'NoneType' has no len()", benching a healthy replica."""
    import asyncio

    import fsspec.asyn

    from ckptstore.errors import StorageError

    bucket = _bucket(s3_endpoint)
    store = Store(f"s3://{bucket}/run", retry=RetryPolicy(attempts=2, timeout_s=5))
    store.put("blob", b"bytes")

    fs = store.backend.fs

    async def cancelled():
        raise asyncio.CancelledError

    monkeypatch.setattr(fs, "cat_file", lambda *a, **kw: fsspec.asyn.sync(fs.loop, cancelled))
    with pytest.raises(StorageError, match="get .*blob: the S3 client stopped before it answered"):
        store.get("blob")


@pytest.mark.parametrize("then", ["nothing", "busy"])
def test_a_commit_a_server_applies_after_the_client_gave_up_is_unknown_not_failed(
    s3_endpoint, then
):
    """A storage-fault adversary of stop 80: a manifest put held by the server past the
    request's deadline, then applied, was "step 9 not committed" (a loop retrying it met
    StepExistsError), and the save's lease was deleted at once, so a gc could sweep the chunks
    of a step that became committed a moment later. It is CommitUnknownError, and the lease is
    left in place to go stale (not renewed), keeping gc off those chunks for its ttl. The fix's
    adversary: the same when the put's later attempts were answered 503 (only the last
    attempt's error was looked at), and the lease was judged dead at once once its process was
    gone; it records that its commit's outcome is unknown, and goes stale by its age only."""
    import time

    import torch

    from ckptstore import Checkpointer, CommitUnknownError, RetentionOptions, StorageOptions
    from ckptstore.leases import SAVE, _lifetime, find_leases
    from tests.helpers.wait import wait_until

    bucket = _bucket(s3_endpoint)
    with s3_relay(s3_endpoint) as relay:
        relay.faults.append(Fault("PUT", "/commits/", "late", delay_s=4.0 + 4 * (then == "busy")))
        if then == "busy":
            relay.faults.append(Fault("PUT", "/commits/", "slowdown", times=1000))
        uri, options = f"s3://{bucket}/run", {"endpoint_url": relay.endpoint}
        storage = StorageOptions(timeout_s=2 + 4 * (then == "busy"))
        retention = RetentionOptions(lease_ttl_s=4)
        with Checkpointer(uri, storage_options=options, storage=storage, retention=retention) as c:
            with pytest.raises(CommitUnknownError, match="the server may still apply that put"):
                c.save(9, {"w": torch.arange(100.0)}).wait()
            leases = find_leases(c.store, SAVE)
            assert len(leases) == 1 and leases[0].live, leases  # not deleted
            assert leases[0].doc["outcome_unknown"] is True
            gone = {**leases[0].doc, "pid": 2**22 + 1}  # its process gone from this machine
            assert _lifetime(SAVE, gone, True) == 4
            assert _lifetime(SAVE, {**gone, "outcome_unknown": False}, True) == 0
            wait_until(lambda: c.steps() == [9], timeout_s=30)  # applied after all
            state = {"w": torch.zeros(100)}
            c.load(state)
            assert torch.equal(state["w"], torch.arange(100.0))
            renewed = leases[0].doc["renewed_at"]
            time.sleep(2.5)  # renewed every second while held
            assert [x.doc["renewed_at"] for x in find_leases(c.store, SAVE)] == [renewed]


def test_a_listing_page_cut_short_without_a_next_page_is_named(s3_uri, monkeypatch):
    """A listing adversary of stop 80 (LOW): a page that says it is cut short and names no
    next page came out of s3fs as "list ... failed: KeyError: 'NextContinuationToken'"."""
    from ckptstore import StorageError

    store = Store(s3_uri)

    def cut(path):
        raise KeyError("NextContinuationToken")

    monkeypatch.setattr(store.backend, "list", cut)
    with pytest.raises(StorageError, match="answered a listing page s3fs cannot follow"):
        store.list("commits")


def _raised(error: BaseException, during: BaseException | None = None) -> BaseException:
    """``error`` as raised, with ``during`` as the error it was raised while handling."""
    try:
        try:
            if during is not None:
                raise during
        finally:
            raise error
    except BaseException as caught:  # noqa: BLE001 - the error built, with its context
        return caught


def test_only_a_request_that_was_sent_and_got_no_answer_is_unanswered():
    """The fix's adversary (MED): a connection that never opened (aiobotocore's
    ConnectTimeoutError, raised while handling aiohttp's ConnectionTimeoutError, a
    TimeoutError) counted as unanswered, so a commit put never sent was CommitUnknownError."""
    import aiohttp
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    from ckptstore.store.retry import is_unanswered

    never_sent = _raised(
        ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), aiohttp.ConnectionTimeoutError()
    )
    assert not is_unanswered(never_sent)
    assert not is_unanswered(_raised(ConnectionRefusedError(111, "refused")))
    assert is_unanswered(_raised(ReadTimeoutError(endpoint_url="http://127.0.0.1:1")))
    assert is_unanswered(_raised(TimeoutError("no answer")))
