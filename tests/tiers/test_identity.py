"""A durable store's identity is written once, whoever races to make it, on every backend."""

from __future__ import annotations

import concurrent.futures

import pytest

from ckptstore.errors import CheckpointCorruptError
from ckptstore.store import Store
from ckptstore.tiers.identity import IDENTITY_KEY, ensure_identity, read_identity

BOUND_S = 60.0


def test_identity_is_made_once_by_racing_writers(store_uri):
    assert read_identity(Store(store_uri)) is None
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        made = [
            f.result(BOUND_S)
            for f in [pool.submit(ensure_identity, Store(store_uri)) for _ in range(6)]
        ]
    assert len({m.id for m in made}) == 1 and not made[0].adopted
    assert read_identity(Store(store_uri)) == made[0]


def test_a_damaged_identity_is_refused_by_name(tmp_path):
    store = Store(str(tmp_path))
    ensure_identity(store)
    path = tmp_path / IDENTITY_KEY
    path.chmod(0o644)
    path.write_bytes(path.read_bytes().replace(b'"adopted":false', b'"adopted":true '))
    with pytest.raises(CheckpointCorruptError, match="identity.json"):
        read_identity(store)


def test_an_identity_file_too_large_to_be_one_is_refused_unread(tmp_path):
    """Adversary: a 700 MB identity.json was read whole (2.4 GB at peak) before being refused."""
    store = Store(str(tmp_path))
    path = tmp_path / IDENTITY_KEY
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b" " * (1 << 20) + b"{}")
    with pytest.raises(CheckpointCorruptError, match="over 4096 bytes, not a store identity"):
        read_identity(store)
