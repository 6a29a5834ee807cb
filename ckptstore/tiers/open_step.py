"""A step opened from the tiers for a reader that fetches chunks by digest: DCP's
``StoreReader(local_dir=...)``, whose copies (``StoreWriter(tiers=TierOptions(local_dir=...))``)
hold each rank's own items, its index and the save's DCP metadata.

The save to load and each rank's sources come from ``tiers.plan.plan_restore``, the planner of
every front-end. Then:

* A rank whose own copy is missing gets it back from a rank that holds it
  (``tiers.transfer.restore_copies``: every chunk hashed on arrival) before the load; if that
  fails, the step loads from durable storage where it is there. Meanwhile the ranks whose
  copies are intact verify their own chunks ahead (``tiers.ahead``), where the host has two
  cores per rank.
* A step every rank holds loads from the local tiers: each rank sends the others its index (DCP
  items written by one rank are read by others), and each chunk is read by a rank that holds
  it and sent to those that need it (``shared_read``). A rank whose copy cannot be read moves
  every rank to durable storage, where the step is there.
* Otherwise the step loads from durable storage, and a rank whose local copy is of that same
  save reads its own chunks from it; a rank whose first source is a peer's copy gets it back
  first and reads from it, as the Checkpointer's load does (a rank with neither reads its own
  chunks from durable storage).

Each chunk is verified wherever it came from; one that fails in a local copy is read from
durable storage instead (``tiers.fetch``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from ckptstore.catalog import load_manifest, read_rank_index_bytes
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    NoHealthyStepError,
    one_line,
)
from ckptstore.format import ChunkInfo, RankIndex, decode_rank_index
from ckptstore.health import name_passed_over
from ckptstore.options import StorageOptions
from ckptstore.save.engine import SaveEngine
from ckptstore.steps import DCP, StepView
from ckptstore.store import Store
from ckptstore.tiers.ahead import VerifiedAhead, verify_ahead
from ckptstore.tiers.fetch import TierFetch
from ckptstore.tiers.group import RankGroup, front_end_group
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.plan import RestorePlan, plan_restore
from ckptstore.tiers.policy import TierPolicy
from ckptstore.tiers.restore import DURABLE, LOCAL, PEER, Candidate, LoadReport
from ckptstore.tiers.transfer import Damage, RepairedCopy, restore_copies, write_behind

logger = logging.getLogger(__name__)


@dataclass
class TierLoad:
    """One rank's plan of a tiered load."""

    view: StepView  # the step: manifest, metadata, indexes
    held: dict[str, ChunkInfo]  # the chunks this rank reads from its local copy
    fetch: TierFetch
    report: LoadReport
    started: float  # perf_counter() as the plan began
    repaired: list[RepairedCopy] = dataclasses.field(default_factory=list)
    local: LocalTier | None = None  # the tier the load resumes from, once every rank read it

    def loaded(self) -> None:
        """Every rank read the step: the next save of this process drops later copies (a
        load that failed changes nothing)."""
        if self.local is not None:
            self.local.resumed_from = self.view.step

    def reads_done(self) -> None:
        """Once the load's reads are done, or once it failed: what this rank's copy had
        verified ahead is let go, and the copy a repair held in memory is written and committed
        in the background (``transfer.write_behind``)."""
        if self.fetch.ahead is not None:
            self.fetch.ahead.close()
        repaired, self.repaired = self.repaired, []
        write_behind(repaired)


# [(the default group, tiered, its load group)]: the groups of one default group, tiered or not
_load_groups: list[tuple[object, bool, RankGroup]] = []


def load_group(storage: StorageOptions, *, tiered: bool) -> RankGroup:
    """The gloo group tiered loads (``tiered``), or untiered resumes and shared reads, run on;
    each made once per default process group (by every rank, at its first such load) and shared
    by every ``StoreReader`` of the process: loads are synchronous, one at a time. A rank lost
    during a load (or before it joined the group) fails every other rank's load within
    ``storage.lost_rank_timeout_s`` (four times that untiered: ``front_end_group``), naming it.
    (A ``StoreWriter`` keeps groups of its own: its exchanges may run in ``async_save``'s
    thread.)"""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if _load_groups and _load_groups[0][0] is not world:
        _load_groups.clear()
    for _, was_tiered, group in _load_groups:
        if was_tiered == tiered:
            return group
    group = front_end_group(storage, tiered=tiered)
    _load_groups.append((world, tiered, group))
    return group


def _local_tier(durable: Store, policy: TierPolicy, group: RankGroup) -> LocalTier:
    return LocalTier.open(
        policy, SaveEngine(), durable, group, create=False, timeout_s=durable.retry.timeout_s
    )


