"""Ranks as threads of one process (``ckptbench scale --threads``): the ``torch.distributed``
calls ckptstore makes, served to threads, so that 1,024 ranks fit on one small machine.

Not torch's own multi-threaded process group (``torch.testing._internal.distributed.
multi_threaded_pg``), checked with torch 2.13: its world is thread-local, so a group made on a
rank's thread is unknown on the Checkpointer's background save thread, whose first collective
fails with "Group ... is not registered"; and Checkpointer's ``new_group(backend="gloo")``
would make a real gloo group between the threads (a TCP mesh, n^2 connections). Here a group
is a handle that knows its rank, so any thread may use it.

A collective is a meeting: the k-th call of each rank on a group meets the k-th call of the
others; the last rank to arrive computes the result and wakes the rest. Objects are pickled by
their sender (its own work, as over gloo) and a gathered list is unpickled once, by the last
arrival, and handed to every rank (over gloo every rank unpickles it: on one machine that would
be n^2 work in one process, n times what any one rank of a real job does).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveCall:
    """One rank's call of a collective, in seconds of ``time.perf_counter``: when it entered
    and returned; on thread ranks also when the last rank arrived (``ready``), when the result
    was complete (``done``) and when this rank's thread ran again (``woke``)."""

    name: str
    enter: float
    exit: float
    ready: float | None = None
    done: float | None = None
    woke: float | None = None

    def work_s(self) -> float | None:
        """The collective's own time on thread ranks: the result computed, then this rank's
        part of it, not the wait for its thread to be scheduled again among all the ranks'
        (an artifact of n ranks sharing one interpreter); None on gloo."""
        if self.ready is None or self.done is None or self.woke is None:
            return None
        return (self.done - self.ready) + (self.exit - self.woke)


class _Meeting:
    def __init__(self, size: int) -> None:
        self.parts: list[Any] = [None] * size
        self.arrived = 0
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.ready = 0.0
        self.finished = 0.0
        self.aborted = False


class ThreadGroup:
    """A group of thread ranks as one rank sees it (``rank()`` and ``size()`` as torch's
    ``ProcessGroup``)."""

    def __init__(self, world: ThreadWorld, gid: int, rank: int, ranks: list[int]) -> None:
        self.world = world
        self.gid = gid
        self.global_rank = rank
        self.ranks = ranks

    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    def size(self) -> int:
        return len(self.ranks)


