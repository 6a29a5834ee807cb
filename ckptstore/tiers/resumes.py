"""The job's resumes, recorded in the durable store, so that no node brings back a run the job
left (docs/FORMAT.md, "Resumes").

At the first tiered save after a load of step L (either front-end), the copies of the steps
after L are unlisted on the nodes the job runs on (``TierSaver.drop_stale``). A node that was
away then (down, or replaced for a while) still holds its copies of that run; when it comes
back they looked like any other copies, and a load of "latest" took them. So a restarted
process's rank 0 also records the resume: an empty object ``resumes/<L:020d>-<token>`` (the
token: ms since the epoch by rank 0's clock, but never before a resume already recorded, then
8 hex), and every copy the job saves from then
on records the token of the resume it descends from (``RESUME_FIELD`` of its tier info). A copy
of step S made under an earlier resume (or none) than one from a step L < S belongs to a run
the job left, and the tiered load's planner passes it over. Only the records' times are
compared, each taken by the rank 0 of one restart: never a copy's own clock.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import CheckpointError, StorageError, one_line
from ckptstore.store import Store

logger = logging.getLogger(__name__)

RESUMES_PREFIX = "resumes"
RESUME_FIELD = "resume"  # in a copy's tier info: the token of the resume it descends from
FRESH_START = -1  # the step "resumed from" by a load that found none: every copy is left
_TOKEN = re.compile(r"(\d{16})-[0-9a-f]{8}")
_KEY = re.compile(rf"{RESUMES_PREFIX}/(\d{{20}}|-\d{{19}})-(\d{{16}})-[0-9a-f]{{8}}")


@dataclass(frozen=True)
class Resume:
    step: int  # the step the job resumed from: copies of later steps made before are left
    at: float  # when (seconds since the epoch, the recording rank's clock)
    key: str = ""


def record_resume(durable: Store, step: int, rank: int) -> str:
    """Record that the job resumed from ``step`` now (one listing, one small put); its token,
    which the copies saved from now on record. Its time is never before a resume already
    recorded (restarts' rank 0s may run on hosts whose clocks disagree). A store that cannot
    list or take it is one warning, and the token is still given: the copies of this run must
    not look older than an earlier resume (the run left stays unlisted on the nodes the job runs
    on, but a node that was away could bring it back). Once it is recorded, the records it
    makes redundant are removed (:func:`outdated`), so a job restarting from the same step again
    and again keeps one."""
    ms = int(time.time() * 1000)
    recorded: list[Resume] = []
    try:
        recorded = resumes(durable)
        ms = max([ms] + [int(r.at * 1000) + 1 for r in recorded])
    except (CheckpointError, StorageError) as exc:
        logger.warning("rank %d: the resumes in %s cannot be listed: %s", rank, durable.uri, exc)
    token = f"{ms:016d}-{uuid.uuid4().hex[:8]}"
    try:
        durable.put(f"{RESUMES_PREFIX}/{step:020d}-{token}", b"")
    except (CheckpointError, StorageError) as exc:
        logger.warning(
            "rank %d: the resume from step %d could not be recorded in %s (a node away now "
            "could bring back the run left when it returns): %s",
            rank,
            step,
            durable.uri,
            one_line(exc),
        )
        return token
    for old in outdated(step, recorded):
        try:
            durable.delete(old.key)
        except (CheckpointError, StorageError):
            break  # kept records are only listed: the next resume tries again
    return token


def outdated(step: int, recorded: list[Resume]) -> list[Resume]:
    """The records a resume from ``step`` recorded after them makes redundant: those from a step
    at or after it. Every copy such a record passes over (a later step's, made before it) the
    new one passes over too, as its step is no later and its time is."""
    return [r for r in recorded if r.step >= step]


def made_under(info: Any) -> float:
    """When the resume a copy descends from was recorded (its tier info's token); 0 for a copy
    of a job that never resumed, or one without a well-formed token."""
    token = info.get(RESUME_FIELD) if isinstance(info, dict) else None
    found = _TOKEN.fullmatch(token) if isinstance(token, str) else None
    return int(found[1]) / 1000 if found else 0.0


def resumes(durable: Store) -> list[Resume]:
    """Every resume recorded in ``durable`` (keys of another shape ignored)."""
    out = []
    for key in durable.list(RESUMES_PREFIX):
        found = _KEY.fullmatch(key)
        if found is not None:
            out.append(Resume(int(found[1]), int(found[2]) / 1000, key))
    return out


def left_by(step: int, made_under: float, recorded: list[Resume]) -> Resume | None:
    """The resume that left a copy of ``step`` behind: one from an earlier step, recorded after
    the resume the copy descends from (``made_under``), if any."""
    return next((r for r in recorded if r.step < step and r.at > made_under), None)
