"""``--frontend dcp``: ``dcp.async_save`` and ``dcp.load`` through ``ckptstore.dcp``.

Each rank saves with ``dcp.async_save(state, storage_writer=writer, checkpoint_id=step)``
through ``StoreWriter(durable, local_dir=<node dir>, durable_every=1, peer_copies=1,
node_rank=rank // ranks_per_node)`` (tiers: each rank's local copy also goes to the rank at its
position on the next node) and a plain ``StoreWriter`` on a sibling prefix. Blocked is the time
until ``async_save`` returns (the state copied into the writer's staging buffer, the save handed
to its thread); the future's ``result()`` is awaited outside that timing, so each save starts
with none in flight, and the time until it returned is the time to committed. Before the timed
saves each writer makes one untimed warm-up save, of step 0 (older than every timed step, so no
load uses it): it allocates the writer's staging buffer (its pool holds one, reused by every
later save), makes its gloo groups and does DCP's first-call work; the pool's allocation count
is recorded per save to show that no timed save allocates.

Each restore round runs ``dcp.load`` with ``StoreReader(durable, local_dir=<node dir>)``
(tiers), ``StoreReader(durable)`` (no tiers) and DCP's own reader of the baseline;
``reader.last_load`` gives the tiered load's bytes per tier.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Any, ClassVar

from bench import _ckpt_common as common
from bench.recover.counting import CountedStore
from bench.recover.frontend import Frontend, ratio_text, sources
from bench.recover.plan import METHODS, RecoverPlan, fill
from bench.report import format_seconds

WARMUP_STEP = 0
"""The untimed first save of each writer (the timed ones are 1..repeat)."""


def _store_writer(plan: RecoverPlan, rank: int, *, tiered: bool) -> Any:
    from ckptstore import StorageOptions
    from ckptstore.dcp import StoreWriter

    storage = StorageOptions(timeout_s=plan.timeout_s, background_nice=plan.background_nice)
    if not tiered:
        return StoreWriter(plan.plain_uri, storage=storage)
    return StoreWriter(plan.durable_uri, storage=storage, tiers=plan.tier_options(rank))


def _staging_allocations(writer: Any) -> int | None:
    """How many staging buffers ``writer``'s pool ever allocated (None if it does not say)."""
    pool = getattr(getattr(writer, "engine", None), "pool", None)
    return getattr(pool, "allocations", None)


def _timed_async_save(writer: Any, step: int, state: Any, timeout_s: float) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    with common.quiet_dcp():
        t0 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)
        blocked = time.perf_counter() - t0
        future.result(timeout=timeout_s)  # nothing in flight when the next save starts
        # A tiered writer drains a durable step in the background: committed means durable,
        # as for the plain writer, so wait for that drain too.
        drain = writer.durable(step) if hasattr(writer, "durable") else None
        if drain is not None:
            drain.result(timeout=timeout_s)
        committed = time.perf_counter() - t0
    return {"step": step, "blocked_s": blocked, "committed_s": committed}


