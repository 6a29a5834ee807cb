"""Quarantine: a committed step found damaged is taken out of the way, kept for forensics
(docs/FORMAT.md, "Quarantine").

``Checkpointer.load(fallback=True)`` that skipped a step as corrupt and loaded an older one
quarantines the skipped step: its chunks are re-checked (a step whose every object checks out
is never quarantined: the failure was elsewhere), a marker ``quarantine/<step>-<attempt>.json``
is written once with the step's manifest bytes and why, each damaged chunk's object is copied
(by the store itself where it can: S3's CopyObject) to ``quarantine/chunks/<digest>`` and its
``chunks/`` object deleted (so a new save of the same bytes writes a good one), and last the step's manifest ``commits/<step>.json`` is deleted. The
step is then gone from ``steps()``, ``latest()``, retention and restore, and a new save of that
step number commits as any save. The objects move under a gc lease while no save is in flight,
after reading the manifest and the damaged chunks again (a save may have written them since). The quarantined objects stay until ``ckptstore gc
--remove-corrupt``.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import Callable

from ckptstore.catalog import (
    QUARANTINE_KIND,
    QUARANTINE_PREFIX,
    legacy_markers,
    list_steps,
    load_manifest_bytes,
    marker_key,
    quarantined,
    read_marker,
    read_rank_index,
)
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    UnsafeObjectError,
    one_line,
)
from ckptstore.format import (
    MAX_MANIFEST_BYTES,
    ChunkInfo,
    _dump,
    chunk_key,
    commit_key,
    decode_manifest,
    is_attempt,
    is_digest,
)
from ckptstore.leases import DEFAULT_TTL_S, GC, SAVE, Lease, find_leases

logger = logging.getLogger(__name__)


def quarantine_step(store, step: int, why: str) -> bool:
    """Quarantine committed ``step`` if re-checking it finds damaged or missing chunks; returns
    whether it did. Never raises for the step's damage; storage errors are raised.

    The objects are moved under a gc lease while no save is in flight (a save repairs a chunk
    it finds damaged, or commits the step number again): a save in flight defers the
    quarantine to a later load. Under the lease the step's manifest and its damaged chunks are
    read again, and only what is still the same save, still damaged, is moved."""
    from ckptstore._inspect import verify_steps  # torch: only where chunks are read

    try:
        manifest, data = load_manifest_bytes(store, step)
    except CheckpointCorruptError:
        return _under_lease(
            store, step, lambda lease: _quarantine_unreadable(store, step, why, lease)
        )
    except CheckpointError:
        return False  # gone: another process's retention
    (check,) = verify_steps(store, [step])
    bad = [p for p in check.problems if p.problem in ("corrupt", "missing")]
    if not bad or any(p.problem == "unreadable" for p in check.problems):
        return False
    missing = [p.object for p in bad if p.problem == "missing"]
    if len(missing) == len(bad) and _turn_up(store, missing):
        logger.warning(
            "step %d of %s: objects a load found missing are there now (a store whose reads "
            "lag its writes?); not quarantined",
            step,
            store.uri,
        )
        return False
    found = sorted({p.object.rsplit("/", 1)[-1] for p in bad if p.what == "chunk"})
    damaged = _damaged_chunks(store, step, found, check.chunk_refs)

    def move(lease: Lease) -> bool:
        if _manifest_bytes(store, step) != data:
            return False  # removed, or the step number committed again since the check
        if _damaged_chunks(store, step, found, check.chunk_refs) != damaged:
            logger.warning(
                "step %d of %s: its chunks changed since the load checked them (written again "
                "by a save?); not quarantined",
                step,
                store.uri,
            )
            return False
        _move(store, step, why, manifest.attempt, data, bad, damaged, lease)
        return True

    return _under_lease(store, step, move)


def quarantine_skipped(store, skipped: list[tuple[int, BaseException]]) -> None:
    """After a load with fallback loaded a step: each step it skipped as corrupt or missing
    objects is quarantined (``quarantine_step``); one that cannot be is one warning, never an
    error (the load itself went through). Rank 0's work, called by both front-ends."""
    for step, error in skipped:
        if not isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError)):
            continue
        try:
            quarantine_step(store, step, one_line(error))
        except Exception as exc:  # noqa: BLE001 - the load went through, whatever this met
            logger.warning(
                "rank 0: step %d was skipped as corrupt but could not be quarantined: %s",
                step,
                one_line(exc),
            )


SETTLE_TIMEOUT_S = 60.0


