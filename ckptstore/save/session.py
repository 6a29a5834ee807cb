"""One save, as every front-end walks it: the commit protocol::

    begin      (the coordinator) the save's one lease, once no gc sweeps (leases.py): from here
               until release no gc deletes a chunk, so chunks found stored may be referenced,
               not rewritten; then the committed steps, listed once, and the newest one's
               manifest: where each rank's index of it is
    learn      (every rank) its own index of that step, one read: the chunks this save knows
               are stored, and they stay so under the coordinator's lease
    write      a rank's chunks hashed, deduplicated, encoded, put (encode_threads at once): a
               known chunk costs no request, an unknown one a single exclusive-create put
    index      the rank's index built and put once, each floating tensor's health in it (its
               NaN and Inf counts and sum of squares, scanned in ``write`` from the staged
               copy as each chunk is hashed, ``health.ChunkScan``); what it wrote, for the
               coordinator
    commit     (the coordinator) the lease still held -> the step's health from every rank's
               (``HealthPolicy``: an unhealthy step is saved, skipped or refused) -> the
               manifest written once; an ambiguous outcome is read back
    release    (the coordinator) the lease, once the commit's outcome is known or a rank is lost
    retain     (the coordinator) keep_last under a gc lease

Every rank works under the coordinator's lease, so the requests a save makes besides its chunks
do not grow with ranks: one lease, one gc check and one listing per save, and per rank one read
and one put of an index. A crash anywhere leaves the previous steps intact and the new one
invisible or complete: a dead rank ends the save before its commit (the front-end's exchange
fails), a dead coordinator commits nothing, and the next gc removes what they left once the
lease is released or stale.

The front-ends decide *when* each step runs (``Checkpointer``'s background thread; DCP's
``prepare_global_plan`` / ``write_data`` / ``finish``) and how ranks exchange what ``begin``
found and what they wrote (gloo objects; DCP's plans and write results). Every ``RankIndex``
and ``Manifest`` a save writes is built here.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.catalog import (
    commit_manifest,
    list_steps,
    load_manifest,
    rank_of,
    read_rank_index,
    seen_below,
)
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    FormatVersionError,
    StorageError,
    one_line,
)
from ckptstore.format import (
    ChunkInfo,
    Manifest,
    ObjectRef,
    RankIndex,
    TensorEntry,
    dcp_metadata_key,
    encode_manifest,
    encode_rank_index,
    object_ref,
    rank_index_key,
    split_dcp_item_key,
)
from ckptstore.health import ChunkScan, RankHealth, StepHealth, rank_health, to_commit, verdict
from ckptstore.health import one_line as health_line
from ckptstore.leases import Lease, acquire_save_lease
from ckptstore.pipeline import ChunkLayout, Rechecks, suspect_chunks, tensor_entries, write_chunks
from ckptstore.retention import collect
from ckptstore.save.engine import SaveEngine
from ckptstore.save.once import write_chunks_once
from ckptstore.store import Store
from ckptstore.store.processes import machine_tag
from ckptstore.tree import tensor_paths

logger = logging.getLogger(__name__)

PREVIOUS_HEALTHY_READS = 32  # manifests read back at most to find the previous healthy step


def tensor_names(index: RankIndex) -> dict[int, str]:
    """Tensor index -> its name: its path in a state save, its fully qualified name in a DCP
    save (a shard's offsets left out)."""
    if index.items is not None:
        return {i: split_dcp_item_key(key)[0] for key, i in index.items.items()}
    return tensor_paths(index.tree)


def previous_healthy(store: Store, step: int) -> tuple[int, dict] | None:
    """The newest committed step before ``step`` whose health is healthy, and its health;
    None if none is among the ``PREVIOUS_HEALTHY_READS`` steps before it."""
    older = [s for s in list_steps(store) if s < step][-PREVIOUS_HEALTHY_READS:]
    for s in reversed(older):
        try:
            health = load_manifest(store, s).health
        except (CheckpointNotFoundError, CheckpointCorruptError, FormatVersionError):
            continue
        if health is not None and health["healthy"]:
            return s, health
    return None


@dataclass(frozen=True)
class RankWritten:
    """What one rank hands the committing rank: its index and its chunks' sizes."""

    rank: int
    index: ObjectRef
    chunk_bytes: dict[str, tuple[int, int]]  # digest -> (raw, stored)
    health: RankHealth | None = None  # None: not recorded (scan off, or an older copy)
    store: str = ""  # where it was written (``store_place``); "": not said (an older copy)


def store_place(store: Store) -> str:
    """Where a rank writes: an object store's URI; a local store's real path on this host
    (with the machine's tag: the same path on two hosts may be two disks); a ``memory://``
    store's, with the process's (each process has its own)."""
    here = f"on {socket.gethostname()} ({machine_tag() or 'no boot id'})"
    if store.is_local:
        return f"{os.path.realpath(store.root)} {here}"
    if store.uri.startswith("memory://"):
        return f"{store.uri} {here}, pid {os.getpid()}"
    return store.uri


@dataclass(frozen=True)
class LatestIndex:
    """Where a rank finds the chunks it knows: its index in the newest committed step, as the
    coordinator's ``begin`` found it in that step's manifest."""

    step: int
    index: ObjectRef


def save_lease_holder(step: int, attempt: str, rank: int) -> str:
    """Who holds the lease of a save of ``step`` (``attempt``) begun on ``rank``."""
    return f"{step:020d}-{attempt}-{rank:05d}"


class SaveSession:
    """One save of ``step`` (``attempt``) of ``kind`` to ``store`` (see the module docstring).

    The coordinator's session calls ``begin`` (it holds the save's lease); every rank's session,
    the coordinator's included, then calls ``learn`` with what ``begin`` found for that rank.
    A session on which neither is called knows no chunks (``known`` stays None) and asks the
    store for each chunk's size before putting it (docs/FORMAT.md, "Known chunks")."""

    def __init__(
        self, engine: SaveEngine, store: Store, *, step: int, attempt: str, kind: str
    ) -> None:
        self.engine = engine
        self.store = store
        self.step = step
        self.attempt = attempt
        self.kind = kind
        self.lease: Lease | None = None
        self.known: dict[str, ChunkInfo] | None = None
        """Chunks this save may reference without asking the store (set by ``learn``): those
        of the rank's index in the latest committed step, and those this save wrote."""
        self.index_written: tuple[RankIndex, bytes] | None = None
        """The index ``put_index`` wrote, and its bytes (a tier copy hands them on)."""
        self.manifest_written: tuple[Manifest, bytes] | None = None
        """The manifest ``commit`` wrote, and its bytes (a tier copy hands them on)."""
        self._scans: list[tuple[list[TensorEntry], ChunkScan]] = []
        """Each ``write``'s entries and health scan, whose results ``put_index`` records."""

    def begin(self, rank: int = 0) -> dict[int, LatestIndex]:
        """On the coordinator (``rank``): take the save's lease, which covers every rank, and
        wait while a gc sweeps: from here until ``release()`` no gc deletes a chunk, so chunks
        found stored may be referenced instead of written again. Then list the committed steps
        and read the newest one's manifest: by rank, where each rank's index of it is (empty
        when there is no step, or its manifest cannot be read); the coordinator's own chunks
        are learnt here."""
        lease = acquire_save_lease(
            self.store,
            save_lease_holder(self.step, self.attempt, rank),
            ttl_s=self.engine.lease_ttl_s,
            gc_wait_s=self.engine.gc_wait_s,
            what=f"save of step {self.step}",
            info={"step": self.step, "attempt": self.attempt, "rank": rank, "save_kind": self.kind},
        )
        try:
            latest = self._latest_indexes()
            self.learn(rank, latest.get(rank))
        except BaseException:
            lease.release()
            raise
        self.lease = lease
        return latest

    def _latest_indexes(self) -> dict[int, LatestIndex]:
        steps = list_steps(self.store)
        if not steps:
            return {}
        try:
            manifest = load_manifest(self.store, steps[-1])
            return {rank_of(ref.key): LatestIndex(steps[-1], ref) for ref in manifest.ranks}
        except (CheckpointNotFoundError, CheckpointCorruptError, FormatVersionError) as exc:
            logger.info(
                "save of step %d knows no stored chunks (step %d: %s)", self.step, steps[-1], exc
            )
            return {}

    def learn(self, rank: int, latest: LatestIndex | None) -> SaveSession:
        """Know the chunks of ``latest``, ``rank``'s index in the newest committed step as the
        coordinator's ``begin`` found it (None: there is none, then no chunk is known): one
        read, checked against the size and hash its manifest records. The chunks are stored,
        and stay so while the coordinator holds its lease, whichever rank reads them; an index
        that cannot be read, or a store that does not answer, leaves none known (each chunk is
        put, one found stored is kept): this rank then fails, if it does, where every rank
        hears it, not before the exchanges of the save. The coordinator learns in ``begin``; a
        second call changes nothing."""
        if self.known is not None:
            return self
        self.known = {}
        if latest is None:
            return self
        try:
            self.known = dict(read_rank_index(self.store, latest.index).chunks)
        except StorageError as exc:
            logger.warning(
                "rank %d: save of step %d knows no stored chunks (step %d's index: %s)",
                rank,
                self.step,
                latest.step,
                one_line(exc),
            )
        except (CheckpointNotFoundError, CheckpointCorruptError, FormatVersionError) as exc:
            logger.info(
                "rank %d: save of step %d knows no stored chunks (step %d: %s)",
                rank,
                self.step,
                latest.step,
                exc,
            )
        return self

    def rechecks(self) -> Rechecks:
        """Which of the chunks this save references without writing it reads back
        (``pipeline.Rechecks``: about one in ``recheck_every``, and those a load in this
        process, or in another rank's, found damaged)."""
        # Made with no period and no suspect too: in a save with one writer per chunk, another
        # rank's suspects (heard in the exchange) may fall to this rank to read back.
        return Rechecks(self.engine.recheck_every, self.step, suspect_chunks(self.store))

    def write(
        self,
        buffer: torch.Tensor,
        layout: ChunkLayout,
        tensors: list[Any],
        *,
        health: list | None = None,
        group: Any = None,
    ) -> tuple[list[TensorEntry], dict[str, ChunkInfo]]:
        """Put the chunks of ``layout`` (slices of ``buffer``, whose copy is done); the entries
        of ``tensors`` (laid out at ``layout.offsets``) and the chunks written or found, each
        floating tensor's health scanned from ``buffer`` as its chunks are hashed and recorded
        in its entry by ``put_index``, with the rank's (``health``: already scanned where the
        state was staged on a device, recorded here). ``group``: the ranks saving together
        (every rank calling, each having learnt): a chunk several of them hold is put by one of
        them (``pipeline.write_chunks_once``)."""
        engine = self.engine
        scan = None
        if engine.health.scan and health is None:
            # In the chunks' hashing pass: each piece of a chunk is scanned right before it is
            # hashed, while it is in cache (one read of the staged copy for both).
            scan = ChunkScan(tensors, layout.offsets, layout.chunks)
        args = (self.store, buffer.numpy(), layout, engine.config)
        options = {
            "hedged": engine.hedge_uploads,
            "governor": engine.governor,
            "known": self.known,
            "scan": scan,
            "recheck": self.rechecks(),
        }
        if group is not None and group.active and self.known is not None:
            digests, chunks = write_chunks_once(*args, group, save=self.attempt, **options)
        else:
            digests, chunks = write_chunks(*args, **options)
        entries = tensor_entries(tensors, layout, digests)
        if scan is not None:
            self._scans.append((entries, scan))  # recorded in ``entries`` by ``put_index``
        elif engine.health.scan and health is not None:
            for entry, h in zip(entries, health):
                entry.health = h
        return entries, chunks

    def put_index(
        self,
        rank: int,
        entries: list[TensorEntry],
        chunks: dict[str, ChunkInfo],
        *,
        tree: Any = None,
        numpy: set[int] = frozenset(),
        items: dict[str, int] | None = None,
    ) -> RankWritten:
        """Put the rank's index: a state save's ``tree`` (``numpy``: the tensors that were
        numpy arrays, marked in their entries) or a DCP save's ``items``, each entry with the
        health its ``write`` scanned; what the rank wrote, its health summed. A lapsed lease is
        found by ``commit``, before anything references the index."""
        for i in numpy:
            entries[i].numpy = True
        index = RankIndex(rank=rank, tensors=entries, chunks=chunks, tree=tree, items=items)
        names = tensor_names(index)
        policy = self.engine.health
        scans, self._scans = self._scans, []
        health = rank_health(rank, scans, entries, names, policy.norm_groups, policy.ignore)
        data = encode_rank_index(index)
        key = rank_index_key(self.step, self.attempt, rank)
        self.store.put(key, data)
        self.index_written = (index, data)
        sizes = {digest: (c.raw, c.stored) for digest, c in chunks.items()}
        return RankWritten(rank, object_ref(key, data), sizes, health, store_place(self.store))

    def commit(
        self,
        ranks: list[RankWritten],
        *,
        world_size: int,
        user: dict | None = None,
        dcp_metadata: bytes | None = None,
        apply_policy: bool = True,
    ) -> StepHealth:
        """Write the step's manifest over ``ranks`` (and DCP's ``dcp_metadata``, put first),
        unless the lease was lost (a gc may have swept meanwhile). A chunk written by several
        ranks counts once in the byte totals. The step's health is judged from every rank's
        (``HealthPolicy``; ``apply_policy=False``, a tier copy: NaN and Inf only, and always
        committed); an unhealthy step is committed with one warning, or skipped (nothing
        written), or refused (``UnhealthyStepError``). Returns the step's health."""
        self._refuse_stores_apart(ranks)
        policy = self.engine.health
        health = self._judge(ranks, policy.norm_jump if apply_policy else None)
        action = policy.on_unhealthy if apply_policy else "save"
        if not to_commit(self.step, health, action, self.store.uri):
            return StepHealth.of(self.step, health, committed=False)
        metadata_ref = None
        if dcp_metadata is not None:
            key = dcp_metadata_key(self.step, self.attempt)
            self.store.put(key, dcp_metadata)
            metadata_ref = object_ref(key, dcp_metadata)
        unique: dict[str, tuple[int, int]] = {}
        for written in ranks:
            unique.update(written.chunk_bytes)
        manifest = Manifest(
            step=self.step,
            attempt=self.attempt,
            kind=self.kind,
            world_size=world_size,
            ranks=[w.index for w in sorted(ranks, key=lambda w: w.rank)],
            dcp_metadata=metadata_ref,
            raw_bytes=sum(raw for raw, _ in unique.values()),
            stored_bytes=sum(stored for _, stored in unique.values()),
            user=user or {},
            health=health,
            previous=seen_below(self.store, self.step),
        )
        data = encode_manifest(manifest)
        if self.lease is not None:
            self.lease.check()
        try:
            commit_manifest(self.store, manifest.step, data)
        except CommitUnknownError:
            self.release(outcome_unknown=True)
            raise
        self.manifest_written = (manifest, data)
        if health is not None and not health["healthy"]:
            logger.warning("%s (committed to %s)", health_line(self.step, health), self.store.uri)
        logger.info(
            "committed %s step %d to %s (%d ranks, %d bytes raw, %d stored)",
            self.kind,
            self.step,
            self.store.uri,
            world_size,
            manifest.raw_bytes,
            manifest.stored_bytes,
        )
        return StepHealth.of(self.step, health)

    def _refuse_stores_apart(self, ranks: list[RankWritten]) -> None:
        """Every rank wrote to this store, else nothing is committed: ranks given different
        stores (a path with the time in it, a node-local durable path) committed a manifest
        naming indexes this store does not hold, and every step was lost. A store named
        otherwise (a shared file system mounted at another path, on another host) counts when
        its rank's index is found here, checked once per rank and place."""
        here = store_place(self.store)
        seen = self.engine.places_seen
        other = [w for w in ranks if w.store and w.store != here and (w.rank, w.store) not in seen]
        found = list(self.store.map(lambda w: self.store.exists(w.index.key), other))
        seen.update((w.rank, w.store) for w, there in zip(other, found, strict=True) if there)
        other = [w for w, there in zip(other, found, strict=True) if not there]
        if not other:
            return
        shown = "; ".join(f"rank {w.rank} {w.store}" for w in other[:4])
        more = f"; and {len(other) - 4} more" if len(other) > 4 else ""
        raise CheckpointError(
            f"step {self.step} was not committed: ranks wrote to other stores than the "
            f"committing rank's {here} ({shown}{more}): every rank needs the same store"
        )

    def _judge(self, ranks: list[RankWritten], norm_jump: float | None) -> dict | None:
        """The step's health over every rank's; None (unknown) when a rank recorded none."""
        previous: tuple[int, dict] | None = None
        if norm_jump is not None and all(w.health is not None for w in ranks):
            previous = previous_healthy(self.store, self.step)
        return verdict(
            [w.health for w in ranks],
            previous=previous[1] if previous else None,
            previous_step=previous[0] if previous else None,
            norm_jump=norm_jump,
        )

    def hand_over_lease(self) -> Lease | None:
        """The save's lease, which the caller now holds and releases (a tier copy keeps it
        through the phases after its commit); ``release`` then releases nothing."""
        lease, self.lease = self.lease, None
        return lease

    def release(self, outcome_unknown: bool = False) -> None:
        """Give the lease up once every put that may still land has (a manifest put abandoned
        at its deadline must not find its chunks swept); ``outcome_unknown``: left to go stale
        (``Lease.release_when_settled``)."""
        if self.lease is not None:
            self.lease.release_when_settled(0.0, outcome_unknown)
            self.lease = None

    def _retention(self, **kwargs: Any) -> Any:
        """``keep_last`` applied to the store, as this job's retention applies it."""
        return collect(
            self.store,
            keep_last=self.engine.keep_last,
            lease_ttl_s=self.engine.lease_ttl_s,
            verify_healthy=True,  # an old healthy step kept for its health is read once
            known=self.engine.retained_good,
            **kwargs,
        )

    def reclaim(self) -> None:
        """After a save that failed on a full store (``StorageFullError``): what failed saves
        left (this one's chunks, which no commit names) swept as the next commit's retention
        would, so that the next save finds room once what filled the store is gone, where
        nothing else would (no save commits, and retention runs after a commit). With
        ``keep_last`` only (a job that deletes); a sweep that fails too is logged."""
        if self.engine.keep_last is None:
            return
        try:
            report = self._retention()
        except CheckpointError as exc:
            logger.warning(
                "%s is full, and sweeping what failed saves left failed too (free room beside "
                "it; the next failed save tries again): %s",
                self.store.uri,
                exc,
            )
            return
        if report.deleted_chunks:
            logger.warning(
                "%s was full: swept %d chunk(s) of failed saves (%d bytes), room for the next",
                self.store.uri,
                report.deleted_chunks,
                report.deleted_chunk_bytes,
            )

    def retain(self) -> None:
        """Apply ``keep_last`` after a commit; a failure is logged (the next save retries). The
        step just committed is kept even where ``keep_last`` newer-numbered steps outnumber it
        (what ``wait()`` reports committed is there when it returns), with a warning."""
        if self.engine.keep_last is None:
            return
        # The step this engine committed before lists by now where the listing works; one
        # lacking it lags, and may lack others, whose chunks would look unreferenced.
        earlier = self.engine.committed_last.get(self.store.uri)
        self.engine.committed_last[self.store.uri] = self.step
        try:
            report = self._retention(
                ignore_attempts={self.attempt}, keep_steps={self.step}, listed_since=earlier
            )
        except CheckpointError as exc:
            logger.warning(
                "retention in %s failed (will retry after the next save): %s", self.store.uri, exc
            )
            return
        if self.step in report.spared:
            logger.warning(
                "step %d committed in %s below the newest %d steps (keep_last=%d keeps the "
                "highest-numbered: %s): kept now, deleted by the next save's retention; a "
                "second run into the same store without resuming? latest() names step %d",
                self.step,
                self.store.uri,
                self.engine.keep_last,
                self.engine.keep_last,
                ", ".join(map(str, report.kept_steps[-self.engine.keep_last :])),
                report.kept_steps[-1],
            )
