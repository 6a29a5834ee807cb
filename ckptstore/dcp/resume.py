"""``resume``: a DCP load of the newest step that loads, as ``Checkpointer.load(fallback=True)``.

DCP's own ``dcp.load`` plans and reads one step; a step whose chunks are corrupt or missing
fails it on every rank, and a job that resumes with it fails again at every restart. ``resume``
tries the steps a load of ``"latest"`` may take, newest first (with tiers, every tier's, as the
tiered load plans them), skips one that fails as corrupt or missing (one warning naming it), and
quarantines the skipped ones (``ckptstore.quarantine``, rank 0, once a step loaded) as the
Checkpointer's fallback does. Any other failure (a state that does not match, storage that
cannot be reached) is raised at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore.dcp.reader import StoreReader, _OtherRanksFailed
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    no_step_loaded,
    one_line,
)
from ckptstore.health import name_passed_over, resumable_steps
from ckptstore.quarantine import quarantine_skipped
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.open_step import load_group, planned_steps

logger = logging.getLogger("ckptstore")

_SKIPPED = (CheckpointCorruptError, CheckpointNotFoundError)


def resume(
    state_dict: dict[str, Any],
    storage_reader: StoreReader,
    *,
    planner: Any = None,
    no_dist: bool = False,
    state_for: Callable[[int], dict[str, Any]] | None = None,
) -> int | None:
    """``dcp.load`` of the newest step that loads into ``state_dict``; returns that step, or
    None when there is nothing to resume (no tier holds a committed step). Collective: every
    rank calls it.

    A step that fails on some rank as corrupt or missing objects (``CheckpointCorruptError``,
    ``CheckpointNotFoundError``) is skipped on every rank, named in one warning, and the next
    older one tried; once one loads, the skipped ones are quarantined (docs/FORMAT.md,
    "Quarantine"). If none loads, ``NoLoadableStepError`` (each missed objects) or
    ``CheckpointCorruptError`` names every step and why. Any other failure is raised at once:
    ckptstore's own error where the step could not be opened on this rank (a step saved by
    ``Checkpointer``: ``UnsupportedStateError``; storage out of reach: ``StorageError``), else
    DCP's ``CheckpointException`` (its ``step`` the step that failed). A failed attempt may
    have written into the state's tensors (as any failed ``dcp.load``); the older step that
    loads overwrites them. With
    ``healthy=True`` on the reader only healthy steps are tried. ``no_dist`` (as DCP's): this
    process alone, with no collective of its own either. ``state_for``: the state a step loads
    into, where some steps hold less than ``state_dict`` (torchtitan's step 0, a model-only
    seed)."""
    reader = storage_reader
    if reader.step != "latest":
        raise ValueError(f"resume() starts from the latest step; the reader names {reader.step!r}")
    # no_dist: this process alone (a consolidation beside a running job), no collective
    group = (
        RankGroup(None, 0.0, no_dist=True)
        if no_dist
        else load_group(reader.options["storage"], tiered=reader._policy is not None)
    )
    passed_over: dict[int, str] = {}  # rank 0's: why healthy=True passed over each step
    steps = _steps(reader, group, passed_over)
    skipped: list[tuple[int, BaseException]] = []
    try:
        for step in steps:
            reader.step = step
            try:
                into = state_dict if state_for is None else state_for(step)
                dcp.load(into, storage_reader=reader, planner=planner, no_dist=no_dist)
            except CheckpointException as exc:
                why = _skippable(exc, reader, group)
                if why is None:
                    if isinstance(reader.metadata_error, CheckpointError):
                        raise reader.metadata_error from exc  # ckptstore's own, in one line
                    exc.step = step  # which step failed: a front-end's message names it
                    raise
                skipped.append((step, why))
                if group.rank == 0:
                    logger.warning(
                        "step %d of %s cannot be loaded, trying an older step: %s",
                        step,
                        reader.store.uri,
                        one_line(why),
                    )
                continue
            if group.rank == 0:  # a copy only a local tier lost stays: only durable damage
                where = "" if reader._policy is not None else f" in {reader.store.uri}"
                newer = name_passed_over(passed_over, step, where=where)
                quarantine_skipped(reader.store, skipped + newer)
            return step
    finally:
        reader.step = "latest"
    if not skipped:
        reader.say_if_mistyped(group.rank == 0)
        return None
    where = f"committed step in {reader.store.uri}"
    if reader._policy is not None:
        where = f"step in the tiers ({reader._policy.local_dir}, peers) or {reader.store.uri}"
    raise no_step_loaded(where, skipped, passed_over)


def _steps(reader: StoreReader, group: RankGroup, passed_over: dict[int, str]) -> list[int]:
    """The steps to try, newest first, the same on every rank (collective); ``passed_over``
    gets, on rank 0, why ``healthy=True`` passed over each other step."""
    if reader._policy is not None:
        return planned_steps(
            reader.store, reader._policy, group, healthy=reader.healthy, passed_over=passed_over
        )
    listed: list[int] | tuple[type[CheckpointError], str] = []
    if group.rank == 0:
        try:
            listed = _durable_steps(reader, passed_over)
        except CheckpointError as exc:  # raised on every rank as its own class (StorageError...)
            kind = next(c for c in type(exc).__mro__ if c.__module__ == CheckpointError.__module__)
            listed = (kind, str(exc))
    listed = group.broadcast(listed)
    if isinstance(listed, tuple):
        kind, text = listed
        raise kind(text)
    return listed


def _durable_steps(reader: StoreReader, passed_over: dict[int, str]) -> list[int]:
    steps, why = resumable_steps(reader.store, healthy=reader.healthy)
    passed_over.update(why)
    return steps


def _skippable(
    exc: CheckpointException, reader: StoreReader, group: RankGroup
) -> BaseException | None:
    """The error that makes the failed step skippable (the same on every rank), or None when
    some rank failed otherwise. DCP keeps a failed ``read_metadata``'s text alone (its
    AssertionError "metadata is None"): each rank judges its own cause, then the ranks agree."""
    mine = exc.failures.get(group.rank)
    error = mine[0] if mine is not None else None
    if error is not None and not isinstance(error, CheckpointError):
        error = reader.metadata_error or error
    if error is None or isinstance(error, _OtherRanksFailed):
        verdict: tuple[str, str] | None = None
    elif isinstance(error, _SKIPPED):
        kind = "missing" if isinstance(error, CheckpointNotFoundError) else "corrupt"
        verdict = (kind, f"rank {group.rank}: {' '.join(str(error).split())}")
    else:
        verdict = ("other", "")
    verdicts = [v for v in group.gather(verdict) if v is not None]
    if not verdicts or any(kind == "other" for kind, _ in verdicts):
        return None
    text = "; ".join(why for _, why in verdicts[:4])
    if all(kind == "missing" for kind, _ in verdicts):
        return CheckpointNotFoundError(text)
    return CheckpointCorruptError(text)
