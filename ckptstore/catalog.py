"""The read side of a store: committed steps, their manifests and rank indexes, and the saves
in flight (what a step holds, whichever front-end wrote it: ``steps.StepView``).

``format`` names objects and encodes and decodes them; this module finds and reads them, and
writes one: the manifest that commits a step (``commit_manifest``, for a save, a tier copy and a
repaired copy alike; an ambiguous put is settled by reading it back). Used by
``Checkpointer.load`` / ``verify``, the DCP ``StoreReader``, retention, ``_inspect``, the CLI
and the commits::

    list_steps(store)                      committed steps, ascending
    commit_manifest(store, step, data)     a step committed: its manifest put once, read back
                                           when the put's outcome is unknown
    parse_step(step)                       "latest" / None -> None; a number -> an int
    resolve_step(store, step)              "latest" / None / a number -> a committed step
    load_manifest(store, step)             the manifest of a committed step
    open_step(store, step)                 both: the manifest of "latest" or of a number
    load_rank_index(store, manifest, r)    rank r's index, checked against the manifest
    load_rank_indexes(store, manifest)     every rank's index, in the manifest's order
    saves_in_flight(store)                 leases of saves and gcs, and legacy pending markers
    quarantined(store)                     the quarantine's markers (``ckptstore.quarantine``
                                           writes them), ``describe_quarantined`` one step's
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ckptstore.codec import hash_bytes
from ckptstore.errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    ObjectExistsError,
    ObjectNotFoundError,
    StepExistsError,
    StorageError,
    UnsafeObjectError,
    one_line,
    same_kind,
)
from ckptstore.format import (
    MAX_MANIFEST_BYTES,
    STEP_DIGITS,
    Manifest,
    ObjectRef,
    RankIndex,
    _load,
    check_step,
    commit_key,
    decode_manifest,
    decode_rank_index,
    is_attempt,
)
from ckptstore.leases import find_leases
from ckptstore.store import Store

logger = logging.getLogger(__name__)

T = TypeVar("T")

QUARANTINE_PREFIX = "quarantine"
QUARANTINE_KIND = "quarantine"

LEGACY_PENDING_GRACE_S = 6 * 3600.0
"""``pending/`` markers were written by ckptstore before leases; one younger than this may be
an older writer's save in flight."""

# -- steps ---------------------------------------------------------------------------------------


def list_steps(store: Store) -> list[int]:
    """Committed steps, ascending. Uncommitted attempts are never listed, nor a name no save
    writes (``commits/99.json``: a step is read at its 20-digit key, so that one would be
    listed and never read)."""
    steps = []
    for key in store.list("commits"):
        name = key.rsplit("/", 1)[-1]
        digits = name.removesuffix(".json")
        if name.endswith(".json") and len(digits) == STEP_DIGITS and _is_digits(digits):
            steps.append(int(digits))
    return sorted(steps)


def steps_to_resume(store: Store) -> list[int]:
    """:func:`list_steps` for a job about to resume: a bucket that does not exist yet holds no
    step (one WARNING per store and process, as the first run of a job on a new bucket)."""
    try:
        return list_steps(store)
    except BucketNotFoundError as exc:
        if store.uri not in _NO_BUCKET_SAID:
            _NO_BUCKET_SAID.add(store.uri)
            logger.warning(
                "%s: nothing to resume; the first save creates the bucket where the store "
                "does (SeaweedFS, say), elsewhere (AWS S3) it fails until the bucket is made",
                exc,
            )
        return []


_NO_BUCKET_SAID: set[str] = set()


def _is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # "٣" and "²" are digits too


# What this process learnt of each store's steps (by ``Store.uri``): the steps it found
# committed (wrote or read), which a save names in its manifest (``Manifest.previous``) and gc
# looks up where a listing lacks them; and the steps manifests name that it found gone, by the
# naming manifest (a step found gone may be saved again, and a later manifest then names that).
PREVIOUS_NAMED = 16  # a manifest names the newest and the oldest this many steps below it
_SEEN: dict[str, set[int]] = {}
_GONE_AS_NAMED: dict[str, set[tuple[int, str, int]]] = {}  # (step, attempt, step it names)


