"""The report as tables, for any front-end: one :func:`print_table` over the figures of
:func:`~bench.recover.summary.summarize`, in the words of the run's front-end."""

from __future__ import annotations

import sys
from typing import Any

from bench import _ckpt_common as common
from bench.recover.adapters import frontend_of
from bench.recover.frontend import Frontend, ratio_text
from bench.recover.plan import BASELINE, METHODS
from bench.report import format_bytes, format_seconds, rounds, table
from ckptstore.cli.signals import raise_if_stopped

READS = {"tiers": "tiered", "plain": "untiered"}
"""How the lines on durable reads name each counted restore."""


def print_table(result: dict[str, Any], out: Any = None) -> None:
    """``result`` (``run_recover``'s report) as its front-end's tables."""
    raise_if_stopped()  # a signal whose exception was dropped: no results
    out = out or sys.stdout
    fe = frontend_of(result["config"].get("frontend", "checkpointer"))
    for line in _header(fe, result):
        print(line, file=out)
    _restore_table(fe, result, out)
    _save_table(fe, result, out)
    met = {k: "met" if ok else "NOT met" for k, ok in result["targets"].items()}
    durable = (
        f"0 durable chunk bytes {met['zero_durable_chunk_bytes']}"
        if "zero_durable_chunk_bytes" in met
        else f"only the bad chunks from durable storage {met['only_the_bad_chunks_from_durable']}"
    )
    print(
        f"\n{fe.targets_title}: restore >= 5x faster than DCP "
        f"{met['restore_5x_faster_than_dcp']}; {durable}; save blocking <= 1.1x "
        f"{met['save_blocking_within_1_1x']}",
        file=out,
    )
    for note in result["notes"]:
        print(f"note: {note}", file=out)


def _header(fe: Frontend, result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    wiped = ", ".join(map(str, cfg["wiped_ranks"]))
    return [
        f"{fe.title}  {result['date']}  {cfg['ranks']} ranks as {cfg['nodes']} nodes, "
        f"{format_bytes(cfg['size_bytes'])} ({format_bytes(cfg['bytes_per_rank'])} per rank in "
        f"{cfg['tensors_per_rank']} tensors); durable {cfg['durable']} ({cfg['store']}); local "
        f"dirs under {cfg['local_root']}",
        f"{fe.saved_with.format(nice=cfg['background_nice'])}; node {cfg['wiped_node']}'s "
        + (
            f"local dir wiped (ranks {wiped})"
            if cfg.get("damage", "node") == "node"
            else f"copies with one byte flipped in one chunk each (ranks {wiped})"
        )
        + f"; medians of {rounds(cfg['repeat'])}",
    ]


def _restore_table(fe: Frontend, result: dict[str, Any], out: Any) -> None:
    """Per rank and for the job: where the tiered load read from, and each restore's time
    beside DCP's; then what the durable store was asked."""
    restore = result["restore"]
    tiers, baseline = restore["tiers"], restore[BASELINE]
    compared = [name for name in fe.restores if name != BASELINE]
    rows = []
    for i, r in enumerate(result["ranks"]):
        first = r["restore"][0]["tiers"]
        src = {t: s["bytes"] for t, s in first["sources"].items()}
        rows.append(
            [f"rank {r['rank']} (node {r['node']})", first["source"] or "-"]
            + [format_bytes(src.get(tier, 0)) for tier in fe.tiers_read]
            + [format_bytes(first["durable"]["chunk_bytes"])]
            + [format_seconds(restore[name]["per_rank_s"][i]) for name in fe.restores]
            + [ratio_text(common.ratio(baseline["per_rank_s"][i], restore[name]["per_rank_s"][i]))
               for name in compared]
        )  # fmt: skip
    by = tiers["bytes_by_source"]
    rows.append(
        ["job (all ranks)", ""]
        + [format_bytes(by.get(tier, 0)) for tier in fe.tiers_read]
        + [format_bytes(tiers["durable_chunk_bytes"])]
        + [format_seconds(restore[name]["seconds"]) for name in fe.restores]
        + [ratio_text(restore[f"{BASELINE}_over_{name}"]) for name in compared]
    )
    print(f"\n{fe.restore_title}", file=out)
    header = ["", "source", *fe.tiers_read, "durable chunks"]
    header += [fe.columns[name] for name in fe.restores]
    header += [f"DCP / {fe.columns[name]}" for name in compared]
    table(header, rows, out=out)
    for name in fe.counted:
        reads = restore[name]["durable_reads"][0]
        ops = ", ".join(f"{op} {n}" for op, n in sorted(reads["requests"].items())) or "none"
        print(
            f"durable store during the {READS[name]} restore (round 1, all ranks): {ops}; "
            f"{format_bytes(sum(reads['bytes'].values()))} read, of which chunks "
            f"{format_bytes(reads['chunk_bytes'])} in {reads['chunk_requests'].get('get', 0)} "
            "GETs",
            file=out,
        )
    if tiers.get("p2p_bytes_per_s"):
        print(
            f"wiped ranks' tiered restore: {format_bytes(int(tiers['peer_restore_bytes_per_s']))}/s "
            f"(the slowest, peer bytes over its whole load); the group's point to point: "
            f"{format_bytes(int(tiers['p2p_bytes_per_s']))}/s: "
            f"{ratio_text(tiers['peer_restore_over_p2p'])} (target >= 0.50x)",
            file=out,
        )
    expected = (
        "wiped ranks loaded from their peers' copies, the others from their own, no durable "
        "chunk read"
        if result["config"].get("damage", "node") == "node"
        else "every rank loaded its own copy, each damaged rank one chunk from durable storage"
    )
    print(f"{expected} (every round): {'yes' if tiers['as_expected'] else 'NO'}", file=out)


def _save_table(fe: Frontend, result: dict[str, Any], out: Any) -> None:
    """Each method's save times; the front-end's rows and lines after them."""
    save = result["save"]
    columns = fe.save_columns(save)
    rows = []
    for name, label in zip(METHODS, ("with tiers", "without (durable store)"), strict=True):
        s = save[name]
        rows.append(
            [label, format_seconds(s["blocked_s"]), format_seconds(s["blocked_slowest_s"])]
            + [cell(s, name) for _, cell in columns]
        )
    more, tail, lines = fe.save_lines(result)
    print(f"\n{fe.save_title}", file=out)
    table(["", "blocked", "slowest rank", *(h for h, _ in columns)], rows + more, out=out)
    print(
        f"blocked with / without tiers: {ratio_text(save['tiers_over_plain'])} (slowest rank "
        f"{ratio_text(save['tiers_over_plain_slowest'])}); {tail}",
        file=out,
    )
    for line in lines:
        print(line, file=out)