def _plan(
    durable: Store, local: LocalTier, wanted: int | str, group: RankGroup, healthy: bool
) -> RestorePlan:
    return plan_restore(durable, local, group, step=wanted, limit=1, healthy=healthy)


def open_tiered_step(
    durable: Store,
    policy: TierPolicy,
    wanted: int | str,
    group: RankGroup,
    kind: str,
    *,
    healthy: bool = False,
) -> TierLoad:
    """Collective over ``group`` (every rank of the load calls it): the step of ``kind`` to
    load and where each rank reads its chunks. Raises on every rank alike when no step can be
    loaded, or a rank failed to say what it holds. ``healthy``: only a healthy step, each newer
    one passed over named once with why."""
    started = time.perf_counter()
    rank = group.rank
    local = _local_tier(durable, policy, group)
    plan = _plan(durable, local, wanted, group, healthy)
    candidate = plan.candidates[0]
    step = candidate.step
    name_passed_over(plan.not_healthy, step, say=rank == 0)
    report = LoadReport(step=step)
    in_durable = candidate.sources[rank][-1].tier == DURABLE  # the same on every rank
    if all(mine[0].tier != DURABLE for mine in candidate.sources):
        repaired: list[RepairedCopy] = []  # this rank's copy, if a repair holds it in memory
        ahead: list[VerifiedAhead] = []  # this rank's copy, verified during the repair
        found = None
        try:
            found = _from_tiers(local, group, candidate, report, kind, repaired, ahead, in_durable)
        finally:
            if found is None:  # not loaded from the tiers: written before durable storage is
                for copy in repaired:
                    copy.write_local()
                for verified in ahead:
                    verified.close()
        if found is not None:
            view, held = found
            fetch = TierFetch(
                local=local.store(rank),
                held=held,
                repaired=repaired[0] if repaired else None,
                ahead=ahead[0] if ahead else None,
                # A chunk is read from durable storage by its digest: the durable store may
                # hold it encoded otherwise (sizes unknown here); where the step is not there,
                # only a bad local chunk is looked for.
                durable=durable,
                durable_step=in_durable,
                durable_sized=False,
                report=report,
                rank=rank,
                local_tier=report.source,
                forget=local.forget_bad_chunk,
            )
            return TierLoad(view, held, fetch, report, started, repaired, local)
        logger.warning(
            "rank %d: a local copy of step %d could not be read or restored; loading it from %s",
            rank,
            step,
            durable.uri,
        )
        return _from_durable(durable, local, candidate, report, kind, started, rank)
    repaired = _repair_beside_durable(local, group, candidate, report)
    return _from_durable(durable, local, candidate, report, kind, started, rank, repaired)


def _repair_beside_durable(
    local: LocalTier, group: RankGroup, candidate: Candidate, report: LoadReport
) -> RepairedCopy | bool:
    """(collective) Where some rank's first source is durable storage, the ranks whose first
    source is a peer's copy still get it from there, as the Checkpointer's load does: this
    rank's copy held in memory, True where it was repaired and written, False where it was
    not repaired (its chunks are then read from durable storage)."""
    sources = {
        r: mine[0].holder
        for r, mine in enumerate(candidate.sources)
        if mine[0].tier == PEER and mine[0].holder is not None
    }
    if not sources:
        return False
    repaired: list[RepairedCopy] = []
    _repair(local, group, candidate, sources, report, repaired)
    if repaired:
        return repaired[0]
    if group.rank not in sources:
        return False
    try:
        manifest = load_manifest(local.store(group.rank), candidate.step)
    except CheckpointError:
        return False  # the repair failed: durable storage
    return manifest.attempt == candidate.attempt


def newest_step(
    durable: Store, policy: TierPolicy, group: RankGroup, *, healthy: bool = False
) -> int | None:
    """The step a tiered load of "latest" takes (collective over ``group``, as a load), or
    None when no tier holds one every rank can get (``healthy``: saves that none of them is
    healthy raise ``NoHealthyStepError``, as the load would: not nothing to resume)."""
    return newest_planned_step(durable, _local_tier(durable, policy, group), group, healthy)


def planned_steps(
    durable: Store,
    policy: TierPolicy,
    group: RankGroup,
    *,
    healthy: bool = False,
    passed_over: dict[int, str] | None = None,
) -> list[int]:
    """(collective) Every step a tiered load of "latest" may take, newest first: the steps a
    load with fallback tries in turn; empty when no tier holds one every rank can get.
    ``passed_over`` gets (rank 0) why ``healthy`` passed over each other step."""
    local = _local_tier(durable, policy, group)
    try:
        plan = plan_restore(durable, local, group, step="latest", limit=None, healthy=healthy)
    except NoHealthyStepError:
        raise
    except CheckpointNotFoundError:
        return []
    if passed_over is not None:
        passed_over.update(plan.not_healthy)
    return list(dict.fromkeys(c.step for c in plan.candidates))