def _under_lease(store, step: int, fn: Callable[[Lease], bool]) -> bool:
    """``fn(lease)`` under a gc lease of ``store`` while no save is in flight there (both sides
    write their lease first and look for the other's second, docs/FORMAT.md "Leases"); False,
    with a warning, if one is. ``fn`` calls :func:`_deleting` before its first delete."""
    lease = Lease(store, GC, uuid.uuid4().hex, ttl_s=DEFAULT_TTL_S).acquire()
    try:
        saves = [s.describe() for s in find_leases(store, SAVE) if s.live]
        saves += [m.key for m in legacy_markers(store) if not m.stale]
        if saves:
            logger.warning(
                "step %d of %s not quarantined now: a save is in flight (%s); a later load "
                "with fallback quarantines it",
                step,
                store.uri,
                saves[0],
            )
            return False
        return fn(lease)
    finally:
        lease.release_when_settled(SETTLE_TIMEOUT_S)


def _deleting(lease: Lease) -> None:
    """Before a quarantine's first delete, as before a gc's: the lease still held (else a save
    may have gone on), and marked as deleting (a holder that dies now is waited for until its
    deletes have ended)."""
    lease.check()
    lease.mark_deleting()


def _manifest_bytes(store, step: int) -> bytes | None:
    try:
        return store.get(commit_key(step), 0, MAX_MANIFEST_BYTES + 1, small=True)
    except ObjectNotFoundError:
        return None


def _move(
    store, step: int, why: str, attempt: str, data: bytes, bad, damaged, lease: Lease
) -> None:
    """Step ``step``'s marker written, its ``damaged`` chunks (digest -> still stored) moved
    to the quarantine, then its commit deleted, unless it is another save's by then."""
    chunks = sorted(damaged)
    body = {
        "step": step,
        "attempt": attempt,
        "reason": why,
        "quarantined_at": time.time(),
        "bad_chunks": chunks,
        "problems": [f"{p.object}: {p.problem}" for p in bad[:20]],
        "manifest_b64": base64.b64encode(data).decode(),
    }
    try:
        store.put(marker_key(step, attempt), _dump(QUARANTINE_KIND, body))
    except ObjectExistsError:
        pass  # a quarantine of this save that stopped part-way: finish it
    _deleting(lease)
    for digest, present in sorted(damaged.items()):
        if not present:
            continue  # missing: nothing to keep
        planted = False
        try:  # copied by the store: a read that lied must not replace its own bytes
            store.copy(chunk_key(digest), f"{QUARANTINE_PREFIX}/chunks/{digest}")
        except ObjectExistsError:
            pass
        except UnsafeObjectError:
            planted = True  # a link, a FIFO or a directory: no bytes worth keeping
        try:
            store.delete(chunk_key(digest))
        except StorageError as exc:
            if not planted:
                raise
            logger.warning(  # the commit still goes: the step must not block its re-save
                "step %d: %s could not be removed (%s); a new save of its bytes may fail",
                step,
                store.url(chunk_key(digest)),
                one_line(exc),
            )
    if _manifest_bytes(store, step) != data:
        return  # committed again meanwhile (a save that ignored our lease): it stays
    store.delete(commit_key(step))
    logger.info(  # the load warned of the skipped step already
        "step %d (attempt %s) of %s quarantined (%d damaged chunk(s)): no longer listed nor "
        "loaded; a new save of step %d commits as any save; kept under %s/ until "
        "`ckptstore gc --remove-corrupt`",
        step,
        attempt,
        store.uri,
        len(chunks),
        step,
        QUARANTINE_PREFIX,
    )


MISSING_RECHECKS_S = (1.0, 4.0)
"""A step whose only damage is missing objects is looked at again after these waits before it
is quarantined: a store whose reads lag its writes (a replica behind) must not lose a step."""


def _turn_up(store, keys: list[str]) -> bool:
    """Whether any of ``keys`` turns up within :data:`MISSING_RECHECKS_S`."""
    for wait_s in MISSING_RECHECKS_S:
        time.sleep(wait_s)
        if any(store.exists(key) for key in keys):
            return True
    return False


def _quarantine_unreadable(store, step: int, why: str, lease: Lease) -> bool:
    """A step whose manifest cannot be decoded: its bytes kept in a marker (its attempt is
    unknown: named ``unreadable-<xxh3 of the bytes>``), then its commit removed, so that a new
    save of the step number commits. Its other objects are no save's: gc sweeps them."""
    from ckptstore.codec import hash_bytes  # numpy: only where a step is quarantined

    key = commit_key(step)
    try:
        data = store.get(key, 0, MAX_MANIFEST_BYTES + 1, small=True)
        again = store.get(key, 0, MAX_MANIFEST_BYTES + 1, small=True)
    except ObjectNotFoundError:
        return False
    except UnsafeObjectError:
        data = again = b""  # a FIFO or a link at the commit's key: nothing to keep
    if again != data or _decodes_as_manifest(again, store.url(key), step):
        return False  # a read cut short or damaged on the way: not the stored bytes' fault
    attempt = f"unreadable-{hash_bytes(data)[:16]}"
    body = {
        "step": step,
        "attempt": attempt,
        "reason": why,
        "quarantined_at": time.time(),
        "bad_chunks": [],
        "problems": [f"{store.url(key)}: unreadable"],
        "manifest_b64": base64.b64encode(data[:MAX_MANIFEST_BYTES]).decode(),
    }
    try:
        store.put(marker_key(step, attempt), _dump(QUARANTINE_KIND, body))
    except ObjectExistsError:
        pass
    _deleting(lease)
    store.delete(key)
    logger.info(
        "step %d of %s quarantined (its manifest is unreadable): no longer listed nor loaded; "
        "a new save of step %d commits as any save",
        step,
        store.uri,
        step,
    )
    return True


