"""The tier half of a save, the same for every front-end: copies of a run the job left are
unlisted, each rank's copy is committed to its local tier (every rank's or none: they agree),
then sent to its holders on other nodes (``peer_copies``).

A front-end says what a rank writes (``write(session)``, its chunks and index in the rank's
local store) and what the save's manifest records; ``TierSaver`` sequences the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.catalog import list_steps
from ckptstore.errors import (
    CheckpointError,
    RankLostError,
    StepExistsError,
    StorageError,
    one_line,
)
from ckptstore.format import chunk_key, commit_key
from ckptstore.health import StepHealth, to_commit, verdict
from ckptstore.render import rank_ranges
from ckptstore.retention import drop_step
from ckptstore.save.collective import saves_apart
from ckptstore.save.session import RankWritten, SaveSession
from ckptstore.store import Store, niced
from ckptstore.tiers.committed import CommittedCopy
from ckptstore.tiers.drain import DrainQueue
from ckptstore.tiers.group import Agreement, RankGroup
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import TIER_KEY, DurableCadence, TierPolicy, Topology, node_identity
from ckptstore.tiers.resumes import record_resume
from ckptstore.tiers.transfer import Transfer, TransferStats, transfer, wait_written

logger = logging.getLogger(__name__)


ASK_S = 5.0
"""How long a tiered save of a step above every step the durable store listed since the load
asks it whether it holds that step (``durable_holds``)."""


def durable_holds(store: Store, step: int, local: LocalTier, bound: bool = True) -> bool:
    """Whether the durable ``store`` holds ``step`` committed, asked before a tiered save of
    it (``bound``: the save is bound for durable storage).

    The first save of this process, and the first since each of its loads, lists the store
    and asks for its step: a job that rolled back learns which later steps it holds (a load
    prefers the durable save of a step to a local one, so a local save of one would never
    load). A step at or below the newest listed is asked with the store's own bound, and one
    that cannot be asked is not saved (``StorageError``), as is the first save since a load
    whose listing does not answer. A step above it can be there only if a second job on the
    store committed it since (or the listing left out a step committed before): asked within
    ``ASK_S``, and a store that does not answer is taken not to hold it, the local tier
    taking the save (as while the durable store is out; its drain is refused if the store
    does). A save not ``bound`` does not ask a store that did not answer the last ask (where
    nothing rolled back may be there), so a hung store holds no save long."""
    newest = local.durable_newest
    unlisted_out = newest is None and not local.durable_unasked  # no load: nothing rolled back
    if (unlisted_out or (newest is not None and step > newest)) and local.durable_out and not bound:
        return False  # the store is out: its drains say so
    if newest is None:
        try:
            steps = list_steps(store)
            there = step in steps or store.exists(commit_key(step))  # a listing may lag
        except CheckpointError as exc:
            if local.durable_unasked:
                raise _cannot_know(
                    store, step, "no save has asked it since this job loaded a step", exc
                ) from exc
            return _not_asked(store, step, local, bound, exc)
        local.durable_listed([*steps, step] if there else steps)
        return there
    try:
        there = store.exists(commit_key(step), within_s=ASK_S if step > newest else None)
    except CheckpointError as exc:
        if step <= newest:
            why = f"it held steps up to {newest} when this process listed it"
            raise _cannot_know(store, step, why, exc) from exc
        return _not_asked(store, step, local, bound, exc)
    local.durable_listed([newest, step] if there else [newest])  # there: the listing lagged
    return there


def _cannot_know(store: Store, step: int, why: str, exc: BaseException) -> StorageError:
    return StorageError(
        f"step {step}: {store.uri} does not answer ({one_line(exc)}), and {why}: were the step "
        "there (a rollback), this save would never be loaded; not saved (the next save asks "
        "again)"
    )


def _not_asked(store: Store, step: int, local: LocalTier, bound: bool, exc: BaseException) -> bool:
    local.durable_unanswered()
    logger.log(
        logging.WARNING if bound else logging.INFO,
        "step %d: could not ask %s whether it holds that step (%s): saved to the local tier%s",
        step,
        store.uri,
        one_line(exc),
        "; its drain is refused if the store does" if bound else "",
    )
    return False


def durable_steps(store: Store) -> list[int]:
    """The steps the durable ``store`` lists, for a tiered save numbering its step after one it
    numbered before; [] (with a WARNING) where it does not answer: the saves it numbered and the
    local copies number it."""
    try:
        return list_steps(store)
    except CheckpointError as exc:
        logger.warning(
            "could not list the steps of %s (%s): this save is numbered on from the saves "
            "before it and the local tier's steps",
            store.uri,
            one_line(exc),
        )
        return []


@dataclass
class LocalCommit:
    """A local commit as every rank saw it: what this rank wrote (None: a rank failed, nothing
    was committed locally, the save goes to durable storage) and every rank's payload."""

    written: RankWritten | None
    payloads: list[Any]
    health: StepHealth | None = None
    """The step's health over every rank's copy (NaN and Inf; ``ckptstore.health``)."""
    copy: CommittedCopy | None = None
    """This rank's committed copy as written (its manifest, index, DCP metadata), for the
    peer copy and the drain."""

    @property
    def skipped(self) -> bool:
        """An unhealthy step that ``HealthPolicy(on_unhealthy="skip")`` stores nowhere."""
        return self.health is not None and not self.health.committed


