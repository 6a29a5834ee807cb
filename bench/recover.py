"""``ckptbench recover``: time back to a loaded state after a failure, from node-local and peer
copies (tiers) vs DCP's ``load`` from durable storage, in one run.

N ranks run on this machine as gloo processes, simulated as nodes of ``--ranks-per-node`` ranks
each (``Checkpointer(node_rank=rank // ranks_per_node)``, one local directory per node under
``--local-root``). Each rank holds a deterministic state (``--size`` split over the ranks, in
``--tensors`` float32 tensors each, seeded by rank and step).

1. The save job saves ``--repeat`` fresh states twice per step, alternating which goes first:
   with tiers (``local_dir``, ``peer_copies=1``, ``durable_every=1``: every save is in the
   durable store too) and without (a plain ``Checkpointer`` on a sibling prefix of the durable
   store). Each save starts with no save in flight (the last one's copies and drain finished)
   and the staging memory reserved ahead, so ``save()``'s blocked time is its own. The last
   state is also saved once with DCP's own ``FileSystemWriter`` (``FsspecWriter`` on S3) to
   another sibling prefix. The processes then exit without closing their Checkpointers
   (``os._exit`` after ``ckpt.wait()``): the job is killed, every save committed.
2. The last node's local directory is wiped (a replaced node).
3. A fresh job restores, ``--repeat`` rounds, wiping that node again before each: with tiers
   (a new ``Checkpointer``, then ``load``: the time from before the ``Checkpointer`` is built
   until the state is loaded) and with DCP's ``load`` and its own reader from the durable store,
   alternating which goes first. Every rank checks its state against the saved one; a
   mismatch fails the run (exit 1). The durable store's reads during the tiered restore are
   counted at its backend (chunks apart from the rest) and by its ``StoreCounters``.

``--frontend dcp`` runs the same flow through ``torch.distributed.checkpoint`` and
``ckptstore.dcp`` instead of ``Checkpointer`` (same ranks, nodes, states, wipes, counting and
durable store options):

1. Each rank saves ``--repeat`` states with ``dcp.async_save(state, storage_writer=writer,
   checkpoint_id=step)`` twice per step, alternating which goes first: ``StoreWriter(durable,
   local_dir=<node dir>, durable_every=1, peer_copies=1, node_rank=rank // ranks_per_node)``
   (tiers: each rank's local copy also goes to the rank at its position on the next node) and
   a plain ``StoreWriter`` on a sibling prefix (no tiers). The blocked time is the time until
   ``async_save`` returns (the state copied into the writer's staging buffer and the save
   handed to its thread: what the training loop waits for); the future's ``result()`` is then
   awaited outside that timing, before the next barrier, so each save starts with none in
   flight, and the time until it returned is the time to committed (with tiers: committed
   locally, copied to the peer and, ``durable_every=1``, committed to the durable store).
   Before the timed saves each writer makes one untimed warm-up save, of step 0 (older than
   every timed step, so no load uses it; the stores keep it, and their stored bytes count it):
   it allocates the writer's staging buffer (``StoreWriter``'s pool holds one, state-sized,
   reused by every later save; the ``Checkpointer`` flow reserves it with ``reserve`` instead,
   which ``StoreWriter`` does not offer), makes its gloo groups (with tiers the peer topology
   too) and does DCP's first-call work, so no timed save allocates or sets up (the pool's
   allocation count is recorded per save to show it). Then DCP's ``FileSystemWriter``
   (``FsspecWriter`` on S3) saves the last state with a synchronous ``dcp.save``, and the job
   is killed.
2. As above, the last node's local directory is wiped before each restore round.
3. Each round ``dcp.load`` runs with ``StoreReader(durable, local_dir=<node dir>)`` (tiers),
   ``StoreReader(durable)`` (no tiers) and DCP's own reader of the baseline, in alternating
   order, each timed from before its reader is built until the state is loaded, and each
   rank's state checked bit for bit (a mismatch fails the run, exit 1). Durable reads of both
   ``StoreReader`` loads are counted at the backend; ``reader.last_load`` gives the tiered
   load's bytes per tier.

With one node wiped, the tiered load takes the newest step from the local tiers: the wiped
node's ranks restore their copies from their holders on the next node (``last_load.source`` is
``"peer"``), the other ranks read their own local copies, and no rank reads a chunk from durable
storage (the target "0 durable chunk bytes", met or not as counted at the backend).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench import _ckpt_common as common
from bench._gloo import free_port, join_loopback_group
from bench.report import format_bytes, format_seconds, parse_bytes, print_json, table

logger = logging.getLogger(__name__)

MAX_RANKS = 16
"""Ranks run as processes, each with its own torch (~0.3 GB) and state."""
DEFAULT_BUCKET = "ckptbench-recover"
METHODS = ("tiers", "plain")
"""Save methods: with tiers, and a plain Checkpointer on the durable store."""
FRONTENDS = ("checkpointer", "dcp")
"""What saves and restores: ``Checkpointer``, or ``dcp.async_save`` / ``dcp.load`` with
``ckptstore.dcp``'s ``StoreWriter`` / ``StoreReader``."""
DCP_RESTORES = ("tiers", "plain", "dcp")
"""``--frontend dcp`` restores: ``StoreReader`` with tiers, without, and DCP's own reader."""
WARMUP_STEP = 0
"""``--frontend dcp``: the untimed first save of each writer (the timed ones are 1..repeat)."""
_BACKEND_OPS = {"get": "get", "get_view": "get", "size": "head", "exists": "head"}
_BACKEND_OPS |= {"modified": "head", "list": "list", "put_once": "put", "delete": "delete"}


class RankFailed(OSError):
    """A rank of the run failed, or the ranks did not finish in time (exit status 1)."""


@dataclass(kw_only=True)
class RecoverPlan:
    """What every rank of both jobs does."""

    durable_uri: str
    plain_uri: str
    dcp_path: str
    dcp_is_local: bool
    local_root: str
    ranks_per_node: int
    nodes: int
    bytes_per_rank: int
    tensors: int
    repeat: int
    peer_budget_bytes: int
    seed: int = 0
    background_nice: int = 0
    """``Checkpointer(background_nice=)`` of the save job's Checkpointers, both."""
    timeout_s: float = 300.0
    """Deadline of one storage request (moto is slow under four ranks' uploads)."""
    group_timeout_s: float = 1800.0
    frontend: str = "checkpointer"

    @property
    def wiped_node(self) -> int:
        return self.nodes - 1

    def node_dir(self, node: int) -> str:
        return os.path.join(self.local_root, f"node{node}")


# -- the state ----------------------------------------------------------------------------------


