"""Which save a tiered DCP load reads, and from where (``StoreReader(local_dir=...)``).

Each rank's local tier keeps one-rank copies of DCP steps (``StoreWriter(tiers=TierOptions(local_dir=...))``): the
rank's own items, its index and the save's DCP metadata, and with ``peer_copies`` other nodes
keep them too. Every rank says which copies its node holds (its own and others'); rank 0 adds
the steps of durable storage and picks, with the Checkpointer's planner
(``tiers.restore.plan_sources``), the newest save (or the step asked for) every rank can get:
a durable step's own save wins over local copies of another save of that step number.

* A rank whose own copy is missing gets it back from a rank that holds it
  (``tiers.transfer``, repair: every chunk hashed on arrival) before the load; if that fails,
  the step loads from durable storage where it is there.

* A step every rank holds loads from the local tiers: each rank sends the others its index (DCP
  items written by one rank are read by others), and each chunk is read by a rank that holds
  it and sent to those that need it (``shared_read``). A rank whose copy cannot be read moves
  every rank to durable storage, where the step is there.
* Otherwise the step loads from durable storage, and a rank whose local copy is of that same
  save reads its own chunks from it (a wiped node's ranks read theirs from durable storage).

Each chunk is verified wherever it came from; one that fails in a local copy is read from
durable storage instead (``tiers.fetch``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from ckptstore.catalog import list_steps, load_manifest, read_rank_index_bytes
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    FormatVersionError,
    UnhealthyStepError,
)
from ckptstore.format import ChunkInfo, decode_rank_index
from ckptstore.health import tiered_verdict
from ckptstore.options import StorageOptions
from ckptstore.save.engine import SaveEngine
from ckptstore.steps import DCP, StepView
from ckptstore.store import Store
from ckptstore.tiers.fetch import TierFetch
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.identity import agree_identity
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import TierPolicy, store_identity
from ckptstore.tiers.restore import (
    DURABLE,
    LOCAL,
    PEER,
    Candidate,
    LoadReport,
    Source,
    plan_sources,
)
from ckptstore.tiers.transfer import Transfer, transfer

logger = logging.getLogger(__name__)


@dataclass
class TierLoad:
    """One rank's plan of a tiered DCP load."""

    view: StepView  # the step: manifest, metadata, indexes
    held: dict[str, ChunkInfo]  # the chunks this rank reads from its local copy
    fetch: TierFetch
    report: LoadReport
    started: float  # perf_counter() as the plan began


_load_groups: list[tuple[object, RankGroup]] = []  # [(the default group, its tier-load group)]


def load_group(storage: StorageOptions) -> RankGroup:
    """The gloo group tiered loads and shared reads run on, made once per default process group
    (by every rank, at its first such load) and shared by every ``StoreReader`` of the process:
    loads are synchronous, one at a time. A rank lost during a load (or before it joined the
    group) fails every other rank's load within ``storage.lost_rank_timeout_s``, naming it. (A
    ``StoreWriter`` keeps a group of its own: its exchanges may run in ``async_save``'s
    thread.)"""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if not _load_groups or _load_groups[0][0] is not world:
        group = RankGroup(
            None, timeout_s=storage.group_timeout_s(0.0), lost_rank_s=storage.lost_rank_timeout_s
        )
        _load_groups[:] = [(world, group)]
    return _load_groups[0][1]


def plan_tier_load(
    durable: Store,
    policy: TierPolicy,
    wanted: int | str,
    group: RankGroup,
    *,
    healthy: bool = False,
) -> TierLoad:
    """Collective over ``group`` (every rank of the load calls it). Raises on every rank alike
    when no step can be loaded, or a rank failed to say what it holds. ``healthy``: only a
    healthy step (``_not_healthy``), each newer one passed over named once with why."""
    started = time.perf_counter()
    rank = group.rank
    local, here, durable_steps, candidate, why = _plan(durable, policy, wanted, group, healthy)
    step = candidate.step
    if rank == 0:
        for s in sorted((s for s in why if s > step), reverse=True):
            logger.warning("%s (tiers, %s): skipped by healthy=True", why[s], durable.uri)
    report = LoadReport(step=step)
    copies = here.get(rank, {})
    if all(mine[0].tier != DURABLE for mine in candidate.sources):
        assert candidate.attempt is not None
        sources = {
            r: mine[0].holder
            for r, mine in enumerate(candidate.sources)
            if mine[0].tier == PEER and mine[0].holder is not None
        }
        repaired = _repair(local, group, step, candidate.attempt, sources, report)
        if repaired:
            copies = local.copies(rank)
        store = local.store(rank)
        found = None
        if repaired or not sources:
            found = _local_view(store, step, group, in_durable=step in durable_steps)
        if found is not None:
            view, held = found
            report.source = PEER if rank in sources else LOCAL
            fetch = TierFetch(
                local=store,
                held=held,
                # A chunk is read from durable storage only where the step is there, by its
                # digest: the durable store may hold it encoded otherwise (sizes unknown here).
                durable=durable if step in durable_steps else None,
                durable_sized=False,
                report=report,
                rank=rank,
                local_tier=report.source,
            )
            return TierLoad(view, held, fetch, report, started)
        if step not in durable_steps:
            raise CheckpointError(
                f"DCP step {step} is held only by the local tiers, and a rank's copy could not "
                "be restored from its peers (see the warning above)"
            )
        logger.warning(
            "rank %d: a local copy of DCP step %d could not be read or restored; loading it "
            "from %s",
            rank,
            step,
            durable.uri,
        )
    view = StepView.open(durable, step)
    view.require(DCP)
    held = {}
    store = local.store(rank) if copies else None
    if store is not None and copies.get(step) == view.manifest.attempt:
        try:
            held = dict(_own_index(store, step)[0][0].chunks)
        except CheckpointError as exc:
            logger.warning("rank %d: local copy of step %d unreadable: %s", rank, step, exc)
    report.source = LOCAL if held else DURABLE
    fetch = TierFetch(local=store, held=held, durable=durable, report=report, rank=rank)
    return TierLoad(view, held, fetch, report, started)