def newest_planned_step(
    durable: Store, local: LocalTier, group: RankGroup, healthy: bool
) -> int | None:
    """``newest_step`` over a tier already open (the Checkpointer's)."""
    try:
        return _plan(durable, local, "latest", group, healthy).candidates[0].step
    except NoHealthyStepError:
        raise
    except CheckpointNotFoundError:
        return None


def _from_tiers(
    local: LocalTier,
    group: RankGroup,
    candidate: Candidate,
    report: LoadReport,
    kind: str,
    repaired: list[RepairedCopy],
    ahead: list[VerifiedAhead],
    in_durable: bool,
) -> tuple[StepView, dict[str, ChunkInfo]] | None:
    """(collective) The step as every rank's local copy holds it, the copies a peer keeps
    restored first (this rank's into ``repaired`` where the repair holds it in memory; an
    intact copy's chunks verified meanwhile into ``ahead``, where they can be); None
    (on every rank) where a copy could not be had and the step is in durable storage."""
    rank, step = group.rank, candidate.step
    sources = {
        r: mine[0].holder
        for r, mine in enumerate(candidate.sources)
        if mine[0].tier == PEER and mine[0].holder is not None
    }
    sources.update(_unreadable_copies(local, group, candidate))
    if sources:
        verified = verify_ahead(local, group, step, candidate.attempt, intact=rank not in sources)
        ahead.extend([verified] if verified is not None else [])
    whole = _repair(local, group, candidate, sources, report, repaired)
    if whole is not True and in_durable:
        return None
    if whole is not True:
        # Copies damaged at either end are corrupt data, which a resume skips as the
        # Checkpointer's does; a lost rank or a disk that fails is not (``Damage`` says which).
        error = CheckpointCorruptError if isinstance(whole, Damage) else CheckpointError
        raise error(
            f"step {step} is held only by the local tiers, and a rank's copy could not be "
            f"restored from its peers ({whole or 'the repair stopped'})"
        )
    mine = repaired[0] if repaired else None
    found = _local_view(local, candidate, group, kind, mine, in_durable=in_durable)
    if found is not None:
        report.source = PEER if rank in sources else LOCAL
    return found


def _unreadable_copies(local: LocalTier, group: RankGroup, candidate: Candidate) -> dict[int, int]:
    """(collective) The ranks whose own copy is their first source but whose manifest or index
    cannot be read, each with the holder it is restored from: its next peer source (a rank
    without one is left to fail as before: durable storage, where the step is there)."""
    rank, step = group.rank, candidate.step
    mine = candidate.sources[rank]
    holder = None
    if mine[0].tier == LOCAL:
        try:
            _, manifest = _own_index(local.store(rank), step)
            local.check_copy(manifest, rank, candidate.attempt)
        except CheckpointError as exc:
            holder = next((s.holder for s in mine[1:] if s.tier == PEER), None)
            if holder is not None:
                logger.warning(
                    "rank %d: its copy of step %d cannot be read, restoring it from peer rank "
                    "%d: %s",
                    rank,
                    step,
                    holder,
                    one_line(exc),
                )
    return {r: h for r, h in enumerate(group.gather(holder)) if h is not None}


def _from_durable(
    durable: Store,
    local: LocalTier,
    candidate: Candidate,
    report: LoadReport,
    kind: str,
    started: float,
    rank: int,
    repaired: RepairedCopy | bool = False,
) -> TierLoad:
    """The step from durable storage; a rank whose own local copy is of the same save reads
    its own chunks from that copy (``repaired``: a copy a peer just restored, in memory or
    written, see ``_repair_beside_durable``)."""
    view = StepView.open(durable, candidate.step)
    view.require(kind)
    held: dict[str, ChunkInfo] = {}
    kept = repaired if isinstance(repaired, RepairedCopy) else None
    own = repaired is not False or any(src.tier == LOCAL for src in candidate.sources[rank])
    store = local.store(rank) if own else None
    if kept is not None and candidate.attempt == view.manifest.attempt:
        held = dict(kept.index.chunks)
    elif store is not None and candidate.attempt == view.manifest.attempt:
        try:
            held = dict(_own_index(store, candidate.step)[0][0].chunks)
        except CheckpointError as exc:
            logger.warning(
                "rank %d: local copy of step %d unreadable: %s", rank, candidate.step, one_line(exc)
            )
    report.source = (PEER if repaired is not False else LOCAL) if held else DURABLE
    fetch = TierFetch(
        local=store,
        held=held,
        durable=durable,
        report=report,
        rank=rank,
        local_tier=report.source,
        repaired=kept,
        forget=local.forget_bad_chunk,
    )
    return TierLoad(view, held, fetch, report, started, [kept] if kept is not None else [], local)


