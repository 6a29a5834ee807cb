"""Retention and garbage collection: drop old steps, then chunks no kept step references.

Order matters for crash safety: a step's manifest is deleted first (the step disappears
atomically), then its indexes, then unreferenced chunks. Chunks are swept under a ``gc`` lease
and only while no live ``save`` lease exists (``leases`` explains why that is safe against a
concurrent save); stale leases, objects of attempts that never committed and, on local paths,
temporaries of dead writers go in the same sweep.

Retention never leaves a store without its newest healthy step (docs/FORMAT.md, "Health"):
``keep_last`` keeps it beside the newest K, whatever came after it.

Retention counts only steps that can be read (manifest and rank indexes decode): a damaged
step is never what keeps a loadable one from deletion, is never deleted by ``keep_last`` (only
on request), and stops the sweep while it is kept, since the chunks it references are unknown.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ckptstore.catalog import (
    SETTLE_TIMEOUT_S,
    found_gone_as_named,
    gone_as_named,
    gone_step,
    legacy_markers,
    list_steps,
    load_manifest,
    load_rank_indexes,
    quarantined,
    read_object,
    seen_steps,
)
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    FormatVersionError,
    StorageError,
)
from ckptstore.format import (
    Manifest,
    attempt_of_key,
    chunk_key,
    commit_key,
    digest_of_chunk_key,
    save_of_key,
)
from ckptstore.leases import (
    DEFAULT_TTL_S,
    GC,
    SAVE,
    Lease,
    delete_stale,
    find_leases,
    stale_probes,
    store_now,
)
from ckptstore.quarantine import quarantine_objects, quarantined_attempts, quarantined_chunks
from ckptstore.store import Store

logger = logging.getLogger(__name__)


@dataclass
class GcReport:
    kept_steps: list[int] = field(default_factory=list)
    deleted_steps: list[int] = field(default_factory=list)
    unreadable_steps: dict[int, str] = field(default_factory=dict)
    """Committed steps whose manifest or a rank index does not decode -> why: never counted
    as kept, never deleted by ``keep_last``; while one is kept, nothing is swept."""
    removed_corrupt: list[int] = field(default_factory=list)
    spared: list[int] = field(default_factory=list)
    """Steps ``keep_last`` would have deleted that ``keep_steps`` kept."""
    kept_healthy: int | None = None
    """The newest healthy step, kept whatever ``keep_last`` says (None: no healthy step)."""
    removed_quarantine: list[int] = field(default_factory=list)
    """Steps whose quarantined objects ``remove_corrupt`` deletes (``ckptstore.quarantine``)."""
    deleted_chunks: int = 0
    deleted_chunk_bytes: int = 0
    deleted_other: int = 0
    young_chunks: int = 0
    """Unreferenced chunks left as younger than ``young_s`` (``collect``)."""
    swept: bool = False
    blocked_by: list[str] = field(default_factory=list)
    dry_run: bool = False
    verified_steps: list[int] = field(default_factory=list)
    """Steps whose every chunk was re-hashed and checks out (``verify_chunks``, ``verify_kept``)."""
    read_attempts: dict[int, str] = field(default_factory=dict)
    """The save (attempt) of each step as read, from every manifest that decoded: a step is
    deleted, and its objects left unswept, only while it is still that save."""


_ANY_SAVE: Any = object()


def drop_step(store: Store, step: int, attempt: str | None = _ANY_SAVE) -> bool:
    """Unlist committed ``step``: its manifest goes, so it is gone from here on; the objects only
    it referenced are swept by the next ``collect``. ``attempt``: only if the step is still that
    save (None: a manifest that did not decode, and still does not), not one another process
    committed under the number since it was read (after dropping it). Whether it was dropped."""
    if attempt is not _ANY_SAVE and not _unchanged(store, step, attempt):
        logger.info("gc %s: step %d was saved again since it was read; kept", store.uri, step)
        return False
    store.delete(commit_key(step))
    gone_step(store, step)
    logger.info("gc %s: deleted step %d", store.uri, step)
    return True


def collect(
    store: Store,
    *,
    keep_last: int | None,
    dry_run: bool = False,
    remove_corrupt: bool = False,
    ignore_attempts: set[str] = frozenset(),
    keep_steps: set[int] = frozenset(),
    lease_ttl_s: float = DEFAULT_TTL_S,
    verify_chunks: bool = False,
    check_chunks: bool = False,
    verify_kept: bool = False,
    verify_healthy: bool = False,
    known: set[tuple[int, str]] | None = None,
    warn: bool = True,
    young_s: float = 0.0,
    listed_since: int | None = None,
) -> GcReport:
    """Keep the newest ``keep_last`` readable steps (all if None); sweep what nothing kept
    references.

    A step whose manifest or rank index does not decode is neither counted nor deleted
    (``remove_corrupt`` deletes the corrupt ones); while one is kept, nothing is swept: the
    chunks it references are unknown. ``ignore_attempts``: save leases of these attempts do
    not block the sweep (the caller's own save, committed already). ``keep_steps``: kept
    whatever ``keep_last`` says (a node-local copy not yet drained to durable storage). The
    newest healthy step is kept too, so a run of unhealthy steps never leaves the store
    without one to resume from. ``verify_chunks``: every chunk of every readable step is
    re-hashed first (``verify``); a step with a damaged or missing chunk is corrupt, as one
    whose manifest does not decode; one the store does not answer for fails the call
    (``StorageError``, nothing deleted). ``check_chunks``: one listing of the chunks first, and a
    step that references a chunk not there is corrupt (``ckptstore gc``: a step that lost a
    chunk never stands in for one that loads). ``verify_kept``, ``verify_healthy``, ``known``: see
    ``_verify_kept``.
    ``warn=False``: the report's findings logged at INFO (a caller that prints it).
    ``young_s``: see ``_unreferenced_chunks``. ``listed_since``: a step the caller committed
    a save ago; a listing of commits/ without it (unless deleted since) lags the store's writes
    and may lack other steps, whose chunks would look unreferenced: ``StorageError``, nothing
    deleted."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    report = GcReport(dry_run=dry_run)
    seen = seen_steps(store)  # before the listing: a step committed after it is not missed
    listed = _listed_with(store, listed_since)
    # keep_steps are read even where the listing lags behind their commit (the save's own)
    readable = _read_steps(store, sorted(set(listed) | set(keep_steps)), report)
    _refuse_a_listing_that_misses_steps(store, readable, [*listed, *keep_steps], {}, seen)
    if verify_chunks:
        _verify_chunks(store, readable, report, sorted(readable))
    elif check_chunks:
        _check_chunks_present(store, readable, report)
    if not verify_chunks:
        _verify_kept(store, readable, report, keep_last, verify_kept, verify_healthy, known)
    doomed = _doomed(store, readable, keep_last, set(keep_steps), report)
    level = logging.WARNING if warn else logging.INFO
    _judge_unreadable(store, report, remove_corrupt, level)
    forensics, keep_attempts, keep_chunks = _quarantine(store, report, remove_corrupt)
    gone = {s: report.read_attempts.get(s) for s in [*doomed, *report.removed_corrupt]}
    if not dry_run:
        for step in report.deleted_steps + report.removed_corrupt:
            if not drop_step(store, step, gone[step]):
                del gone[step]  # saved again: kept, and looked up where a listing lacks it
        if remove_corrupt:
            list(store.map(store.delete, forensics))
    lease = None
    if not dry_run:
        lease = Lease(store, GC, uuid.uuid4().hex, ttl_s=lease_ttl_s).acquire()
    try:
        _sweep(
            store, report, gone, readable, ignore_attempts, lease_ttl_s, lease, keep_attempts,
            level, set(keep_steps), keep_chunks, young_s,
        )  # fmt: skip
    finally:
        if lease is not None:
            lease.release_when_settled(SETTLE_TIMEOUT_S)
    return report


def _listed_with(store: Store, step: int | None) -> list[int]:
    """The steps the store lists; ``StorageError`` when they lack ``step`` and its commit is
    there when read by its key."""
    listed = list_steps(store)
    if step is not None and step not in listed and store.exists(commit_key(step)):
        raise StorageError(
            f"{store.uri}: the listing of commits/ lacks step {step}, committed a save ago: "
            "the store's listing lags its writes, and the steps it leaves out would lose their "
            "chunks; nothing was deleted"
        )
    return listed


def _quarantine(
    store: Store, report: GcReport, remove_corrupt: bool
) -> tuple[list[str], set[str], set[str]]:
    """The quarantine's own objects, and the attempts and chunks it keeps (none where
    ``remove_corrupt`` deletes the quarantined steps, named in ``report``)."""
    if remove_corrupt:
        report.removed_quarantine = sorted(set(quarantined(store).values()))
        return quarantine_objects(store), set(), set()
    return quarantine_objects(store), quarantined_attempts(store), quarantined_chunks(store)


def _judge_unreadable(store: Store, report: GcReport, remove_corrupt: bool, level: int) -> None:
    """The corrupt steps ``remove_corrupt`` deletes; each unreadable one kept logged."""
    if remove_corrupt:
        report.removed_corrupt = [s for s, why in report.unreadable_steps.items() if _corrupt(why)]
    for step in report.unreadable_steps.keys() - set(report.removed_corrupt):
        why = report.unreadable_steps[step]
        logger.log(level, "gc %s: step %d is %s; it is kept", store.uri, step, why)


def _doomed(
    store: Store,
    readable: dict[int, _Step],
    keep_last: int | None,
    keep_steps: set[int],
    report: GcReport,
) -> set[int]:
    """The readable steps ``keep_last`` deletes: not the newest K, nor ``keep_steps`` (noted
    in ``report.spared``), nor the newest healthy step."""
    steps = sorted(readable)
    report.kept_healthy = _newest_healthy(readable, steps)
    doomed = set(steps[:-keep_last] if keep_last is not None else [])
    report.spared = sorted(doomed & keep_steps)
    doomed -= keep_steps
    if report.kept_healthy in doomed:
        doomed.discard(report.kept_healthy)
        logger.info("gc %s: step %d kept, the newest healthy step", store.uri, report.kept_healthy)
    report.deleted_steps = sorted(doomed)
    return doomed


def _newest_healthy(readable: dict[int, _Step], steps: list[int]) -> int | None:
    healthy = [s for s in steps if (readable[s].manifest.health or {}).get("healthy")]
    return healthy[-1] if healthy else None


@dataclass
class _Step:
    manifest: Manifest
    chunks: dict[str, int]  # digest -> the size its index records


_CORRUPT = "corrupt: "


def _corrupt(why: str) -> bool:
    return why.startswith(_CORRUPT)


def _read_steps(store: Store, steps: list[int], report: GcReport) -> dict[int, _Step]:
    """The steps whose manifest and rank indexes decode; the others go to
    ``report.unreadable_steps`` (a step deleted meanwhile is skipped; a storage error is
    raised: it says nothing of the step)."""

    def read(step: int) -> _Step | str | None:
        try:
            manifest = load_manifest(store, step)
        except CheckpointNotFoundError:
            return None
        except (CheckpointCorruptError, FormatVersionError) as exc:
            return _why(exc)
        report.read_attempts[step] = manifest.attempt  # a dict's item assignment is atomic
        try:
            chunks = {
                d: info.stored
                for index in load_rank_indexes(store, manifest)
                for d, info in index.chunks.items()
            }
        except (CheckpointCorruptError, CheckpointNotFoundError, FormatVersionError) as exc:
            return _why(exc) if _unchanged(store, step, manifest.attempt) else None
        return _Step(manifest, chunks)

    readable = {}
    for step, found in zip(steps, store.map(read, steps), strict=True):
        if isinstance(found, str):
            report.unreadable_steps[step] = found
        elif found is not None:
            readable[step] = found
    return readable


def _verify_kept(
    store: Store,
    readable: dict[int, _Step],
    report: GcReport,
    keep_last: int | None,
    newest: bool,
    healthy: bool,
    known: set[tuple[int, str]] | None,
) -> None:
    """While ``keep_last`` would delete a step, re-hash what is kept in its place: with
    ``newest`` the newest ``keep_last`` not yet checked, with ``healthy`` the newest healthy step
    where it is older than those (kept for a job to resume from after a run of unhealthy
    saves). A damaged one leaves ``readable`` (corrupt) and the next older takes its place: a
    byte flipped in the newest step, or in the healthy one kept, never costs the good steps
    before it (``ckptstore gc``'s default; savers check the healthy one). ``known``: the
    saves (step, attempt) found good before (value None), not read again; those found good
    here are added (a damaged one is read again next time: a later save may repair it)."""
    good = known if known is not None else set()
    while keep_last is not None and len(readable) > keep_last:
        steps = sorted(readable)
        want = steps[-keep_last:] if newest else []
        kept_healthy = _newest_healthy(readable, steps)
        if healthy and kept_healthy is not None and kept_healthy not in steps[-keep_last:]:
            want.append(kept_healthy)
        want = [s for s in want if s not in report.verified_steps]
        if not want:
            return
        ids = {s: (s, readable[s].manifest.attempt) for s in want}
        unread = [s for s in want if ids[s] not in good]
        for step in set(want) - set(unread):
            report.verified_steps = sorted({*report.verified_steps, step})
        if unread:
            _verify_chunks(store, readable, report, unread)
            good.update(ids[s] for s in unread if s in readable)


def _verify_chunks(
    store: Store, readable: dict[int, _Step], report: GcReport, steps: list[int]
) -> None:
    """Re-hash every chunk of ``steps`` (of ``readable``); move each whose chunks do not all
    check out to the unreadable ones, the others to ``report.verified_steps``."""
    from ckptstore._inspect import verify_steps  # torch: only where chunks are read

    checks = verify_steps(store, steps)
    unread = [(c.step, p) for c in checks for p in c.problems if p.problem == "unreadable"]
    if unread:  # asked to verify: a plan over steps it could not check would claim it did
        steps = ", ".join(map(str, sorted({step for step, _ in unread})))
        raise StorageError(
            f"gc could not read {len(unread)} object(s) of step(s) {steps} to re-hash them (first: "
            f"{unread[0][1].object}: {unread[0][1].error}): nothing deleted"
        )
    for check in checks:
        bad = [p for p in check.problems if p.problem in ("corrupt", "missing")]
        if bad and not _unchanged(store, check.step, readable[check.step].manifest.attempt):
            del readable[check.step]  # deleted or saved again meanwhile: not what was read
        elif bad:
            shown = "; ".join(f"{p.object} {p.problem}" for p in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            report.unreadable_steps[check.step] = f"{_CORRUPT}{shown}{more}"
            del readable[check.step]
        else:
            report.verified_steps = sorted({*report.verified_steps, check.step})


def _check_chunks_present(store: Store, readable: dict[int, _Step], report: GcReport) -> None:
    """Move each step of ``readable`` whose DCP metadata does not match its manifest, or that
    references a chunk not listed or listed at another size than its index records
    (truncated), to the unreadable ones (listed after the steps were read: a step's chunks are
    all there before it commits)."""
    present = {  # at its own key only
        digest_of_chunk_key(k): size for k, size in store.list_sizes("chunks").items()
    }
    _refuse_a_listing_that_misses_chunks(store, readable, present)
    for step in sorted(readable):
        ref = readable[step].manifest.dcp_metadata
        if ref is not None:  # a DCP step does not load without it
            try:
                read_object(store, ref, "DCP metadata")
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                report.unreadable_steps[step] = _why(exc)
                del readable[step]
                continue
        chunks = readable[step].chunks
        missing = sorted(d for d in chunks if d not in present)
        cut = sorted(d for d in chunks if d in present and present[d] != chunks[d])
        if (missing or cut) and not _unchanged(store, step, readable[step].manifest.attempt):
            del readable[step]  # deleted or saved again meanwhile, not damaged
        elif missing or cut:
            bad = (missing or cut)[0]
            found = "missing" if missing else f"{present[bad]} bytes, its index says {chunks[bad]}"
            more = len(missing) + len(cut) - 1
            more_text = f" and {more} more" if more else ""
            report.unreadable_steps[step] = f"{_CORRUPT}{chunk_key(bad)} {found}{more_text}"
            del readable[step]


_ASKED_AT_MOST = 64


def _refuse_a_listing_that_misses_chunks(
    store: Store, readable: dict[int, _Step], present: dict[str, int]
) -> None:
    """``StorageError`` (nothing judged, nothing deleted) when a chunk the listing lacks is
    there when asked for by its key: the listing does not see this store's keys (``s3:///b``
    listed them with the bucket in front), or lags its writes, and the steps naming it would
    have been taken for corrupt. Each step's first chunk the listing lacks is asked for, the
    newest steps' first and ``_ASKED_AT_MOST`` in all (one chunk really gone says nothing of
    another step's; a store that lost thousands costs no request per chunk)."""
    firsts = (
        next((d for d in sorted(readable[s].chunks) if d not in present), None)
        for s in sorted(readable, reverse=True)
    )
    missing = list(dict.fromkeys(d for d in firsts if d is not None))[:_ASKED_AT_MOST]
    keys = [chunk_key(d) for d in missing]
    there = next((k for k, found in zip(keys, store.map(store.exists, keys)) if found), None)
    if there is not None:
        raise StorageError(
            f"gc {store.uri}: the listing of chunks/ lacks {there}, which is there when read "
            "by its key: the store's listing does not match its keys (check the URI) or lags "
            "its writes; nothing was deleted"
        )


def _refuse_a_listing_that_misses_steps(
    store: Store,
    readable: dict[int, _Step],
    listed: list[int],
    gone: dict[int, str | None],
    seen: set[int],
) -> None:
    """``StorageError`` (nothing deleted) when a step the listing of commits/ leaves out is
    there when read by its key, for three kinds of step: one this process had found committed
    before the listing (``seen``: it wrote or read it), one an earlier listing of this run held,
    and one a read step's manifest names (``Manifest.previous``). A listing that drops keys (a
    gateway's lost page, a lagging listing) would otherwise have its chunks swept as
    unreferenced, however old. A step a manifest names and found gone is looked up again only
    where another manifest names it (saved again since, it is that one's)."""
    here = set(listed) | gone.keys()
    named: dict[int, str] = {}  # a step to look up -> why
    claims: dict[int, list[tuple[int, str, int]]] = {}
    for step in seen - here:
        named[step] = "found committed by this process"
    for step, read in sorted(readable.items(), reverse=True):
        if step not in here:
            named.setdefault(step, "read earlier in this run")
        for before in read.manifest.previous:
            claim = (step, read.manifest.attempt, before)
            if before in gone:
                found_gone_as_named(store, claim)  # deleted by this run
            elif before not in here and before not in readable:
                if not gone_as_named(store, claim):
                    named.setdefault(before, f"named by step {step} as committed before it")
                    claims.setdefault(before, []).append(claim)
    ask = sorted(named)
    for before, there in zip(ask, store.map(lambda s: store.exists(commit_key(s)), ask)):
        if not there:
            gone_step(store, before)
            for claim in claims.get(before, []):
                found_gone_as_named(store, claim)
            continue
        raise StorageError(
            f"gc {store.uri}: the listing of commits/ lacks step {before} ({named[before]}), "
            f"which is there when {commit_key(before)} is read by its key: the store's listing "
            "drops or lags its keys, and that step's chunks would look unreferenced; nothing "
            "was deleted (run gc again later)"
        )


def _refuse_a_listing_that_misses_commits(
    store: Store, victims: list[str], listed: list[int], gone: dict[int, str | None]
) -> None:
    """``StorageError`` (nothing swept) when a save the sweep takes for failed, as no listed
    commit names it, is committed when its commit is read by its key: the listing of commits/
    left the step out (a store whose listings lag its writes), and its index and chunks would
    go, the newest step with them. One manifest read per step of those saves not listed."""
    steps = sorted({s for s, _ in filter(None, map(save_of_key, victims))} - {*listed, *gone})

    def committed(step: int) -> str | None:
        try:
            return load_manifest(store, step).attempt
        except CheckpointNotFoundError:
            return None
        except (CheckpointCorruptError, FormatVersionError):
            return "a commit that cannot be read"

    for step, attempt in zip(steps, store.map(committed, list(steps)), strict=True):
        if attempt is not None:  # committed (its chunks unreferenced too, whichever save)
            raise StorageError(
                f"gc {store.uri}: the listing of commits/ lacks step {step}, committed when "
                f"{commit_key(step)} is read by its key ({attempt}): the store's listing lags "
                "its writes; no index or chunk was deleted (run gc again later)"
            )


def _unchanged(store: Store, step: int, attempt: str) -> bool:
    """Whether ``step``'s manifest is still the save ``attempt`` gc read: a step found to lack
    a chunk may have been deleted meanwhile (another process's retention deletes the manifest
    first, then its chunks), or deleted and saved again; neither is damage to report (a step
    saved again is read afresh before the sweep)."""
    try:
        return load_manifest(store, step).attempt == attempt
    except CheckpointNotFoundError:
        return False
    except (CheckpointCorruptError, FormatVersionError):
        return True  # there, and still not readable


def _why(exc: Exception) -> str:
    if isinstance(exc, FormatVersionError):
        return f"unreadable: {exc}"  # a newer writer's, not damaged: never removed
    return f"{_CORRUPT}{exc}"


def _sweep(
    store: Store,
    report: GcReport,
    gone: dict[int, str | None],
    readable: dict[int, _Step],
    ignore_attempts: set[str],
    lease_ttl_s: float,
    lease: Lease | None,
    keep_attempts: set[str] = frozenset(),
    level: int = logging.WARNING,
    keep_steps: set[int] = frozenset(),
    keep_chunks: set[str] = frozenset(),
    young_s: float = 0.0,
) -> None:
    saves = find_leases(store, SAVE)
    live = [s.key for s in saves if s.live and s.doc.get("attempt") not in ignore_attempts]
    live += _legacy_saves(store, report.dry_run, lease)
    # Listed after the save leases: a save that committed before that look is kept, also one
    # that saved a step number again after a retention (this one or another) dropped the save
    # read above: read afresh, its index and chunks are its own.
    seen = seen_steps(store)
    listed = list_steps(store)
    if report.dry_run:
        listed = [s for s in listed if s not in gone]
    again = _saved_since_read(store, report, listed, gone)
    for step in again:
        readable.pop(step, None)
        report.unreadable_steps.pop(step, None)
    gone = {s: a for s, a in gone.items() if s not in again}
    listed = [s for s in listed if s not in gone]
    new = [s for s in listed if s not in readable and s not in report.unreadable_steps]
    readable.update(_read_steps(store, new, report))
    _refuse_a_listing_that_misses_steps(store, readable, [*listed, *keep_steps], gone, seen)
    report.kept_steps = sorted((set(listed) | (keep_steps - gone.keys())) & readable.keys())
    if report.kept_healthy not in report.kept_steps:  # removed since by another's retention
        report.kept_healthy = _newest_healthy(readable, report.kept_steps)
    if live:
        report.blocked_by = live
        logger.info("gc %s: %d save(s) in flight, chunks not swept", store.uri, len(live))
        return
    if report.unreadable_steps.keys() - gone:
        logger.log(level, "gc %s: a kept step cannot be read, no chunk swept", store.uri)
        return
    kept = [readable[s] for s in report.kept_steps]
    referenced = {d for step in kept for d in step.chunks} | keep_chunks
    protected = {step.manifest.attempt for step in kept} | set(ignore_attempts) | keep_attempts
    # Only keys of this format's shapes: a stranger's file under these prefixes is left.
    keys = [k for prefix in ("steps", "indexes") for k in store.list(prefix)]
    victims = [k for k, a in zip(keys, map(attempt_of_key, keys)) if a and a not in protected]
    # Aged by the store's clock, as leases are (a gc host's clock a day ahead deleted a live
    # writer's temporaries on a file system whose server stamps the times). One probe for all
    # below: taken before their listings, it understates their ages, the safe side.
    # A dry run writes nothing (a read-only or full store previews too): this host's clock.
    now = time.time() if report.dry_run else store_now(store)
    chunk_victims = _unreferenced_chunks(store, report, referenced, young_s, now)
    _refuse_a_listing_that_misses_commits(store, victims, [*listed, *report.kept_steps], gone)
    stale_leases = [s for s in saves if not s.live]
    temporaries = store.stale_temporaries(older_than_s=lease_ttl_s, now=now)
    temporaries += stale_probes(store, older_than_s=lease_ttl_s, now=now)
    report.swept = True
    report.deleted_chunks = len(chunk_victims)
    report.deleted_other = len(victims) + sum(len(s.keys) for s in stale_leases) + len(temporaries)
    if report.dry_run:
        report.deleted_chunk_bytes = sum(store.map(store.size, chunk_victims))
        return
    # Saves go on once our lease looks stale: never delete after it may have looked so.
    lease.check()
    if chunk_victims or victims or temporaries:
        lease.mark_deleting()
    # drain: a sweep stopped (an error, SIGTERM) ends its running deletes before the lease
    # goes, or a save starting then could find a chunk that one of them deletes a moment later.
    deleting = store.map(_delete_sized(store, lease), chunk_victims, drain=True)
    sizes = [n for n in deleting if n is not None]
    report.deleted_chunks, report.deleted_chunk_bytes = len(sizes), sum(sizes)
    list(store.map(_checked_delete(store, lease), victims + temporaries, drain=True))
    delete_stale(store, stale_leases)
    delete_stale(store, [g for g in find_leases(store, GC, now) if not g.live])


def _unreferenced_chunks(
    store: Store, report: GcReport, referenced: set[str], young_s: float, now: float
) -> list[str]:
    """Keys of the chunks no kept step references. With ``young_s``, only those older than
    that by the store's clock, the others counted in ``report``: a chunk of a step committed
    so lately that the listings left out both its commit and its indexes (a store whose
    listings lag its writes, an NFS client's cached directories) is young, as is one such a
    step found stored (``Store.refresh``, where the store can)."""
    if not young_s:
        chunks = store.list("chunks")
        return [k for k in chunks if (d := digest_of_chunk_key(k)) and d not in referenced]
    victims = []
    for key, written in store.list_times("chunks").items():
        digest = digest_of_chunk_key(key)
        if not digest or digest in referenced:
            continue
        if now - written >= young_s:
            victims.append(key)
        else:
            report.young_chunks += 1
    return victims


def _saved_since_read(
    store: Store, report: GcReport, listed: list[int], gone: dict[int, str | None]
) -> set[int]:
    """The steps of ``listed`` read before (or dropped) that are no longer the save read: one
    manifest read each."""
    read = {
        s: report.read_attempts.get(s) for s in listed if s in report.read_attempts or s in gone
    }
    changed = store.map(lambda s: not _unchanged(store, s, read[s]), list(read))
    return {s for s, c in zip(read, changed, strict=True) if c}


def _legacy_saves(store: Store, dry_run: bool, lease: Lease | None) -> list[str]:
    """Keys of young legacy ``pending/`` markers (saves that may be in flight); stale ones
    are deleted (not in a dry run; while ``lease`` holds, where there is one)."""
    live = []
    delete = store.delete if lease is None else _checked_delete(store, lease)
    for marker in legacy_markers(store):
        if not marker.stale:
            live.append(marker.key)
        elif not dry_run:
            delete(marker.key)
    return live


def _checked_delete(store: Store, lease: Lease):
    """``store.delete`` issued only while ``lease`` holds: a dead gc's lease records how long
    after its last renewal its deletes may go on (``Lease.settle_s``), so none may start later."""

    def delete(key: str) -> None:
        lease.check()
        store.delete(key)

    return delete


def _delete_sized(store: Store, lease: Lease):
    """Delete a chunk and say its size; None: gone already (another gc deleted it)."""

    def delete(key: str) -> int | None:
        try:
            size = store.size(key)
        except FileNotFoundError:
            return None
        _checked_delete(store, lease)(key)
        return size

    return delete