class TierSaver:
    """One rank's tier saves: its local tier, its ranks' group and where its copies go."""

    def __init__(
        self,
        policy: TierPolicy,
        local: LocalTier,
        group: RankGroup,
        topology: Topology | None,
        *,
        durable_uri: str,
        dir_mates: list[int] | None = None,
        durable: Store | None = None,
    ) -> None:
        """``dir_mates``: the ranks sharing this rank's job directory (None: unknown, and no
        store of a rank that left is removed); ``durable``: the store rank 0 records a resume
        in (``tiers.resumes``)."""
        self.policy = policy
        self.local = local
        self.group = group
        self.topology = topology
        self.durable_uri = durable_uri
        self.durable = durable
        self._resume: str | None = None  # rank 0: the token of the resume it just made
        self.rank = group.rank
        self.committed: set[int] = set()  # steps this process committed to the local tiers
        self.last_peer_copy: TransferStats | None = None
        self.last_copy: CommittedCopy | None = None
        """This rank's copy of the step it last committed locally, until ``copy_to_peers``;
        its ``lease`` (the local commit's) is held until then."""
        self._failures = 0  # local commits failed in a row
        # Fixed for the job: every rank's peer copies (source, holder), this rank's wards.
        self._pairs = [(r, h) for r in range(group.world_size) for h in _holders(topology, r)]
        self._wards = [self.rank] + _wards(topology, self.rank)
        # The ranks that share this node's job directory, the lowest of which removes the
        # stores of ranks it no longer keeps (``LocalTier.remove_left_behind``).
        mates = dir_mates or [self.rank]
        self._sweeps_dir = dir_mates is not None and self.rank == min(mates)
        self._kept_here = set(mates) | {w for m in mates for w in _wards(topology, m)}

    def wards(self) -> list[int]:
        """This rank and the ranks whose copies it holds."""
        return list(self._wards)

    def _clear_for(self, step: int) -> None:
        """Before this rank's copy of ``step``: the copies a resumed job left unlisted
        (``drop_stale``), and its own store's copy of ``step`` if another instance of the
        durable store made it (``LocalTier.drop_foreign``)."""
        self.drop_stale(step)
        self.local.drop_foreign(self.rank, step)

    def drop_stale(self, step: int) -> None:
        """At the first save after a load of step L in this process (either front-end): the
        copies of steps after L, and of ``step`` and later, that this process did not commit
        (a run the job left: any world size) are unlisted in this rank's store and its
        wards'; the resumed job saves those step numbers again, as other saves. A process
        that loaded nothing unlists nothing (another process's copies stay). A step still to
        be drained is kept. The lowest rank sharing this node's job directory also unlists
        those steps in the stores of ranks the node no longer keeps."""
        resumed = self.local.resumed_from
        if resumed is None:
            return
        floor = min(step, resumed + 1)
        # Only the saving object's own: a new object saving after a load of an older step (a
        # restart within the process) is a rollback, whatever objects committed the copies.
        keep = self.committed | set(self.local.to_drain())
        for ward in self.wards():
            if self.local.rank_dir(ward).is_dir():
                self._unlist(self.local.store(ward), floor, keep, f"rank {ward}'s local copies")
        if self._sweeps_dir:
            # The stores a restart left on this node hold the run the job left too: every copy.
            for _ward, path, store in self.local.left_behind(self._kept_here):
                try:
                    self._unlist(store, floor, set(), f"the copies left in {path}")
                except (CheckpointError, OSError) as exc:
                    logger.warning("rank %d: %s not unlisted: %s", self.rank, path, one_line(exc))
        # For the nodes away now; only a restarted process can have left one behind (a
        # process that committed copies before its load keeps them, as above).
        if self.rank == 0 and self.durable is not None and not self.local.last_two_committed():
            self._resume = record_resume(self.durable, floor - 1, self.rank)
        self.local.resumed_from = None

    def _take_resume(self) -> str | None:
        """(rank 0) The token of the resume its ``drop_stale`` just made, once."""
        resume, self._resume = self._resume, None
        return resume

    def _unlist(self, store: Store, floor: int, keep: set[int], what: str) -> None:
        stale = [s for s in list_steps(store) if s >= floor and s not in keep]
        for s in stale:
            drop_step(store, s)
        if stale:
            logger.warning(
                "rank %d: unlisted %s of steps %s (a run the job left)",
                self.rank,
                what,
                rank_ranges(stale),
            )

    def commit_local(
        self,
        *,
        step: int,
        attempt: str,
        kind: str,
        write: Callable[[SaveSession], RankWritten],
        user: dict | None = None,
        payload: Any = None,
        metadata: Callable[[], bytes] | None = None,
        fatal: BaseException | None = None,
    ) -> LocalCommit:
        """Every rank's copy of ``step``, committed only once every rank wrote its own.

        ``write(session)`` writes this rank's chunks and index (as rank 0 of a one-rank step);
        ``payload`` travels with this rank's outcome to every rank; ``metadata()`` (rank 0
        alone) is the save's DCP metadata, recorded in every rank's copy. A rank's ``fatal``
        error (it cannot take part in the save at all) fails the save on every rank once all
        heard of it."""
        wait_written()  # a copy a load repaired is committed before stale copies are judged
        local = self.local
        self.release_copy()  # a step whose peer copy never came
        session: SaveSession | None = None
        written: RankWritten | None = None
        shared: bytes | None = None
        error: BaseException | None = None
        committed = False
        dcp_metadata: bytes | None = None  # the save's, as every rank heard it
        try:
            try:
                if fatal is not None:
                    raise fatal
                self._clear_for(step)
                if metadata is not None and self.rank == 0:
                    shared = metadata()
                session = SaveSession(
                    local.engine, local.store(self.rank), step=step, attempt=attempt, kind=kind
                )
                session.begin(0)
                _forget_removed(session, local.take_bad())
                written = write(session)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it
                error = exc
            mine, save = None if written is None else written.health, (step, attempt)
            told = (payload, shared, fatal is not None, mine, save, self._take_resume())
            heard = self.group.agree(error, told)
            payloads = [p for p, *_ in heard.payloads]
            healths = [h and h.as_rank(r) for r, (_, _, _, h, *_) in enumerate(heard.payloads)]
            local.resume_token = heard.payloads[0][5]  # rank 0's: copies from now on carry it
            _raise_if_stopped(save, heard, fatal)
            health = verdict(healths) if heard.ok else None
            # Every rank judges the same healths alike: refused everywhere, or skipped.
            action = local.engine.health.on_unhealthy
            where = f"the local tiers or {self.durable_uri}"
            if heard.ok and not to_commit(step, health, action, where, log=self.rank == 0):
                return LocalCommit(None, payloads, StepHealth.of(step, health, committed=False))
            if heard.ok:
                dcp_metadata = next((m for _, m, *_ in heard.payloads if m), None)
                error = self._commit_copy(session, written, user, dcp_metadata)
                heard = self.group.agree(error)
                committed = heard.ok
        finally:
            if session is not None:
                if committed:  # its lease is held through the peer copy (and a drain)
                    self.last_copy = _committed(session, self.rank, dcp_metadata, keep=True)
                session.release()
        if not heard.ok:
            self._not_committed(step, heard)
            return LocalCommit(None, payloads)
        self._failures = 0
        self.committed.add(step)
        local.note_committed(step)
        # The step is kept, so its chunks are: the lease held for its peer copy and drain need
        # not stop this sweep of the others.
        local.retain(self.rank, keep={step}, ignore_attempts={attempt})
        self._remove_left_behind()
        return LocalCommit(written, payloads, StepHealth.of(step, health), self.last_copy)

    def _remove_left_behind(self) -> None:
        """Once this rank's own store holds ``local_keep_last`` copies and this process
        committed two, the stores of ranks that ran on this node before (a restart placed
        them elsewhere) go when their newest copy is older than all of those: kept as long
        as local retention keeps its own, and never before the step before the newest
        (whose peer copies and drain may not be done yet)."""
        keep, previous = self.policy.local_keep_last, self.local.last_two_committed()
        if not self._sweeps_dir or len(previous) < 2:
            return
        if not self.local.anything_left_behind(self._kept_here):
            return  # the common case: no listing of this rank's store on the save's path
        try:
            newest = list_steps(self.local.store(self.rank))[-keep:]
        except CheckpointError as exc:
            logger.warning("rank %d: local stores left behind not looked at: %s", self.rank, exc)
            return
        if len(newest) == keep:
            self.local.remove_left_behind(self._kept_here, older_than=min(newest[0], previous[0]))

    def _commit_copy(
        self,
        session: SaveSession | None,
        written: RankWritten | None,
        user: dict | None,
        dcp_metadata: bytes | None,
    ) -> Exception | None:
        """This rank's copy committed as a one-rank step, with the save's ``dcp_metadata``;
        the error every rank must hear, if any."""
        try:
            assert session is not None and written is not None
            session.commit(
                [written],
                world_size=1,
                user={**(user or {}), TIER_KEY: self.local.info(self.rank)},
                dcp_metadata=dcp_metadata,
                apply_policy=False,  # one rank's copy: its policy is the job's
            )
        except Exception as exc:  # noqa: BLE001 - every rank hears of it
            return exc
        return None

    def _not_committed(self, step: int, heard: Agreement) -> None:
        """Fails the save if the local tier holds another save of ``step``; else says the save
        goes to durable storage instead, and sweeps the failed attempt's chunks (a disk that
        filled mid-copy: kept, a tier too small for its copies stayed full, failing for good)."""
        _raise_if_taken(step, heard, self.durable_uri)
        if any(r == self.rank and kind == "StorageFullError" for r, _, kind in heard.failures):
            self._keep_fewer()
        try:
            self.local.retain(self.rank)
        except Exception as exc:  # noqa: BLE001 - the save goes to durable storage anyway
            logger.debug("rank %d: local retention after the failure: %s", self.rank, exc)
        self._failures += 1
        # A warning at the first failure and every 10th in a row (a tier too small for
        # local_keep_last + 1 copies fails at every save, and did so at INFO level unseen)
        again = self._failures > 1
        level = logging.WARNING if self._failures % 10 == 1 else logging.INFO
        logger.log(
            level,
            "rank %d: step %d not committed to the local tier%s (%s); saving it to %s instead",
            self.rank,
            step,
            f" ({self._failures} saves in a row)" if again else "",
            heard.why(),
            self.durable_uri,
        )

    def _keep_fewer(self) -> None:
        """This rank's local disk is full with its copies: keep fewer from now on (one warning),
        else every later save would go to durable storage past a tier full of old copies
        (copies only the tier holds stay)."""
        try:
            fits = self.local.keep_fewer()
        except CheckpointError as exc:
            logger.debug("rank %d: copies of the full local tier not counted: %s", self.rank, exc)
            return
        if fits is not None:
            logger.warning(
                "rank %d: the local tier %s is full: it keeps %d cop%s from now on, not "
                "local_keep_last=%d (a save writes its copy before retention drops the oldest: "
                "give it room for local_keep_last + 1 copies)",
                self.rank,
                self.local.policy.local_dir,
                fits,
                "y" if fits == 1 else "ies",
                self.local.policy.local_keep_last,
            )

    def release_copy(self) -> None:
        """Give up the lease the last local commit holds for its peer copy, if it still does."""
        copy, self.last_copy = self.last_copy, None
        if copy is not None:
            copy.release()

    def copy_to_peers(
        self, step: int, attempt: str, *, drain: bool = False
    ) -> CommittedCopy | None:
        """Each rank's committed copy of ``step`` to its holders (collective); a failed copy is
        logged once by rank 0, the save stands (restore falls back to other tiers). This rank's
        copy is sent as its local commit wrote it (``last_copy``), under that commit's lease,
        released here; with ``drain`` (the step's drain is queued next) the copy and its lease
        are returned instead, for the drain (``DrainJob.copy``), which releases it: one lease
        on the local store per save."""
        try:
            if self.topology is not None:
                self._copy_to_peers(step, attempt)
        except BaseException:
            self.release_copy()  # no drain follows
            raise
        if not drain:
            self.release_copy()
            return None
        copy, self.last_copy = self.last_copy, None
        return copy

    def _copy_to_peers(self, step: int, attempt: str) -> None:
        transfers = [Transfer(r, h, r, step, attempt) for r, h in self._pairs]
        mine = self.last_copy
        if mine is not None and (mine.step, mine.attempt) != (step, attempt):
            mine = None
        self.group.check("the peer copies")  # a rank lost before: the next save fails
        outcomes = self._transfer(step, transfers, mine)
        failed = [e for e in outcomes.values() if e is not None]
        if failed and self.rank == 0:
            logger.warning(
                "step %d: %d of %d peer copies failed (restore falls back to other tiers): %s",
                step,
                len(failed),
                len(transfers),
                failed[0],
            )

    def _transfer(
        self, step: int, transfers: list[Transfer], mine: CommittedCopy | None
    ) -> dict[Transfer, str | None]:
        """Run the peer copies of ``step``; each one's outcome (a lost rank fails them all)."""
        try:
            outcomes, self.last_peer_copy = transfer(
                transfers,
                group=self.group.group,
                local=self.local,
                budget_bytes=self.policy.peer_budget_bytes,
                source=mine,
            )
        except Exception as exc:  # noqa: BLE001 - a lost rank: the local copies stand
            try:
                self.group.check(f"the peer copies of step {step}", exc)
            except RankLostError as lost:
                exc = lost
            outcomes = {t: one_line(exc) for t in transfers}
        return outcomes


