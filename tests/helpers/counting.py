"""Requests counted where they leave the process: at a store's backend (``CountingBackend``)
or as the S3 API calls its client sends (``counted_s3``), by kind into a ``Tally``."""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from typing import Any

from ckptstore import Checkpointer, EncodingOptions, StorageOptions
from ckptstore.store import Store

CHUNK_BYTES = 64 * 1024


# S3 API calls by the kind of request they are.
_S3_KINDS = {
    "PutObject": "put",
    "GetObject": "get",
    "HeadObject": "head",
    "ListObjectsV2": "list",
    "DeleteObject": "delete",
}


# Backend calls by the kind of request they are.
_BACKEND_KINDS = {
    "put_once": "put",
    "get": "get",
    "get_view": "get",
    "size": "head",
    "exists": "head",
    "modified": "head",
    "list": "list",
    "list_times": "list",
    "delete": "delete",
}


class Tally:
    """Requests by kind (put, get, head, list, delete), apart for chunks and for the rest."""

    def __init__(self) -> None:
        self.chunks: Counter[str] = Counter()
        self.others: Counter[str] = Counter()

    def add(self, kind: str, path: str) -> None:
        (self.chunks if "/chunks/" in path else self.others)[kind] += 1

    @property
    def total(self) -> int:
        return self.chunks.total() + self.others.total()

    def clear(self) -> None:
        self.chunks.clear()
        self.others.clear()


class CountingBackend:
    """A store's backend, forwarded call for call, each request added to a ``Tally``."""

    def __init__(self, inner: Any, tally: Tally, **overrides: Any) -> None:
        self._inner = inner
        self._tally = tally
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        kind = _BACKEND_KINDS.get(name)
        if kind is None:
            return value

        def counted(path: str, *args: Any, **kwargs: Any) -> Any:
            self._tally.add(kind, path)
            return value(path, *args, **kwargs)

        return counted


@contextmanager
def counted_s3(store: Store, tally: Tally):
    """Every S3 API call ``store``'s client sends, added to ``tally`` while this is open."""
    fs = store.backend.fs
    fs.connect()
    events = fs.s3.meta.events

    def count(model, params, **_: Any) -> None:
        tally.add(_S3_KINDS.get(model.name, model.name), params.get("url_path", ""))

    events.register("before-call.s3", count)
    try:
        yield
    finally:
        events.unregister("before-call.s3", count)


@contextmanager
def counted_checkpointer(uri: str, tally: Tally, recheck_every: int = 16, **kwargs: Any):
    """A Checkpointer of ``uri`` whose requests are counted into ``tally``."""
    encoding = EncodingOptions(
        chunk_bytes=CHUNK_BYTES,
        compression="none",
        hedge_uploads=False,
        recheck_every=recheck_every,
    )
    if uri.startswith("s3://"):
        with Checkpointer(uri, encoding=encoding, **kwargs) as ckpt, counted_s3(ckpt.store, tally):
            yield ckpt
        return
    store = Store(uri)
    store.backend = CountingBackend(store.backend, tally)
    with Checkpointer(
        uri, storage=StorageOptions(store=store), encoding=encoding, **kwargs
    ) as ckpt:
        yield ckpt


@contextmanager
def moto_server():
    """Outside pytest: a moto server that this process's environment names (child processes
    inherit it); yields a function that creates a new bucket and returns its name."""
    import logging
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )

    def new_bucket() -> str:
        bucket = f"figures-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        return bucket

    try:
        yield new_bucket
    finally:
        server.stop()


class PathTally(Tally):
    """A ``Tally`` that also keeps the path of each chunk GET."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def add(self, kind: str, path: str) -> None:
        super().add(kind, path)
        if kind == "get" and "/chunks/" in path:
            self.paths.append(path)


def counting_store(root: str, tally: Tally) -> Store:
    """A store of ``root`` whose backend calls are counted into ``tally``."""
    store = Store(root)
    store.backend = CountingBackend(store.backend, tally)
    return store
