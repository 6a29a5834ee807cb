"""Which save every rank restores, and from which tiers.

Every rank reports the copies its node keeps (every rank store of its job directory, step ->
attempt); the
coordinator adds the durable steps (their attempts read from their manifests) and picks the
newest save, a (step, attempt) pair, that every rank can get from some tier: a durable step's
own save where its manifest reads, else the save of it that most ranks hold locally. One planner
for both front-ends (through ``tiers.plan.plan_restore``). Each rank then
tries its sources in order: its own local copy, the copies its holders keep (nearest node
first), durable storage. Matching attempts, not only step numbers, is what keeps a rank from
loading a copy of another save of the same step (a job that resumed from an older step and
saved that step number again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstore import telemetry

LOCAL, PEER, DURABLE = "local", "peer", "durable"


@dataclass(frozen=True)
class Source:
    tier: str  # LOCAL, PEER or DURABLE
    holder: int | None = None  # PEER: the rank whose node keeps the copy

    def __str__(self) -> str:
        return f"peer rank {self.holder}" if self.tier == PEER else self.tier


@dataclass(frozen=True)
class Candidate:
    step: int
    attempt: str | None  # None: whichever save of the step is committed (a load without tiers)
    sources: list[list[Source]]  # by rank, in the order to try


@dataclass
class SourceStats:
    bytes: int = 0  # stored bytes read (or received from a peer)
    seconds: float = 0.0
    chunks: int = 0


@dataclass
class LoadReport:
    """``Checkpointer.last_load``: what this rank's last load read, per tier."""

    step: int | None = None
    source: str | None = None  # the tier the rank's state came from (most of its bytes)
    sources: dict[str, SourceStats] = field(default_factory=dict)
    seconds: float = 0.0
    peer_buffer_bytes: int = 0  # the most round-buffer bytes its peer transfers held at once
    # A repair of this rank's copy, by where each chunk came from: across the wire from the
    # holder, or on this node (chunks of its own copy that still verify, another copy's).
    repair_chunks_received: int = 0
    repair_chunks_here: int = 0

    def count(self) -> None:
        """This load in the process-wide tier telemetry (``ckptstore_tier_loads_total`` by the
        tier the state came from, ``..._tier_load_bytes_total`` by tier): once per rank's
        load, whichever front-end ran it. ``source`` is settled first: the tier the load set
        out from, unless another served more of the bytes (a copy whose chunks failed their
        check, read from durable storage instead)."""
        served = {tier: stats.bytes for tier, stats in self.sources.items() if stats.bytes}
        if served and served.get(self.source or "", 0) < max(served.values()):
            self.source = max(served, key=lambda tier: served[tier])
        if self.source is not None:
            telemetry.tier_loads_total.inc(tier=self.source)
        for tier, stats in self.sources.items():
            telemetry.tier_load_bytes_total.inc(stats.bytes, tier=tier)

    def add(self, tier: str, nbytes: int, seconds: float, chunks: int = 0) -> None:
        stats = self.sources.setdefault(tier, SourceStats())
        stats.bytes += nbytes
        stats.seconds += seconds
        stats.chunks += chunks


def plan_sources(
    held: list[dict[int, dict[int, str]]],
    durable_steps: list[int],
    durable_attempt: Callable[[int], str | None],
    *,
    step: int | None = None,
    limit: int | None = None,
    places: list[str | None] | None = None,
) -> list[Candidate]:
    """The saves every rank can restore, newest first. ``held[h]``: rank h's node's copies, by
    ward, step -> attempt; ``durable_attempt(step)``: the attempt of a durable step (None when
    its manifest cannot be read: its candidate, durable only, fails to load), asked only of the
    steps considered. ``step``: only that step;
    ``limit``: at most that many saves (a load without fallback needs one). ``places[h]``: the
    job directory rank h reads (None: not known): a directory is one source of a rank's copy
    however many ranks share it, and the rank's own directory its local source, never a
    peer's (a repair from it would read the very copy it replaces)."""
    world = len(held)
    where = places if places is not None else [None] * world
    by_save: dict[tuple[int, str], dict[int, list[Source]]] = {}
    for h, wards in enumerate(held):
        for ward, copies in wards.items():
            if not 0 <= ward < world:
                continue
            for s, attempt in copies.items():
                source = Source(LOCAL) if ward == h else Source(PEER, h)
                by_save.setdefault((s, attempt), {}).setdefault(ward, []).append(source)
    steps = {s for s, _ in by_save} | set(durable_steps)
    if step is not None:
        steps &= {step}
    out: list[Candidate] = []
    for s in sorted(steps, reverse=True):
        durable = durable_attempt(s) if s in durable_steps else None
        # The durable save of a step is its record: copies of another save of that step number
        # (one the job never finished, then resumed below and saved again) are never loaded.
        attempts = {durable} if durable is not None else {a for (t, a) in by_save if t == s}
        found = []
        for attempt in sorted(attempts):
            tiers = by_save.get((s, attempt), {})
            sources = []
            for r in range(world):
                mine = sorted(
                    tiers.get(r, []),
                    key=lambda src: (src.tier != LOCAL, _distance(src.holder, r, world)),
                )
                mine = _one_per_place(mine, where, r)
                if attempt == durable:
                    mine.append(Source(DURABLE))
                sources.append(mine)
            if all(sources):
                local = sum(any(src.tier == LOCAL for src in mine) for mine in sources)
                found.append((local, attempt, sources))
        if found:
            _, attempt, sources = max(found, key=lambda f: (f[0], f[1]))
            out.append(Candidate(s, attempt, sources))
        elif s in durable_steps and durable is None:
            # Committed, its manifest unreadable and no tier holds every rank's copy: tried as
            # the durable front-end tries it, so its load says why, and one with fallback
            # skips it, then quarantines it (passed over unnamed, it was never saved again).
            out.append(Candidate(s, None, [[Source(DURABLE)] for _ in range(world)]))
        if limit is not None and len(out) >= limit:
            break
    return out


def _distance(holder: Any, rank: int, world: int) -> int:
    return 0 if holder is None else (holder - rank) % world


def _one_per_place(sources: list[Source], places: list[str | None], rank: int) -> list[Source]:
    """``sources`` without a second source in a job directory already listed (the first, the
    rank's own or the nearest holder, kept); a source of an unknown place is kept."""
    seen: set[str] = set()
    if places[rank] is not None:
        seen.add(places[rank])  # its own directory: LOCAL when listed, never a peer
    out = []
    for src in sources:
        place = places[rank] if src.tier == LOCAL else places[src.holder]  # type: ignore[index]
        if src.tier != LOCAL and place is not None and place in seen:
            continue
        if place is not None:
            seen.add(place)
        out.append(src)
    return out