def saw_step(store: Store, step: int) -> None:
    _SEEN.setdefault(store.uri, set()).add(step)


def gone_step(store: Store, step: int) -> None:
    _SEEN.get(store.uri, set()).discard(step)


def seen_steps(store: Store) -> set[int]:
    return set(_SEEN.get(store.uri, ()))


def seen_below(store: Store, step: int) -> list[int]:
    """The steps below ``step`` found committed (and not found gone since), newest first: the
    newest and the oldest :data:`PREVIOUS_NAMED` of them (a step kept long, the best or the
    newest healthy one, stays named once the steps after it are deleted)."""
    below = sorted((s for s in _SEEN.get(store.uri, ()) if s < step), reverse=True)
    if len(below) <= 2 * PREVIOUS_NAMED:
        return below
    return below[:PREVIOUS_NAMED] + below[-PREVIOUS_NAMED:]


def gone_as_named(store: Store, claim: tuple[int, str, int]) -> bool:
    """Whether the step that manifest ``(step, attempt)`` names (``claim[2]``) was found gone."""
    return claim in _GONE_AS_NAMED.get(store.uri, ())


def found_gone_as_named(store: Store, claim: tuple[int, str, int]) -> None:
    _GONE_AS_NAMED.setdefault(store.uri, set()).add(claim)


# How long a commit waits for its abandoned puts to end before it says the outcome is unknown.
SETTLE_TIMEOUT_S = 60.0


def commit_manifest(store: Store, step: int, data: bytes) -> None:
    """Make ``step`` visible by writing its manifest ``data``, once: the last write of every
    save, of a tier copy and of a repaired copy (the caller checked its lease just before).

    :class:`StepExistsError` if another writer committed the step first. When the put
    fails ambiguously (a timeout, a lost answer), the manifest is read back once every
    abandoned put has ended: ours in place means committed; absent means not committed
    (the put's error is raised); unreadable is :class:`CommitUnknownError`."""
    key = commit_key(step)
    try:
        # Read back only where exclusive create is not enforced: elsewhere a put that
        # returned is the commit, and a read-back could find the step already retained away.
        store.put(key, data)
        saw_step(store, step)
        return
    except StorageError as exc:  # ObjectExistsError included: a retry may find its own put
        error = exc
    if not store.settle(SETTLE_TIMEOUT_S):
        raise CommitUnknownError(
            f"step {step}: writing {store.url(key)} failed ({error}) and the put may "
            f"still land; run `ckptstore ls {store.uri}` to see whether it is committed"
        ) from error
    try:
        found = store.get(key)
    except ObjectNotFoundError:
        if isinstance(error, ObjectExistsError):
            raise StepExistsError(
                f"step {step} of {store.uri} was committed first by another writer (or an "
                "earlier attempt of this put) and removed since (a retention): this save is not "
                "committed; steps are write-once"
            ) from error
        if error.unanswered and store.backend.remote:
            raise CommitUnknownError(
                f"step {step}: writing {store.url(key)} got no answer ({error}) and it is not "
                "there now; the server may still apply that put: run `ckptstore ls "
                f"{store.uri}` later to see whether it is committed"
            ) from error
        raise same_kind(error, f"step {step} not committed: {error}", StorageError) from error
    except CheckpointError as exc:
        raise CommitUnknownError(
            f"step {step}: writing {store.url(key)} failed ({error}) and reading it back "
            f"failed ({exc}); run `ckptstore ls {store.uri}` to see whether it is committed"
        ) from error
    if found == data:
        logger.warning(
            "step %d: the commit reported an error (%s) but its manifest is in place: committed",
            step,
            error,
        )
        saw_step(store, step)
        return
    raise StepExistsError(
        f"step {step} is already committed in {store.uri} (by an earlier save, this "
        "writer's or another's); steps are write-once"
    ) from error


