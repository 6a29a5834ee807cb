"""Which instance of a durable store local and peer copies belong to (docs/FORMAT.md, "Store
identity").

A path names a store, not an instance of it: a store deleted and made again at the same path is
another store, and the copies a node kept of the first must never load into the second. So a
durable store records ``identity.json`` once, as an exclusive create, when a tiered front-end
first opens it for writing; every local and peer copy records its id. A store that already held
steps when its identity was made (written before identities existed) is *adopted*: copies that
record no id still belong to it. A store made fresh has no such past: an unmarked copy is of
another instance. A store whose ``identity.json`` was removed while it held steps takes back the
id its copies record, where copies of its own steps (the same saves) vouch for exactly one.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.catalog import list_steps, load_manifest
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
from ckptstore.tiers.policy import TIER_KEY

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


# (step, attempt, store id) of one rank's copy: what it says of the store it belongs to
Claim = tuple[int, str, str]
_CLAIMS_PER_RANK = 64  # a rank's newest copies: local_keep_last is a few


def copy_claims(own_dir: Path | None) -> list[Claim]:
    """What the newest copies in a rank's own tier directory (``own_dir``, not created here)
    record of their durable store; unreadable ones left out."""
    if own_dir is None or not own_dir.is_dir():
        return []
    claims: list[Claim] = []
    try:
        store = Store(str(own_dir))
        steps = list_steps(store)
    except (CheckpointError, OSError):
        return []
    for step in reversed(steps):  # the newest readable ones: junk pushes none out
        if len(claims) >= _CLAIMS_PER_RANK:
            break
        try:
            manifest = load_manifest(store, step)
        except (CheckpointError, OSError):
            continue
        info = manifest.user.get(TIER_KEY)
        ident = info.get("store_id") if isinstance(info, dict) else None
        if isinstance(ident, str):
            claims.append((step, manifest.attempt, ident))
    return claims


def _vouched_id(
    store: Store, steps: list[int], claims: list[Claim]
) -> tuple[str, list[int]] | None:
    """The one id that copies of the store's own saves record (a copy's step and attempt are
    those of a committed step there), with those steps; None if none or several do."""
    held, attempts = set(steps), {}
    vouched: dict[str, set[int]] = {}
    for step, attempt, ident in claims:
        if step not in held:
            continue
        if step not in attempts:
            try:
                attempts[step] = load_manifest(store, step).attempt
            except CheckpointError:
                attempts[step] = None
        if attempts[step] == attempt:
            vouched.setdefault(ident, set()).add(step)
    if len(vouched) != 1:
        return None
    ((ident, by),) = vouched.items()
    return ident, sorted(by)


def ensure_identity(store: Store, claims: list[Claim] | None = None) -> StoreIdentity:
    """The store's identity, made now (write-once) if it has none; of two writers racing to
    make it, the one whose exclusive create lost reads the winner's. A store that holds steps
    takes the id that the ``claims`` of the job's copies vouch for (``_vouched_id``): its
    ``identity.json`` was removed (or lost), and its copies are still its own."""
    found = read_identity(store)
    if found is not None:
        return found
    steps = list_steps(store)
    vouched = _vouched_id(store, steps, claims) if steps and claims else None
    # A vouched id was the store's: copies that record none are no more its own than they
    # were (an older instance's would otherwise start to load).
    made = (
        StoreIdentity(vouched[0], adopted=False, created_at=time.time())
        if vouched
        else StoreIdentity(uuid.uuid4().hex, adopted=bool(steps), created_at=time.time())
    )
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
    if vouched:
        shown = ", ".join(map(str, vouched[1][-4:]))
        logger.warning(
            "store %s had no identity.json: its id %s is recorded again, as the local copies of "
            "its steps %s record it (the same saves): those copies load as before",
            store.uri,
            made.id,
            shown,
        )
    else:
        logger.info(
            "store %s: identity %s recorded (adopted: %s)", store.uri, made.id, made.adopted
        )
    return made


def agree_identity(
    store: Store, group: RankGroup, *, create: bool, own_dir: Path | None = None
) -> StoreIdentity | None:
    """The durable store's identity on every rank of ``group`` (collective): rank 0 reads it
    (``create``: makes it if missing, from what every rank's copies in ``own_dir`` record, see
    ``ensure_identity``) and tells the others; a failure there fails every rank, except a
    storage error while making it (a durable store that takes no puts now): then the run goes
    on without one (None, one warning) and its copies record none. A store that cannot be
    read is never taken for one without an identity: every copy of its own would look like
    another instance's, and the job would go back to an older durable step."""
    result: tuple[StoreIdentity | None, str | None] = (None, None)
    missing = False
    if group.rank == 0:
        try:
            result = (read_identity(store), None)
            missing = result[0] is None
        except StorageError as exc:
            result = (
                None,
                f"{one_line(exc)} (the tiers cannot tell its copies from another "
                "store's until it answers)",
            )
        except Exception as exc:  # noqa: BLE001 - every rank waits for this broadcast
            result = (None, _unreadable(exc))
    result, missing = group.broadcast((result, missing))
    if not missing:
        return _told(store, result)
    claims = group.gather(copy_claims(own_dir))
    if group.rank == 0:
        every = [c for mine in claims for c in mine]
        try:
            result = (ensure_identity(store, every) if create else _vouched(store, every), None)
        except StorageError as exc:
            result = (None, None if create and _cannot_record(store, exc) else one_line(exc))
        except Exception as exc:  # noqa: BLE001 - every rank waits for this broadcast
            result = (None, _unreadable(exc))
    return _told(store, group.broadcast(result))


def _vouched(store: Store, claims: list[Claim]) -> StoreIdentity | None:
    """For a reader, which records nothing: the identity the ``claims`` vouch for in a store
    that has none, as ``ensure_identity`` would record it (None: they vouch for none; no copy
    claims one, or the store cannot be listed: as before a reader looked)."""
    if not claims:
        return None
    try:
        steps = list_steps(store)
    except StorageError:  # a bucket not made yet, say: no step to vouch with
        return None
    vouched = _vouched_id(store, steps, claims) if steps and claims else None
    if vouched is None:
        return None
    logger.warning(
        "store %s has no identity.json: the local copies of its steps %s record id %s (the "
        "same saves), and load as its own (the next tiered writer records it)",
        store.uri,
        ", ".join(map(str, vouched[1][-4:])),
        vouched[0],
    )
    return StoreIdentity(vouched[0], adopted=False, created_at=time.time())


def _cannot_record(store: Store, exc: StorageError) -> bool:
    """A durable store that takes no request now: saves still go to the local tier, and a
    later open records the identity."""
    logger.warning(
        "cannot record the identity of %s (%s): this run's copies record none",
        store.uri,
        one_line(exc),
    )
    return True


def _unreadable(exc: BaseException) -> str:
    if not isinstance(exc, CheckpointCorruptError):
        return one_line(exc)
    return (
        f"{one_line(exc)} (move it aside: the next tiered writer records the id again from "
        "the local copies of the store's steps, docs/FORMAT.md, Store identity)"
    )


def _told(store: Store, result: tuple[StoreIdentity | None, str | None]) -> StoreIdentity | None:
    identity, error = result
    if error is not None:
        raise CheckpointError(f"cannot read the identity of {store.uri}: {error}")
    return identity