def rank_state(rank: int, tensors: int, nbytes: int) -> dict[str, torch.Tensor]:
    """``tensors`` zeroed float32 tensors holding ``nbytes`` between them, named by rank (so
    DCP, which merges every rank's keys into one checkpoint, keeps each rank's apart)."""
    numel = max(1, nbytes // tensors // 4)
    return {f"rank{rank:02d}.layer{i:02d}": torch.zeros(numel) for i in range(tensors)}


def fill(state: dict[str, torch.Tensor], rank: int, step: int, seed: int) -> None:
    """The state of ``rank`` at ``step``: normal values, the same for the same arguments."""
    for i, t in enumerate(state.values()):
        g = torch.Generator().manual_seed(((seed * 1009 + rank) * 1009 + step) * 1009 + i)
        t.normal_(generator=g)


# -- counting the durable store's reads ---------------------------------------------------------


class CountingBackend:
    """A store's backend, forwarded call for call; each request counted by kind, chunk
    objects (``chunks/``) apart from the rest, with the bytes each read returned."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.requests: dict[str, dict[str, int]] = {"chunks": {}, "other": {}}
        self.read_bytes = {"chunks": 0, "other": 0}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        kind = _BACKEND_OPS.get(name)
        if kind is None:
            return value

        def counted(path: str, *args: Any, **kwargs: Any) -> Any:
            out = value(path, *args, **kwargs)
            what = "chunks" if "/chunks/" in f"/{path}" else "other"
            nbytes = memoryview(out).nbytes if kind == "get" else 0
            with self._lock:
                self.requests[what][kind] = self.requests[what].get(kind, 0) + 1
                self.read_bytes[what] += nbytes
            return out

        return counted


# -- the ranks ----------------------------------------------------------------------------------


def _tiered(plan: RecoverPlan, rank: int, **kwargs: Any) -> Any:
    from ckptstore import Checkpointer

    node = rank // plan.ranks_per_node
    return Checkpointer(
        plan.durable_uri,
        local_dir=plan.node_dir(node),
        peer_copies=1,
        durable_every=1,
        node_rank=node,
        peer_budget_bytes=plan.peer_budget_bytes,
        timeout_s=plan.timeout_s,
        **kwargs,
    )


def _timed_save(ckpt: Any, step: int, state: Any, timeout_s: float) -> dict[str, Any]:
    """One save from a quiet start: how long ``save()`` blocked, until ``wait()`` returned
    (with tiers: committed locally and copied to the peers) and until durable."""
    t0 = time.perf_counter()
    handle = ckpt.save(step, state)
    blocked = time.perf_counter() - t0
    handle.wait(timeout_s)
    committed = time.perf_counter() - t0
    durable = committed
    if handle.durable is not None:
        handle.durable.result(timeout=timeout_s)
        durable = time.perf_counter() - t0
    ckpt.wait()  # nothing in flight when the next save starts
    return {"step": step, "blocked_s": blocked, "committed_s": committed, "durable_s": durable}


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


def save_job(plan: RecoverPlan, rank: int) -> dict[str, Any]:
    """The job that saves: ``repeat`` steps with tiers and without, then DCP's save of the last
    state. Its Checkpointers are left open: the caller exits without closing them."""
    import torch.distributed as dist

    from ckptstore import Checkpointer

    state = rank_state(rank, plan.tensors, plan.bytes_per_rank)
    tiered = _tiered(plan, rank, background_nice=plan.background_nice)
    plain = Checkpointer(
        plan.plain_uri, timeout_s=plan.timeout_s, background_nice=plan.background_nice
    )
    for ckpt in (tiered, plain):  # steady-state saves: no first-save allocation timed
        ckpt.reserve(state).result(timeout=plan.timeout_s)
    saves: list[dict[str, Any]] = []
    for i in range(plan.repeat):
        step = i + 1
        fill(state, rank, step, plan.seed)
        order = METHODS if i % 2 == 0 else METHODS[::-1]
        for name in order:
            ckpt = tiered if name == "tiers" else plain
            dist.barrier()
            record = {"method": name, **_timed_save(ckpt, step, state, plan.group_timeout_s)}
            copy = tiered.last_peer_copy if name == "tiers" else None
            if copy is not None:
                record["peer_copy"] = {
                    "sent_bytes": copy.sent_bytes,
                    "received_bytes": copy.received_bytes,
                    "buffer_bytes": copy.buffer_bytes,
                    "seconds": copy.seconds,
                    "failed": dict(copy.failed),
                }
            saves.append(record)
    return _saved(plan, rank, state, saves)


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
        "node": rank // plan.ranks_per_node,
        "state_bytes": common.state_bytes(state),
        "saves": saves,
        "dcp_save_s": dcp_save_s,
    }


def _restore_tiers(plan: RecoverPlan, rank: int, dest: dict[str, torch.Tensor]) -> dict:
    from ckptstore.store import open_store

    t0 = time.perf_counter()
    store = open_store(plan.durable_uri, timeout_s=plan.timeout_s)
    counted = CountingBackend(store.backend)
    store.backend = counted
    ckpt = _tiered(plan, rank, store=store)
    built = time.perf_counter()
    try:
        step = ckpt.load(dest)
        end = time.perf_counter()
        report = ckpt.last_load
    finally:
        ckpt.close()
    counters = store.counters.snapshot()
    return {
        "start": t0,
        "end": end,
        "seconds": end - t0,
        "construct_s": built - t0,
        "load_s": report.seconds,
        "step": step,
        "source": report.source,
        "sources": {tier: asdict(stats) for tier, stats in report.sources.items()},
        "durable": {
            "requests": {op: sum(n.values()) for op, n in counters["requests"].items()},
            "bytes": counters["bytes"],
            "chunk_requests": counted.requests["chunks"],
            "chunk_bytes": counted.read_bytes["chunks"],
            "other_requests": counted.requests["other"],
            "other_bytes": counted.read_bytes["other"],
        },
    }


def _restore_dcp(plan: RecoverPlan, dest: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    with common.quiet_dcp():
        dcp.load(dest, storage_reader=_dcp_reader(plan))
    end = time.perf_counter()
    return {"start": t0, "end": end, "seconds": end - t0}


def restore_job(plan: RecoverPlan, rank: int) -> dict[str, Any]:
    """The fresh job: ``repeat`` rounds, each wiping the last node's local directory, then
    restoring with tiers and with DCP (alternating which goes first), each checked."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - both libraries imported before timing

    from ckptstore import Checkpointer  # noqa: F401
    from ckptstore.store import open_store  # noqa: F401

    expected = rank_state(rank, plan.tensors, plan.bytes_per_rank)
    fill(expected, rank, plan.repeat, plan.seed)
    dest = {k: torch.zeros_like(t) for k, t in expected.items()}
    rounds = []
    for i in range(plan.repeat):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(plan.node_dir(plan.wiped_node), ignore_errors=True)
        dist.barrier()
        done: dict[str, Any] = {}
        for name in ("tiers", "dcp") if i % 2 == 0 else ("dcp", "tiers"):
            for t in dest.values():
                t.zero_()
            dist.barrier()
            if name == "tiers":
                done[name] = _restore_tiers(plan, rank, dest)
            else:
                done[name] = _restore_dcp(plan, dest)
            done[name]["equal"] = common.same_state(dest, expected)
        rounds.append(done)
    return {"rank": rank, "node": rank // plan.ranks_per_node, "rounds": rounds}


# -- the ranks, --frontend dcp ------------------------------------------------------------------


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Equal keys, and every tensor's bytes equal (-0.0 is not 0.0, a NaN equals itself)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().view(torch.uint8)

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
        for k in a
    )


def _store_writer(plan: RecoverPlan, rank: int, *, tiered: bool) -> Any:
    from ckptstore.dcp import StoreWriter

    options: dict[str, Any] = {"timeout_s": plan.timeout_s, "background_nice": plan.background_nice}
    if not tiered:
        return StoreWriter(plan.plain_uri, **options)
    node = rank // plan.ranks_per_node
    return StoreWriter(
        plan.durable_uri,
        local_dir=plan.node_dir(node),
        durable_every=1,
        peer_copies=1,
        node_rank=node,
        peer_budget_bytes=plan.peer_budget_bytes,
        **options,
    )


def _staging_allocations(writer: Any) -> int | None:
    """How many staging buffers ``writer``'s pool ever allocated (None if it does not say)."""
    pool = getattr(getattr(writer, "engine", None), "pool", None)
    return getattr(pool, "allocations", None)


def _timed_async_save(writer: Any, step: int, state: Any, timeout_s: float) -> dict[str, Any]:
    """One ``dcp.async_save`` from a quiet start: how long it blocked (until it returned: the
    state staged, the save handed to its thread) and until its future's ``result()`` returned
    (committed; with tiers and ``durable_every=1`` also copied to the peer and durable)."""
    import torch.distributed.checkpoint as dcp

    with common.quiet_dcp():
        t0 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)
        blocked = time.perf_counter() - t0
        future.result(timeout=timeout_s)  # nothing in flight when the next save starts
        committed = time.perf_counter() - t0
    return {"step": step, "blocked_s": blocked, "committed_s": committed}