def parse_step(step: int | str | None) -> int | None:
    """A step as a user names it: ``None`` for ``"latest"`` (or None), else the int of an int
    or a string of digits; ``ValueError`` for anything else."""
    if step is None or step == "latest":
        return None
    if isinstance(step, str):
        if not _is_digits(step):
            raise ValueError(f"step must be an integer or 'latest', got {step!r}")
        step = int(step)
    return check_step(step)


def no_checkpoint(store: Store) -> CheckpointNotFoundError:
    """The error of a store that holds no committed step, naming a store just above or below it
    where there is one (a mistyped path), or the torch DCP checkpoint it holds instead."""
    why = dcp_checkpoint_there(store) or store_nearby(store)
    return CheckpointNotFoundError(f"no committed checkpoint in {store.uri}{why}")


def dcp_checkpoint_there(store: Store) -> str:
    """A note when ``store`` holds torch DCP's own checkpoint (its ``.metadata``, as
    ``FileSystemWriter`` writes it), "" otherwise."""
    try:
        there = store.exists(".metadata")
    except CheckpointError:
        return ""
    if not there:
        return ""
    return (
        " (it holds a checkpoint of torch DCP's own FileSystemWriter, not a ckptstore store: "
        "read it with torch.distributed.checkpoint.FileSystemReader)"
    )


_NEARBY_DIRS = 256  # subdirectories of an empty local store looked into, at most


def store_nearby(store: Store, *, remote: bool = False) -> str:
    """For a local store that holds no committed step: a note naming the store it lies inside
    (up to 3 levels up) or one of its subdirectories that holds committed steps, "" if none.
    An object store's is looked for only where ``remote`` (the CLI: a few listings, which every
    rank of a job starting afresh would make)."""
    if not store.is_local:
        return _remote_store_nearby(store) if remote else ""

    def holds_steps(path: Path) -> bool:
        try:
            return any(p.name.endswith(".json") for p in (path / "commits").iterdir())
        except OSError:
            return False

    root = Path(store.backend.root)
    for parent in list(root.parents)[:3]:
        if holds_steps(parent):
            return f" (it lies inside the store {parent}: a mistyped path?)"
    try:
        below = [p for p in itertools.islice(root.iterdir(), _NEARBY_DIRS) if p.is_dir()]
    except OSError:
        return ""
    found = next((p for p in sorted(below) if holds_steps(p)), None)
    return "" if found is None else f" (but {found} holds checkpoints: a mistyped path?)"


_NEARBY_PREFIXES = 16  # sub-prefixes of an empty remote store looked into, at most


def _remote_store_nearby(store: Store) -> str:
    """``store_nearby`` for an object store (S3 and the like): a few listings, best effort."""
    fs = getattr(store.backend, "fs", None)
    scheme, sep, _ = store.uri.partition("://")
    if fs is None or not sep:
        return ""

    def holds_steps(prefix: str) -> bool:
        try:
            fs.invalidate_cache(f"{prefix}/commits")
            return any(p.endswith(".json") for p in fs.ls(f"{prefix}/commits", detail=False))
        except Exception:  # noqa: BLE001 - a hint only: any failure is "no"
            return False

    parts = store.root.strip("/").split("/")
    for n in range(len(parts) - 1, max(len(parts) - 4, 0), -1):
        parent = "/".join(parts[:n])
        if holds_steps(parent):
            return f" (it lies inside the store {scheme}://{parent}: a mistyped prefix?)"
    try:
        fs.invalidate_cache(store.root)
        below = sorted(fs.ls(store.root, detail=False))[:_NEARBY_PREFIXES]
    except Exception:  # noqa: BLE001 - as above
        return ""
    found = next((p for p in below if holds_steps(p.rstrip("/"))), None)
    return (
        "" if found is None else f" (but {scheme}://{found} holds checkpoints: a mistyped prefix?)"
    )


