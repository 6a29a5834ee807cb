"""``ckptstore ls``: the committed steps of a store, and the saves in flight."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from ckptstore._inspect import manifest_summary, message, ratio, utc_text
from ckptstore.catalog import list_steps, load_manifest, quarantined, saves_in_flight
from ckptstore.cli.common import Failed, UsageError, emit_json
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    StorageAccessError,
    StorageTimeoutError,
)
from ckptstore.render import format_ratio, human_bytes, rank_ranges, table
from ckptstore.store import Store
from ckptstore.tiers.identity import IDENTITY_KEY, StoreIdentity, read_identity, store_identity
from ckptstore.tiers.local import TierListing, describe_copies, tier_copies
from ckptstore.tiers.policy import TIER_KEY
from ckptstore.tiers.resumes import resumes


def cmd_ls(args: argparse.Namespace, store: Store) -> int:
    steps = list_steps(store)
    unanswered: set[int] = set()  # steps whose manifest the store refused or did not answer for

    def one(step: int) -> dict[str, Any]:
        try:
            return manifest_summary(load_manifest(store, step))
        except (CheckpointError, OSError) as exc:
            if isinstance(exc, (StorageAccessError, StorageTimeoutError)):
                unanswered.add(step)
            return {"step": step, "error": message(exc)}

    rows = list(store.map(one, steps))
    for d in args.local_dir:  # the directories ls itself names: one too deep
        name = os.path.basename(os.path.normpath(str(d)))
        if re.fullmatch(r"(job-[0-9a-f]+|rank-\d{5})", name):
            parent = os.path.dirname(os.path.normpath(str(d)))
            if name.startswith("rank-"):
                parent = os.path.dirname(parent)
            raise UsageError(
                f"--local-dir {d} is a {name.split('-')[0]} directory inside a tier directory: "
                f"pass the tier directory, --local-dir {parent}"
            )
    identity, unknown = _identity(store) if args.local_dir else (None, None)
    recorded = resumes(store) if args.local_dir else []
    listings = {
        d: tier_copies(
            d, store_identity(store), identity, of_identity=identity is not None, recorded=recorded
        )
        for d in args.local_dir
    }
    local = {d: listing.copies for d, listing in listings.items()}
    local_problems = [f"{d}: {p}" for d, listing in listings.items() for p in listing.problems]
    local_problems += [unknown] if unknown else []
    if local:
        rows = _with_tiers(rows, local)
        for row in rows:
            if not row["tiers"]["durable"]:
                copies = [c for x in listings.values() for c in x.manifests.get(row["step"], [])]
                if copies:
                    row.update(_described(describe_copies(copies)))
    pending = saves_in_flight(store)
    held_apart = sorted(set(quarantined(store).values()))
    bad = [r for r in rows if "error" in r]
    if args.json:
        doc = _listing_doc(store, steps, rows, pending, listings) | {"quarantined": held_apart}
        emit_json(doc | ({"identity_problem": unknown} if unknown else {}))
    else:
        _print_steps(store, rows, tiers=bool(local))
        _print_pending(pending, set(_readable_durable(rows)))
        if held_apart:
            again = [s for s in held_apart if s in steps]
            print(
                f"quarantined: step(s) {', '.join(map(str, held_apart))}, found damaged by a load "
                "with fallback, kept apart for forensics (ckptstore gc --remove-corrupt deletes "
                "them)"
                + (
                    f"; step(s) {', '.join(map(str, again))} saved again since: the rows above "
                    "are the new saves"
                    if again
                    else ""
                )
            )
        _print_local_dirs(listings, local_problems)
    if bad and all(r["step"] in unanswered for r in bad):
        raise Failed(
            f"{len(bad)} step(s) could not be read: the store refused or did not answer (see "
            "the listing); this says nothing of the checkpoints"
        )
    if bad:
        raise Failed(f"{len(bad)} step(s) have an unreadable manifest (see the listing)")
    if unknown:
        raise Failed(unknown)
    if local_problems:
        raise Failed(f"{len(local_problems)} local copy(ies) have an unreadable manifest")
    return 0


def _identity(store: Store) -> tuple[StoreIdentity | None, str | None]:
    """The store's identity, and what is wrong with it where it cannot be read: the local
    copies are then listed by the store's location alone, as for a store that records none."""
    try:
        return read_identity(store), None
    except CheckpointCorruptError as exc:
        return None, (
            f"{message(exc)}: local copies listed by the store's location alone "
            "(ckptstore verify says what to do)"
        )


def _listing_doc(
    store: Store,
    steps: list[int],
    rows: list[dict[str, Any]],
    pending: list[dict[str, Any]],
    listings: dict[str, TierListing],
) -> dict[str, Any]:
    """What ``ls --json`` prints."""
    return {
        "uri": store.uri,
        "steps": rows,
        # the newest a load of "latest" would take (a step whose manifest reads), durable only
        "latest": max(_readable_durable(rows), default=None),
        "pending": pending,
        **(
            {
                "local_dirs": {
                    d: {
                        "job_dir": str(listing.job_dir),
                        "problems": listing.problems,
                        "left": [
                            {"step": step, "ranks": ranks, "resumed_from": resumed}
                            for step, (ranks, resumed) in sorted(listing.left.items())
                        ],
                        "under_other_paths": listing.elsewhere,
                    }
                    for d, listing in listings.items()
                }
            }
            if listings
            else {}
        ),
    }