def dcp_save_job(plan: RecoverPlan, rank: int) -> dict[str, Any]:
    """``--frontend dcp``'s save job: an untimed warm-up save (step 0) of each writer, then
    ``repeat`` steps with ``dcp.async_save`` through a tiered ``StoreWriter`` and a plain one
    (each waited for before the next starts), then DCP's own synchronous save of the last
    state."""
    import torch.distributed as dist

    state = rank_state(rank, plan.tensors, plan.bytes_per_rank)
    writers = {name: _store_writer(plan, rank, tiered=name == "tiers") for name in METHODS}
    # Warm-up, untimed: each writer's staging buffer (its pool holds one, reused by every later
    # save), its gloo groups (with tiers: the tier group and peer topology) and DCP's first-call
    # work, all before the timed saves. Step 0 is older than every timed step: no load uses it.
    fill(state, rank, WARMUP_STEP, plan.seed)
    for name in METHODS:
        dist.barrier()
        _timed_async_save(writers[name], WARMUP_STEP, state, plan.group_timeout_s)
    warm = {name: _staging_allocations(writers[name]) for name in METHODS}
    saves: list[dict[str, Any]] = []
    for i in range(plan.repeat):
        step = i + 1
        fill(state, rank, step, plan.seed)
        for name in METHODS if i % 2 == 0 else METHODS[::-1]:
            writer = writers[name]
            dist.barrier()
            record = {
                "method": name,
                **_timed_async_save(writer, step, state, plan.group_timeout_s),
            }
            record["saved_step"] = writer.saved_step
            record["staging_allocations"] = _staging_allocations(writer)
            saves.append(record)
    return _saved(plan, rank, state, saves) | {"staging_allocations_warm": warm}


def _restore_store_reader(
    plan: RecoverPlan, rank: int, dest: dict[str, torch.Tensor], *, tiered: bool
) -> dict[str, Any]:
    """``dcp.load`` through a ``StoreReader`` of the durable store (with tiers: and this
    rank's node directory), its durable reads counted at the backend."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreReader
    from ckptstore.store import open_store

    t0 = time.perf_counter()
    store = open_store(plan.durable_uri, timeout_s=plan.timeout_s)
    counted = CountingBackend(store.backend)
    store.backend = counted
    options: dict[str, Any] = {"store": store, "timeout_s": plan.timeout_s}
    if tiered:
        options["local_dir"] = plan.node_dir(rank // plan.ranks_per_node)
    reader = StoreReader(plan.durable_uri, **options)
    with common.quiet_dcp():
        dcp.load(dest, storage_reader=reader)
    end = time.perf_counter()
    counters = store.counters.snapshot()
    report, exchange = reader.last_load, reader.last_load_exchange
    view = reader.view
    record: dict[str, Any] = {
        "start": t0,
        "end": end,
        "seconds": end - t0,
        "step": report.step if report is not None else view.manifest.step if view else None,
        "durable": {
            "requests": {op: sum(n.values()) for op, n in counters["requests"].items()},
            "bytes": counters["bytes"],
            "chunk_requests": counted.requests["chunks"],
            "chunk_bytes": counted.read_bytes["chunks"],
            "other_requests": counted.requests["other"],
            "other_bytes": counted.read_bytes["other"],
        },
        "exchange": asdict(exchange) if exchange is not None else None,
    }
    if tiered:
        record["source"] = report.source if report is not None else None
        record["sources"] = (
            {tier: asdict(stats) for tier, stats in report.sources.items()} if report else {}
        )
    return record


def dcp_restore_job(plan: RecoverPlan, rank: int) -> dict[str, Any]:
    """``--frontend dcp``'s fresh job: ``repeat`` rounds, each wiping the last node's local
    directory, then ``dcp.load`` with a tiered ``StoreReader``, a plain one and DCP's own
    reader (alternating the order), each checked bit for bit."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - both libraries imported before timing

    import ckptstore.dcp  # noqa: F401
    from ckptstore.store import open_store  # noqa: F401

    expected = rank_state(rank, plan.tensors, plan.bytes_per_rank)
    fill(expected, rank, plan.repeat, plan.seed)
    dest = {k: torch.zeros_like(t) for k, t in expected.items()}
    rounds = []
    for i in range(plan.repeat):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(plan.node_dir(plan.wiped_node), ignore_errors=True)
        dist.barrier()
        done: dict[str, Any] = {}
        for name in DCP_RESTORES if i % 2 == 0 else DCP_RESTORES[::-1]:
            for t in dest.values():
                t.zero_()
            dist.barrier()
            if name == "dcp":
                done[name] = _restore_dcp(plan, dest)
            else:
                done[name] = _restore_store_reader(plan, rank, dest, tiered=name == "tiers")
            done[name]["equal"] = same_bits(dest, expected)
        rounds.append(done)
    return {"rank": rank, "node": rank // plan.ranks_per_node, "rounds": rounds}


def rank_main(rank: int, plan: RecoverPlan, world: int, port: int, out: str, job: str) -> None:
    """One rank of one job (``torch.multiprocessing.spawn``): its report into ``out``."""
    import torch.distributed as dist

    join_loopback_group(rank, world, port, timeout_s=plan.group_timeout_s)
    jobs = {
        "checkpointer": (save_job, restore_job),
        "dcp": (dcp_save_job, dcp_restore_job),
    }[plan.frontend]
    report = jobs[0 if job == "save" else 1](plan, rank)
    dist.barrier()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    if job == "restore":
        dist.destroy_process_group()
    # The save job is killed here: no close(), no teardown. Either way, leave without
    # interpreter finalization, which a gloo thread can turn into SIGABRT (tests/_dist.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(plan: RecoverPlan, world: int, job: str, *, timeout_s: float) -> list[dict]:
    """``job`` on ``world`` spawned ranks; their reports, by rank. Raises ``RankFailed`` when a
    rank fails or they are not all done within ``timeout_s``."""
    import torch.multiprocessing as mp

    # torch logs a line per rank it terminates once one failed; the error says which failed
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="ckptbench-recover-") as out:
        ctx = mp.spawn(
            rank_main, args=(plan, world, free_port(), out, job), nprocs=world, join=False
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise RankFailed(f"the {job} job did not finish within {timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise RankFailed(
                f"the {job} job: rank {exc.error_index} failed: {lines[-1].strip()}"
            ) from None
        except mp.ProcessExitedException as exc:
            raise RankFailed(f"the {job} job: {exc}") from None
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]