def _decodes_as_manifest(data: bytes, name: str, step: int) -> bool:
    """Whether ``data`` is a manifest of ``step`` (another step's is as unreadable here)."""
    try:
        manifest = decode_manifest(data[: MAX_MANIFEST_BYTES + 1], name)
    except CheckpointError:
        return False
    return len(data) <= MAX_MANIFEST_BYTES and manifest.step == step


def _damaged_chunks(
    store, step: int, found: list[str], refs: dict[str, ChunkInfo | None]
) -> dict[str, bool]:
    """Those of the chunks ``found`` bad in ``step`` whose own bytes do not decode to their
    digest at any raw size a committed step declares for them, and whether each is there.
    A chunk only this step's index misdescribes (its stored or raw size edited) is intact:
    other steps share it, so it stays (moving it would break them). Each is read at most to
    the size an encoding of its largest declared raw size can take (a huge object planted at
    a chunk key is damaged without being read whole)."""
    sizes = _declared_raw_sizes(store, skip=step)
    damaged: dict[str, bool] = {}
    for digest in found:
        ours = refs.get(digest)
        declared = {ours.raw} if ours is not None else set()
        others = sizes.get(digest, set()) - declared
        most = max(declared | others, default=0)
        limit = most + most // 64 + 4096  # zstd's bound, generously, plus the header
        try:
            data = store.get(chunk_key(digest), 0, limit + 1)
        except ObjectNotFoundError:
            damaged[digest] = False
            continue
        except UnsafeObjectError:  # a link out of the store or a FIFO: damaged, and there
            damaged[digest] = True
            continue
        if len(data) > limit or not (
            _decodes(store, digest, data, declared) or _decodes(store, digest, data, others)
        ):
            damaged[digest] = True
    return damaged


def _decodes(store, digest: str, data: bytes, raw_sizes: set[int]) -> bool:
    """Whether ``data`` (chunk ``digest``'s object) decodes to bytes that hash to ``digest`` at
    one of ``raw_sizes`` (each bounded by an index's checks: a header declaring another size
    is refused before anything is decompressed)."""
    from ckptstore.codec import decode  # numpy: only where chunks are read

    for raw in sorted(raw_sizes):
        try:
            decode(data, expected_hash=digest, name=store.url(chunk_key(digest)), raw_len=raw)
            return True
        except CheckpointCorruptError:
            continue
    return False


def _declared_raw_sizes(store, skip: int) -> dict[str, set[int]]:
    """Chunk digest -> the raw sizes the rank indexes of every committed step but ``skip``
    declare for it (an index that cannot be read declares nothing)."""
    from ckptstore._inspect import check_step_objects

    sizes: dict[str, set[int]] = {}
    for other in list_steps(store):
        if other == skip:
            continue
        for digest, info in check_step_objects(store, other).chunk_refs.items():
            if info is not None:
                sizes.setdefault(digest, set()).add(info.raw)
    return sizes


def quarantined_attempts(store) -> set[str]:
    """The attempts of the quarantined steps (their rank indexes are kept for forensics)."""
    attempts = set()
    for key in quarantined(store):
        try:
            doc = read_marker(store, key)
        except CheckpointError:
            continue
        if is_attempt(doc.get("attempt")):
            attempts.add(doc["attempt"])
    return attempts


def quarantined_chunks(store) -> set[str]:
    """The chunks the quarantined saves' rank indexes name (gc keeps those still stored until
    ``--remove-corrupt``: a step quarantined by mistake can be put back whole)."""
    digests: set[str] = set()
    for key in quarantined(store):
        try:
            doc = read_marker(store, key)
            manifest = decode_manifest(base64.b64decode(doc["manifest_b64"]), store.url(key))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue  # an unreadable manifest's marker: nothing to keep
        for ref in manifest.ranks:
            try:
                digests.update(read_rank_index(store, ref).chunks)
            except CheckpointError:
                continue  # this rank's index gone or damaged: the others' chunks are kept
    return digests


def quarantine_objects(store) -> list[str]:
    """Everything under the quarantine (``gc --remove-corrupt`` deletes it)."""
    markers = quarantined(store)
    return [
        k for k in store.list(QUARANTINE_PREFIX) if k in markers or is_digest(k.rsplit("/", 1)[-1])
    ]