class ThreadWorld:
    """``world_size`` ranks, each run on a thread of its own by :meth:`run`."""

    def __init__(self, world_size: int, *, timeout_s: float = 900.0) -> None:
        if world_size < 1:
            raise ValueError(f"a world needs at least one rank, got {world_size}")
        self.size = world_size
        self.timeout_s = timeout_s
        self.calls: list[list[CollectiveCall]] = [[] for _ in range(world_size)]
        self._lock = threading.Lock()
        self._meetings: dict[tuple[int, int], _Meeting] = {}
        self._seq: dict[tuple[int, int], int] = {}
        self._groups_made = [0] * world_size
        self._local = threading.local()
        self._aborted: BaseException | None = None

    # -- running ranks -------------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on one thread per rank, ``torch.distributed`` served by this world
        meanwhile; the results by rank. The first rank to fail aborts every collective and
        its error is raised."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def rank_main(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
                errors.append(exc)
                self.abort(exc)

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True)
            for r in range(self.size)
        ]
        with self.installed():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return results

    def abort(self, error: BaseException) -> None:
        """Fail every collective waiting now or called later (a rank died)."""
        with self._lock:
            self._aborted = error
            meetings = list(self._meetings.values())
        for m in meetings:
            m.aborted = True
            m.done.set()

    def current_rank(self) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise RuntimeError(
                "torch.distributed was asked for the default group's rank outside a rank's "
                "thread; ckptbench's thread ranks serve that only on the rank threads"
            )
        return rank

    # -- collectives ---------------------------------------------------------------------------

    def meet(
        self,
        group: ThreadGroup,
        name: str,
        part: Any,
        combine: Callable[[list[Any]], Any],
        then: Callable[[Any], None] | None = None,
    ) -> None:
        """Hand ``part`` to the ``name`` collective; ``combine(parts)`` (run once, by the last
        rank to arrive) is every rank's result, which ``then`` takes on each rank."""
        enter = time.perf_counter()
        rank = group.rank()
        with self._lock:
            if self._aborted is not None:
                raise RuntimeError(f"rank {group.global_rank}: {name}: another rank failed")
            seq = self._seq.get((group.gid, rank), 0)
            self._seq[(group.gid, rank)] = seq + 1
            meeting = self._meetings.setdefault((group.gid, seq), _Meeting(group.size()))
            meeting.parts[rank] = part
            meeting.arrived += 1
            last = meeting.arrived == group.size()
            if last:
                del self._meetings[(group.gid, seq)]
        if last:
            meeting.ready = time.perf_counter()
            try:
                meeting.result = combine(meeting.parts)
            except BaseException as exc:  # noqa: BLE001 - every rank raises it
                meeting.error = exc
            meeting.finished = time.perf_counter()
            meeting.done.set()
        elif not meeting.done.wait(self.timeout_s):
            raise TimeoutError(f"rank {group.global_rank}: {name} waited {self.timeout_s:g} s")
        woke = time.perf_counter()
        if meeting.aborted:
            raise RuntimeError(f"rank {group.global_rank}: {name}: another rank failed")
        if meeting.error is not None:
            raise meeting.error
        if then is not None:
            then(meeting.result)
        self.calls[group.global_rank].append(
            CollectiveCall(name, enter, time.perf_counter(), meeting.ready, meeting.finished, woke)
        )

    # -- torch.distributed, as ckptstore calls it ----------------------------------------------

    def _group(self, group: Any) -> ThreadGroup:
        if group is None:
            rank = self.current_rank()
            return ThreadGroup(self, -1, rank, list(range(self.size)))
        if not isinstance(group, ThreadGroup):
            raise TypeError(f"not a group of ckptbench's thread ranks: {group!r}")
        return group

    def new_group(self, ranks: list[int] | None = None, **_: Any) -> Any:
        rank = self.current_rank()
        gid = self._groups_made[rank]  # every rank makes the same groups in the same order
        self._groups_made[rank] += 1
        members = sorted(ranks) if ranks is not None else list(range(self.size))
        if rank not in members:
            return dist.GroupMember.NON_GROUP_MEMBER
        return ThreadGroup(self, gid, rank, members)

    def get_rank(self, group: Any = None) -> int:
        return self._group(group).rank() if group is not None else self.current_rank()

    def get_world_size(self, group: Any = None) -> int:
        return self._group(group).size() if group is not None else self.size

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(self._group(group).ranks)

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        return self._group(group).ranks[group_rank]

    def barrier(self, group: Any = None, **_: Any) -> None:
        self.meet(self._group(group), "barrier", None, lambda parts: None)

    def broadcast_object_list(
        self, object_list: list[Any], src: int = 0, group: Any = None, **_: Any
    ) -> None:
        g = self._group(group)
        mine = pickle.dumps(object_list) if g.global_rank == src else None

        def take(sent: bytes) -> None:
            if g.global_rank != src:
                object_list[:] = pickle.loads(sent)

        self.meet(g, "broadcast_object_list", mine, lambda ps: ps[g.ranks.index(src)], take)

    def scatter_object_list(
        self,
        scatter_object_output_list: list[Any],
        scatter_object_input_list: list[Any] | None,
        src: int = 0,
        group: Any = None,
        **_: Any,
    ) -> None:
        g = self._group(group)
        mine = None
        if g.global_rank == src:
            assert scatter_object_input_list is not None
            mine = [pickle.dumps(obj) for obj in scatter_object_input_list]

        def take(sent: list[bytes]) -> None:
            scatter_object_output_list[0] = pickle.loads(sent[g.rank()])

        self.meet(g, "scatter_object_list", mine, lambda ps: ps[g.ranks.index(src)], take)

    def all_gather_object(self, object_list: list[Any], obj: Any, group: Any = None) -> None:
        g = self._group(group)

        def take(gathered: list[Any]) -> None:
            object_list[:] = gathered

        self.meet(g, "all_gather_object", pickle.dumps(obj), _unpickle_all, take)

    def gather_object(
        self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
    ) -> None:
        g = self._group(group)

        def take(gathered: list[Any]) -> None:
            if g.global_rank == dst and object_gather_list is not None:
                object_gather_list[:] = gathered

        self.meet(g, "gather_object", pickle.dumps(obj), _unpickle_all, take)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False
    ) -> Any:
        g = self._group(group)

        def copy(parts: list[torch.Tensor]) -> None:
            source = parts[g.ranks.index(src)]
            for t in parts:
                if t is not source:
                    t.copy_(source)

        self.meet(g, "broadcast", tensor, copy)
        return _Done() if async_op else None

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False
    ) -> Any:
        g = self._group(group)
        reduce = {
            dist.ReduceOp.SUM: lambda s: s.sum(0),
            dist.ReduceOp.MAX: lambda s: s.amax(0),
            dist.ReduceOp.MIN: lambda s: s.amin(0),
        }
        how = reduce.get(dist.ReduceOp.SUM if op is None else op)
        if how is None:
            raise NotImplementedError(f"ckptbench's thread ranks do not all_reduce with {op}")

        def combine(parts: list[torch.Tensor]) -> None:
            total = how(torch.stack(parts))
            for t in parts:
                t.copy_(total)

        self.meet(g, "all_reduce", tensor, combine)
        return _Done() if async_op else None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """``torch.distributed``'s functions in ``SERVED`` replaced by this world's."""
        served = {name: getattr(self, name) for name in SERVED}
        served.update(is_available=lambda: True, is_initialized=lambda: True)
        saved = {name: getattr(dist, name) for name in served}
        for name, fn in served.items():
            setattr(dist, name, fn)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


SERVED = (
    "new_group", "get_rank", "get_world_size", "get_process_group_ranks", "get_global_rank",
    "barrier", "broadcast_object_list", "scatter_object_list", "all_gather_object",
    "gather_object", "broadcast", "all_reduce",
)  # fmt: skip
"""The ``torch.distributed`` functions thread ranks serve (besides ``is_available`` and
``is_initialized``); ckptstore code that calls another fails naming it."""


def _unpickle_all(parts: list[bytes]) -> list[Any]:
    return [pickle.loads(p) for p in parts]


class _Done:
    """The work handle of a collective that already ran (``async_op=True``)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