def _repair(
    local: LocalTier,
    group: RankGroup,
    candidate: Candidate,
    sources: dict[int, int],
    report: LoadReport,
    repaired: list[RepairedCopy],
) -> bool | str:
    """Each rank without its own copy of the save gets it from ``sources[rank]`` (collective);
    True if every such copy arrived whole (this rank's into ``repaired`` where it is held in
    memory); False if the repair itself failed (a lost rank); else why a copy did not arrive
    whole (the same on every rank; ``Damage`` where every failure was damaged data). Nothing
    to do: True."""
    if not sources:
        return True
    assert candidate.attempt is not None
    try:
        outcomes, kept = restore_copies(
            local, group, candidate.step, candidate.attempt, sources, report
        )
    except Exception as exc:  # noqa: BLE001 - a lost rank: the durable tier, where it can
        logger.warning(
            "rank %d: restoring copies of step %d from peers failed: %s",
            group.rank,
            candidate.step,
            one_line(exc),
        )
        return False
    repaired.extend(kept.values())
    failed = [e for e in outcomes.values() if e is not None]
    if failed:
        logger.warning(
            "rank %d: %d of %d copies of step %d could not be restored from peers: %s",
            group.rank,
            len(failed),
            len(outcomes),
            candidate.step,
            failed[0],
        )
    if not failed:
        return True
    why = f"{len(failed)} of {len(outcomes)} copies: {failed[0]}"
    return Damage(why) if all(isinstance(e, Damage) for e in failed) else why


def _own_index(store: Store, step: int):
    manifest = load_manifest(store, step)
    return read_rank_index_bytes(store, manifest.ranks[0]), manifest


def _own_copy(
    local: LocalTier, candidate: Candidate, rank: int, kind: str, repaired: RepairedCopy | None
) -> tuple[StepView, RankIndex, bytes]:
    """This rank's copy of the step: its view (the DCP metadata decoded for a DCP load), its
    index and the index's bytes; from ``repaired`` as received, else read from its store."""
    store, step = local.store(rank), candidate.step
    if repaired is None or repaired.step != step:
        (index, data), manifest = _own_index(store, step)
    else:
        manifest, index = repaired.manifest, repaired.index
        data = repaired.index_bytes
    local.check_copy(manifest, rank, candidate.attempt)
    view = StepView(store, manifest)
    view.require(kind)
    if kind == DCP:
        if repaired is not None and repaired.metadata is not None and repaired.step == step:
            from ckptstore.metadata import decode_metadata  # imports torch: DCP steps only

            assert manifest.dcp_metadata is not None
            name = store.url(manifest.dcp_metadata.key)
            view.adopt_metadata(decode_metadata(repaired.metadata, name))
        view.dcp_metadata()
    return view, index, data


def _local_view(
    local: LocalTier,
    candidate: Candidate,
    group: RankGroup,
    kind: str,
    repaired: RepairedCopy | None,
    *,
    in_durable: bool,
) -> tuple[StepView, dict[str, ChunkInfo]] | None:
    """The step as the local copies hold it, every rank's index sent to every other (each copy
    is a one-rank step: its index is rank 0's there, rank r's in the view); this rank's from
    ``repaired`` where a repair holds it in memory (not read back); None (on every rank) if a
    rank's copy could not be read and the step is in durable storage."""
    step = candidate.step
    view = None
    data = b""
    error = None
    try:
        view, index, data = _own_copy(local, candidate, group.rank, kind, repaired)
        view.adopt_index(dataclasses.replace(index, rank=group.rank))
    except CheckpointError as exc:
        error = exc
    line = None if error is None else " ".join(str(error).split())[:300]
    damaged = isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError))
    everything = group.gather((line, damaged, data if error is None else b""))
    failed = [(r, e, d) for r, (e, d, _) in enumerate(everything) if e is not None]
    if failed:
        if in_durable:
            return None
        why = "; ".join(f"rank {r}: {e}" for r, e, _ in failed[:4])
        # A copy damaged or missing is corrupt data, which a resume skips (as the
        # Checkpointer's does); any other failure is raised as it is.
        kind_of = CheckpointCorruptError if all(d for _, _, d in failed) else CheckpointError
        raise kind_of(
            f"step {step} is held only by the local tiers, and a copy cannot be read ({why})"
        )
    assert view is not None
    held = dict(view.index(group.rank).chunks)
    for r, (_, _, blob) in enumerate(everything):
        if r == group.rank:
            continue
        index = decode_rank_index(blob, f"rank {r}'s local index of step {step}")
        if index.rank != 0:  # a tier copy is a one-rank step
            raise CheckpointError(f"rank {r} sent an index of rank {index.rank}, not its copy's")
        view.adopt_index(dataclasses.replace(index, rank=r))
    return view, held