def resolve_step(store: Store, step: int | str | None = "latest") -> int:
    """A committed step: ``None`` or ``"latest"`` is the newest one; an int or a string of
    digits must be committed. :class:`CheckpointNotFoundError` otherwise, naming the latest
    steps; ``ValueError`` for a step that is neither."""
    step = parse_step(step)
    if step is None:
        steps = list_steps(store)
        if not steps:
            raise no_checkpoint(store)
        return steps[-1]
    try:
        committed = store.exists(commit_key(step))
    except UnsafeObjectError as exc:  # a link out of the store at the manifest: damage
        raise CheckpointCorruptError(f"{store.url(commit_key(step))}: {exc}") from exc
    if not committed:
        near = ", ".join(map(str, list_steps(store)[-5:])) or "none"
        why = describe_quarantined(store, step)
        raise CheckpointNotFoundError(
            f"step {step} is not committed in {store.uri} (latest steps: {near})"
            + (f"; {why}" if why else "")
        )
    return step


def load_manifest(store: Store, step: int) -> Manifest:
    """The manifest of ``step``; :class:`CheckpointNotFoundError` if it is not committed."""
    return load_manifest_bytes(store, step)[0]


def load_manifest_bytes(store: Store, step: int) -> tuple[Manifest, bytes]:
    """The manifest of ``step`` and the bytes it was decoded from (a tier copies them)."""
    return _read_again_if_damaged(store, lambda: _load_manifest_once(store, step))


def _read_again_if_damaged(store: Store, read: Callable[[], T]) -> T:
    """``read()``, once more where it finds the bytes damaged in a remote store: an answer
    damaged on the way (a body cut short that its length did not tell) would otherwise send
    a load to an older step, as a chunk's is (``pipeline.fetch_chunk``)."""
    try:
        return read()
    except CheckpointCorruptError as exc:
        if not store.backend.remote:
            raise
        first = exc
    result = read()
    logger.warning("%s; read again, it checks out (damaged on the way)", one_line(first))
    return result


def _load_manifest_once(store: Store, step: int) -> tuple[Manifest, bytes]:
    key = commit_key(step)
    try:
        data = store.get(key, 0, MAX_MANIFEST_BYTES + 1, small=True)  # a cap: a damaged store
    except ObjectNotFoundError as exc:
        gone_step(store, step)
        raise CheckpointNotFoundError(f"step {step} is not committed in {store.uri}") from exc
    except UnsafeObjectError as exc:  # a FIFO or a link out of the store: damage
        raise CheckpointCorruptError(f"{store.url(key)}: {exc}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(
            f"{store.url(key)}: over {MAX_MANIFEST_BYTES} bytes, larger than any manifest"
        )
    manifest = decode_manifest(data, store.url(key))
    if manifest.step != step:
        raise CheckpointCorruptError(f"{store.url(key)}: manifest says step {manifest.step}")
    saw_step(store, step)
    return manifest, data


LATEST_TRIES = 3
# A collective "latest" load (both front-ends) whose step was removed while it loaded plans
# again, this often.
LATEST_REPLANS = 3


def open_step(store: Store, step: int | str | None = "latest") -> Manifest:
    """The manifest of ``step`` as :func:`resolve_step` resolves it. The latest step removed
    between its listing and its read (another process's ``keep_last``: a newer save came) is
    listed again, up to :data:`LATEST_TRIES` times."""
    latest = parse_step(step) is None
    for _ in range(LATEST_TRIES - 1 if latest else 0):
        number = resolve_step(store, step)
        try:
            return load_manifest(store, number)
        except CheckpointNotFoundError:
            logger.info(
                "step %d of %s was removed as it was read; listing again", number, store.uri
            )
    return load_manifest(store, resolve_step(store, step))


# -- objects a manifest references ---------------------------------------------------------------


def read_object(store: Store, ref: ObjectRef, what: str) -> bytes:
    """A small object referenced by a manifest, checked against its recorded size and hash
    (read once more where they do not match, from a remote store)."""
    return _read_again_if_damaged(store, lambda: _read_object_once(store, ref, what))


