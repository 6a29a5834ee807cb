"""Retention and garbage collection: drop old steps, then chunks no kept step references.

Order matters for crash safety: a step's manifest is deleted first (the step disappears
atomically), then its indexes, then unreferenced chunks. Chunks are swept only when no other
save is in flight: every save writes a ``pending/`` marker before it looks at existing chunks and
deletes it after its commit, and the sweep is skipped while a marker younger than
``pending_grace_s`` exists (an older one is a crashed writer's and is removed).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from ckptstore.errors import CheckpointError
from ckptstore.format import (
    commit_key,
    list_steps,
    load_manifest,
    load_rank_index,
)
from ckptstore.store import Store

logger = logging.getLogger(__name__)

DEFAULT_PENDING_GRACE_S = 6 * 3600.0


@dataclass
class GcReport:
    kept_steps: list[int] = field(default_factory=list)
    deleted_steps: list[int] = field(default_factory=list)
    deleted_chunks: int = 0
    deleted_chunk_bytes: int = 0
    deleted_other: int = 0
    swept: bool = False
    blocked_by: list[str] = field(default_factory=list)
    dry_run: bool = False


def live_pending(
    store: Store, grace_s: float, ignore: set[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """Keys of pending markers (live, stale), leaving out attempts in ``ignore``."""
    live, stale = [], []
    now = time.time()
    for key in store.list("pending"):
        if any(a in key for a in ignore):
            continue
        try:
            created = float(json.loads(store.get(key)).get("created_at", 0))
        except (CheckpointError, ValueError, AttributeError):
            created = 0.0
        (live if now - created < grace_s else stale).append(key)
    return live, stale


def collect(
    store: Store,
    *,
    keep_last: int | None,
    dry_run: bool = False,
    pending_grace_s: float = DEFAULT_PENDING_GRACE_S,
    ignore_attempts: set[str] = frozenset(),
) -> GcReport:
    """Keep the newest ``keep_last`` steps (all if None); sweep what nothing kept references."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    report = GcReport(dry_run=dry_run)
    steps = list_steps(store)
    doomed = steps[:-keep_last] if keep_last is not None else []
    report.kept_steps = [s for s in steps if s not in doomed]
    report.deleted_steps = list(doomed)
    kept = [load_manifest(store, s) for s in report.kept_steps]
    kept_attempts = {m.attempt for m in kept}

    if not dry_run:
        for step in doomed:
            store.delete(commit_key(step))  # the step is gone from here on
            logger.info("gc %s: deleted step %d", store.uri, step)

    live, stale = live_pending(store, pending_grace_s, ignore_attempts)
    if live:
        report.blocked_by = live
        logger.info("gc %s: %d save(s) in flight, chunks not swept", store.uri, len(live))
        return report

    referenced: set[str] = set()
    for manifest in kept:
        for rank in range(manifest.world_size):
            try:
                index = load_rank_index(store, manifest, rank)
            except CheckpointError:
                if any(r.key.endswith(f"/rank-{rank:05d}.json") for r in manifest.ranks):
                    raise
                continue  # DCP ranks that wrote nothing have no index
            referenced.update(index.chunks)
    protected = kept_attempts | set(ignore_attempts)
    victims = []
    for key in store.list("steps"):
        parts = key.split("/")
        if len(parts) >= 3 and parts[2] not in protected:
            victims.append(key)
    chunk_victims = [k for k in store.list("chunks") if k.rsplit("/", 1)[-1] not in referenced]
    report.swept = True
    report.deleted_chunks = len(chunk_victims)
    report.deleted_other = len(victims) + len(stale)
    if dry_run:
        report.deleted_chunk_bytes = sum(store.map(store.size, chunk_victims))
        return report
    # Last look before deleting: a save that started meanwhile keeps its chunks.
    if live_pending(store, pending_grace_s, ignore_attempts)[0]:
        report.swept = False
        report.deleted_chunks = 0
        return report
    sizes = list(store.map(_delete_sized(store), chunk_victims))
    report.deleted_chunk_bytes = sum(sizes)
    list(store.map(store.delete, victims + stale))
    return report


def _delete_sized(store: Store):
    def delete(key: str) -> int:
        try:
            size = store.size(key)
        except FileNotFoundError:
            return 0
        store.delete(key)
        return size

    return delete
