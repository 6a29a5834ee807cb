"""Which saves a tiered load may take, and from where: the one planning step of every
front-end's tiered load (the Checkpointer's ``loading``, DCP's ``StoreReader`` through
``tiers.open_step``), collective over the load's ``RankGroup``.

1. Each rank lists the copies its node keeps: every ``rank-<r>`` store of the node's job
   directory (its own ranks', those whose peer copies it keeps, and those of ranks that ran here
   before a restart placed them elsewhere); a store that cannot be read is not offered (a peer or
   durable storage may serve that rank).
2. Rank 0 lists the durable steps (where that fails, only local and peer copies count) and
   plans with ``restore.plan_sources``, reading each durable manifest it weighs once: the load
   shares them (``RestorePlan.manifests``).
3. With ``healthy``, each rank reads the health its own copy of each candidate save records and
   rank 0 judges (``health.tiered_verdict``): a step is healthy when its durable manifest of the
   same save says so, or, when it is not durable, when every rank's own copy does; a copy that
   says unhealthy makes it unhealthy either way. The steps passed over are named with why.

Every rank gets the same plan, or raises the same error.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ckptstore.catalog import load_manifest, parse_step, steps_to_resume
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    FormatVersionError,
    StorageError,
    UnhealthyStepError,
    one_line,
)
from ckptstore.format import Manifest
from ckptstore.health import Unreadable, no_healthy_step, tiered_verdict
from ckptstore.render import rank_ranges
from ckptstore.store import Store
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.local import LocalTier, copies_under_other_paths
from ckptstore.tiers.restore import PEER, Candidate, Source, plan_sources
from ckptstore.tiers.resumes import FRESH_START, Resume, left_by, resumes
from ckptstore.tiers.transfer import wait_written

logger = logging.getLogger(__name__)


@dataclass
class RestorePlan:
    candidates: list[Candidate]  # newest first; each rank's sources in the order to try
    not_healthy: dict[int, str] = field(default_factory=dict)  # healthy=True: step -> why not
    manifests: dict[int, Manifest] = field(default_factory=dict)  # rank 0: durable, read once
    unreadable: dict[int, BaseException] = field(default_factory=dict)  # rank 0: why not read


def plan_restore(
    durable: Store,
    local: LocalTier,
    group: RankGroup,
    *,
    step: int | str | None = "latest",
    limit: int | None = 1,
    healthy: bool = False,
) -> RestorePlan:
    """The saves to try (``step``: only that one; ``limit``: at most that many, None: every
    older one too, for a load with fallback). Collective; raises on every rank alike when no
    tier holds a step every rank can get. For the latest step, where every rank read its
    copies and durable storage was listed, that means nothing to resume: the job starts over
    (``FRESH_START``), and its next save unlists the copies of the run it leaves."""
    wait_written()  # a copy the last load repaired is listed once it is committed
    wanted = parse_step(step)
    listed: Any = None
    if group.rank == 0:
        try:
            listed = steps_to_resume(durable)  # a bucket not made yet holds none
        except CheckpointError as exc:
            listed = exc
    held = _held(local, group.rank)
    if wanted is None and not any(held[0].values()):
        _name_copies_elsewhere(local, group.rank)
    everything = group.gather((*held, _place(local), listed))
    plan = RestorePlan([])
    found: Any = None
    fresh = False  # nothing to resume, as far as every tier could tell
    if group.rank == 0:
        made = [h for h, _, _, _ in everything]
        held = _left_out(durable, made, listed)
        places = [p for _, _, p, _ in everything]
        try:
            found = _plan(
                durable, local, held, places, listed, wanted, None if healthy else limit, plan
            )
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            found = exc
        read_all = all(whole for _, whole, _, _ in everything)
        listed_all = not isinstance(listed, BaseException)
        fresh = isinstance(found, CheckpointNotFoundError) and read_all and listed_all
        fresh = fresh and wanted is None
    found, fresh = group.broadcast((found, fresh))
    if fresh:
        local.resumed_from = FRESH_START
    plan.candidates = _raise_or(found)
    if healthy:
        plan.candidates, plan.not_healthy = _healthy(durable, local, group, plan, wanted)
        plan.candidates = plan.candidates[:limit] if limit is not None else plan.candidates
    return plan


_named_elsewhere: set[str] = set()  # local dirs whose copies under other paths were named


def _name_copies_elsewhere(local: LocalTier, rank: int) -> None:
    """A load of the latest step that finds no copy of its own here: copies of this store made
    while it was at another path are named, once per process and directory (they are not
    loaded: a copy belongs to the store's path)."""
    where = os.fspath(local.policy.local_dir)
    if where in _named_elsewhere:
        return
    _named_elsewhere.add(where)
    for path, steps in copies_under_other_paths(where, local.durable_uri, local.identity).items():
        logger.warning(
            "rank %d: %s holds copies of this store (id %s) made while it was at %s, of "
            "step(s) %s; they are not loaded (a copy belongs to the store's path): run the job "
            "with the store at %s to resume from them",
            rank,
            where,
            local.identity.id if local.identity else "?",
            path,
            ", ".join(map(str, steps)),
            path,
        )


def _raise_or(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


def _held(local: LocalTier, rank: int) -> tuple[dict[int, dict[int, tuple[str, float]]], bool]:
    """The copies this rank's node keeps: by ward, step -> (attempt, when the resume it descends
    from was recorded); and whether every one was read (no request failed)."""
    held: dict[int, dict[int, tuple[str, float]]] = {}
    unread: list[str] = []
    try:
        wards = local.wards_here()
    except OSError as exc:
        logger.warning("rank %d: the local tier cannot be listed, not offered: %s", rank, exc)
        return held, False
    for ward in wards:
        try:
            held[ward] = local.copies_made(ward, unread)
        except Exception as exc:  # noqa: BLE001 - peers or durable storage may serve it
            unread.append(str(exc))
            logger.warning(
                "rank %d: the local tier of rank %d cannot be read, not offered: %s",
                rank,
                ward,
                one_line(exc),
            )
    return held, not unread


def _left_out(
    durable: Store, made: list[dict[int, dict[int, tuple[str, float]]]], listed: Any
) -> list[dict[int, dict[int, str]]]:
    """(rank 0) Every rank's copies, step -> attempt, without those of a run the job left:
    made under an earlier resume (or none) than one from an earlier step (``tiers.resumes``),
    kept by a node that was away then. Named in one warning. Not where the durable store could not be listed (its
    warning says so)."""
    try:
        recorded = [] if isinstance(listed, BaseException) else resumes(durable)
    except (CheckpointError, StorageError) as exc:
        recorded = []
        logger.warning(
            "the resumes recorded in %s cannot be listed: copies of a run the job left, on a "
            "node that was away, are not told apart: %s",
            durable.uri,
            one_line(exc),
        )
    left: dict[int, Resume] = {}
    held: list[dict[int, dict[int, str]]] = []
    for wards in made:
        kept: dict[int, dict[int, str]] = {}
        for ward, copies in wards.items():
            kept[ward] = {}
            for step, (attempt, under) in copies.items():
                resume = left_by(step, under, recorded)
                if resume is None:
                    kept[ward][step] = attempt
                else:
                    left[step] = resume
        held.append(kept)
    if left:
        newest = max(left)
        logger.warning(
            "copies of step%s %s not loaded: a run the job left when it %s (at %s)",
            "s" if len(left) > 1 else "",
            rank_ranges(sorted(left)),
            "started over" if left[newest].step < 0 else f"resumed from step {left[newest].step}",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(left[newest].at)),
        )
    return held


def _place(local: LocalTier) -> str | None:
    """This rank's job directory, as the ranks sharing it know it (its ``dir-token``): the
    copies another rank of the same directory reports are this rank's own, not a peer's. None
    where the node holds no copies (or the token cannot be read)."""
    try:
        if not local.rank_dir(local.rank).parent.is_dir():
            return None
    except OSError:
        return None
    return local.dir_token()


def _plan(
    durable: Store,
    local: LocalTier,
    held: list[dict[int, dict[int, str]]],
    places: list[str | None],
    listed: list[int] | BaseException,
    step: int | None,
    limit: int | None,
    reads: RestorePlan,
) -> list[Candidate]:
    """(rank 0) ``plan_sources`` over every rank's copies and the durable steps; ``reads``
    gets the durable manifests read, and why each that was not could not be."""
    unlisted = listed if isinstance(listed, BaseException) else None
    steps: list[int] = [] if unlisted is not None else listed  # type: ignore[assignment]
    if unlisted is not None:
        logger.warning(
            "durable store %s cannot be listed, only local and peer copies are considered: %s",
            durable.uri,
            one_line(unlisted),
        )

    def attempt(s: int) -> str | None:
        try:
            manifest = load_manifest(durable, s)
        except (CheckpointCorruptError, CheckpointNotFoundError, FormatVersionError) as exc:
            logger.warning("durable step %d in %s unreadable: %s", s, durable.uri, one_line(exc))
            reads.unreadable[s] = exc
            return None  # a storage error is raised: the step may be fine
        reads.manifests[s] = manifest
        return manifest.attempt

    plan = plan_sources(held, steps, attempt, step=step, limit=limit, places=places)
    if plan:
        if step is None:
            _name_passed_over(held, plan[0].step)
        return plan
    if unlisted is not None:
        raise unlisted
    where = f"step {step}" if step is not None else "any step"
    raise CheckpointNotFoundError(
        f"no tier holds {where} for every rank: every node's local dir (rank 0's: "
        f"{local.policy.local_dir}), peers, durable "
        f"{durable.uri} (durable steps: {', '.join(map(str, steps[-5:])) or 'none'})"
    )


def _name_passed_over(held: list[dict[int, dict[int, str]]], planned: int) -> None:
    """(rank 0) One warning naming the newest step some ranks hold copies of that the plan
    passes over, and the ranks no tier holds it for (a node replaced with no peer copies of its
    ranks: the operator learns what was lost)."""
    world = len(held)
    holders: dict[int, set[int]] = {}
    for wards in held:
        for ward, copies in wards.items():
            for s in copies:
                if s > planned and 0 <= ward < world:
                    holders.setdefault(s, set()).add(ward)
    if not holders:
        return
    newest = max(holders)
    missing = sorted(set(range(world)) - holders[newest])
    others = len(holders) - 1
    logger.warning(
        "step %d passed over: no tier holds a copy of rank%s %s (only of rank%s %s)%s; "
        "loading step %d",
        newest,
        "s" if len(missing) > 1 else "",
        rank_ranges(missing) or "-",
        "s" if len(holders[newest]) > 1 else "",
        rank_ranges(holders[newest]),
        f", and {others} older step{'s' if others > 1 else ''} likewise" if others else "",
        planned,
    )


def _healthy(
    durable: Store, local: LocalTier, group: RankGroup, plan: RestorePlan, wanted: int | None
) -> tuple[list[Candidate], dict[int, str]]:
    """(collective) The healthy saves of ``plan``, and why each other one is not. Each rank
    tells the health its own copy records, and that of each copy it holds of a rank whose
    first source it is (a node replaced: the peer copy the load will take)."""
    mine: dict[tuple[int, int], Any] = {}  # (rank whose copy, step) -> its health
    for c in plan.candidates:
        wards = [w for w, s in enumerate(c.sources) if s[0] == Source(PEER, group.rank)]
        for ward in [group.rank, *wards]:
            try:
                manifest = load_manifest(local.store(ward), c.step)
            except CheckpointError:
                continue  # no copy here: another tier serves that rank
            if manifest.attempt == c.attempt:
                mine[(ward, c.step)] = manifest.health
    copies = group.gather(mine)
    verdict: Any = None
    if group.rank == 0:
        try:
            verdict = _judge(durable, plan, copies)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            verdict = exc
    good, why = _raise_or(group.broadcast(verdict))
    if wanted is not None and not any(c.step == wanted for c in good):
        raise UnhealthyStepError(f"{why.get(wanted, wanted)} (healthy=True)")
    if not good:  # the plan found saves: a job that started over would save over them
        raise no_healthy_step(f"no healthy step in the tiers or {durable.uri}", why)
    return good, why


def _judge(
    durable: Store, plan: RestorePlan, copies: list[dict]
) -> tuple[list[Candidate], dict[int, str]]:
    """(rank 0) ``plan``'s healthy saves, and why each other one is not."""
    good, why = [], {}
    told = {key: health for reported in copies for key, health in reported.items()}
    for c in plan.candidates:
        if c.attempt is None:  # only its durable manifest, which cannot be read
            error = plan.unreadable[c.step]
            why[c.step] = Unreadable(f"step {c.step}: cannot be read ({error})", error)
            continue
        own = [told.get((r, c.step), "absent") for r in range(len(copies))]
        durable_health = _durable_health(durable, plan.manifests, c)
        reason = tiered_verdict(c.step, own, durable_health)
        if reason is None:
            good.append(c)
        else:
            held = "only by the local tiers" if durable_health == "absent" else f"in {durable.uri}"
            why[c.step] = f"{reason}; held {held}"
    return good, why


def _durable_health(durable: Store, manifests: dict[int, Manifest], c: Candidate) -> Any:
    """(rank 0) The health the durable manifest of ``c``'s save records; "absent" when the
    durable store does not hold that save."""
    manifest = manifests.get(c.step)
    if manifest is None:
        try:
            manifest = load_manifest(durable, c.step)
        except CheckpointError:
            return "absent"
    return manifest.health if c.attempt is None or manifest.attempt == c.attempt else "absent"