def _read_object_once(store: Store, ref: ObjectRef, what: str) -> bytes:
    try:
        data = store.get(ref.key, 0, ref.nbytes + 1)  # one byte more tells a longer object
    except ObjectNotFoundError as exc:
        raise CheckpointNotFoundError(f"{what} {store.url(ref.key)} is missing") from exc
    except UnsafeObjectError as exc:  # a FIFO or a link out of the store: damage
        raise CheckpointCorruptError(f"{what} {store.url(ref.key)}: {exc}") from exc
    if len(data) != ref.nbytes or hash_bytes(data) != ref.xxh3:
        raise CheckpointCorruptError(
            f"{what} {store.url(ref.key)}: size or xxh3 does not match the manifest"
        )
    return data


def rank_of(key: str) -> int:
    """The rank of a ``.../rank-00003.json`` key."""
    name = key.rsplit("/", 1)[-1]
    if not (name.startswith("rank-") and name.endswith(".json") and name[5:-5].isdigit()):
        raise CheckpointCorruptError(f"manifest references {key!r}, not a rank index key")
    return int(name[5:-5])


def read_rank_index(store: Store, ref: ObjectRef) -> RankIndex:
    """The rank index ``ref`` names, checked against its size, xxh3 and rank."""
    return read_rank_index_bytes(store, ref)[0]


def read_rank_index_bytes(store: Store, ref: ObjectRef) -> tuple[RankIndex, bytes]:
    """``read_rank_index`` and the bytes it was decoded from."""
    data = read_object(store, ref, "rank index")
    index = decode_rank_index(data, store.url(ref.key))
    if index.rank != rank_of(ref.key):
        raise CheckpointCorruptError(f"{store.url(ref.key)}: index says rank {index.rank}")
    return index, data


def load_rank_index(store: Store, manifest: Manifest, rank: int) -> RankIndex:
    """Rank ``rank``'s index of ``manifest`` (a DCP rank that wrote nothing has none:
    :class:`CheckpointNotFoundError`)."""
    for ref in manifest.ranks:
        if ref.key.endswith(f"/rank-{rank:05d}.json"):
            return read_rank_index(store, ref)
    raise CheckpointNotFoundError(f"step {manifest.step} has no index for rank {rank}")


def load_rank_indexes(store: Store, manifest: Manifest) -> list[RankIndex]:
    """Every rank index of ``manifest``, in the order the manifest lists them."""
    return [read_rank_index(store, ref) for ref in manifest.ranks]


# -- saves in flight -----------------------------------------------------------------------------


@dataclass
class LegacyMarker:
    """A ``pending/`` marker of a ckptstore version before leases."""

    key: str
    info: dict[str, Any]
    age_s: float | None  # None: unreadable
    unread: bool = False  # its read failed and its modification time is young (or unknown)

    @property
    def stale(self) -> bool:
        if self.unread:
            return False
        return self.age_s is None or self.age_s >= LEGACY_PENDING_GRACE_S


MAX_MARKER_BYTES = 64 * 1024  # a legacy marker is a few hundred bytes: more is not one


def legacy_markers(store: Store) -> list[LegacyMarker]:
    """Every ``pending/`` marker with its age. One that is too large, nested too deeply, not
    JSON, no plain file or gone since the listing (a dangling link) counts as stale; one whose
    read failed for a storage reason (a timeout, access) is aged by its modification time, as
    an unreadable lease is: live while that is young or cannot be read either."""
    out = []
    for key in store.list("pending"):
        info: Any = {}
        unread = False
        try:
            data = store.get(key, 0, MAX_MARKER_BYTES + 1)
            if len(data) <= MAX_MARKER_BYTES:
                info = json.loads(data)
        except (ValueError, RecursionError, UnsafeObjectError, FileNotFoundError):
            pass  # not a marker, or no longer one: garbage
        except (CheckpointError, OSError) as exc:
            unread = _modified_young(store, key)
            logger.warning(
                "pending marker %s could not be read (%s): %s",
                key,
                one_line(exc),
                "counted live (young or of unknown age)" if unread else "stale by its age",
            )
        info = info if isinstance(info, dict) else {}
        out.append(LegacyMarker(key, info, _age_s(info.get("created_at")), unread))
    return out


