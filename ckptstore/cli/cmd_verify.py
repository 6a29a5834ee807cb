"""``ckptstore verify``: re-check steps in full, every object by name."""

from __future__ import annotations

import argparse
import sys

from ckptstore._inspect import (
    UNREAD,
    check_all_chunks,
    check_step_objects,
    chunks_to_check,
    removed_while_checked,
)
from ckptstore.catalog import LATEST_TRIES, list_steps, load_manifest, resolve_step
from ckptstore.cli.common import Failed, emit_json, progress
from ckptstore.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    StorageTimeoutError,
)
from ckptstore.health import UNHEALTHY, status
from ckptstore.render import human_bytes
from ckptstore.store import Store
from ckptstore.tiers.identity import read_identity


def cmd_verify(args: argparse.Namespace, store: Store) -> int:
    checks, removed, chunks, total = _checked(args, store)
    checks = [c for c in checks if c.step not in removed]
    problems = [p for c in checks for p in c.problems]
    health = {c.step: _health(store, c.step) for c in checks}
    identity = _identity_problem(store)
    if args.json:
        emit_json(
            {
                "uri": store.uri,
                "ok": not problems,
                "steps": [{**c.as_dict(), "health": health[c.step]} for c in checks],
                "problems": [p.as_dict() for p in problems],
                "removed_while_verified": removed,
                "chunks_checked": len(chunks),
                "bytes_checked": total,
                "identity_problem": identity,
            }
        )
    else:
        _print_report(checks, removed, health, len(chunks), total, identity)
    if identity and not problems:
        raise Failed(identity)
    if problems:
        objects = list(dict.fromkeys(p.object for p in problems))
        kinds = "/".join(sorted({p.problem for p in problems}))
        failed = ", ".join(str(c.step) for c in checks if not c.ok)
        raise Failed(
            f"{len(objects)} {kinds} object(s) (first: {objects[0]}) in step(s) {failed} "
            f"of {store.uri}" + (f" ({UNREAD})" if _not_read(problems) else "")
        )
    return 0


def _checked(args: argparse.Namespace, store: Store) -> tuple[list, list[int], dict, int]:
    """The steps asked for, checked: their checks, those removed while checked (another
    process's keep_last or gc), the chunks read and their raw bytes. The newest step removed
    meanwhile gives way to the newest again, as every step of ``--all`` removed does (a check
    of nothing is no verdict), ``LATEST_TRIES`` times at most; a step named by ``--step``
    removed fails saying so."""
    for tries_left in range(LATEST_TRIES - 1, -1, -1):
        if args.all:
            steps = list_steps(store)
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {store.uri}")
        else:
            steps = [resolve_step(store, args.step)]
        checks = [check_step_objects(store, step) for step in steps]
        chunks = chunks_to_check(checks)
        total = sum(info.raw for info in chunks.values() if info is not None)
        with progress(total, "verify") as advance:
            check_all_chunks(
                store, checks, read_concurrency=args.read_concurrency, on_chunk=advance
            )
        removed = removed_while_checked(store, checks)
        if len(removed) < len(steps):
            return checks, removed, chunks, total
        which = ", ".join(map(str, removed))
        if args.step is not None or not tries_left:
            raise CheckpointNotFoundError(
                f"step(s) {which} of {store.uri} were removed while they were verified "
                "(keep_last or gc of another process): verify a step still kept (ckptstore ls)"
            )
        print(
            f"step(s) {which} were removed while they were verified (keep_last or gc of "
            f"another process); verifying the newest {'steps' if args.all else 'step'} again",
            file=sys.stderr,
        )
    raise AssertionError("unreachable")


def _print_report(
    checks: list,
    removed: list[int],
    health: dict[int, str],
    chunks: int,
    total: int,
    identity: str | None,
) -> None:
    """The text verify prints: a line per step and per problem, then the verdict."""
    for c in checks:
        shape = (
            f"{c.kind}, {c.ranks}/{c.world_size} rank(s), {c.tensors} tensors, "
            f"{c.chunks} chunks, {human_bytes(c.raw_bytes)}"
            if c.kind
            else "manifest unreadable"
        )
        status = "OK" if c.ok else f"FAILED ({len(c.problems)} problem(s))"
        if c.problems and all(p.problem == "refused" for p in c.problems):
            # Intact, but a safe load does not unpickle some of its values: not "corrupt".
            status = f"REFUSED ({len(c.problems)} pickled value(s); stored bytes intact)"
        if _not_read(c.problems):
            status = f"NOT VERIFIED ({len(c.problems)} object(s) not read)"
        print(f"step {c.step}: {status}  [{shape}]  health: {health[c.step]}")
        for p in c.problems:
            used = ""
            if p.tensors:
                shown = ", ".join(p.tensors[:5])
                more = f" and {len(p.tensors) - 5} more" if len(p.tensors) > 5 else ""
                used = f"\n      holds bytes of: {shown}{more}"
            print(f"  {p.problem.upper():10} {p.what} {p.object}\n      {p.error}{used}")
    for step in removed:
        print(f"step {step}: REMOVED while it was verified (keep_last or gc of another process)")
    bad_steps = sum(1 for c in checks if not c.ok and not _not_read(c.problems))
    unread = sum(1 for c in checks if _not_read(c.problems))
    verdicts = [f"{bad_steps} step(s) FAILED"] if bad_steps else []
    verdicts += [f"{unread} step(s) not verified ({UNREAD})"] if unread else []
    print(
        f"verified {len(checks)} step(s), {chunks} chunk(s), {human_bytes(total)}: "
        + ("; ".join(verdicts) or "all OK")
    )
    unhealthy = [str(s) for s, h in health.items() if h == UNHEALTHY]
    if unhealthy:
        print(f"unhealthy (intact, but NaN/Inf or a norm jump): step(s) {', '.join(unhealthy)}")
    if identity:
        print(f"IDENTITY   {identity}")


def _not_read(problems: list) -> bool:
    """Problems that are all reads the storage failed (a timeout, a refused request)."""
    return bool(problems) and all(p.problem == "unreadable" for p in problems)


def _health(store: Store, step: int) -> str:
    """``healthy``, ``unhealthy`` or ``unknown``; ``unreadable`` when the manifest is not,
    ``not read`` when the store did not answer."""
    try:
        return status(load_manifest(store, step).health)
    except StorageError:
        return "not read"  # a request failed: says nothing of the manifest
    except CheckpointError:
        return "unreadable"


def _identity_problem(store: Store) -> str | None:
    """What is wrong with the store's ``identity.json``, which every tiered job reads at open
    (None: intact, or none recorded)."""
    try:
        read_identity(store)
    except StorageTimeoutError as exc:
        return f"{exc}: not read (the store did not answer); run verify again"
    except StorageError as exc:
        return f"{exc}: not read (a request failed, which says nothing of the identity)"
    except CheckpointError as exc:
        return (
            f"{exc}: every tiered job fails to open this store until it is moved aside; the "
            "next tiered writer then records the id again from the local copies of the store's "
            "steps (docs/FORMAT.md, Store identity)"
        )
    return None
