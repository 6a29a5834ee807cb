"""Draining a local copy to durable storage: one rank's part of a durable save of a step that
every rank already committed to its local tier.

The chunks are copied as they are stored (no second encode), each decoded and hashed first, so
a byte that went bad on a node never reaches durable storage, where later saves would reuse it;
a chunk the durable save knows stored (``SaveSession.learn``) costs no request. The rank's
durable index holds the same entries and tree as its local one, under its rank in the job. The
front-end gathers every rank's ``RankWritten`` and commits as for any save.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptstore.catalog import load_manifest, read_object, read_rank_index
from ckptstore.codec import decode
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    DrainSupersededError,
    ObjectExistsError,
    ObjectNotFoundError,
    RankLostError,
    one_line,
    same_kind,
)
from ckptstore.format import ChunkInfo, Manifest, RankIndex, chunk_key, commit_key
from ckptstore.leases import SAVE, Lease
from ckptstore.pipeline import (
    Rechecks,
    chunk_damage,
    existing_chunk_size,
    release_free_memory,
    rewrite_chunk,
)
from ckptstore.save.collective import save_collective
from ckptstore.save.once import gather_stored, share_out
from ckptstore.save.session import RankWritten, SaveSession
from ckptstore.store import Store, set_thread_nice
from ckptstore.tiers.committed import CommittedCopy
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import TIER_KEY

logger = logging.getLogger(__name__)


@dataclass
class Drained:
    """A rank's part of a drain: its index in durable storage, the save's user metadata and
    (a DCP step) the save's DCP metadata, as its local copy recorded them."""

    written: RankWritten
    user: dict
    dcp_metadata: bytes | None