def _modified_young(store: Store, key: str) -> bool:
    """Whether ``key`` was modified within the legacy grace, or its time cannot be read."""
    try:
        age = time.time() - store.modified(key)
    except (CheckpointError, OSError):
        return True
    return not math.isfinite(age) or age < LEGACY_PENDING_GRACE_S


def _age_s(created: Any) -> float | None:
    """Seconds since the time ``created`` (None: not a time, 10**400 or 1e400 included)."""
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        return None
    try:
        age = time.time() - float(created)
    except OverflowError:
        return None
    return age if math.isfinite(age) else None


def saves_in_flight(store: Store) -> list[dict[str, Any]]:
    """Saves and gcs in flight (live leases, young legacy markers) and dead ones (stale), as
    JSON-ready dicts: key, kind (save | gc), step, attempt, rank, host, renewed_at, age_s,
    stale."""
    out = []
    for lease in sorted(find_leases(store), key=lambda lease: lease.key):
        age = lease.age_s
        out.append(
            {
                "key": lease.key,
                "kind": lease.kind,
                "step": lease.doc.get("step"),
                "attempt": lease.doc.get("attempt"),
                "rank": lease.doc.get("rank"),
                "host": lease.doc.get("host"),
                "renewed_at": lease.doc.get("renewed_at"),
                "age_s": round(age, 1) if age is not None else None,
                "stale": not lease.live,
                "holder_dead": lease.holder_dead,
                "expires_in_s": lease.expires_in_s,
            }
        )
    for marker in legacy_markers(store):
        out.append(
            {
                "key": marker.key,
                "kind": "save",
                "step": marker.info.get("step"),
                "attempt": marker.info.get("attempt"),
                "rank": marker.info.get("rank"),
                "host": marker.info.get("host"),
                "renewed_at": marker.info.get("created_at"),
                "age_s": round(marker.age_s, 1) if marker.age_s is not None else None,
                "stale": marker.stale,
            }
        )
    return out


# -- quarantined steps (``ckptstore.quarantine`` takes them out of the way) ----------------------


def marker_key(step: int, attempt: str) -> str:
    return f"{QUARANTINE_PREFIX}/{step:020d}-{attempt}.json"


def quarantined(store: Store) -> dict[str, int]:
    """The quarantine's markers: key -> step (their attempts' objects are kept by gc)."""
    out = {}
    for key in store.list(QUARANTINE_PREFIX):
        name = key.rsplit("/", 1)[-1]
        head, _, tail = name.partition("-")
        if name.endswith(".json") and _is_digits(head) and is_attempt(tail[:-5]):
            out[key] = int(head)
    return out


def read_marker(store: Store, key: str) -> dict[str, Any]:
    """A quarantine marker, checked as JSON of its kind."""
    return _load(store.get(key), QUARANTINE_KIND, store.url(key))


def describe_quarantined(store: Store, step: int) -> str | None:
    """Where ``step`` was quarantined, for an error that says it is not committed: when, how
    many damaged chunks, the marker's key; None if it was not (or the quarantine cannot be
    listed: the error being raised says enough)."""
    try:
        keys = sorted(k for k, s in quarantined(store).items() if s == step)
    except CheckpointError:
        return None
    if not keys:
        return None
    try:
        doc = read_marker(store, keys[-1])
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(doc["quarantined_at"])))
        what = f"at {when}, {len(doc['bad_chunks'])} damaged chunk(s)"
    except (CheckpointError, KeyError, TypeError, ValueError, OverflowError):
        what = "its marker unreadable"
    return (
        f"a load found step {step} damaged and quarantined it ({what}; {keys[-1]}): kept for "
        "forensics until `ckptstore gc --remove-corrupt`"
    )
