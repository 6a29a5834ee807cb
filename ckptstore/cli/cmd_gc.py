"""``ckptstore gc``: retention and the chunk sweep."""

from __future__ import annotations

import argparse
import sys

from ckptstore.cli.common import emit_json
from ckptstore.errors import StorageFullError
from ckptstore.render import human_bytes
from ckptstore.retention import GcReport, collect
from ckptstore.store import Store


def cmd_gc(args: argparse.Namespace, store: Store) -> int:
    try:
        report = collect(
            store,
            keep_last=args.keep_last,
            dry_run=args.dry_run,
            remove_corrupt=args.remove_corrupt,
            verify_chunks=args.verify,
            check_chunks=True,
            verify_kept=not args.no_verify,
            verify_healthy=not args.no_verify,
            warn=False,  # the report below says it all
            # Run beside a job, maybe on another host: an unreferenced chunk may be of a step
            # committed so lately that its listings missed it (NFS caches directories).
            young_s=args.grace_s,
        )
    except StorageFullError as exc:
        if args.dry_run:  # a dry run writes nothing: the store's own requests failed
            raise
        # Its lease and clock probe are small writes: a store with no byte or inode left
        # stops gc after it unlisted the steps it drops, before it freed their chunks
        raise StorageFullError(
            f"{exc} (gc writes a lease and a clock probe: free a little room beside the store, "
            "then run gc again: the steps it dropped are gone from ckptstore ls, and their "
            "chunks go then)"
        ) from exc
    damaged = sorted(report.unreadable_steps.keys() - set(report.removed_corrupt))
    if args.json:
        emit_json(_doc(args, store, report))
        return 1 if damaged else 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{'dry run: ' if args.dry_run else ''}kept steps: {_steps(report.kept_steps)}")
    print(f"{verb} steps: {_steps(report.deleted_steps)}")
    if report.kept_healthy is not None:
        print(
            f"newest healthy step of those listed when gc began (always kept): {report.kept_healthy}"
        )
    if report.verified_steps:
        print(f"re-hashed, every chunk checks out: step(s) {_steps(report.verified_steps)}")
    removed = set(report.removed_corrupt)
    for step, why in sorted(report.unreadable_steps.items()):
        fate = f"{verb} (--remove-corrupt)" if step in removed else "kept, not counted"
        print(f"unreadable step {step}: {fate}: {why}")
    if report.removed_quarantine:
        print(f"{verb} quarantined step(s) {_steps(report.removed_quarantine)} (--remove-corrupt)")
    print(_sweep_line(report, verb, args.grace_s))
    if damaged:  # a cron job's `gc ... || alert` hears of it, as of `verify`
        print(
            f"ckptstore gc: {store.uri}: step(s) {_steps(damaged)} cannot be read and are kept "
            "(exit 1); --remove-corrupt deletes them",
            file=sys.stderr,
        )
        return 1
    return 0


def _doc(args: argparse.Namespace, store: Store, report: GcReport) -> dict:
    return {
        "uri": store.uri,
        "dry_run": report.dry_run,
        "keep_last": args.keep_last,
        "kept_steps": report.kept_steps,
        "deleted_steps": report.deleted_steps,
        "kept_healthy": report.kept_healthy,
        "verified_steps": report.verified_steps,
        "unreadable_steps": [
            {"step": step, "error": why, "removed": step in report.removed_corrupt}
            for step, why in sorted(report.unreadable_steps.items())
        ],
        "removed_corrupt": report.removed_corrupt,
        "removed_quarantine": report.removed_quarantine,
        "deleted_chunks": report.deleted_chunks,
        "deleted_chunk_bytes": report.deleted_chunk_bytes,
        "deleted_other": report.deleted_other,
        "young_chunks": report.young_chunks,
        "grace_s": args.grace_s,
        "swept": report.swept,
        "blocked_by": report.blocked_by,
    }


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) or "none"


def _sweep_line(report: GcReport, verb: str, grace_s: float) -> str:
    if report.blocked_by:
        return (
            f"chunk sweep skipped: {len(report.blocked_by)} save(s) in flight "
            f"({', '.join(report.blocked_by)}); unreferenced chunks stay until a later gc"
        )
    if not report.swept:
        kept = sorted(report.unreadable_steps.keys() - set(report.removed_corrupt))
        return (
            f"chunk sweep skipped: step(s) {_steps(kept)} are kept unreadable or damaged (see "
            "above), so no chunk is swept; repair them or remove them with --remove-corrupt"
        )
    young = (
        f"; {report.young_chunks} unreferenced chunk(s) written less than "
        f"--grace-s {grace_s:g} s ago, stay until a later gc"
        if report.young_chunks
        else ""
    )
    return (
        f"{verb} {report.deleted_chunks} unreferenced chunk(s) "
        f"({human_bytes(report.deleted_chunk_bytes)}) and {report.deleted_other} other "
        f"object(s) (indexes of old or failed saves, dead writers' leases and temporaries){young}"
    )
