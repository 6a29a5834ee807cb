"""Crafted stores for the trust tests: real saves whose objects are then rewritten the way an
attacker or a broken disk would, with every checksum and manifest reference recomputed so that
only the checks under test can catch them (xxh3 is no MAC).

Objects are write-once, so a rewrite deletes the object and puts it again; that works on every
backend the tests use (local paths, ``memory://``, moto)."""

from __future__ import annotations

import json
from typing import Any

import xxhash

from ckptstore.catalog import load_manifest
from ckptstore.format import commit_key
from ckptstore.store import Store


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def canonical(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def sealed(doc: dict) -> bytes:
    """``doc`` as stored: its ``checksum`` (last) recomputed over everything else."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    body["checksum"] = xxh3(canonical(body))
    return canonical(body)


def rewrite(store: Store, key: str, data: bytes) -> None:
    """Replace the object at ``key`` (write-once stores: delete, then put)."""
    if store.exists(key):
        store.delete(key)
    store.put(key, data)


def manifest_doc(store: Store, step: int) -> dict[str, Any]:
    return json.loads(store.get(commit_key(step)))


def put_manifest(store: Store, step: int, doc: dict[str, Any]) -> None:
    """Store ``doc`` as the manifest of ``step``, checksum recomputed."""
    rewrite(store, commit_key(step), sealed(doc))


def rank_index_doc(store: Store, step: int, rank: int = 0) -> dict[str, Any]:
    return json.loads(store.get(_rank_ref(store, step, rank)["key"]))


def put_rank_index(store: Store, step: int, rank: int, doc: dict[str, Any]) -> None:
    """Store ``doc`` as rank ``rank``'s index of ``step``; the index's checksum and the
    manifest's size and xxh3 of it are recomputed."""
    key = _rank_ref(store, step, rank)["key"]
    replace_referenced(store, step, key, sealed(doc))


def replace_referenced(store: Store, step: int, key: str, data: bytes) -> None:
    """Replace an object the manifest of ``step`` references by key (a rank index, the DCP
    metadata) and fix the manifest's size and xxh3 of it, so that it passes every hash."""
    rewrite(store, key, data)
    doc = manifest_doc(store, step)
    refs = list(doc["ranks"]) + ([doc["dcp_metadata"]] if doc.get("dcp_metadata") else [])
    found = [ref for ref in refs if ref["key"] == key]
    assert found, f"the manifest of step {step} does not reference {key}"
    for ref in found:
        ref["nbytes"] = len(data)
        ref["xxh3"] = xxh3(data)
    put_manifest(store, step, doc)


def _rank_ref(store: Store, step: int, rank: int) -> dict[str, Any]:
    manifest = load_manifest(store, step)
    suffix = f"/rank-{rank:05d}.json"
    for ref in manifest.ranks:
        if ref.key.endswith(suffix):
            return {"key": ref.key, "nbytes": ref.nbytes, "xxh3": ref.xxh3}
    raise AssertionError(f"step {step} has no index for rank {rank}")


def failing_for(monkeypatch, method: str, prefix: str, error) -> None:
    """``Store.<method>`` raises ``error(store, key)`` for the keys under ``prefix``; the others
    go through."""
    original = getattr(Store, method)

    def failing(self, key, *args, **kwargs):
        if key.startswith(prefix):
            raise error(self, key)
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(Store, method, failing)
