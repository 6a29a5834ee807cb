"""One ``SaveSession`` run by every rank of a group: rank 0 begins it (its lease, the gc check,
the committed steps listed once) and hands each rank where its index of the latest step is;
every rank writes its part; rank 0 commits once all have, and every rank learns the outcome.
Used by the Checkpointer's saves and by the drains of both front-ends."""

from __future__ import annotations

import logging
import pickle
import random
import time
from collections.abc import Callable
from typing import Any

from ckptstore.catalog import load_manifest
from ckptstore.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    RankLostError,
    is_full_store,
    one_line,
)
from ckptstore.format import commit_key
from ckptstore.health import StepHealth
from ckptstore.leases import SAVE, find_lease
from ckptstore.save.session import LatestIndex, RankWritten, SaveSession, save_lease_holder

logger = logging.getLogger(__name__)

Write = Callable[["LatestIndex | BaseException | None"], RankWritten]


def save_collective(
    session: SaveSession,
    group: Any,
    write: Write,
    *,
    user: Callable[[], dict | None] | None = None,
    dcp_metadata: Callable[[], bytes | None] | None = None,
) -> StepHealth | None:
    """Run ``session`` over ``group`` (a ``tiers.group.RankGroup``). ``write(latest)`` writes
    this rank's chunks and index and returns what it wrote; ``latest`` is where its index of
    the latest committed step is, or the error the save fails with on this rank (rank 0 could
    not begin it), which ``write`` raises once it has taken part in any collective of its
    own. ``user()`` and ``dcp_metadata()``, what the manifest records, are called on rank 0 at
    the commit. Raises this rank's error, else the commit's; returns the step's health as
    the commit judged it, on every rank."""
    rank = group.rank
    try:
        latest = _begin(session, group)
        try:
            written: RankWritten | BaseException = write(latest)
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather
            written = exc
        try:  # fails when a rank is lost
            every = group.gather(((session.step, session.attempt), portable(written)))
        except BaseException:
            if isinstance(written, BaseException):  # what no other rank will hear
                logger.warning(
                    "rank %d: step %d failed here: %s", rank, session.step, one_line(written)
                )
            raise
        ranks = [w for _, w in every]
        outcome: Any = None
        if rank == 0:
            failed = [(r, e) for r, e in enumerate(ranks) if isinstance(e, BaseException)]
            apart = saves_apart(session.step, session.attempt, [save for save, _ in every])
            if apart is not None:
                outcome = apart
            elif failed:
                r, error = failed[0]
                outcome = CheckpointError(f"step {session.step}: rank {r} failed: {error}")
                outcome.__cause__ = error
            else:
                outcome = _commit(session, ranks, user, group.world_size, dcp_metadata)
        try:
            outcome = group.broadcast(portable(outcome))
        except BaseException as lost:
            known = (
                None
                if isinstance(written, BaseException)
                else _committed(session, rank, outcome, lost)
            )
            if known is None:
                if rank == 0 and isinstance(outcome, BaseException):
                    raise outcome  # noqa: B904 - what it would have told; the loss its context
                raise
            logger.warning(
                "rank %d: step %d is committed in %s, but %s",
                rank,
                session.step,
                session.store.uri,
                one_line(lost),
            )
            outcome = known
    finally:
        session.release()  # rank 0's lease: the commit's outcome is known, or never will be
    if rank == 0 and any(is_full_store(e) for e in (*ranks, outcome)):
        session.reclaim()
    if isinstance(written, BaseException):
        raise written
    if isinstance(outcome, BaseException):
        raise outcome
    if rank == 0 and outcome.committed:
        session.retain()
    return outcome


def _committed(
    session: SaveSession, rank: int, outcome: Any, lost: BaseException
) -> StepHealth | None:
    """Where the outcome's broadcast failed (a rank lost as it was sent, after the commit):
    the step's health if this save committed it, None where it did not. Rank 0 knows it (a
    manifest put whose outcome is unknown it raises as such). Another rank reads the manifest
    (this attempt's) once rank 0 has let the save's lease go, which it does once it knows the
    outcome; where that cannot be seen (rank 0 lost, its lease left to go stale, the store not
    answering), no manifest is ``CommitUnknownError``: never a failure the commit may belie."""
    if rank == 0:
        return outcome if isinstance(outcome, StepHealth) and outcome.committed else None
    rank_0_lost = isinstance(lost, RankLostError) and 0 in lost.lost
    decided = not rank_0_lost and _rank_0_decided(session)
    try:
        manifest = load_manifest(session.store, session.step)
    except CheckpointNotFoundError:
        manifest = None
    except Exception as exc:  # noqa: BLE001 - the store cannot say
        raise _unknown(session, lost, f"its manifest could not be read ({one_line(exc)})") from exc
    if manifest is not None and manifest.attempt == session.attempt:
        return StepHealth.of(session.step, manifest.health)
    if decided or manifest is not None:  # rank 0 let the lease go; or another save's step
        return None
    raise _unknown(session, lost, "rank 0's outcome could not be heard and no manifest is there")


