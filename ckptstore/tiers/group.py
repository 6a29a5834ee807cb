"""Coordination of ranks on a dedicated gloo group (made once, by every rank), so that what
a background thread exchanges never interleaves with the training loop's collectives."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptstore.errors import RankLostError, RanksOutOfStepError, one_line

logger = logging.getLogger(__name__)

# Of a group's bound on a lost rank, the share its collectives wait (gloo's timeout); the rest
# is the roll call that names the ranks that did not answer.
_COLLECTIVE_SHARE = 0.75

_COLLECTIVE_CALLS = (
    "Checkpointer's load() and save(), and with tiers latest(), are collective: every rank "
    "calls them, in the same order"
)


def _has_default_store() -> bool:
    """Whether torch.distributed holds the job's rendezvous store (not where its calls are
    served to threads, as ``ckptbench scale --threads`` does)."""
    try:
        dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return False
    return True


class RankGroup:
    """The ranks of ``process_group`` (None: all) on a gloo group of their own; with one rank,
    or without ``torch.distributed``, every exchange returns this rank's value alone.

    ``lost_rank_s``: the bound on a lost rank. An exchange that a rank never joins fails on
    every other rank within it (gloo's timeout is three quarters of it, or sooner: a closed
    connection), with a ``RankLostError`` naming the ranks whose heartbeat on the job's
    rendezvous store stopped (the last quarter); the group is then spent (later exchanges fail
    at once with the same error). None: exchanges wait up to ``timeout_s``.
    ``bound_collectives=False``: ranks still wait for each other's arrival as above (where the
    job has a rendezvous store; without one, exchanges wait up to ``timeout_s``), but gloo
    keeps ``timeout_s`` (a load's reads shared over the group wait for ranks reading durable
    storage, whose requests and retries may take longer than the bound)."""

    def __init__(
        self,
        process_group: Any,
        timeout_s: float,
        *,
        no_dist: bool = False,
        lost_rank_s: float | None = None,
        bound_collectives: bool = True,
    ) -> None:
        self.active = not no_dist and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.group = None
        if lost_rank_s is not None and not bound_collectives and not _has_default_store():
            lost_rank_s = None  # ranks served without a rendezvous store (threads): plain calls
        self.lost_rank_s = lost_rank_s
        self.lost: RankLostError | None = None  # or ranks out of step: the group is spent
        self._calls = threading.local()  # what each thread's exchanges are part of
        self._members: list[int] = []  # the group's ranks while it is being made
        self._arrival_s = timeout_s  # how long ranks whose heartbeat moves are waited for
        self._exchanges = 0
        self._store: Any = None
        self._on_host: int | None = None
        if lost_rank_s is not None and bound_collectives:
            timeout_s = min(timeout_s, lost_rank_s * _COLLECTIVE_SHARE)
        self.timeout_s = timeout_s
        if self.active and self.world_size > 1:
            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            if lost_rank_s is not None:
                # Beating before the group exists: a rank lost before it joins is named too.
                _HEARTBEAT.start(self.rank, lost_rank_s / 8)
            try:
                self.group = dist.new_group(
                    ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s)
                )
            except Exception as exc:  # noqa: BLE001 - a rank that never joined, named
                self._members = ranks or list(range(self.world_size))
                self.check("making the ranks' group", exc)
                raise
            if lost_rank_s is not None:
                self._members = dist.get_process_group_ranks(self.group)
                self._store = dist.distributed_c10d._get_default_store().clone()
        self.active = self.group is not None

    @contextmanager
    def calling(self, call: str) -> Iterator[None]:
        """Label this thread's exchanges as part of ``call`` (``"latest()"``, say): a rank
        that comes to an exchange another rank reached in another call fails, with every rank
        in that exchange, naming both calls (``RanksOutOfStepError``), instead of pairing
        collectives that do not match."""
        before = getattr(self._calls, "call", None)
        self._calls.call = call
        try:
            yield
        finally:
            self._calls.call = before

    def _call(self) -> str:
        return getattr(self._calls, "call", None) or "ckptstore's exchanges"

    def check(self, what: str, exc: BaseException | None = None) -> None:
        """Raise ``RankLostError`` if a rank of the group is lost: known already, or found now
        by a roll call after ``exc`` (an exchange's error, raised as it is if every rank's
        heartbeat still moves)."""
        if self.lost is not None:
            raise self.lost
        if exc is None or self.lost_rank_s is None or not self.active:
            return
        left = self._said_left()
        if left is not None:  # a rank left the group: this one was taken for lost, say
            raise self._after_left(what, left, _plain(exc)) from exc
        lost, never = self._roll_call()
        if lost:
            raise self._lose(what, lost, _plain(exc), never=never) from exc

    def _roll_call(self) -> tuple[list[int], list[int]]:
        """The ranks of the group whose heartbeat on the job's rendezvous store did not move
        within the rest of the bound (counters, never clocks: each process adds to its own),
        and those of them that never beat at all."""
        assert self.lost_rank_s is not None
        others = [r for r in self._members if r != self.rank]
        started = self.group is not None  # every member joined it after its first beat
        try:
            before = _HEARTBEAT.counts(others, started=started)
            threading.Event().wait(self._window_s)
            after = _HEARTBEAT.counts(others, started=started)
        except Exception as exc:  # noqa: BLE001 - the store lived in a lost process
            raise self._store_gone(exc) from exc
        lost = [(r, a) for r, b, a in zip(others, before, after) if a == b]
        return [r for r, _ in lost], [r for r, a in lost if a == 0]

    @property
    def _window_s(self) -> float:
        """How long a live rank's heartbeat surely moves (it beats every eighth of the bound)."""
        assert self.lost_rank_s is not None
        return self.lost_rank_s * (1 - _COLLECTIVE_SHARE)

    def _store_gone(self, exc: BaseException) -> RankLostError:
        return RankLostError(
            f"a rank of {len(self._members)} lost (which one is unknown: the job's rendezvous "
            f"store is gone too, and it lives in rank 0's process unless a launcher such "
            f"as torchrun holds it): {one_line(exc)}",
            [],
        )

    def _lose(self, what: str, lost: list[int], heard: str, never: list[int] = ()) -> RankLostError:
        ranks = ", ".join(map(str, lost))
        if never and len(never) == len(lost):
            # No beat ever: a rank that never made a group with a lost-rank bound (a DCP
            # writer without tiers beside tiered ones), or one that died before it could.
            why = (
                "it never started ckptstore's heartbeat: it runs without the tier options "
                "given here (TierOptions(local_dir=...) on every rank), or died first"
            )
        else:
            why = "its heartbeat stopped"
        self.lost = RankLostError(
            f"rank {ranks} lost: {what} failed and {why} (rank {self.rank} heard: {heard})",
            lost,
        )
        logger.warning("rank %d: %s", self.rank, self.lost)
        return self.lost

    def _arrive(self, what: str) -> None:
        """Wait until every rank of the group has come to this exchange (counted on the job's
        rendezvous store), so that its gloo collective, bounded by a share of ``lost_rank_s``,
        waits only for ranks already there: a rank that is slow but alive (its heartbeat
        moves) is waited for up to the group's ``timeout_s``; one lost before it came is
        named within the bound."""
        self._exchanges += 1
        base = self._arrivals()
        key, everyone = f"{base}/{self._exchanges}", f"{base}/{self._exchanges}/all"
        store = self._store
        try:
            self._refuse_out_of_step(f"{base}/{self._exchanges}")
            if store.add(key, 1) == len(self._members):
                if store.check([f"{base}/left"]):  # the others gave up on this rank and left
                    said = store.get(f"{base}/left").decode()
                    raise self._after_left(what, said, "nothing: a rank left the group")
                store.set(everyone, b"1")
                last = f"{base}/{self._exchanges - 1}"
                for old in (last, f"{last}/all", f"{last}/call"):
                    store.delete_key(old)  # every rank has left the exchange before
                return
            others = [r for r in self._members if r != self.rank]
            start = looked = time.monotonic()
            beats: list[int] | None = None  # first taken after a window: most waits are shorter
            pause = 0.001
            apart, apart_looked = f"{base}/{self._exchanges}/apart", start
            while not store.check([everyone]):
                now = time.monotonic()
                if now - apart_looked >= 0.05:
                    apart_looked = now
                    if not dist.is_initialized():  # the other ranks' gloo calls fail, not wait
                        self.lost = RankLostError(_destroyed(what, self._call()), [])
                        raise self.lost
                    if store.check([apart]):
                        rank, call = store.get(apart).decode().split(" ", 1)
                        raise self._out_of_step(int(rank), call, self.rank, self._call())
                    if store.check([f"{base}/left"]):
                        raise self._left(store.get(f"{base}/left").decode())
                if now - looked >= self._window_s:
                    now_beats = _HEARTBEAT.counts(others, started=True)
                    lost = [r for r, b, a in zip(others, beats or now_beats, now_beats) if a == b]
                    if beats is not None and lost:
                        raise self._lose(what, lost, "nothing: the lost rank never came to it")
                    beats, looked = now_beats, now
                if now - start >= self._arrival_s:
                    came = int(store.add(key, 0))
                    self.lost = RankLostError(  # a rank may still come to it: the group is spent
                        f"{what} of {self._call()}: {len(self._members) - came} of "
                        f"{len(self._members)} ranks did not come within {self._arrival_s:g}s "
                        f"(their heartbeats still move: alive but stuck, or not making this "
                        f"call: {_COLLECTIVE_CALLS})",
                        [],
                    )
                    raise self.lost
                time.sleep(pause)
                pause = min(pause * 2, 0.01)  # a longer pause overshoots the last arrival
        except RankLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store lived in a lost process
            raise self._store_gone(exc) from exc

    def _arrivals(self) -> str:
        """The rendezvous store's key prefix of this group's exchanges (the same on every rank)."""
        return f"ckptstore/arrived/{self.group.group_name}"

    def _refuse_out_of_step(self, exchange: str) -> None:
        """Raise ``RanksOutOfStepError`` if another rank came to this exchange in another call
        (the first rank to come names its call; a rank that differs tells the others)."""
        mine = self._call()
        first = self._store.compare_set(f"{exchange}/call", "", mine).decode()
        if first != mine:
            self._store.set(f"{exchange}/apart", f"{self.rank} {mine}")
            raise self._out_of_step(self.rank, mine, None, first)

    def leave(self, call: str) -> None:
        """Tell the group's other ranks this one makes no more exchanges (its Checkpointer
        closed in ``call``): one waiting for it in an exchange fails at once, naming both."""
        if self.group is None or self._store is None:
            return
        said = {"rank": self.rank, "call": call}
        if isinstance(self.lost, RankLostError) and self.lost.lost:  # what spent the group
            said.update(lost=self.lost.lost, why=str(self.lost))
        try:
            self._store.set(f"{self._arrivals()}/left", json.dumps(said))
        except Exception:  # noqa: BLE001 - the store lived in a lost process: nobody waits
            logger.debug("rank %d: could not tell the group it left", self.rank)

    def _said_left(self) -> str | None:
        """What a rank that left the group said (``leave``), None if none did (or the group
        is not made yet)."""
        if self.group is None or self._store is None:
            return None
        key = f"{self._arrivals()}/left"
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store lived in a lost process: the roll call says
            return None

    def _after_left(self, what: str, said: str, heard: str) -> RankLostError:
        """The error of a rank that finds another left the group (``said``): the lost rank
        that made it leave (this one, maybe), else a rank the roll call finds lost (killed,
        having left at exit), else ranks out of step."""
        if not json.loads(said).get("lost"):
            lost, never = self._roll_call()
            if lost:
                return self._lose(what, lost, heard, never=never)
        return self._left(said)

    def _left(self, said: str) -> RankLostError:
        """The error of a rank that waits in an exchange another rank has left: that rank's
        lost rank where one spent the group (a slower rank hears the cause, not the leaving),
        else the ranks are out of step."""
        left = json.loads(said)
        rank, call = left["rank"], left["call"]
        if self.rank in left.get("lost", ()):  # stopped, or held the GIL, past the bound
            self.lost = RankLostError(
                f"rank {self.rank} (this one) was taken for lost by rank {rank}, which left in "
                f"{call}: its heartbeat stood still past the bound (the process stopped, or "
                f"one call held the GIL); the ckptstore group is spent: {left['why']}",
                left["lost"],
            )
        elif left.get("lost"):
            self.lost = RankLostError(
                f"rank {', '.join(map(str, left['lost']))} lost (rank {rank} heard it and left "
                f"in {call} while rank {self.rank} came to an exchange of {self._call()}): "
                f"{left['why']}",
                left["lost"],
            )
        else:
            self.lost = RanksOutOfStepError(
                f"ranks out of step: rank {rank} left in {call} while rank {self.rank} waits in "
                f"an exchange of {self._call()} ({_COLLECTIVE_CALLS}); the ranks' ckptstore "
                "group is spent: restart the job"
            )
        logger.warning("rank %d: %s", self.rank, self.lost)
        return self.lost

    def _out_of_step(
        self, rank: int, call: str, other: int | None, other_call: str
    ) -> RanksOutOfStepError:
        where = "another rank" if other is None else f"rank {other}"
        self.lost = RanksOutOfStepError(
            f"ranks out of step: rank {rank} came to an exchange of {call} that {where} "
            f"reached in {other_call} ({_COLLECTIVE_CALLS}); the ranks' ckptstore group is spent: "
            "restart the job"
        )
        logger.warning("rank %d: %s", self.rank, self.lost)
        return self.lost

    def _exchange(self, what: str, call: Any) -> None:
        self.check(what)
        if not dist.is_initialized():  # gloo's calls would fail on an unregistered group
            self.lost = RankLostError(_destroyed(what, self._call()), [])
            raise self.lost
        try:
            if self.lost_rank_s is not None:
                self._arrive(what)
            call()
        except Exception as exc:  # noqa: BLE001 - a lost rank, named by the roll call
            self.check(what, exc)
            if isinstance(exc, RankLostError) or not isinstance(exc, RuntimeError):
                raise  # not gloo's (a value every rank received and could not unpickle)
            raise self._spent(what, exc) from exc

    def _spent(self, what: str, exc: BaseException) -> RanksOutOfStepError:
        """A collective that failed with no rank found lost: gloo has closed the group's
        connections (a timeout, or ranks whose exchanges no longer pair), so every later
        exchange fails at once, naming this one."""
        self.lost = RanksOutOfStepError(
            f"{what} of {self._call()} failed with no rank lost ({_plain(exc)}): a rank was "
            "stuck past the group's timeout, or skipped an exchange the others made; the "
            "ranks' ckptstore group is spent: restart the job"
        )
        logger.warning("rank %d: %s", self.rank, self.lost)
        return self.lost

    def broadcast(self, value: Any) -> Any:
        if not self.active:
            return value
        box = [value]
        self._exchange(
            "a broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.group)
        )
        return box[0]

    def scatter(self, values: list[Any] | None) -> Any:
        """``values[r]`` of rank 0 on each rank r (``values`` is read on rank 0 only)."""
        if not self.active:
            assert values is not None
            return values[0]
        box: list[Any] = [None]
        self._exchange(
            "a scatter", lambda: dist.scatter_object_list(box, values, src=0, group=self.group)
        )
        return box[0]

    def ranks_on_host(self) -> int:
        """How many of the group's ranks run on this host, this one included (collective the
        first time, then remembered)."""
        if self._on_host is None:
            host = socket.gethostname()
            self._on_host = self.gather(host).count(host)
        return self._on_host

    def gather(self, value: Any) -> list[Any]:
        if not self.active:
            return [value]
        out: list[Any] = [None] * self.world_size
        self._exchange(
            "an exchange of outcomes",
            lambda: dist.all_gather_object(out, value, group=self.group),
        )
        return out

    def agree(self, error: BaseException | None, payload: Any = None) -> Agreement:
        """Every rank's outcome of a step every rank took (``error``: None if it succeeded on
        this one) and ``payload``: collective, so every rank hears every rank's error."""
        mine = None if error is None else (one_line(error), type(error).__name__)
        everything = self.gather((mine, payload))
        return Agreement(
            failures=[(r, e[0], e[1]) for r, (e, _) in enumerate(everything) if e is not None],
            payloads=[p for _, p in everything],
        )


