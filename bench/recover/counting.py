"""The durable store as a restore reads it, its requests counted by ckptstore's own
``StoreCounters``: chunk objects apart from the rest.

Every ``Store`` counts its requests by operation and outcome, and the bytes they moved, in its
``counters``. A :class:`CountedStore` sends the requests for chunk objects (``chunks/...``)
through a second ``Store`` on the same backend and settings (its ``chunks``), so each of the two
counts its own: the durable store's reads of chunks and of everything else (listings,
manifests, indexes), each request once whatever its attempts.
"""

from __future__ import annotations

from typing import Any

from ckptstore.store import Store, open_store

CHUNKS = "chunks/"
"""Where chunk objects live in a store (``format.chunk_key``)."""


class CountedStore(Store):
    """A ``Store`` whose chunk reads (get, get_view, size, exists) go through ``self.chunks``:
    ``counters`` count the other requests, ``chunks.counters`` the chunks'."""

    chunks: Store

    def get(self, key: str, *args: Any, **kwargs: Any) -> bytes:
        if key.startswith(CHUNKS):
            return self.chunks.get(key, *args, **kwargs)
        return super().get(key, *args, **kwargs)

    def get_view(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if key.startswith(CHUNKS):
            return self.chunks.get_view(key, *args, **kwargs)
        return super().get_view(key, *args, **kwargs)

    def size(self, key: str) -> int:
        return self.chunks.size(key) if key.startswith(CHUNKS) else super().size(key)

    def exists(self, key: str) -> bool:
        return self.chunks.exists(key) if key.startswith(CHUNKS) else super().exists(key)


def open_counted(uri: str, *, timeout_s: float) -> CountedStore:
    """The store at ``uri`` as ``open_store`` opens it, chunk reads counted apart."""
    opened = open_store(uri, timeout_s=timeout_s)
    options = {"retry": opened.retry, "max_concurrency": opened.max_concurrency}
    store = CountedStore(uri, backend=opened.backend, hedge=opened.hedger.policy, **options)
    store.chunks = Store(uri, backend=opened.backend, hedge=opened.hedger.policy, **options)
    return store


def durable_reads(store: CountedStore) -> dict[str, Any]:
    """What ``store`` was asked, from its two ``StoreCounters``: requests by operation (every
    outcome) and bytes by operation, in all and for chunks and the rest apart."""
    chunks, other = store.chunks.counters.snapshot(), store.counters.snapshot()
    chunk_requests = _requests(chunks)
    other_requests = _requests(other)
    return {
        "requests": _sum(chunk_requests, other_requests),
        "bytes": _sum(chunks["bytes"], other["bytes"]),
        "chunk_requests": chunk_requests,
        "chunk_bytes": chunks["bytes"].get("get", 0),
        "other_requests": other_requests,
        "other_bytes": other["bytes"].get("get", 0),
    }


def _requests(snapshot: dict[str, Any]) -> dict[str, int]:
    return {op: sum(outcomes.values()) for op, outcomes in snapshot["requests"].items()}


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in sorted(a.keys() | b.keys())}