# -- the durable store --------------------------------------------------------------------------


@contextlib.contextmanager
def durable_store(uri: str | None, *, moto: bool) -> Iterator[tuple[str | None, str]]:
    """``uri`` and what kind of store it is; with ``moto`` a moto S3 server on 127.0.0.1 in
    this process (the ranks, which inherit its endpoint, run in their own), its bucket made."""
    if not moto:
        kind = "s3" if uri and uri.startswith("s3://") else "local"
        yield uri, kind
        return
    uri = uri or f"s3://{DEFAULT_BUCKET}"
    if not uri.startswith("s3://"):
        raise ValueError(f"--moto serves S3: give --durable s3://bucket/prefix, not {uri!r}")
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise ValueError("--moto needs moto's server (pip install 'moto[server]')") from None
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request under -v
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        with mock.patch.dict(os.environ, env):
            import fsspec

            bucket = uri.removeprefix("s3://").split("/", 1)[0]
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
            yield uri, "moto"
    finally:
        server.stop()
        # fsspec keeps S3 clients by their arguments, not by AWS_ENDPOINT_URL: one made here
        # would point at this stopped server for the rest of the process.
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


# -- the run ------------------------------------------------------------------------------------


def check_layout(ranks: int, ranks_per_node: int, frontend: str = "checkpointer") -> int:
    """The node count of ``ranks`` over nodes of ``ranks_per_node``; ValueError unless at
    least two nodes of equal size (a node's ranks need peers on another node, with either
    frontend)."""
    if not 2 <= ranks <= MAX_RANKS:
        raise ValueError(f"bad --ranks {ranks}: must be within 2..{MAX_RANKS}")
    if ranks_per_node < 1 or ranks % ranks_per_node:
        raise ValueError(f"bad --ranks-per-node {ranks_per_node}: must divide --ranks {ranks}")
    nodes = ranks // ranks_per_node
    if nodes < 2:
        why = "peer copies need 2 or more" + (" (--frontend dcp too)" if frontend == "dcp" else "")
        raise ValueError(f"--ranks {ranks} --ranks-per-node {ranks_per_node} is one node: {why}")
    return nodes


