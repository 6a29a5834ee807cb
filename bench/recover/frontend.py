"""A front-end as the bench drives it (:class:`Frontend`: how a rank saves a step, how it
restores, what a restore reports, and what its summary and tables add), and the two jobs every
front-end runs through it: :func:`save_job` and :func:`restore_job`."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Any, ClassVar

import torch

from bench import _ckpt_common as common
from bench.recover.counting import CountedStore, durable_reads
from bench.recover.plan import (
    BASELINE,
    METHODS,
    RecoverPlan,
    damage_node,
    fill,
    rank_state,
    same_bits,
)

median = common.median


class Frontend:
    """What one front-end does in the bench. The jobs, the summary and the tables are the
    same for every front-end; they ask it what differs."""

    name: ClassVar[str]
    restores: ClassVar[tuple[str, ...]]
    """The restores of each round, in the order of the even rounds (the odd ones reverse it);
    ``BASELINE`` (DCP's own reader) among them."""
    counted: ClassVar[tuple[str, ...]]
    """The restores that read the durable store through a :class:`CountedStore`."""
    columns: ClassVar[dict[str, str]]
    """The table's column of each restore."""
    tiers_read: ClassVar[tuple[str, ...]]
    """The tiers the restore table shows the bytes of, per rank."""
    title: ClassVar[str]
    saved_with: ClassVar[str]
    """How the save job saved (``{nice}``: its ``background_nice``) and how it ended."""
    restore_title: ClassVar[str]
    save_title: ClassVar[str]
    targets_title: ClassVar[str]
    notes: ClassVar[list[str]]

    # -- the save job -------------------------------------------------------------------

    def open_savers(self, plan: RecoverPlan, rank: int, state: dict) -> tuple[dict, dict]:
        """Each method's saver, ready for steady-state saves of ``state``; and what the save
        job's report adds about them."""
        raise NotImplementedError

    def timed_save(
        self, saver: Any, name: str, step: int, state: dict, timeout_s: float
    ) -> dict[str, Any]:
        """One save of ``step`` from a quiet start, nothing in flight when it returns."""
        raise NotImplementedError

    # -- the restore job ----------------------------------------------------------------

    def import_libraries(self) -> None:
        """Import what the restores use, before any is timed."""

    def load(
        self,
        plan: RecoverPlan,
        rank: int,
        name: str,
        store: CountedStore,
        dest: dict,
        *,
        t0: float,
        after: contextlib.ExitStack,
    ) -> dict[str, Any]:
        """Load the newest step into ``dest`` by restore ``name`` through ``store`` (opened at
        ``t0``): what its report says. What must be closed, ``after`` closes once timed."""
        raise NotImplementedError

    # -- the summary and the tables -------------------------------------------------------

    def summarize_saves(self, saved: list[dict], save: dict[str, Any]) -> dict[str, Any]:
        """Add this front-end's save figures to ``save``; the report's own additions."""
        return {}

    def save_columns(self, save: dict[str, Any]) -> list[tuple[str, Any]]:
        """The save table's columns past blocked and slowest rank: (header, cell of a method)."""
        raise NotImplementedError

    def save_lines(self, result: dict[str, Any]) -> tuple[list[list[str]], str, list[str]]:
        """The save table's rows past the methods', the end of the line under it, and the
        lines after that."""
        raise NotImplementedError


# -- the save job -------------------------------------------------------------------------


def save_job(frontend: Frontend, plan: RecoverPlan, rank: int) -> dict[str, Any]:
    """``repeat`` steps, each saved by both methods (alternating which goes first), then DCP's
    own save of the last state. The savers are left open: the caller exits without closing."""
    import torch.distributed as dist

    state = rank_state(rank, plan.tensors, plan.bytes_per_rank)
    savers, extra = frontend.open_savers(plan, rank, state)
    saves: list[dict[str, Any]] = []
    for i in range(plan.repeat):
        step = i + 1
        fill(state, rank, step, plan.seed)
        for name in METHODS if i % 2 == 0 else METHODS[::-1]:
            dist.barrier()
            timed = frontend.timed_save(savers[name], name, step, state, plan.group_timeout_s)
            saves.append({"method": name, **timed})
    return _saved(plan, rank, state, saves) | extra


def _saved(plan: RecoverPlan, rank: int, state: dict, saves: list[dict]) -> dict[str, Any]:
    """A save job's record, after DCP's own save of the last state (the restore baseline)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.barrier()
    t0 = time.perf_counter()
    with common.quiet_dcp():
        dcp.save(state, storage_writer=_dcp_writer(plan))
    dcp_save_s = time.perf_counter() - t0
    return {
        "rank": rank,
        "node": plan.node_of(rank),
        "state_bytes": common.state_bytes(state),
        "saves": saves,
        "dcp_save_s": dcp_save_s,
    }


def _dcp_writer(plan: RecoverPlan) -> Any:
    import torch.distributed.checkpoint as dcp

    if plan.dcp_is_local:
        return dcp.FileSystemWriter(plan.dcp_path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(plan.dcp_path)


def _dcp_reader(plan: RecoverPlan) -> Any:
    import torch.distributed.checkpoint as dcp

    if plan.dcp_is_local:
        return dcp.FileSystemReader(plan.dcp_path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(plan.dcp_path)


# -- the restore job ----------------------------------------------------------------------


def restore_job(frontend: Frontend, plan: RecoverPlan, rank: int) -> dict[str, Any]:
    """The fresh job: ``repeat`` rounds, each wiping the last node's local directory, then
    every restore of the front-end (alternating the order), each checked bit for bit."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - both libraries imported before timing

    from ckptstore.store import open_store  # noqa: F401

    frontend.import_libraries()
    expected = rank_state(rank, plan.tensors, plan.bytes_per_rank)
    fill(expected, rank, plan.repeat, plan.seed)
    dest = {k: torch.zeros_like(t) for k, t in expected.items()}
    rounds = []
    originals: dict = {}  # rank 0: the chunks --damage chunk flipped, as they were
    for i in range(plan.repeat):
        dist.barrier()
        if rank == 0:
            damage_node(plan, originals)
        dist.barrier()
        done: dict[str, Any] = {}
        for name in frontend.restores if i % 2 == 0 else frontend.restores[::-1]:
            for t in dest.values():
                t.zero_()
            dist.barrier()
            if name == BASELINE:
                done[name] = _restore_dcp(plan, dest)
            else:
                done[name] = _restore_counted(frontend, plan, rank, name, dest)
            done[name]["equal"] = same_bits(dest, expected)
        rounds.append(done)
    p2p = _p2p_bytes_per_s(plan, rank) if plan.damage == "node" else None
    return {"rank": rank, "node": plan.node_of(rank), "rounds": rounds, "p2p_bytes_per_s": p2p}


def _p2p_bytes_per_s(plan: RecoverPlan, rank: int, times: int = 3) -> float | None:
    """The point-to-point bandwidth this job's gloo group reaches: each rank of the wiped node
    receives ``bytes_per_rank`` from the rank at its place on the node before, all pairs at
    once (as a repair runs them); a receiver's median bytes per second (None on the others)."""
    import torch.distributed as dist

    rpn, wiped = plan.ranks_per_node, plan.wiped_node
    first = wiped * rpn
    buf = torch.ones(plan.bytes_per_rank, dtype=torch.uint8)
    if plan.node_of(rank) == wiped:
        op, peer = dist.irecv, rank - rpn
    elif plan.node_of(rank) == wiped - 1:
        op, peer = dist.isend, rank + rpn
    else:
        op, peer = None, None
    runs = []
    for _ in range(times + 1):  # the first warms the pairs' connections
        dist.barrier()
        t0 = time.perf_counter()
        if op is not None:
            for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
                work.wait()
        runs.append(time.perf_counter() - t0)
    if rank < first:
        return None
    return plan.bytes_per_rank / median(runs[1:])


def _restore_dcp(plan: RecoverPlan, dest: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    with common.quiet_dcp():
        dcp.load(dest, storage_reader=_dcp_reader(plan))
    end = time.perf_counter()
    return {"start": t0, "end": end, "seconds": end - t0}


def _restore_counted(
    frontend: Frontend, plan: RecoverPlan, rank: int, name: str, dest: dict
) -> dict[str, Any]:
    """Restore ``name``, timed from before its store is opened until the state is loaded,
    its durable reads counted by the store's ``StoreCounters``."""
    from bench.recover.counting import open_counted

    with contextlib.ExitStack() as after:
        t0 = time.perf_counter()
        store = open_counted(plan.durable_uri, timeout_s=plan.timeout_s)
        loaded = frontend.load(plan, rank, name, store, dest, t0=t0, after=after)
        end = time.perf_counter()
    record = {"start": t0, "end": end, "seconds": end - t0, **loaded}
    record["durable"] = durable_reads(store)
    return record


def sources(report: Any) -> dict[str, dict[str, Any]]:
    """A load report's bytes, chunks and seconds per tier, as plain dicts."""
    return {tier: asdict(stats) for tier, stats in report.sources.items()} if report else {}


def ratio_text(value: float | None) -> str:
    """A ratio for the tables: ``1.23x``, or ``-`` where there is none."""
    return f"{value:.2f}x" if value else "-"
