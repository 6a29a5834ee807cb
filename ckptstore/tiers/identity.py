"""Which instance of a durable store local and peer copies belong to (docs/FORMAT.md, "Store
identity").

A path names a store, not an instance of it: a store deleted and made again at the same path is
another store, and the copies a node kept of the first must never load into the second. So a
durable store records ``identity.json`` once, as an exclusive create, when a tiered front-end
first opens it for writing; every local and peer copy records its id. A store that already held
steps when its identity was made (written before identities existed) is *adopted*: copies that
record no id still belong to it. A store made fresh has no such past: an unmarked copy is of
another instance.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptstore.catalog import list_steps
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    UnsafeObjectError,
    one_line,
)
from ckptstore.format import MAX_TIMESTAMP, _dump, _load
from ckptstore.store import Store

if TYPE_CHECKING:
    from ckptstore.tiers.group import RankGroup

logger = logging.getLogger(__name__)

IDENTITY_KEY = "identity.json"
_KIND = "store-identity"


@dataclass(frozen=True)
class StoreIdentity:
    """A durable store instance: ``id`` (32 hex digits, random); ``adopted``: the store held
    steps written before identities when it was given one (unmarked copies belong to it)."""

    id: str
    adopted: bool
    created_at: float


def store_identity(store: Any) -> str:
    """The durable store a copy belongs to by its path, the same however its URI was spelled (a
    relative path, ``file://``, a trailing slash); ``StoreIdentity`` tells its instances apart."""
    if store.is_local:
        return os.path.realpath(store.root)
    return store.uri.rstrip("/")


_MAX_BYTES = 4096  # an identity is a few hundred bytes


def read_identity(store: Store) -> StoreIdentity | None:
    """The store's identity, or None when it records none (a store of an older version, or
    a new one no tiered writer has opened yet)."""
    name = store.url(IDENTITY_KEY)
    try:
        data = store.get(IDENTITY_KEY, 0, _MAX_BYTES + 1)
    except ObjectNotFoundError:
        return None
    except UnsafeObjectError as exc:  # a FIFO or a link out of the store: damage, as bad JSON
        raise CheckpointCorruptError(f"{name}: {exc}") from exc
    if len(data) > _MAX_BYTES:
        raise CheckpointCorruptError(f"{name}: over {_MAX_BYTES} bytes, not a store identity")
    doc = _load(data, _KIND, name)
    ident, adopted, created = doc.get("id"), doc.get("adopted"), doc.get("created_at")
    if not (
        isinstance(ident, str)
        and len(ident) == 32
        and all(c in "0123456789abcdef" for c in ident)
        and isinstance(adopted, bool)
        and isinstance(created, (int, float))
        and not isinstance(created, bool)
        and 0 <= created <= MAX_TIMESTAMP
    ):
        raise CheckpointCorruptError(f"{name}: not a valid store identity")
    return StoreIdentity(ident, adopted, float(created))


def ensure_identity(store: Store) -> StoreIdentity:
    """The store's identity, made now (write-once) if it has none; of two writers racing to
    make it, the one whose exclusive create lost reads the winner's."""
    found = read_identity(store)
    if found is not None:
        return found
    made = StoreIdentity(uuid.uuid4().hex, adopted=bool(list_steps(store)), created_at=time.time())
    body = {"id": made.id, "adopted": made.adopted, "created_at": made.created_at}
    try:
        store.put(IDENTITY_KEY, _dump(_KIND, body), verify_readback=True)
    except ObjectExistsError:
        found = read_identity(store)
        if found is None:
            raise CheckpointError(
                f"{store.url(IDENTITY_KEY)}: lost a race to make it, then vanished"
            ) from None
        return found
    logger.info("store %s: identity %s recorded (adopted: %s)", store.uri, made.id, made.adopted)
    return made


def agree_identity(store: Store, group: RankGroup, *, create: bool) -> StoreIdentity | None:
    """The durable store's identity on every rank of ``group`` (collective): rank 0 reads it
    (``create``: makes it if missing) and tells the others; a failure there fails every rank,
    except a storage error while making it (a durable store that takes no puts now): then the
    run goes on without one (None, one warning) and its copies record none."""
    result: tuple[StoreIdentity | None, str | None] = (None, None)
    if group.rank == 0:
        try:
            result = (ensure_identity(store) if create else read_identity(store), None)
        except StorageError as exc:
            if not create:
                result = (None, one_line(exc))
            else:  # saves still go to the local tier; a later open records the identity
                logger.warning(
                    "cannot record the identity of %s (%s): this run's copies record none",
                    store.uri,
                    one_line(exc),
                )
        except Exception as exc:  # noqa: BLE001 - every rank waits for this broadcast
            result = (None, one_line(exc))
    identity, error = group.broadcast(result)
    if error is not None:
        raise CheckpointError(f"cannot read the identity of {store.uri}: {error}")
    return identity