def _wards(topology: Topology | None, rank: int) -> list[int]:
    return topology.wards(rank) if topology is not None else []


def _holders(topology: Topology | None, rank: int) -> list[int]:
    return topology.holders(rank) if topology is not None else []


def _committed(
    session: SaveSession, rank: int, dcp_metadata: bytes | None, *, keep: bool
) -> CommittedCopy | None:
    """``rank``'s copy as ``session`` committed it, with its ``dcp_metadata`` (None if the
    session wrote no manifest); with ``keep``, the session's lease goes with it."""
    if session.index_written is None or session.manifest_written is None:
        return None
    manifest, manifest_bytes = session.manifest_written
    index, index_bytes = session.index_written
    metadata = dcp_metadata if manifest.dcp_metadata is not None and dcp_metadata else b""
    return CommittedCopy(
        rank,
        session.step,
        session.attempt,
        manifest,
        manifest_bytes,
        index,
        index_bytes,
        metadata,
        session.hand_over_lease() if keep else None,
    )


def _raise_if_stopped(save: tuple[int, str], heard: Agreement, fatal: BaseException | None) -> None:
    """A rank that could not take part in the save (its ``fatal`` error), or ranks that saved
    different steps, fail it on every rank."""
    if fatal is not None:
        raise fatal
    step = save[0]
    apart = saves_apart(*heard.payloads[0][4], [p[4] for p in heard.payloads])
    if apart is not None:
        raise apart
    stopped = [r for r, (_, _, f, *_) in enumerate(heard.payloads) if f]
    if stopped:
        raise CheckpointError(
            f"step {step} failed on rank(s) {stopped} before the local tier: {heard.why()}"
        )


