"""``ckptstore ls``: the committed steps of a store, and the saves in flight."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ckptstore._inspect import manifest_summary, message
from ckptstore.catalog import list_steps, load_manifest, saves_in_flight
from ckptstore.cli.common import Failed, emit_json
from ckptstore.errors import CheckpointError
from ckptstore.render import format_ratio, human_bytes, table
from ckptstore.store import Store


def cmd_ls(args: argparse.Namespace, store: Store) -> int:
    steps = list_steps(store)

    def one(step: int) -> dict[str, Any]:
        try:
            return manifest_summary(store, load_manifest(store, step))
        except (CheckpointError, OSError) as exc:
            return {"step": step, "error": message(exc)}

    rows = list(store.map(one, steps))
    pending = saves_in_flight(store)
    bad = [r for r in rows if "error" in r]
    if args.json:
        emit_json(
            {
                "uri": store.uri,
                "steps": rows,
                "latest": steps[-1] if steps else None,
                "pending": pending,
            }
        )
    else:
        if not rows:
            print(f"no committed steps in {store.uri}")
        else:
            rows_text = [
                [
                    str(r["step"]),
                    r["kind"],
                    str(r["world_size"]),
                    r["created"],
                    human_bytes(r["raw_bytes"]),
                    human_bytes(r["stored_bytes"]),
                    format_ratio(r["compression_ratio"]),
                    json.dumps(r["user"]) if r["user"] else "",
                ]
                if "error" not in r
                else [str(r["step"]), "ERROR", "", "", "", "", "", r["error"]]
                for r in rows
            ]
            print(
                table(
                    ["STEP", "KIND", "RANKS", "CREATED (UTC)", "RAW", "STORED", "RATIO", "USER"],
                    rows_text,
                    right={0, 2, 4, 5, 6},
                )
            )
        for p in pending:
            if p["kind"] == "gc":
                what = "gc"
            else:
                what = f"step {p['step']} rank {p['rank']} attempt {p['attempt']}: save"
            state = "stale (dead writer; the next gc removes it)" if p["stale"] else "in flight"
            age = f"renewed {p['age_s']:.0f}s ago" if p["age_s"] is not None else "unreadable"
            print(f"pending: {what} {state}, {age} ({p['key']})")
    if bad:
        raise Failed(f"{len(bad)} step(s) have an unreadable manifest (see the listing)")
    return 0