class DcpFrontend(Frontend):
    name = "dcp"
    restores = ("tiers", "plain", "dcp")
    counted = ("tiers", "plain")
    columns: ClassVar[dict[str, str]] = {"tiers": "tiers", "plain": "no tiers", "dcp": "DCP load"}
    tiers_read = ("local", "peer", "durable")
    title = "ckptbench recover --frontend dcp"
    saved_with = (
        "saved with dcp.async_save and StoreWriter(local_dir=, peer_copies=1, durable_every=1), "
        "background_nice={nice}; the job killed (exit without teardown)"
    )
    restore_title = (
        "back to a loaded state: dcp.load with StoreReader, tiers vs without, vs DCP's own "
        "reader (local, peer, durable: last_load's bytes per tier; durable chunks: counted by "
        "the store's StoreCounters)"
    )
    save_title = (
        "save: time dcp.async_save blocks the loop, and until its result() (committed; medians)"
    )
    targets_title = "targets (DCP)"
    notes: ClassVar[list[str]] = [
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
    ]

    def open_savers(self, plan: RecoverPlan, rank: int, state: dict) -> tuple[dict, dict]:
        """Each writer after an untimed warm-up save: its staging buffer (its pool holds one,
        reused by every later save), its gloo groups (with tiers: the tier group and peer
        topology) and DCP's first-call work. Step 0 is older than every timed step: no load
        uses it."""
        import torch.distributed as dist

        writers = {name: _store_writer(plan, rank, tiered=name == "tiers") for name in METHODS}
        fill(state, rank, WARMUP_STEP, plan.seed)
        for name in METHODS:
            dist.barrier()
            _timed_async_save(writers[name], WARMUP_STEP, state, plan.group_timeout_s)
        warm = {name: _staging_allocations(writers[name]) for name in METHODS}
        return writers, {"staging_allocations_warm": warm}

    def timed_save(
        self, saver: Any, name: str, step: int, state: dict, timeout_s: float
    ) -> dict[str, Any]:
        """How long ``dcp.async_save`` blocked and until its future's ``result()`` returned
        (committed; with tiers and ``durable_every=1`` also copied to the peer and durable)."""
        record = _timed_async_save(saver, step, state, timeout_s)
        record["saved_step"] = saver.saved_step
        record["staging_allocations"] = _staging_allocations(saver)
        return record

    def import_libraries(self) -> None:
        import ckptstore.dcp  # noqa: F401

    def load(
        self, plan: RecoverPlan, rank: int, name: str, store: CountedStore, dest: dict, *,
        t0: float, after: contextlib.ExitStack,
    ) -> dict[str, Any]:  # fmt: skip
        import torch.distributed.checkpoint as dcp

        from ckptstore import StorageOptions
        from ckptstore.dcp import StoreReader

        tiers = plan.tier_options(rank) if name == "tiers" else None
        storage = StorageOptions(store=store, timeout_s=plan.timeout_s)
        reader = StoreReader(plan.durable_uri, storage=storage, tiers=tiers)
        with common.quiet_dcp():
            dcp.load(dest, storage_reader=reader)
        report, exchange, view = reader.last_load, reader.last_load_exchange, reader.view
        loaded: dict[str, Any] = {
            "step": report.step if report is not None else view.manifest.step if view else None,
            "exchange": asdict(exchange) if exchange is not None else None,
        }
        if name == "tiers":
            loaded["source"] = report.source if report is not None else None
            loaded["sources"] = sources(report)
        return loaded

    def summarize_saves(self, saved: list[dict], save: dict[str, Any]) -> dict[str, Any]:
        """Each method's committed time over DCP's save's, and the staging buffers allocated
        by the warm-up save and none after it (None: not known)."""
        for name in METHODS:
            save[f"{name}_over_dcp_save"] = common.ratio(
                save[name]["committed_s"], save["dcp_save_s"]
            )
        after = [
            (r.get("staging_allocations_warm", {}).get(s["method"]), s.get("staging_allocations"))
            for r in saved
            for s in r["saves"]
        ]
        save["staging_allocations_warm"] = [r.get("staging_allocations_warm", {}) for r in saved]
        save["staging_allocated_in_timed_saves"] = (
            None if any(a is None or b is None for a, b in after) else any(b != a for a, b in after)
        )
        return {}

    def save_columns(self, save: dict[str, Any]) -> list[tuple[str, Any]]:
        return [
            ("committed", lambda s, _name: format_seconds(s["committed_s"])),
            ("committed / DCP's", lambda _s, name: ratio_text(save[f"{name}_over_dcp_save"])),
        ]

    def save_lines(self, result: dict[str, Any]) -> tuple[list[list[str]], str, list[str]]:
        save = result["save"]
        row = ["DCP FileSystemWriter/FsspecWriter (dcp.save, last state once)", "-", "-"]
        row += [format_seconds(save["dcp_save_s"]), "1.00x"]
        staged = save.get("staging_allocated_in_timed_saves")
        tail = (
            f"committed with / without: {ratio_text(save['tiers_over_plain_committed'])}; staging "
            "buffers allocated in the timed saves: "
            f"{'-' if staged is None else 'yes' if staged else 'none'} (warm-up save first)"
        )
        return [row], tail, []
