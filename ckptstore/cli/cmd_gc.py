"""``ckptstore gc``: retention and the chunk sweep."""

from __future__ import annotations

import argparse

from ckptstore.cli.common import emit_json
from ckptstore.render import human_bytes
from ckptstore.retention import collect
from ckptstore.store import Store


def cmd_gc(args: argparse.Namespace, store: Store) -> int:
    report = collect(store, keep_last=args.keep_last, dry_run=args.dry_run)
    doc = {
        "uri": store.uri,
        "dry_run": report.dry_run,
        "keep_last": args.keep_last,
        "kept_steps": report.kept_steps,
        "deleted_steps": report.deleted_steps,
        "deleted_chunks": report.deleted_chunks,
        "deleted_chunk_bytes": report.deleted_chunk_bytes,
        "deleted_other": report.deleted_other,
        "swept": report.swept,
        "blocked_by": report.blocked_by,
    }
    if args.json:
        emit_json(doc)
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    kept = ", ".join(map(str, report.kept_steps)) or "none"
    gone = ", ".join(map(str, report.deleted_steps)) or "none"
    print(f"{'dry run: ' if args.dry_run else ''}kept steps: {kept}")
    print(f"{verb} steps: {gone}")
    if report.blocked_by:
        print(
            f"chunk sweep skipped: {len(report.blocked_by)} save(s) in flight "
            f"({', '.join(report.blocked_by)}); unreferenced chunks stay until a later gc"
        )
    elif report.swept:
        print(
            f"{verb} {report.deleted_chunks} unreferenced chunk(s) "
            f"({human_bytes(report.deleted_chunk_bytes)}) and {report.deleted_other} other "
            "object(s) (indexes of old or failed saves, dead writers' leases and temporaries)"
        )
    return 0