def newest_step(
    durable: Store, policy: TierPolicy, group: RankGroup, *, healthy: bool = False
) -> int | None:
    """The step a tiered load of "latest" takes (collective over ``group``, as a load), or
    None when no tier holds one every rank can get (``healthy``: a healthy one)."""
    try:
        return _plan(durable, policy, "latest", group, healthy)[3].step
    except CheckpointNotFoundError:
        return None


def _not_healthy(
    durable: Store,
    local: LocalTier,
    here: dict[int, dict[int, str]],
    durable_steps: set[int],
    local_steps: set[int],
    group: RankGroup,
) -> dict[int, str]:
    """(collective) Why each step a load could take is not healthy: a rank's own copy that
    records NaN or Inf rules its step out; else a durable step is what its manifest says; a
    step only the tiers hold is healthy when every rank's own copy says so."""
    rank = group.rank
    mine: dict[int, dict | None] = {}
    error = None
    try:
        store = local.store(rank) if here.get(rank) else None
        for step, attempt in (here.get(rank) or {}).items():
            manifest = load_manifest(store, step)
            if manifest.attempt == attempt:
                mine[step] = manifest.health
        if rank == 0:
            found = {}
            for step in durable_steps:
                try:
                    found[step] = load_manifest(durable, step).health
                except (CheckpointCorruptError, CheckpointNotFoundError, FormatVersionError):
                    found[step] = None
            mine = (mine, found)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    heard = _agree(group, error, mine, "read the health of the copies")
    durable_health = heard[0][1]
    own = [heard[0][0], *heard[1:]]
    why = {}
    for step in local_steps | durable_steps:
        kept = durable_health.get(step) if step in durable_steps else "absent"
        reason = tiered_verdict(step, [h.get(step, "absent") for h in own], kept)
        if reason is not None:
            why[step] = reason
    return why


def _plan(durable: Store, policy: TierPolicy, wanted: int | str, group: RankGroup, healthy: bool):
    """This rank's ``LocalTier``; the copies its node holds (ward -> step -> attempt); the
    durable steps; the save to load and each rank's sources (``tiers.restore.plan_sources``,
    the Checkpointer's planner, run by rank 0 and sent to all); with ``healthy``, why each
    step left out is not healthy (``_not_healthy``). Collective."""
    rank = group.rank
    local = LocalTier(
        policy,
        SaveEngine(),
        rank=rank,
        world_size=group.world_size,
        durable_uri=store_identity(durable),
        timeout_s=durable.retry.timeout_s,
        identity=agree_identity(durable, group, create=False),
    )
    here: dict[int, dict[int, str]] = {}
    steps: list[int] | None = None
    error = None
    try:
        here = {ward: local.copies(ward) for ward in local.wards_here()}
        if rank == 0:
            steps = list_steps(durable)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    everything = _agree(group, error, (here, steps), "list the tiers")
    durable_steps = sorted(everything[0][1] or [])
    held = [h for h, _ in everything]
    why: dict[int, str] = {}
    if healthy:
        local_steps = {s for h in held for copies in h.values() for s in copies}
        why = _not_healthy(durable, local, here, set(durable_steps), local_steps, group)
        if wanted != "latest" and int(wanted) in why:
            raise UnhealthyStepError(f"{why[int(wanted)]} (healthy=True)")
        held = [
            {w: {s: a for s, a in c.items() if s not in why} for w, c in h.items()} for h in held
        ]
        durable_steps = [s for s in durable_steps if s not in why]
    plan: Candidate | BaseException | None = None
    if rank == 0:
        try:
            plan = _choose(wanted, held, durable_steps, local, durable)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            plan = exc
    plan = group.broadcast(plan)
    if isinstance(plan, BaseException):
        raise plan
    assert plan is not None
    return local, here, set(durable_steps), plan, why