def _raise_if_taken(step: int, heard: Agreement, durable_uri: str) -> None:
    """A local tier that holds another save of ``step`` (a second process of the job: an old
    incarnation still running) fails the save: only a tier that cannot be written sends it to
    durable storage, where the step may not be yet and both saves would report committed."""
    taken = [(r, line) for r, line, kind in heard.failures if kind == "StepExistsError"]
    if taken:
        rank, line = taken[0]
        raise StepExistsError(
            f"step {step}: the local tier holds another save of it (rank {rank}: {line}); "
            f"not saved to {durable_uri} either (to go on from the tiers' copies, load the "
            "latest step before saving; a load of it that finds none lets the job start over)"
        )


@dataclass
class Tiers:
    """One rank's tiers, as a front-end holds them."""

    local: LocalTier
    topology: Topology | None
    saver: TierSaver
    drains: DrainQueue
    cadence: DurableCadence
    """Which saves go to durable storage; a failed drain tells it."""


def open_tiers(
    policy: TierPolicy,
    engine: Any,
    group: RankGroup,
    durable: Any,
    *,
    node_rank: int | None,
    drain_group: RankGroup,
    timeout_s: float,
    thread_nice: int = 0,
    keep_alive: Any = None,
) -> Tiers:
    """This rank's tiers over ``group`` (collective: the ranks tell each other their job
    directory's token and, with ``peer_copies``, their nodes): its local tier for the ``durable`` store, the topology of its peer
    copies, its tier saver, its drain queue (on ``drain_group``, a group of its own;
    ``keep_alive``: the front-end its thread keeps alive until closed) and its durable cadence,
    which starts afresh with the tiers (a writer moved to another store)."""
    local = LocalTier.open(
        policy,
        engine,
        durable,
        group,
        create=True,
        timeout_s=timeout_s,
        thread_nice=thread_nice,
    )
    topology = None
    if policy.peer_copies:
        if not group.active:
            raise ValueError("peer_copies needs torch.distributed with 2 or more nodes")
        nodes = group.gather(node_identity(node_rank, group.rank))
        topology = Topology.build(nodes, policy.peer_copies)
    token = local.dir_token()
    tokens = group.gather(token)  # a rank that could not read one: none removes any store
    mates = None if None in tokens else [r for r, t in enumerate(tokens) if t == token]
    saver = TierSaver(
        policy, local, group, topology, durable_uri=durable.uri, dir_mates=mates, durable=durable
    )
    cadence = DurableCadence(policy.durable_every)
    drains = DrainQueue(
        local=local,
        group=drain_group,
        store=durable,
        thread_nice=niced(thread_nice),
        keep_alive=keep_alive,
        missed=cadence.missed,
    )
    return Tiers(local, topology, saver, drains, cadence)


def _forget_removed(session: SaveSession, bad: set[str]) -> None:
    """The local save's known chunks (its newest copy's index) less those no longer stored: a
    chunk a drain or a load found bad is removed (``LocalTier.forget_bad_chunk``, maybe by an
    earlier process), and one removed by hand is gone as well; each is written again, never
    referenced unread. One ``exists`` per chunk, under the store's deadline (a hung disk fails
    the local save, as any of its requests would)."""
    if not session.known:
        return
    store = session.store
    for digest in [d for d in session.known if d in bad or not store.exists(chunk_key(d))]:
        del session.known[digest]