def front_end_group(
    storage: Any,
    *,
    tiered: bool,
    gc_wait_s: float = 0.0,
    process_group: Any = None,
    no_dist: bool = False,
) -> RankGroup:
    """The group a front-end's saves or loads exchange over (the ``Checkpointer``'s, the DCP
    writer's and reader's), from its ``StorageOptions``: collectives wait as long as a save may
    make them (``storage.group_timeout_s(gc_wait_s)``); a lost rank is bounded by
    ``storage.lost_rank_timeout_s`` with tiers (``tiered``), where gloo's collectives are bounded
    too, and by four times that without: a rank's heartbeat (a Python thread) stands still while
    one call holds the GIL, and reads shared over the group wait in gloo for ranks reading
    durable storage, so there gloo keeps the group's timeout."""
    return RankGroup(
        process_group,
        timeout_s=storage.group_timeout_s(gc_wait_s),
        no_dist=no_dist,
        lost_rank_s=storage.lost_rank_timeout_s * (1 if tiered else 4),
        bound_collectives=tiered,
    )


def refuse_options_apart(group: RankGroup, options: dict[str, Any]) -> None:
    """``options`` (those that decide which exchanges a rank takes part in) the same on every
    rank of ``group``, else ``ValueError`` on every rank naming them: ranks given different
    ones would wait on exchanges the others never start. Run right after the group is made,
    before any exchange that depends on them."""
    if not group.active:
        return
    every: list[Any] = [None] * group.world_size
    try:
        # Not ``group.gather``: its arrival count waits for ranks with a lost-rank bound,
        # which an untiered rank (the very disagreement looked for) does not join.
        dist.all_gather_object(every, options, group=group.group)
    except Exception as exc:  # noqa: BLE001 - a lost rank, named by the roll call
        group.check("an exchange of options", exc)
        raise
    for key, mine in options.items():
        values = [o.get(key) if isinstance(o, dict) else None for o in every]
        if any(v != mine for v in values):
            shown = "; ".join(f"rank {r} {v!r}" for r, v in enumerate(values[:8]))
            more = f"; {len(values) - 8} more" if len(values) > 8 else ""
            raise ValueError(
                f"the ranks were given different {key} ({shown}{more}): every rank needs the same"
            )