def _agree(group: RankGroup, error: BaseException | None, payload, what: str) -> list:
    """Every rank's ``payload``; every rank raises if one failed."""
    heard = group.agree(error, None if error is not None else payload)
    if not heard.ok:
        raise CheckpointError(f"tiered DCP load: could not {what} ({heard.why()})") from error
    return heard.payloads


def _choose(
    wanted: int | str,
    held: list[dict[int, dict[int, str]]],
    durable_steps: list[int],
    local: LocalTier,
    durable: Store,
) -> Candidate:
    def attempt(step: int) -> str | None:
        try:
            return load_manifest(durable, step).attempt
        except CheckpointError as exc:
            logger.warning("step %d in %s unreadable: %s", step, durable.uri, exc)
            return None

    step = None if wanted == "latest" else int(wanted)
    plan = plan_sources(held, durable_steps, attempt, step=step, limit=1)
    if plan:
        return plan[0]
    if step is not None and step in durable_steps:  # unreadable: its load says why
        return Candidate(step, None, [[Source(DURABLE)] for _ in held])
    if step is None:
        raise CheckpointNotFoundError(
            f"no DCP step held by every rank's local tier ({local.policy.local_dir}) or in "
            f"{durable.uri}"
        )
    raise CheckpointNotFoundError(
        f"step {step} is neither held by every rank's local tier "
        f"({local.policy.local_dir}) nor committed in {durable.uri}"
    )


def _repair(
    local: LocalTier,
    group: RankGroup,
    step: int,
    attempt: str,
    sources: dict[int, int],
    report: LoadReport,
) -> bool:
    """Each rank without its own copy of the save gets it from ``sources[rank]`` (collective);
    True if every such copy arrived whole (every chunk hashed on arrival). Nothing to do: True."""
    if not sources:
        return True
    transfers = [Transfer(src, r, r, step, attempt, repair=True) for r, src in sources.items()]
    try:
        outcomes, stats = transfer(
            transfers, group=group.group, local=local, budget_bytes=local.policy.peer_budget_bytes
        )
    except Exception as exc:  # noqa: BLE001 - a lost rank: the durable tier, where it can
        logger.warning(
            "rank %d: restoring copies of step %d from peers failed: %s", group.rank, step, exc
        )
        return False
    if group.rank in sources:  # its bytes are counted as the load reads them from the copy
        report.add(PEER, 0, stats.seconds)
    report.peer_buffer_bytes = max(report.peer_buffer_bytes, stats.buffer_bytes)
    failed = [e for e in outcomes.values() if e is not None]
    if failed:
        logger.warning(
            "rank %d: %d of %d copies of step %d could not be restored from peers: %s",
            group.rank,
            len(failed),
            len(transfers),
            step,
            failed[0],
        )
    return not failed


def _own_index(store: Store, step: int):
    manifest = load_manifest(store, step)
    return read_rank_index_bytes(store, manifest.ranks[0]), manifest


def _local_view(
    store: Store, step: int, group: RankGroup, *, in_durable: bool
) -> tuple[StepView, dict[str, ChunkInfo]] | None:
    """The step as the local copies hold it, every rank's index sent to every other (each copy
    is a one-rank step: its index is rank 0's there, rank r's in the view); None (on every
    rank) if a rank's copy could not be read and the step is in durable storage."""
    view = None
    data = b""
    error = None
    try:
        (index, data), manifest = _own_index(store, step)
        view = StepView(store, manifest)
        view.require(DCP)
        view.dcp_metadata()
        view.adopt_index(dataclasses.replace(index, rank=group.rank))
    except CheckpointError as exc:
        error = exc
    line = None if error is None else " ".join(str(error).split())[:300]
    everything = group.gather((line, data if error is None else b""))
    failed = [(r, e) for r, (e, _) in enumerate(everything) if e is not None]
    if failed:
        if in_durable:
            return None
        why = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
        raise CheckpointError(
            f"DCP step {step} is held only by the local tiers, and a copy cannot be read ({why})"
        )
    assert view is not None
    held = dict(view.index(group.rank).chunks)
    for r, (_, blob) in enumerate(everything):
        if r == group.rank:
            continue
        index = decode_rank_index(blob, f"rank {r}'s local index of step {step}")
        if index.rank != 0:  # a tier copy is a one-rank step
            raise CheckpointError(f"rank {r} sent an index of rank {index.rank}, not its copy's")
        view.adopt_index(dataclasses.replace(index, rank=r))
    return view, held
