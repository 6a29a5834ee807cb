"""``--frontend checkpointer`` (the default): ``Checkpointer.save`` and ``Checkpointer.load``.

The save job saves with tiers (``local_dir``, ``peer_copies=1``, ``durable_every=1``: every
save is in the durable store too) and without (a plain ``Checkpointer`` on a sibling prefix of
the durable store), each save from a quiet start (the last one's copies and drain finished) and
its staging memory reserved ahead, so ``save()``'s blocked time is its own. Each restore round
loads with tiers (a new ``Checkpointer``, then ``load``: timed from before the ``Checkpointer``
is built) and with DCP's ``load`` and its own reader from the durable store.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ClassVar

from bench import _ckpt_common as common
from bench.recover.counting import CountedStore
from bench.recover.frontend import Frontend, sources
from bench.recover.plan import RecoverPlan
from bench.report import format_bytes, format_seconds


def _tiered(plan: RecoverPlan, rank: int, *, nice: int = 0, store: Any = None) -> Any:
    from ckptstore import Checkpointer, StorageOptions

    storage = StorageOptions(timeout_s=plan.timeout_s, background_nice=nice, store=store)
    return Checkpointer(plan.durable_uri, storage=storage, tiers=plan.tier_options(rank))


class CheckpointerFrontend(Frontend):
    name = "checkpointer"
    restores = ("tiers", "dcp")
    counted = ("tiers",)
    columns: ClassVar[dict[str, str]] = {"tiers": "tiers", "dcp": "DCP load"}
    tiers_read = ("local", "peer")
    title = "ckptbench recover"
    saved_with = (
        "saved with peer_copies=1, durable_every=1, background_nice={nice}; the job killed "
        "(exit without close)"
    )
    restore_title = "back to a loaded state: tiers vs DCP load from the durable store"
    save_title = "save: time save() blocks the loop (medians)"
    targets_title = "targets"
    notes: ClassVar[list[str]] = [
        "restore: from before the Checkpointer is built (tiers) or before dcp.load (DCP) "
        "until the state is loaded, first rank's start to last rank's end; medians of the "
        "rounds; each round wipes the node's local directory again",
        "save: blocked = time in save() with no save in flight and staging reserved, "
        "median over every rank's saves (slowest: the slowest rank per save, median over "
        "saves); wait() returned: tiers, committed locally and copied to the peers; "
        "without, committed to the durable store",
        "the save job's processes exit without close() after ckpt.wait() (os._exit): "
        "killed with every save committed and drained",
    ]

    def open_savers(self, plan: RecoverPlan, rank: int, state: dict) -> tuple[dict, dict]:
        from ckptstore import Checkpointer, StorageOptions

        nice = plan.background_nice
        storage = StorageOptions(timeout_s=plan.timeout_s, background_nice=nice)
        savers = {
            "tiers": _tiered(plan, rank, nice=nice),
            "plain": Checkpointer(plan.plain_uri, storage=storage),
        }
        for ckpt in savers.values():  # steady-state saves: no first-save allocation timed
            ckpt.reserve(state).result(timeout=plan.timeout_s)
        return savers, {}

    def timed_save(
        self, saver: Any, name: str, step: int, state: dict, timeout_s: float
    ) -> dict[str, Any]:
        """How long ``save()`` blocked, until ``wait()`` returned (with tiers: committed
        locally and copied to the peers) and until durable; with tiers, the peer copy."""
        t0 = time.perf_counter()
        handle = saver.save(step, state)
        blocked = time.perf_counter() - t0
        handle.wait(timeout_s)
        committed = time.perf_counter() - t0
        durable = committed
        if handle.durable is not None:
            handle.durable.result(timeout=timeout_s)
            durable = time.perf_counter() - t0
        saver.wait()  # nothing in flight when the next save starts
        record = {"step": step, "blocked_s": blocked, "committed_s": committed}
        record["durable_s"] = durable
        copy = saver.last_peer_copy if name == "tiers" else None
        if copy is not None:
            record["peer_copy"] = {
                "sent_bytes": copy.sent_bytes,
                "received_bytes": copy.received_bytes,
                "buffer_bytes": copy.buffer_bytes,
                "seconds": copy.seconds,
                "failed": dict(copy.failed),
            }
        return record

    def import_libraries(self) -> None:
        from ckptstore import Checkpointer  # noqa: F401

    def load(
        self, plan: RecoverPlan, rank: int, name: str, store: CountedStore, dest: dict, *,
        t0: float, after: contextlib.ExitStack,
    ) -> dict[str, Any]:  # fmt: skip
        ckpt = after.enter_context(contextlib.closing(_tiered(plan, rank, store=store)))
        built = time.perf_counter()
        step = ckpt.load(dest)
        report = ckpt.last_load
        return {
            "construct_s": built - t0,
            "load_s": report.seconds,
            "step": step,
            "source": report.source,
            "sources": sources(report),
        }

    def summarize_saves(self, saved: list[dict], save: dict[str, Any]) -> dict[str, Any]:
        copies = [s["peer_copy"] for r in saved for s in r["saves"] if "peer_copy" in s]
        median = common.median
        peer = {
            "buffer_bytes_peak": max((c["buffer_bytes"] for c in copies), default=0),
            "sent_bytes_per_save": median([c["sent_bytes"] for c in copies]) if copies else 0,
            "seconds": median([c["seconds"] for c in copies]) if copies else None,
            "failed": sorted({k for c in copies for k in c["failed"]}),
        }
        return {"peer_copy": peer}

    def save_columns(self, save: dict[str, Any]) -> list[tuple[str, Any]]:
        return [
            ("wait() returned", lambda s, _name: format_seconds(s["committed_s"])),
            ("durable", lambda s, _name: format_seconds(s["durable_s"])),
        ]

    def save_lines(self, result: dict[str, Any]) -> tuple[list[list[str]], str, list[str]]:
        cfg, save, peer = result["config"], result["save"], result["peer_copy"]
        tail = f"DCP's save of the last state: {format_seconds(save['dcp_save_s'])}"
        line = (
            f"peer copy: peak round buffer {format_bytes(peer['buffer_bytes_peak'])} per rank "
            f"(peer_budget_bytes {format_bytes(cfg['peer_budget_bytes'])}, state per rank "
            f"{format_bytes(cfg['bytes_per_rank'])}); "
            f"{format_bytes(peer['sent_bytes_per_save'])} sent per rank per save"
        )
        return [], tail, [line]
