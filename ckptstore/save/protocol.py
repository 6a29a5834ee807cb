"""The commit protocol under ``SaveSession``: how a save and a gc stay apart, and how a step
becomes visible exactly once.

    begin_save      write the rank's save lease, wait while a gc sweeps (leases.py)
    ...             the session writes chunks, then the rank index
    lease.check()   the lease never lapsed: no gc can have swept chunks this save reuses
    commit_step     (one rank) write the manifest once; an ambiguous outcome is read back
    lease.release() every rank, after the commit's outcome is known
    retain          (one rank) keep_last retention under a gc lease

A crash anywhere leaves the previous steps intact and the new one invisible or complete; a
dead rank's lease goes stale after its ttl and the next gc removes what it left.
"""

from __future__ import annotations

import logging

from ckptstore.errors import (
    CheckpointError,
    CommitUnknownError,
    ObjectNotFoundError,
    StepExistsError,
    StorageError,
)
from ckptstore.format import Manifest, commit_key, encode_manifest
from ckptstore.leases import DEFAULT_TTL_S, SAVE, Lease, wait_for_gc
from ckptstore.retention import collect
from ckptstore.store import Store

logger = logging.getLogger(__name__)

DEFAULT_GC_WAIT_S = 600.0


def begin_save(
    store: Store,
    *,
    step: int,
    attempt: str,
    rank: int,
    kind: str,
    ttl_s: float = DEFAULT_TTL_S,
    gc_wait_s: float = DEFAULT_GC_WAIT_S,
) -> Lease:
    """The rank's save lease, once no gc sweeps: from here until ``release()`` no gc deletes
    a chunk, so chunks found stored may be referenced instead of written again."""
    lease = Lease(
        store,
        SAVE,
        f"{step:020d}-{attempt}-{rank:05d}",
        ttl_s=ttl_s,
        info={"step": step, "attempt": attempt, "rank": rank, "save_kind": kind},
    ).acquire()
    try:
        wait_for_gc(store, timeout_s=gc_wait_s, what=f"rank {rank}: save of step {step}")
    except BaseException:
        lease.release()
        raise
    return lease


def commit_step(store: Store, manifest: Manifest, *, settle_timeout_s: float = 60.0) -> None:
    """Make ``manifest``'s step visible by writing its manifest, once.

    :class:`StepExistsError` if another writer committed the step first. When the put fails
    ambiguously (a timeout, a lost answer, a failed read-back), the manifest is read back once
    every abandoned put has ended: ours in place means committed; absent means not committed
    (the put's error is raised); unreadable is :class:`CommitUnknownError`."""
    key = commit_key(manifest.step)
    data = encode_manifest(manifest)
    try:
        # Read back only where exclusive create is not enforced: elsewhere a put that returned
        # is the commit, and a read-back could find the step already deleted by retention.
        store.put(key, data)
        return
    except StorageError as exc:  # ObjectExistsError included: a retry may find its own put
        error = exc
    if not store.settle(settle_timeout_s):
        raise CommitUnknownError(
            f"step {manifest.step}: writing {store.url(key)} failed ({error}) and the put may "
            f"still land; run `ckptstore ls {store.uri}` to see whether it is committed"
        ) from error
    try:
        found = store.get(key)
    except ObjectNotFoundError:
        raise StorageError(f"step {manifest.step} not committed: {error}") from error
    except CheckpointError as exc:
        raise CommitUnknownError(
            f"step {manifest.step}: writing {store.url(key)} failed ({error}) and reading it "
            f"back failed ({exc}); run `ckptstore ls {store.uri}` to see whether it is committed"
        ) from error
    if found == data:
        logger.warning(
            "step %d: the commit reported an error (%s) but its manifest is in place: committed",
            manifest.step,
            error,
        )
        return
    raise StepExistsError(
        f"step {manifest.step} is already committed in {store.uri} (by another writer or an "
        "earlier run); steps are write-once"
    ) from error


def retain(store: Store, *, keep_last: int | None, attempt: str, ttl_s: float) -> None:
    """Apply ``keep_last`` after a commit; a failure is logged (the next save retries)."""
    if keep_last is None:
        return
    try:
        collect(store, keep_last=keep_last, ignore_attempts={attempt}, lease_ttl_s=ttl_s)
    except CheckpointError as exc:
        logger.warning(
            "retention in %s failed (will retry after the next save): %s", store.uri, exc
        )