class _Heartbeat:
    """One per process: a thread that adds 1 to ``ckptstore/alive/<rank>`` on the default
    group's store every ``period_s``, so that a rank whose counter stops moving is lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._period_s: float | None = None
        self._store: Any = None
        self._rank = 0
        self._shorter = threading.Event()  # set when the period shrinks: the wait ends early

    def start(self, rank: int, period_s: float) -> None:
        with self._lock:
            running = self._period_s is not None
            if running and period_s < self._period_s:
                self._shorter.set()  # a tiered group's bound after an untiered one's
            self._period_s = min(self._period_s or period_s, period_s)
            # The job's current store (a process may make its default group again), on a
            # connection of its own: a blocking wait on the store elsewhere stops no beat.
            self._store, self._rank = dist.distributed_c10d._get_default_store().clone(), rank
            self._store.add(f"ckptstore/alive/{rank}", 1)
        if not running:
            threading.Thread(target=self._beat, name="ckptstore-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:  # the thread ends with the process
            assert self._period_s is not None
            self._shorter.wait(self._period_s)
            self._shorter.clear()
            with self._lock:
                store, rank = self._store, self._rank
            try:
                store.add(f"ckptstore/alive/{rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone: others find no beat
                continue

    def counts(self, ranks: list[int], *, started: bool = False) -> list[int]:
        """The ranks' counters; ``started``: every one has beaten once (they all joined a group
        after starting), so one request reads them all."""
        with self._lock:
            store = self._store
        keys = [f"ckptstore/alive/{r}" for r in ranks]
        if started:
            return [int(v) for v in store.multi_get(keys)]
        return [store.add(key, 0) for key in keys]


_HEARTBEAT = _Heartbeat()


@dataclass
class Agreement:
    """What every rank heard of one step: the ranks that failed, each with its error as one
    line and the error's type name, and every rank's payload (by rank)."""

    failures: list[tuple[int, str, str]]
    payloads: list[Any]

    @property
    def ok(self) -> bool:
        return not self.failures

    def why(self, shown: int = 4) -> str:
        """The failures as one line: ``rank r: Error: text; ...``."""
        text = "; ".join(f"rank {r}: {line}" for r, line, _ in self.failures[:shown])
        more = len(self.failures) - shown
        return text + (f"; and {more} more" if more > 0 else "")


def _destroyed(what: str, call: str) -> str:
    return (
        f"{what} of {call}: the process group was destroyed (destroy_process_group() while a "
        "save was pending, or before one: wait() for the saves first)"
    )


def _plain(exc: BaseException) -> str:
    """A collective's error in one line, without the advice gloo appends ("This is typically
    caused by a remote worker crashing ...": the message says which rank, and why)."""
    return one_line(exc).split(" This is typically caused", 1)[0]
