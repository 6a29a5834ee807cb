"""What one rank of ``ckptbench scale`` does, as a thread (``bench._thread_ranks``) or as a
process on gloo: a few saves of a small fresh state, then one restore, counting its store's
requests; and what the coordinator spends on each save, timed where it happens.

The coordinator's time in a save is its own work, never its wait for other ranks: the save
protocol's steps it runs alone (``SaveSession.begin``, ``commit``, ``release``, ``retain``:
the lease, the listings, the manifest; timed by wrapping those methods) plus, for each
collective of the save, its time from the last rank's arrival to its own return (the exchange
itself: pickling, the transfer, unpickling what it gathered).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench._ckpt_common import MemoryProbe
from bench._gloo import join_loopback_group
from bench._thread_ranks import CollectiveCall
from ckptstore import Checkpointer, EncodingOptions, StorageOptions, telemetry
from ckptstore.save import SaveSession

PHASES = ("begin", "commit", "release", "retain")
"""The steps of a save the coordinator runs alone (``SaveSession``'s methods)."""
RECORDED = (
    "barrier", "broadcast_object_list", "scatter_object_list", "all_gather_object",
    "gather_object", "broadcast", "all_reduce",
)  # fmt: skip
"""The collectives recorded on gloo ranks."""


@dataclass(kw_only=True)
class RankPlan:
    """What every rank of one run does."""

    uri: str
    storage_options: dict[str, Any] | None = None
    state_bytes: int
    chunk_bytes: int
    saves: int
    encode_threads: int = 2
    max_concurrency: int = 4
    replicas: int = 1
    """Consecutive ranks holding the same state (data-parallel replicas)."""
    compression: str = "none"
    every_rank_writes: bool = False
    """Each rank puts every chunk it holds, as before one writer per distinct chunk (issue
    36): the baseline its figures are compared with."""
    timeout_s: float = 300.0
    """Deadline of one storage request: generous, as a thousand thread ranks share one
    interpreter and a request may wait long for its thread to run."""


def rank_state(rank: int, step: int, nbytes: int) -> dict[str, torch.Tensor]:
    """Fresh bytes for each ``rank`` (a replica group's, with replicas) and step: every chunk
    of every save is new."""
    generator = torch.Generator().manual_seed(step * 1_000_003 + rank)
    return {"w": torch.rand(max(1, nbytes // 4), generator=generator)}


def requests_of(ckpt: Checkpointer) -> dict[str, int]:
    """The requests its store sent so far, by operation (every outcome)."""
    counted = ckpt.store.counters.snapshot()["requests"]
    return {op: sum(outcomes.values()) for op, outcomes in counted.items()}


def puts_of(ckpt: Checkpointer) -> tuple[int, int]:
    """Bytes its puts sent so far (every attempt), and the puts answered "exists"."""
    counted = ckpt.store.counters.snapshot()
    return counted["sent"].get("put", 0), counted["requests"].get("put", {}).get("exists", 0)


def encode_cpu_s() -> float:
    """The CPU seconds this process's encode threads spent so far (byte-grouping, zstd)."""
    return telemetry.encode_cpu_seconds_total.value()


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}


def every_rank_writes() -> None:
    """In this process, each rank puts every chunk it holds (``--every-rank-writes``)."""
    import ckptstore.save.session as session
    from ckptstore.pipeline import write_chunks

    def alone(
        store: Any, buffer: Any, layout: Any, cfg: Any, group: Any, *, save: Any, **kw: Any
    ) -> Any:
        return write_chunks(store, buffer, layout, cfg, **kw)

    session.write_chunks_once = alone


def run_rank(plan: RankPlan, rank: int, barrier: Callable[[], None]) -> dict[str, Any]:
    """The saves and the restore of ``rank``; what each took and sent (perf_counter times)."""
    probe = MemoryProbe() if rank == 0 else None
    ckpt = Checkpointer(
        plan.uri,
        storage_options=plan.storage_options,
        encoding=EncodingOptions(
            chunk_bytes=plan.chunk_bytes,
            compression=plan.compression,
            hedge_uploads=False,  # on a loaded machine every put is slow: hedges would double
            encode_threads=plan.encode_threads,
        ),
        storage=StorageOptions(max_concurrency=plan.max_concurrency, timeout_s=plan.timeout_s),
    )
    saves = []
    try:
        for step in range(1, plan.saves + 1):
            state = rank_state(rank // plan.replicas, step, plan.state_bytes)
            barrier()
            before, puts_before = requests_of(ckpt), puts_of(ckpt)
            if probe is not None:
                probe.reset()
            start, cpu, encode = time.perf_counter(), time.process_time(), encode_cpu_s()
            ckpt.save(step, state).wait()
            end, cpu = time.perf_counter(), time.process_time() - cpu
            encode = encode_cpu_s() - encode
            sent, exists = (a - b for a, b in zip(puts_of(ckpt), puts_before))
            saves.append(
                {
                    "step": step,
                    "start": start,
                    "end": end,
                    "requests": _minus(requests_of(ckpt), before),
                    "sent_put_bytes": sent,
                    "cpu_s": cpu,
                    "encode_cpu_s": encode,
                    "put_exists": exists,
                    "peak_rss_bytes": probe.peak() if probe is not None else None,
                }
            )
        barrier()
        into = {k: torch.zeros_like(t) for k, t in state.items()}
        before = requests_of(ckpt)
        start = time.perf_counter()
        loaded = ckpt.load(into)
        end = time.perf_counter()
        restore = {
            "step": loaded,
            "start": start,
            "end": end,
            "requests": _minus(requests_of(ckpt), before),
            "equal": all(torch.equal(into[k], state[k]) for k in state),
        }
    finally:
        ckpt.close()
    return {"rank": rank, "saves": saves, "restore": restore}


# -- the coordinator's phases ---------------------------------------------------------------


class PhaseTimes:
    """Seconds the coordinator spent in each of ``PHASES``, by step, while :meth:`timing`."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}
        self._coordinating: weakref.WeakSet[SaveSession] = weakref.WeakSet()

    def _add(self, step: int, phase: str, seconds: float) -> None:
        phases = self.by_step.setdefault(step, dict.fromkeys(PHASES, 0.0))
        phases[phase] += seconds

    @contextmanager
    def timing(self) -> Iterator[PhaseTimes]:
        saved = {name: getattr(SaveSession, name) for name in PHASES}

        def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(method)
            def run(session: SaveSession, *args: Any, **kwargs: Any) -> Any:
                rank = args[0] if args else kwargs.get("rank")
                if name == "commit" or (name == "begin" and rank == 0):
                    self._coordinating.add(session)
                if session not in self._coordinating:
                    return method(session, *args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return method(session, *args, **kwargs)
                finally:
                    self._add(session.step, name, time.perf_counter() - t0)

            return run

        for name, method in saved.items():
            setattr(SaveSession, name, timed(name, method))
        try:
            yield self
        finally:
            for name, method in saved.items():
                setattr(SaveSession, name, method)


# -- ranks as processes on gloo ---------------------------------------------------------------


@contextmanager
def recording_collectives(calls: list[CollectiveCall]) -> Iterator[None]:
    """``torch.distributed``'s collectives in ``RECORDED`` timed into ``calls`` (when each was
    entered and returned; when the last rank arrived is found later, from every rank's)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in RECORDED}

    def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            enter = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append(CollectiveCall(name, enter, time.perf_counter()))

        return run

    for name, fn in saved.items():
        setattr(dist, name, recorded(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def process_main(rank: int, plan: RankPlan, world: int, port: int) -> dict[str, Any]:
    """One rank as a process (``bench._gloo.run_ranks``): its report, its collectives and
    (rank 0) the coordinator's phases."""
    import torch.distributed as dist

    join_loopback_group(rank, world, port, timeout_s=600)
    if plan.every_rank_writes:
        every_rank_writes()
    calls: list[CollectiveCall] = []
    try:
        with PhaseTimes().timing() as phases, recording_collectives(calls):
            report = run_rank(plan, rank, dist.barrier)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    report["calls"] = [asdict(c) for c in calls]
    report["phases"] = {str(step): p for step, p in phases.by_step.items()}
    return report