def run_recover(
    *,
    ranks: int = 4,
    ranks_per_node: int = 2,
    size_bytes: int = 2**30,
    tensors: int = 4,
    durable: str | None = None,
    moto: bool = False,
    repeat: int = 3,
    peer_budget_bytes: int = 64 * 2**20,
    local_root: str | None = None,
    timeout_s: float = 3600.0,
    seed: int = 0,
    background_nice: int = 0,
    frontend: str = "checkpointer",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; the report as a JSON-ready dict."""
    if frontend not in FRONTENDS:
        raise ValueError(f"bad --frontend {frontend!r}: one of {', '.join(FRONTENDS)}")
    nodes = check_layout(ranks, ranks_per_node, frontend)
    if repeat < 1:
        raise ValueError(f"bad --repeat {repeat}: must be at least 1")
    if tensors < 1 or size_bytes // ranks // tensors < 4:
        raise ValueError(f"bad --size/--tensors: each of {ranks * tensors} tensors needs 4 bytes")
    if local_root is None:
        local_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    if not 0 <= background_nice <= 19:
        raise ValueError(f"bad --background-nice {background_nice}: must be within 0..19")
    if not os.path.isdir(local_root):
        raise ValueError(f"--local-root {local_root!r} is not a directory")
    say = progress or (lambda _msg: None)
    date = common.now_iso()
    with (
        durable_store(durable, moto=moto) as (durable_uri, kind),
        common.Workspace(durable_uri, command="recover") as ws,
    ):
        local = tempfile.mkdtemp(prefix="ckptbench-recover-", dir=local_root)
        try:
            plan = RecoverPlan(
                durable_uri=ws.child("durable"),
                plain_uri=ws.child("plain"),
                dcp_path=ws.path("dcp") if ws.is_local else ws.child("dcp"),
                dcp_is_local=ws.is_local,
                local_root=local,
                ranks_per_node=ranks_per_node,
                nodes=nodes,
                bytes_per_rank=size_bytes // ranks,
                tensors=tensors,
                repeat=repeat,
                peer_budget_bytes=peer_budget_bytes,
                seed=seed,
                background_nice=background_nice,
                frontend=frontend,
            )
            what = "saves" if frontend == "checkpointer" else "dcp.async_save calls"
            say(f"save job: {ranks} ranks, {repeat} {what} with tiers and without, DCP once")
            saved = run_job(plan, ranks, "save", timeout_s=timeout_s)
            stored = {name: ws.bytes_under(name) for name in ("durable", "plain", "dcp")}
            say(f"node {plan.wiped_node} wiped; restore job: {repeat} rounds")
            restored = run_job(plan, ranks, "restore", timeout_s=timeout_s)
        finally:
            shutil.rmtree(local, ignore_errors=True)
    config = {
        "ranks": ranks,
        "ranks_per_node": ranks_per_node,
        "nodes": nodes,
        "size_bytes": saved[0]["state_bytes"] * ranks,
        "bytes_per_rank": saved[0]["state_bytes"],
        "tensors_per_rank": tensors,
        "repeat": repeat,
        "frontend": frontend,
        "durable": durable_uri or "(a temporary local directory)",
        "store": kind,
        "local_root": local_root,
        "peer_copies": 1,
        "durable_every": 1,
        "peer_budget_bytes": peer_budget_bytes,
        "background_nice": background_nice,
        "wiped_node": plan.wiped_node,
        "wiped_ranks": [r for r in range(ranks) if r // ranks_per_node == plan.wiped_node],
        "stored_bytes": stored,
        "host": common.host_info(),
    }
    summary = (
        summarize(saved, restored) if frontend == "checkpointer" else summarize_dcp(saved, restored)
    )
    return {"bench": "recover", "date": date, "config": config, **summary}


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _wall(runs: list[dict[str, Any]]) -> float:
    """From the first rank's start to the last rank's end (one clock: CLOCK_MONOTONIC)."""
    return max(r["end"] for r in runs) - min(r["start"] for r in runs)


def _add(total: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    for key, n in counts.items():
        total[key] = total.get(key, 0) + n
    return total


def _rounds(restored: list[dict]) -> list[list[dict]]:
    """``restored``'s rounds, each a list of every rank's record of that round."""
    return [[r["rounds"][i] for r in restored] for i in range(len(restored[0]["rounds"]))]


def _restore_times(rounds: list[list[dict]], restored: list[dict], name: str) -> dict[str, Any]:
    """Method ``name``'s times: the job's per round (first start to last end) and their
    median, each rank's median, and whether every rank's state was equal in every round."""
    return {
        "seconds": _median([_wall([rank[name] for rank in rnd]) for rnd in rounds]),
        "rounds_s": [_wall([rank[name] for rank in rnd]) for rnd in rounds],
        "per_rank_s": [_median([x[name]["seconds"] for x in r["rounds"]]) for r in restored],
        "equal": all(rank[name]["equal"] for rnd in rounds for rank in rnd),
    }


def _bytes_by_source(rounds: list[list[dict]], name: str) -> list[dict[str, int]]:
    """Per round, the bytes every rank read per tier in method ``name``'s loads."""
    by_tier: list[dict[str, int]] = []
    for rnd in rounds:
        per_tier: dict[str, int] = {}
        for rank in rnd:
            _add(per_tier, {tier: s["bytes"] for tier, s in rank[name]["sources"].items()})
        by_tier.append(per_tier)
    return by_tier


def _durable_reads(rounds: list[list[dict]], name: str) -> list[dict[str, Any]]:
    """Per round, the durable store's requests and bytes in method ``name``'s loads, all
    ranks together (chunks apart from the rest)."""
    durable_rounds = []
    for rnd in rounds:
        reads = {"chunk_bytes": 0, "chunk_requests": {}, "other_bytes": 0, "other_requests": {}}
        reads["requests"], reads["bytes"] = {}, {}
        for rank in rnd:
            d = rank[name]["durable"]
            reads["chunk_bytes"] += d["chunk_bytes"]
            reads["other_bytes"] += d["other_bytes"]
            for key in ("chunk_requests", "other_requests", "requests", "bytes"):
                _add(reads[key], d[key])
        durable_rounds.append(reads)
    return durable_rounds


def _save_blocking(saved: list[dict], name: str, *, waited: bool = True) -> dict[str, Any]:
    """Method ``name``'s saves: blocked (every rank's saves), the slowest rank per save and,
    with ``waited``, until ``wait()`` (``result()``) returned and, where recorded, until
    durable (slowest rank per save); medians over saves."""
    per_step: dict[int, list[dict]] = {}
    for r in saved:
        for s in r["saves"]:
            if s["method"] == name:
                per_step.setdefault(s["step"], []).append(s)
    steps = [per_step[k] for k in sorted(per_step)]
    slowest = [max(s["blocked_s"] for s in step) for step in steps]
    out = {
        # each rank's loop: every save of every rank
        "blocked_s": _median([s["blocked_s"] for step in steps for s in step]),
        # a synchronous job waits for its slowest rank
        "blocked_slowest_s": _median(slowest),
        "blocked_slowest_rounds_s": slowest,
    }
    if waited:
        out["committed_s"] = _median([max(s["committed_s"] for s in step) for step in steps])
        if all("durable_s" in s for step in steps for s in step):
            out["durable_s"] = _median([max(s["durable_s"] for s in step) for step in steps])
    return out


def _rank_records(saved: list[dict], restored: list[dict]) -> list[dict[str, Any]]:
    return [
        {
            "rank": r["rank"],
            "node": r["node"],
            "restore": r["rounds"],
            "saves": s["saves"],
            "dcp_save_s": s["dcp_save_s"],
        }
        for r, s in zip(restored, saved, strict=True)
    ]


def summarize(saved: list[dict], restored: list[dict]) -> dict[str, Any]:
    """The run's figures from every rank's reports of both jobs."""
    rounds = _rounds(restored)
    restore: dict[str, Any] = {
        name: _restore_times(rounds, restored, name) for name in ("tiers", "dcp")
    }
    tiers = restore["tiers"]
    tiers["steps"] = sorted({rank["tiers"]["step"] for rnd in rounds for rank in rnd})
    tiers["sources"] = [r["rounds"][0]["tiers"]["source"] for r in restored]
    by_tier = _bytes_by_source(rounds, "tiers")
    durable_rounds = _durable_reads(rounds, "tiers")
    tiers["bytes_by_source"] = by_tier[0]
    tiers["bytes_by_source_rounds"] = by_tier
    tiers["durable_reads"] = durable_rounds
    tiers["durable_chunk_bytes"] = max(d["chunk_bytes"] for d in durable_rounds)
    tiers["durable_chunk_requests"] = max(sum(d["chunk_requests"].values()) for d in durable_rounds)
    restore["dcp_over_tiers"] = common.ratio(restore["dcp"]["seconds"], tiers["seconds"])

    save: dict[str, Any] = {name: _save_blocking(saved, name) for name in METHODS}
    save["tiers_over_plain"] = common.ratio(save["tiers"]["blocked_s"], save["plain"]["blocked_s"])
    save["tiers_over_plain_slowest"] = common.ratio(
        save["tiers"]["blocked_slowest_s"], save["plain"]["blocked_slowest_s"]
    )
    save["dcp_save_s"] = max(r["dcp_save_s"] for r in saved)
    copies = [s["peer_copy"] for r in saved for s in r["saves"] if "peer_copy" in s]
    peer = {
        "buffer_bytes_peak": max((c["buffer_bytes"] for c in copies), default=0),
        "sent_bytes_per_save": _median([c["sent_bytes"] for c in copies]) if copies else 0,
        "seconds": _median([c["seconds"] for c in copies]) if copies else None,
        "failed": sorted({k for c in copies for k in c["failed"]}),
    }
    equal = restore["tiers"]["equal"] and restore["dcp"]["equal"]
    speedup = restore["dcp_over_tiers"]
    return {
        "restore": restore,
        "save": save,
        "peer_copy": peer,
        "equal": equal,
        "targets": _targets(speedup, tiers, save),
        "ranks": _rank_records(saved, restored),
        "notes": [
            "restore: from before the Checkpointer is built (tiers) or before dcp.load (DCP) "
            "until the state is loaded, first rank's start to last rank's end; medians of the "
            "rounds; each round wipes the node's local directory again",
            "save: blocked = time in save() with no save in flight and staging reserved, "
            "median over every rank's saves (slowest: the slowest rank per save, median over "
            "saves); wait() returned: tiers, committed locally and copied to the peers; "
            "without, committed to the durable store",
            "the save job's processes exit without close() after ckpt.wait() (os._exit): "
            "killed with every save committed and drained",
        ],
    }


def _targets(speedup: float | None, tiers: dict[str, Any], save: dict[str, Any]) -> dict:
    """Issue 22's targets, as this run measured them."""
    return {
        "restore_5x_faster_than_dcp": speedup is not None and speedup >= 5,
        "zero_durable_chunk_bytes": tiers["durable_chunk_bytes"] == 0,
        "save_blocking_within_1_1x": save["tiers_over_plain"] is not None
        and save["tiers_over_plain"] <= 1.1,
    }


def _loaded_as_expected(load: dict[str, Any], source: str) -> bool:
    """A tiered ``StoreReader`` load took its state from ``source`` ("local": its own copy,
    nothing from a peer; "peer": its copy restored from a peer, what it read of it counted as
    the peer's) and read no chunk from durable storage."""
    return (
        load["source"] == source
        and set(load["sources"]) == {source}
        and load["sources"][source]["bytes"] > 0
        and load["durable"]["chunk_bytes"] == 0
    )


def summarize_dcp(saved: list[dict], restored: list[dict]) -> dict[str, Any]:
    """``--frontend dcp``'s figures from every rank's reports of both jobs."""
    rounds = _rounds(restored)
    restore: dict[str, Any] = {
        name: _restore_times(rounds, restored, name) for name in DCP_RESTORES
    }
    for name in ("tiers", "plain"):
        method = restore[name]
        method["steps"] = sorted({rank[name]["step"] for rnd in rounds for rank in rnd})
        reads = _durable_reads(rounds, name)
        method["durable_reads"] = reads
        method["durable_chunk_bytes"] = max(d["chunk_bytes"] for d in reads)
        method["durable_chunk_requests"] = max(sum(d["chunk_requests"].values()) for d in reads)
        method["durable_chunk_gets"] = max(d["chunk_requests"].get("get", 0) for d in reads)
    tiers = restore["tiers"]
    tiers["sources"] = [r["rounds"][0]["tiers"]["source"] for r in restored]
    by_tier = _bytes_by_source(rounds, "tiers")
    tiers["bytes_by_source"] = by_tier[0]
    tiers["bytes_by_source_rounds"] = by_tier
    # Peer copies (peer_copies=1): in every round the wiped node's ranks load from the copies
    # their holders on the next node kept, the kept nodes' ranks from their own local copies,
    # and no rank reads a chunk from durable storage.
    wiped = max(r["node"] for r in restored)
    nodes = [r["node"] for r in restored]
    tiers["as_expected"] = all(
        _loaded_as_expected(rank["tiers"], "peer" if node == wiped else "local")
        for rnd in rounds
        for rank, node in zip(rnd, nodes, strict=True)
    )
    dcp_s = restore["dcp"]["seconds"]
    restore["dcp_over_tiers"] = common.ratio(dcp_s, tiers["seconds"])
    restore["dcp_over_plain"] = common.ratio(dcp_s, restore["plain"]["seconds"])
    restore["plain_over_tiers"] = common.ratio(restore["plain"]["seconds"], tiers["seconds"])

    save: dict[str, Any] = {name: _save_blocking(saved, name) for name in METHODS}
    save["tiers_over_plain"] = common.ratio(save["tiers"]["blocked_s"], save["plain"]["blocked_s"])
    save["tiers_over_plain_slowest"] = common.ratio(
        save["tiers"]["blocked_slowest_s"], save["plain"]["blocked_slowest_s"]
    )
    save["tiers_over_plain_committed"] = common.ratio(
        save["tiers"]["committed_s"], save["plain"]["committed_s"]
    )
    save["dcp_save_s"] = max(r["dcp_save_s"] for r in saved)
    for name in METHODS:
        save[f"{name}_over_dcp_save"] = common.ratio(save[name]["committed_s"], save["dcp_save_s"])
    # Staging buffers allocated by the warm-up save and none after it (None: not known).
    warm = [r.get("staging_allocations_warm", {}) for r in saved]
    after = [
        (r.get("staging_allocations_warm", {}).get(s["method"]), s.get("staging_allocations"))
        for r in saved
        for s in r["saves"]
    ]
    save["staging_allocations_warm"] = warm
    save["staging_allocated_in_timed_saves"] = (
        None if any(a is None or b is None for a, b in after) else any(b != a for a, b in after)
    )
    equal = all(restore[name]["equal"] for name in DCP_RESTORES)
    speedup = restore["dcp_over_tiers"]
    return {
        "restore": restore,
        "save": save,
        "equal": equal,
        "targets": _targets(speedup, tiers, save),
        "ranks": _rank_records(saved, restored),
        "notes": [
            "restore: from before the reader is built until dcp.load returned, first rank's "
            "start to last rank's end; medians of the rounds; each round wipes the node's local "
            "directory again; tiers and plain are ckptstore.dcp.StoreReader on the durable "
            "store, with local_dir and without; dcp is torch's own reader of its own save; the "
            "first method of the first round also pays the fresh process's first storage "
            "client and connections (about 1 s on S3/moto) and the others do not: the order "
            "alternates, so with --repeat 3 or more the median leaves that round out",
            "peer copies (peer_copies=1): the wiped node's ranks restore their copies from "
            "their holders on the next node (source peer), the others read their own local "
            "copies; durable chunk bytes of the tiered load: 0 expected. StoreReader's "
            "last_load counts what a wiped rank reads of its restored copy under peer",
            "save: blocked = time until dcp.async_save returned (the state staged into the "
            "writer's staging buffer, the save handed to its thread: what the loop waits "
            "for), with no save in flight; median over every rank's saves (slowest: the "
            "slowest rank per save, median over saves); committed = until the future's "
            "result() returned (with tiers, durable_every=1: committed locally, copied to the "
            "peer and committed to the durable store), the slowest rank per save, median over "
            "saves; each writer's untimed warm-up save (step 0) allocated its staging buffer "
            "and made its gloo groups first",
            "DCP's own save of the last state is a synchronous dcp.save: compared with the "
            "StoreWriters' time to committed",
            "the save job's processes exit without teardown (os._exit) once every save's "
            "result() returned",
        ],
    }


# -- output -------------------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def print_table(result: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    cfg, restore, save, peer = (result[k] for k in ("config", "restore", "save", "peer_copy"))
    print(
        f"ckptbench recover  {result['date']}  {cfg['ranks']} ranks as {cfg['nodes']} nodes, "
        f"{format_bytes(cfg['size_bytes'])} ({format_bytes(cfg['bytes_per_rank'])} per rank in "
        f"{cfg['tensors_per_rank']} tensors); durable {cfg['durable']} ({cfg['store']}); local "
        f"dirs under {cfg['local_root']}",
        file=out,
    )
    print(
        f"saved with peer_copies=1, durable_every=1, background_nice={cfg['background_nice']}; "
        "the job killed (exit without close); "
        f"node {cfg['wiped_node']}'s local dir wiped (ranks "
        f"{', '.join(map(str, cfg['wiped_ranks']))}); medians of {cfg['repeat']} rounds",
        file=out,
    )
    tiers, dcp = restore["tiers"], restore["dcp"]
    rows = []
    for i, r in enumerate(result["ranks"]):
        first = r["restore"][0]["tiers"]
        src = {t: s["bytes"] for t, s in first["sources"].items()}
        rows.append(
            [f"rank {r['rank']} (node {r['node']})", first["source"],
             format_bytes(src.get("local", 0)), format_bytes(src.get("peer", 0)),
             format_bytes(first["durable"]["chunk_bytes"]),
             format_seconds(tiers["per_rank_s"][i]), format_seconds(dcp["per_rank_s"][i]),
             _ratio(common.ratio(dcp["per_rank_s"][i], tiers["per_rank_s"][i]))]
        )  # fmt: skip
    by = tiers["bytes_by_source"]
    rows.append(
        ["job (all ranks)", "", format_bytes(by.get("local", 0)), format_bytes(by.get("peer", 0)),
         format_bytes(tiers["durable_chunk_bytes"]), format_seconds(tiers["seconds"]),
         format_seconds(dcp["seconds"]), _ratio(restore["dcp_over_tiers"])]
    )  # fmt: skip
    print("\nback to a loaded state: tiers vs DCP load from the durable store", file=out)
    table(
        ["", "source", "local", "peer", "durable chunks", "tiers", "DCP load", "DCP / tiers"],
        rows,
        out=out,
    )
    reads = tiers["durable_reads"][0]
    ops = ", ".join(f"{op} {n}" for op, n in sorted(reads["requests"].items())) or "none"
    print(
        f"durable store during the tiered restore (round 1, all ranks): {ops}; "
        f"{format_bytes(sum(reads['bytes'].values()))} read, of which chunks "
        f"{format_bytes(reads['chunk_bytes'])} in {sum(reads['chunk_requests'].values())} "
        "requests",
        file=out,
    )
    rows = []
    for name, label in (("tiers", "with tiers"), ("plain", "without (durable store)")):
        s = save[name]
        rows.append(
            [label, format_seconds(s["blocked_s"]), format_seconds(s["blocked_slowest_s"]),
             format_seconds(s["committed_s"]), format_seconds(s["durable_s"])]
        )  # fmt: skip
    print("\nsave: time save() blocks the loop (medians)", file=out)
    table(["", "blocked", "slowest rank", "wait() returned", "durable"], rows, out=out)
    print(
        f"blocked with / without tiers: {_ratio(save['tiers_over_plain'])} (slowest rank "
        f"{_ratio(save['tiers_over_plain_slowest'])}); DCP's save of the last state: "
        f"{format_seconds(save['dcp_save_s'])}",
        file=out,
    )
    budget = cfg["peer_budget_bytes"]
    print(
        f"peer copy: peak round buffer {format_bytes(peer['buffer_bytes_peak'])} per rank "
        f"(peer_budget_bytes {format_bytes(budget)}, state per rank "
        f"{format_bytes(cfg['bytes_per_rank'])}); {format_bytes(peer['sent_bytes_per_save'])} "
        "sent per rank per save",
        file=out,
    )
    met = result["targets"]
    print(
        "\ntargets (issue 22): restore >= 5x faster than DCP "
        f"{'met' if met['restore_5x_faster_than_dcp'] else 'NOT met'}; 0 durable chunk bytes "
        f"{'met' if met['zero_durable_chunk_bytes'] else 'NOT met'}; save blocking <= 1.1x "
        f"{'met' if met['save_blocking_within_1_1x'] else 'NOT met'}",
        file=out,
    )
    for note in result["notes"]:
        print(f"note: {note}", file=out)


def print_table_dcp(result: dict[str, Any], out: Any = None) -> None:
    """``--frontend dcp``'s tables."""
    out = out or sys.stdout
    cfg, restore, save = (result[k] for k in ("config", "restore", "save"))
    print(
        f"ckptbench recover --frontend dcp  {result['date']}  {cfg['ranks']} ranks as "
        f"{cfg['nodes']} nodes, {format_bytes(cfg['size_bytes'])} ("
        f"{format_bytes(cfg['bytes_per_rank'])} per rank in {cfg['tensors_per_rank']} tensors); "
        f"durable {cfg['durable']} ({cfg['store']}); local dirs under {cfg['local_root']}",
        file=out,
    )
    print(
        "saved with dcp.async_save and StoreWriter(local_dir=, peer_copies=1, durable_every=1), "
        f"background_nice={cfg['background_nice']}; the job killed (exit without teardown); "
        f"node {cfg['wiped_node']}'s local dir wiped (ranks "
        f"{', '.join(map(str, cfg['wiped_ranks']))}); medians of {cfg['repeat']} rounds",
        file=out,
    )
    tiers, plain, dcp = (restore[k] for k in DCP_RESTORES)
    rows = []
    for i, r in enumerate(result["ranks"]):
        first = r["restore"][0]["tiers"]
        src = {t: s["bytes"] for t, s in first["sources"].items()}
        rows.append(
            [f"rank {r['rank']} (node {r['node']})", first["source"] or "-",
             format_bytes(src.get("local", 0)), format_bytes(src.get("peer", 0)),
             format_bytes(src.get("durable", 0)), format_bytes(first["durable"]["chunk_bytes"]),
             format_seconds(tiers["per_rank_s"][i]), format_seconds(plain["per_rank_s"][i]),
             format_seconds(dcp["per_rank_s"][i]),
             _ratio(common.ratio(dcp["per_rank_s"][i], tiers["per_rank_s"][i])),
             _ratio(common.ratio(dcp["per_rank_s"][i], plain["per_rank_s"][i]))]
        )  # fmt: skip
    by = tiers["bytes_by_source"]
    rows.append(
        ["job (all ranks)", "", format_bytes(by.get("local", 0)), format_bytes(by.get("peer", 0)),
         format_bytes(by.get("durable", 0)), format_bytes(tiers["durable_chunk_bytes"]),
         format_seconds(tiers["seconds"]), format_seconds(plain["seconds"]),
         format_seconds(dcp["seconds"]), _ratio(restore["dcp_over_tiers"]),
         _ratio(restore["dcp_over_plain"])]
    )  # fmt: skip
    print(
        "\nback to a loaded state: dcp.load with StoreReader, tiers vs without, vs DCP's own "
        "reader (local, peer, durable: last_load's bytes per tier; durable chunks: counted at "
        "the store's backend)",
        file=out,
    )
    table(
        ["", "source", "local", "peer", "durable", "durable chunks", "tiers", "no tiers",
         "DCP load", "DCP / tiers", "DCP / no tiers"],
        rows,
        out=out,
    )  # fmt: skip
    for name, label in (("tiers", "tiered"), ("plain", "untiered")):
        reads = restore[name]["durable_reads"][0]
        ops = ", ".join(f"{op} {n}" for op, n in sorted(reads["requests"].items())) or "none"
        gets = reads["chunk_requests"].get("get", 0)
        print(
            f"durable store during the {label} restore (round 1, all ranks): {ops}; "
            f"{format_bytes(sum(reads['bytes'].values()))} read, of which chunks "
            f"{format_bytes(reads['chunk_bytes'])} in {gets} GETs",
            file=out,
        )
    expected = "yes" if tiers["as_expected"] else "NO"
    print(
        f"wiped ranks loaded from their peers' copies, the others from their own, no durable "
        f"chunk read (every round): {expected}",
        file=out,
    )
    rows = []
    for name, label in (("tiers", "with tiers"), ("plain", "without (durable store)")):
        s = save[name]
        rows.append(
            [label, format_seconds(s["blocked_s"]), format_seconds(s["blocked_slowest_s"]),
             format_seconds(s["committed_s"]), _ratio(save[f"{name}_over_dcp_save"])]
        )  # fmt: skip
    rows.append(["DCP FileSystemWriter/FsspecWriter (dcp.save, last state once)", "-", "-",
                 format_seconds(save["dcp_save_s"]), "1.00x"])  # fmt: skip
    print(
        "\nsave: time dcp.async_save blocks the loop, and until its result() (committed; medians)",
        file=out,
    )
    table(["", "blocked", "slowest rank", "committed", "committed / DCP's"], rows, out=out)
    staged = save.get("staging_allocated_in_timed_saves")
    print(
        f"blocked with / without tiers: {_ratio(save['tiers_over_plain'])} (slowest rank "
        f"{_ratio(save['tiers_over_plain_slowest'])}); committed with / without: "
        f"{_ratio(save['tiers_over_plain_committed'])}; staging buffers allocated in the "
        f"timed saves: {'-' if staged is None else 'yes' if staged else 'none'} (warm-up save "
        "first)",
        file=out,
    )
    met = result["targets"]
    print(
        "\ntargets (issue 22, DCP): restore >= 5x faster than DCP "
        f"{'met' if met['restore_5x_faster_than_dcp'] else 'NOT met'}; 0 durable chunk bytes "
        f"{'met' if met['zero_durable_chunk_bytes'] else 'NOT met'}; save blocking <= 1.1x "
        f"{'met' if met['save_blocking_within_1_1x'] else 'NOT met'}",
        file=out,
    )
    for note in result["notes"]:
        print(f"note: {note}", file=out)


def run(args: argparse.Namespace) -> int:
    size = parse_bytes(args.size, what="--size")
    budget = parse_bytes(args.peer_budget, what="--peer-budget")
    if args.timeout <= 0:
        raise ValueError(f"bad --timeout {args.timeout}: must be positive")
    result = run_recover(
        ranks=args.ranks,
        ranks_per_node=args.ranks_per_node,
        size_bytes=size,
        tensors=args.tensors,
        durable=args.durable,
        moto=args.moto,
        repeat=args.repeat,
        peer_budget_bytes=budget,
        local_root=args.local_root,
        timeout_s=args.timeout,
        seed=args.seed,
        background_nice=args.background_nice,
        frontend=args.frontend,
        progress=logger.info,
    )
    if args.json:
        print_json(result)
    elif args.frontend == "dcp":
        print_table_dcp(result)
    else:
        print_table(result)
    if not result["equal"]:
        bad = [
            f"rank {r['rank']} ({name})"
            for r in result["ranks"]
            for rnd in r["restore"]
            for name, method in rnd.items()
            if not method["equal"]
        ]
        print(
            f"ckptbench recover: error: restored state differs from the saved one: "
            f"{', '.join(sorted(set(bad)))}",
            file=sys.stderr,
        )
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "recover",
        help="time back to a loaded state from local and peer copies vs DCP load",
        description="Save a state on N gloo ranks simulated as nodes, with tiers (node-local "
        "copies, one peer copy, every save drained to the durable store) and without; kill "
        "the job, wipe one node's local directory, and restore in a fresh job: time back to a "
        "loaded state and bytes per source (local, peer, durable) side by side with DCP's "
        "load of the same state from the durable store, and save() blocking with and without "
        "tiers. Every restored state is checked against the saved one. Works under a fresh "
        "ckptbench-recover-<random>/ directory of the durable store and deletes it. "
        "--frontend dcp does the same with dcp.async_save / dcp.load through ckptstore.dcp's "
        "StoreWriter(local_dir=, peer_copies=1, durable_every=1) and StoreReader(local_dir=), "
        "with and without tiers, beside DCP's own writer and reader (the wiped node's ranks "
        "load from their peers' copies).",
    )
    p.add_argument(
        "--frontend",
        choices=FRONTENDS,
        default="checkpointer",
        help="what saves and restores: Checkpointer (default), or dcp.async_save / dcp.load "
        "with ckptstore.dcp's StoreWriter / StoreReader",
    )
    p.add_argument("--ranks", type=int, default=4, help="ranks (processes; default 4)")
    p.add_argument(
        "--ranks-per-node", type=int, default=2, help="ranks per simulated node (default 2)"
    )
    p.add_argument(
        "--size", default="1GiB", help="the whole state, split over the ranks (default 1GiB)"
    )
    p.add_argument("--tensors", type=int, default=4, help="tensors per rank (default 4)")
    p.add_argument(
        "--durable",
        metavar="DIR_OR_S3_URI",
        help="the durable store: a directory or s3://bucket/prefix (default: a temporary "
        f"directory; with --moto s3://{DEFAULT_BUCKET})",
    )
    p.add_argument(
        "--moto",
        action="store_true",
        help="start a moto S3 server on 127.0.0.1 and make --durable's bucket there",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="saves per method and restore rounds (default 3)"
    )
    p.add_argument(
        "--peer-budget",
        default="64MiB",
        help="peer_budget_bytes: most bytes per peer-copy round (default 64MiB)",
    )
    p.add_argument(
        "--local-root",
        help="where the nodes' local directories go (default /dev/shm, a RAM disk, else the "
        "temporary directory)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds each job (save, restore) may take before its ranks are killed (default 3600)",
    )
    p.add_argument(
        "--background-nice",
        type=int,
        default=0,
        help="background_nice of the save job's Checkpointers (StoreWriters with --frontend "
        "dcp), with tiers and without: their background threads yield the cores to the loops "
        "(default 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the state (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)
    return p
