"""The job's resumes, recorded in the durable store, so that no node brings back a run the job
left (docs/FORMAT.md, "Resumes").

At the first tiered save after a load of step L (either front-end), the copies of the steps
after L are unlisted on the nodes the job runs on (``TierSaver.drop_stale``). A node that was
away then (down, or replaced for a while) still holds its copies of that run; when it comes
back they looked like any other copies, and a load of "latest" took them. So rank 0 also
records the resume: an empty object ``resumes/<L:020d>-<ms:016d>-<8 hex>`` (its key says all:
the step resumed from and when, in ms since the epoch). A copy of step S made before a resume
from a step L < S belongs to a run the job left, and the tiered load's planner passes it over.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from ckptstore.errors import CheckpointError, StorageError, one_line
from ckptstore.store import Store

logger = logging.getLogger(__name__)

RESUMES_PREFIX = "resumes"
_KEY = re.compile(rf"{RESUMES_PREFIX}/(\d{{20}})-(\d{{16}})-[0-9a-f]{{8}}")


@dataclass(frozen=True)
class Resume:
    step: int  # the step the job resumed from: copies of later steps made before are left
    at: float  # when (seconds since the epoch, the recording rank's clock)


def record_resume(durable: Store, step: int, rank: int) -> None:
    """Record that the job resumed from ``step`` now (one small put). A store that cannot take
    it is one warning: the copies of the run left stay unlisted on the nodes the job runs on,
    but a node that was away could bring them back."""
    key = f"{RESUMES_PREFIX}/{step:020d}-{int(time.time() * 1000):016d}-{uuid.uuid4().hex[:8]}"
    try:
        durable.put(key, b"")
    except (CheckpointError, StorageError) as exc:
        logger.warning(
            "rank %d: the resume from step %d could not be recorded in %s (a node away now "
            "could bring back the run left when it returns): %s",
            rank,
            step,
            durable.uri,
            one_line(exc),
        )


def resumes(durable: Store) -> list[Resume]:
    """Every resume recorded in ``durable`` (keys of another shape ignored)."""
    out = []
    for key in durable.list(RESUMES_PREFIX):
        found = _KEY.fullmatch(key)
        if found is not None:
            out.append(Resume(int(found[1]), int(found[2]) / 1000))
    return out


def left_by(step: int, made_at: float, recorded: list[Resume]) -> Resume | None:
    """The resume that left a copy of ``step`` made at ``made_at`` behind (the job resumed
    from an earlier step after it was made), if any."""
    return next((r for r in recorded if r.step < step and r.at > made_at), None)