def _unknown(session: SaveSession, lost: BaseException, why: str) -> CommitUnknownError:
    error = CommitUnknownError(
        f"step {session.step}: whether it is committed in {session.store.uri} is unknown: "
        f"{one_line(lost)}; {why} (`ckptstore ls` tells once rank 0's lease is gone)"
    )
    error.__cause__ = lost
    return error


def _rank_0_decided(session: SaveSession) -> bool:
    """Wait until this save's manifest is there, or rank 0 no longer holds the save's lease
    (it lets it go once it knows the outcome); True then. False where the lease went stale
    (rank 0 died, or left it for a put whose outcome it could not tell) or the wait reached
    ``RANK_0_WAIT_S``; a request that fails meanwhile is asked again."""
    holder = save_lease_holder(session.step, session.attempt, 0)
    deadline, pause = time.monotonic() + RANK_0_WAIT_S, LEASE_POLL_S
    while time.monotonic() < deadline:
        try:
            if session.store.exists(commit_key(session.step)):
                return True
            lease = find_lease(session.store, SAVE, holder)
        except Exception as exc:  # noqa: BLE001 - asked again at the next poll
            logger.debug("step %d: rank 0's lease not read: %s", session.step, exc)
        else:
            if lease is None:
                return True
            if not lease.live:
                return False
        # Every surviving rank asks: spread out, and less often as the wait goes on.
        time.sleep(pause * random.uniform(0.5, 1.5))
        pause = min(2 * pause, LEASE_POLL_MAX_S)
    return False


LEASE_POLL_S = 1.0
LEASE_POLL_MAX_S = 8.0
RANK_0_WAIT_S = 600.0  # as long as torch's default collective timeout


def portable(value: Any) -> Any:
    """``value`` as every rank can rebuild it: an error that does not survive pickling (a
    class whose ``__init__`` takes other arguments than its ``args``) as a ``CheckpointError``
    naming it; anything else as it is."""
    if not isinstance(value, BaseException):
        return value
    try:
        pickle.loads(pickle.dumps(value))  # our own object, not a stored one
    except Exception:  # noqa: BLE001 - any error of its pickling
        stand_in = CheckpointError(one_line(value))
        stand_in.__cause__ = value
        return stand_in
    return value


def saves_apart(step: int, attempt: str, saves: list[tuple[int, str]]) -> CheckpointError | None:
    """The error when the ranks did not all save ``step`` (``attempt``) as rank 0 did (a loop
    whose step differs by rank, or ranks that skipped different saves), given every rank's
    ``(step, attempt)``: nothing is committed, every rank raises it."""
    apart = sorted({(r, s) for r, (s, a) in enumerate(saves) if (s, a) != (step, attempt)})
    if not apart:
        return None
    shown = ", ".join(f"rank {r} step {s}" for r, s in apart[:4])
    more = f"; and {len(apart) - 4} more" if len(apart) > 4 else ""
    return CheckpointError(
        f"step {step} was not committed: the ranks saved different steps or saves (rank 0 "
        f"step {step}; {shown}{more}): every rank must call save() with the same step, in "
        "the same order"
    )


def _begin(session: SaveSession, group: Any) -> LatestIndex | BaseException | None:
    if group.rank != 0:
        return group.scatter(None)
    try:
        latest = session.begin(0)
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
        told = CheckpointError(
            f"step {session.step}: rank 0 could not begin the save: {one_line(exc)}"
        )
        group.scatter([None] + [told] * (group.world_size - 1))
        return exc
    return group.scatter([latest.get(r) for r in range(group.world_size)])


def _commit(
    session: SaveSession,
    ranks: list[RankWritten],
    user: Callable[[], dict | None] | None,
    world_size: int,
    dcp_metadata: Callable[[], bytes | None] | None,
) -> BaseException | StepHealth:
    try:
        return session.commit(
            ranks,
            world_size=world_size,
            user=user() if user is not None else None,
            dcp_metadata=dcp_metadata() if dcp_metadata is not None else None,
        )
    except BaseException as exc:  # noqa: BLE001 - reported to every rank
        return exc