def _print_steps(store: Store, rows: list[dict[str, Any]], *, tiers: bool) -> None:
    """The table of steps, with a TIERS column when local dirs were listed."""
    if not rows:
        hint = ""
        if not tiers and store.exists(IDENTITY_KEY):
            hint = " (a tiered job's store: steps not yet drained here are listed with --local-dir)"
        print(f"no committed steps in {store.uri}{hint}")
        return
    rows_text = [_row_text(r) for r in rows]
    header = [
        "STEP", "KIND", "RANKS", "HEALTH", "CREATED (UTC)", "RAW", "STORED", "RATIO", "USER"
    ]  # fmt: skip
    if tiers:
        header.insert(1, "TIERS")
        for r, text in zip(rows, rows_text):
            text.insert(1, _tiers_text(r["tiers"]))
    print(table(header, rows_text, right={0, 3, 6, 7, 8} if tiers else {0, 2, 5, 6, 7}))


def _user_text(user: dict[str, Any] | None) -> str:
    """The caller's metadata; a local copy's own record (``TIER_KEY``) is not the user's."""
    shown = {k: v for k, v in (user or {}).items() if k != TIER_KEY}
    return json.dumps(shown) if shown else ""


def _row_text(r: dict[str, Any]) -> list[str]:
    if "error" not in r and "kind" in r:
        return [
            str(r["step"]),
            r["kind"],
            str(r["world_size"]),
            r["health"],
            r["created"],
            "" if r["raw_bytes"] is None else human_bytes(r["raw_bytes"]),
            "" if r["stored_bytes"] is None else human_bytes(r["stored_bytes"]),
            format_ratio(r["compression_ratio"]),
            _user_text(r["user"]),
        ]
    return [str(r["step"]), "ERROR" if "error" in r else "-", *[""] * 6, r.get("error", "")]


def _readable_durable(rows: list[dict[str, Any]]) -> list[int]:
    """The steps of ``rows`` the durable store holds whose manifests read."""
    return [r["step"] for r in rows if "error" not in r and r.get("tiers", {}).get("durable", True)]


def _print_pending(pending: list[dict[str, Any]], committed: set[int]) -> None:
    for p in pending:
        if p["kind"] == "gc":
            what = "gc"
        elif p["age_s"] is None:  # unreadable: the key says what it can
            what = "save"
        else:
            what = f"step {p['step']} rank {p['rank']} attempt {p['attempt']}: save"
        state = "stale (dead writer; the next gc removes it)" if p["stale"] else "in flight"
        if p["stale"] and p["kind"] != "gc" and p.get("step") in committed:
            state = (
                f"stale (its writer died; step {p['step']} is committed, by this attempt or "
                "another: its lease is what is left; the next gc removes it)"
            )
        if not p["stale"] and p.get("holder_dead") and p["kind"] == "gc":
            left = p.get("expires_in_s")
            state = (
                "settling (its process is gone; deletes it sent may still land: saves wait "
                f"{f'{left:.0f}s' if left is not None else 'a while'} more)"
            )
        age = f"renewed {p['age_s']:.0f}s ago" if p["age_s"] is not None else "unreadable"
        print(f"pending: {what} {state}, {age} ({p['key']})")


def _print_local_dirs(listings: dict[str, TierListing], local_problems: list[str]) -> None:
    for d, listing in listings.items():
        if listing.copies:
            step = max(listing.copies)  # a copy this directory holds, to inspect
            example = listing.job_dir / f"rank-{min(listing.copies[step]):05d}"
            print(
                f"local copies in {d}: each rank's under {listing.job_dir}/rank-<r>/, a store "
                f"of its own (ckptstore inspect {example} --step {step})"
            )
        elif listing.left:
            print(f"local copies in {d}: none a load takes (below: a run the job left)")
        else:
            print(f"local copies in {d}: none of this store's job")
        for step, (ranks, resumed) in sorted(listing.left.items()):
            print(
                f"local copies in {d}: step {step} (rank{'s' if len(ranks) > 1 else ''} "
                f"{rank_ranges(ranks)}) is of the run the job left when it "
                f"{'started over' if resumed < 0 else f'resumed from step {resumed}'}: every "
                "load passes over it"
            )
        for path, steps in listing.elsewhere.items():
            print(
                f"local copies in {d}: step(s) {', '.join(map(str, steps))} of this store made "
                f"while it was at {path}: a load does not take them (a copy belongs to the "
                f"store's path; run the job with the store at {path} to resume from them)"
            )
    for problem in local_problems:
        print(f"local copy unreadable: {problem}")


def _with_tiers(rows: list[dict[str, Any]], local: dict[str, dict[int, list[int]]]) -> list[dict]:
    """``rows`` with a ``tiers`` entry each (durable, and the ranks each local dir holds a copy
    of), plus rows for steps held only in local dirs."""
    by_step = {r["step"]: r for r in rows}
    for held in local.values():
        for step in held:
            by_step.setdefault(step, {"step": step, "durable": False})
    out = []
    for step in sorted(by_step):
        row = by_step[step]
        durable = row.pop("durable", True)
        row["tiers"] = {
            "durable": durable,
            "local": {d: held[step] for d, held in local.items() if step in held},
        }
        out.append(row)
    return out


def _described(copies: dict[str, Any]) -> dict[str, Any]:
    """A row of ``ls`` from what a step's local copies say of it (``describe_copies``)."""
    raw, stored = copies["raw_bytes"], copies["stored_bytes"]
    return copies | {
        "created": utc_text(copies["created_at"]),
        "compression_ratio": None if raw is None else ratio(raw, stored),
    }


def _tiers_text(tiers: dict[str, Any]) -> str:
    parts = ["durable"] if tiers["durable"] else []
    for directory, ranks in tiers["local"].items():
        parts.append(f"{directory}: rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}")
    return "; ".join(parts) or "-"