def drain_rank(
    session: SaveSession,
    local: LocalTier,
    rank: int,
    group: Any = None,
    copy: CommittedCopy | None = None,
) -> Drained:
    """Copy ``rank``'s local copy of ``session``'s step and attempt into ``session``'s store,
    and put its index there. ``group``: the ranks draining together (every one calling): a
    chunk several of them hold is copied by one of them (``save.once``). ``copy``: that copy
    as its local commit wrote it (its manifest and index are then not read again), and that
    commit's lease of the local store, held until here and released here."""
    store = local.store(rank)
    step, attempt = session.step, session.attempt
    known = session.known if session.known is not None else {}
    together = group is not None and group.active
    if copy is not None and (copy.ward, copy.step, copy.attempt) != (rank, step, attempt):
        copy = None
    lease = None
    if copy is not None:
        lease, copy.lease = copy.lease, None  # the local commit's, released here
    error: BaseException | None = None
    held: list[tuple[str, int]] = []
    try:
        if lease is None:
            lease = _drain_lease(store, local, step, attempt)
        manifest, index, metadata = _local_copy(store, local, rank, step, attempt, copy)
        held = sorted((digest, info.raw) for digest, info in index.chunks.items())
    except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
        if not together:
            if lease is not None:
                lease.release_when_settled(0.0)
            raise
        error = exc
    try:
        recheck = session.rechecks()
        mine = share_out(group, held, known, error, recheck=recheck) if together else None
        durable = session.store
        put = functools.partial(_copy_chunk, session, local, store, known, recheck)
        ours = [(d, c) for d, c in sorted(index.chunks.items()) if mine is None or d in mine]
        written: dict[str, ChunkInfo] = {}
        try:
            written = dict(
                durable.map(
                    put,
                    ours,
                    max_concurrency=session.engine.config.encode_threads,
                    drain=True,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
            exc = _dropped(store, step, exc) if copy is not None else exc
            if not together:
                raise exc
            error = exc
        finally:
            release_free_memory()
        if together:
            gather_stored(group, written, known, error)
        chunks = {d: written[d] if d in written else known[d] for d in index.chunks}
        written_ref = session.put_index(
            rank, index.tensors, chunks, tree=index.tree, items=index.items
        )
        user = {k: v for k, v in manifest.user.items() if k != TIER_KEY}
        return Drained(written_ref, user, metadata)
    finally:
        if lease is not None:
            lease.release_when_settled(0.0)


def _local_copy(
    store: Store, local: LocalTier, rank: int, step: int, attempt: str, copy: CommittedCopy | None
) -> tuple[Manifest, RankIndex, bytes | None]:
    """The manifest, index and DCP metadata of ``rank``'s copy of ``step``: ``copy``'s, as
    the local commit wrote them, else read from ``store`` (under the drain's lease)."""
    if copy is not None:
        metadata = copy.metadata if copy.manifest.dcp_metadata is not None else None
        return copy.manifest, copy.index, metadata
    manifest = load_manifest(store, step)
    if manifest.attempt != attempt or not local.belongs(manifest, rank):
        raise CheckpointError(
            f"{store.uri}: step {step} is another save ({manifest.attempt}) than the one "
            f"to drain ({attempt})"
        )
    index = read_rank_index(store, manifest.ranks[0])
    metadata = None
    if manifest.dcp_metadata is not None:
        metadata = read_object(store, manifest.dcp_metadata, "DCP metadata")
    return manifest, index, metadata


def _dropped(store: Store, step: int, exc: BaseException) -> BaseException:
    """A chunk of a copy taken from memory that could not be read: the step dropped from
    ``store`` meanwhile (an outside gc) is named as such, as a drain that read its manifest
    would have found it; any other error as it is."""
    if not isinstance(exc, (CheckpointNotFoundError, ObjectNotFoundError)):
        return exc
    try:
        gone = not store.exists(commit_key(step))
    except CheckpointError:
        return exc
    if not gone:
        return exc
    dropped = CheckpointNotFoundError(
        f"step {step} is not committed in {store.uri} (gone before its drain read it: removed "
        "by another process, or by hand)"
    )
    dropped.__cause__ = exc
    return dropped


def _drain_lease(store: Store, local: LocalTier, step: int, attempt: str) -> Lease:
    """A save lease on the local store while its copy is drained: no sweep removes a chunk
    before it is copied."""
    return Lease(
        store,
        SAVE,
        f"{step:020d}-{attempt}-drain-{uuid.uuid4().hex[:12]}",
        ttl_s=local.engine.lease_ttl_s,
        info={"step": step, "attempt": attempt, "drain": True},
    ).acquire()


def _copy_chunk(
    session: SaveSession,
    local: LocalTier,
    store: Store,
    known: dict[str, ChunkInfo],
    recheck: Rechecks | None,
    item: tuple[str, ChunkInfo],
) -> tuple[str, ChunkInfo]:
    """One chunk of the local copy in ``store`` put in the durable store as it is stored,
    decoded and hashed first (a bad one is forgotten by the local tier); one the durable save
    knows stored costs no request, unless ``recheck`` has it read back there (written again
    from the local copy if it is found damaged: ``pipeline.rewrite_chunk``). Returns the chunk
    as the durable store holds it."""
    digest, info = item
    durable = session.store
    damage = None
    if digest in known:
        if recheck is None or not recheck.chosen(digest):
            return digest, known[digest]
        damage = chunk_damage(durable, digest, known[digest])
        if damage is None:
            return digest, known[digest]
    key = chunk_key(digest)
    data = store.get_view(key, 0, info.stored + 1)
    if len(data) != info.stored:
        raise CheckpointError(
            f"chunk {store.url(key)}: {len(data)} bytes stored, the index says {info.stored}"
        )
    try:
        decode(data, expected_hash=digest, name=store.url(key), raw_len=info.raw)
    except CheckpointCorruptError:
        local.forget_bad_chunk(digest)
        raise
    if damage is not None:
        return digest, rewrite_chunk(durable, digest, known[digest], [data], damage)
    try:
        durable.put(key, data, hedged=session.engine.hedge_uploads, shared=True)
    except ObjectExistsError:  # another rank or save stored it, maybe encoded otherwise
        return digest, ChunkInfo(info.raw, existing_chunk_size(durable, key, info.raw))
    return digest, info


@dataclass
class DrainJob:
    """A step every rank committed to its local tier, to be committed to durable storage."""

    step: int
    attempt: str
    kind: str
    future: Future[None]
    keep: bool = False  # never superseded: a save that waits for its drain (after SIGTERM)
    copy: CommittedCopy | None = None
    """This rank's copy as its local commit wrote it, with that commit's lease of the local
    store, held until the drain is over (``TierSaver.take_copy``)."""


class DrainQueue:
    """Drains in save order on a thread and a gloo group of their own, for every front-end.

    When drains fall behind saves, the ranks agree on the newest step every one of them has
    queued and drain it next; the older steps queued before it are superseded (their future
    fails with ``DrainSupersededError``; their local copies are released to retention), so the
    durable tier follows the newest save and the local tier does not grow without bound. Every
    rank queues the same steps in the same order (each drain is collective)."""

    def __init__(
        self,
        *,
        local: LocalTier,
        group: RankGroup,
        store: Store,
        thread_nice: int = 0,
        keep_alive: Any = None,
        missed: Callable[[], None] = lambda: None,
    ) -> None:
        # The front-end whose exit hook (a weak reference) closes this queue: kept alive by the
        # drain thread until ``close``, so a job that drops it still drains at exit.
        self._keep_alive = keep_alive
        self.local = local
        self.group = group
        self.store = store
        self._thread_nice = thread_nice
        self._missed = missed  # a drain failed: its durability passes to the next save
        self._queue: queue.Queue[DrainJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._failures: list[tuple[int, BaseException]] = []
        self._superseded_logged = False
        self.last: Future[None] | None = None
        self._thread = threading.Thread(target=self._loop, name="ckptstore-drain", daemon=True)
        self._thread.start()

    def put(self, job: DrainJob) -> None:
        self.local.protect(job.step)  # until drained or superseded
        self.last = job.future
        self._queue.put(job)

    def wait(self) -> None:
        """Block until every drain queued so far is over (done, failed or superseded)."""
        last = self.last
        if last is not None:
            last.exception()

    def queued(self) -> int:
        """Drains queued and not yet taken by the drain thread."""
        return self._queue.qsize()

    def raise_failures(self) -> None:
        """Raise, once, that steps committed to the local tiers did not reach durable storage
        (the drains that failed since the last call)."""
        with self._lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        steps = ", ".join(str(step) for step, _ in failures)
        first = failures[-1][1]
        if isinstance(first, CommitUnknownError):  # it may be there: never said failed
            raise CommitUnknownError(
                f"step(s) {steps} committed to the local tiers; whether they reached durable "
                f"storage {self.store.uri} is unknown (`ckptstore ls` tells): {one_line(first)}"
            ) from first
        message = (
            f"step(s) {steps} committed to the local tiers but not to durable storage "
            f"{self.store.uri} (a save after it goes there): {one_line(first)}"
        )
        if isinstance(first, RankLostError):  # caught as what it is, its ranks named
            raise type(first)(message, first.lost) from first
        raise same_kind(first, message) from first

    def close(self) -> None:
        """Drain what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
        self._keep_alive = None

    def _loop(self) -> None:
        set_thread_nice(self._thread_nice)
        backlog: list[DrainJob] = []
        closing = False
        while backlog or not closing:
            if not backlog:
                job = self._queue.get()
                if job is None:
                    return
                backlog.append(job)
            while not closing:  # what else is queued by now
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                else:
                    backlog.append(job)
            # Every rank's backlog starts with the same step; the least of their newest is
            # queued on every rank.
            try:
                newest = min(self.group.gather(backlog[-1].step))
            except BaseException as exc:  # noqa: BLE001 - a lost rank: the job fails, the
                # thread goes on (the group is spent, so each queued job fails in turn and
                # every future is resolved: wait() and close() return)
                job = backlog.pop(0)
                self._fail(job, exc)
                self.local.unprotect(job.step)
                continue
            while backlog[0].step < newest and not backlog[0].keep:
                self._supersede(backlog.pop(0), newest)
            self._run(backlog.pop(0))

    def _run(self, job: DrainJob) -> None:
        try:
            if self._drain(job):  # in durable storage too: a full tier may let this copy go
                self.local.note_drained(job.step)
            job.future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - reported on the job's future
            self._fail(job, exc)
        finally:
            self.local.unprotect(job.step)
            _let_go(job)

    def _fail(self, job: DrainJob, exc: BaseException) -> None:
        _let_go(job)  # before its future is done: a waiter finds the lease released
        logger.warning(
            "rank %d: step %d was not drained to %s (%s): %s",
            self.group.rank,
            job.step,
            self.store.uri,
            "its local copy is missing objects"
            if isinstance(exc, CheckpointNotFoundError)
            else "or its outcome is unknown; its local copies stay"
            if isinstance(exc, CommitUnknownError)
            else "its local copies stay",
            one_line(exc),
        )
        self._missed()
        job.future.set_exception(exc)
        with self._lock:
            self._failures.append((job.step, exc))

    def _supersede(self, job: DrainJob, newest: int) -> None:
        level = logging.INFO if self._superseded_logged else logging.WARNING
        self._superseded_logged = True
        _let_go(job)
        logger.log(
            level,
            "rank %d: drains to %s fall behind saves: step %d is not drained, step %d is next",
            self.group.rank,
            self.store.uri,
            job.step,
            newest,
        )
        job.future.set_exception(
            DrainSupersededError(
                f"step {job.step} was not drained to {self.store.uri}: step {newest}, saved "
                "after it, was queued meanwhile and is drained instead (drains fell behind saves)"
            )
        )
        self.local.unprotect(job.step)

    def _drain(self, job: DrainJob) -> bool:
        """Commit ``job``'s step to durable storage from every rank's local copy; whether it
        is committed there (an unhealthy step a ``HealthPolicy`` skips is not)."""
        assert self.local.engine is not None
        session = SaveSession(
            self.local.engine, self.store, step=job.step, attempt=job.attempt, kind=job.kind
        )
        drained: list[Drained] = []

        def write(latest: Any) -> RankWritten:
            if isinstance(latest, BaseException):
                raise latest
            session.learn(self.group.rank, latest)
            drained.append(
                drain_rank(session, self.local, self.group.rank, self.group, copy=job.copy)
            )
            return drained[0].written

        health = save_collective(
            session,
            self.group,
            write,
            user=lambda: drained[0].user,
            dcp_metadata=lambda: drained[0].dcp_metadata,
        )
        return health is not None and health.committed


def _let_go(job: DrainJob) -> None:
    """The local commit's lease of a step not drained (failed, superseded), if still held."""
    if job.copy is not None and job.copy.lease is not None:
        job.copy.release()
