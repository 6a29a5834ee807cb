"""``ckptbench plan``: how often to checkpoint a job, and what checkpoints and failures cost it.

A first-order model (docs/plan.md derives and discusses it). Training blocks for ``blocked_s``
per save while each node stages its shard of the state to host memory; the shard is then written
to storage in the background, so a save is durable ``persist_s`` after it starts. Failures
arrive at random (Poisson) with the job's mean time between failures ``mtbf_s``. The interval is
Daly's higher-order optimum (Young's first-order one is reported alongside), raised when the
previous save would not yet be durable when the next one starts. A failure loses the work since
the last durable save, the time to restore it (from storage or from a peer's memory) and a
restart time, by default FlashRecovery's published 150 s.

Tiers (``Checkpointer(local_dir=..., peer_copies=K, durable_every=M)``): a save every ``T``
seconds to each node's local tier and a peer's, every M-th also to durable storage. A failure
costs the work since the last save of the tier the job restores from, half that tier's save
interval on average, plus the restore and the restart; goodput is

    (1 - blocked / T) * (1 - (T_tier / 2 + P_tier + R_tier + S) / MTBF)

with T_tier = T and R_tier = the slower of the local and the peer restore (a node replaced: its
ranks read a peer's copy while the others read their own) with tiers; without them the job saves
to durable storage only, every M * T (the cadence its durable storage takes), and restores from
it: T_tier = M * T, R_tier = the durable restore. P_tier is the time a save takes to commit
to that tier (a failure before it does loses one more interval): the staging and the peer copy
with tiers, the durable persist without. Shown at Llama 3's failure rate and at the
MTTF of 1.8 h that Meta's cluster study projects for 16,384 GPUs, each scaled per accelerator.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from bench import request_floor
from bench.report import (
    format_bytes,
    format_rate,
    format_seconds,
    load_json_object,
    parse_bytes,
    parse_count,
    parse_rate,
    print_json,
    table,
)

DAY_S = 86400.0


def _bytes(n: float) -> str:
    return format_bytes(n, si=True)


def _rate(n: float) -> str:
    return format_rate(n, si=True)


# Llama 3 (Meta, 2024): 419 unexpected interruptions in a 54-day snapshot of pre-training on
# 16,384 H100s; Tectonic sustained 2 TB/s of checkpoint writes (7 TB/s peak).
LLAMA3_FAILURES = 419
LLAMA3_DAYS = 54.0
LLAMA3_ACCELERATORS = 16384

# FlashRecovery (Zhang et al., arXiv 2509.03047, 2025) restores training on a cluster of 4,800
# accelerators in 150 s after a failure, detection and restart included. A system built for fast
# recovery: a job restarted by its scheduler from a checkpoint takes longer (docs/plan.md).
PUBLISHED_RESTART_S = 150.0
RESTART_SOURCE = "FlashRecovery, arXiv 2509.03047: 4,800 accelerators back in 150 s"

# Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters"
# (Meta, arXiv 2410.21680, HPCA 2025): a failure model fitted to two research clusters projects a
# mean time to failure of 1.8 h for a 16,384-GPU job (7.9 h at 1,024).
CLUSTER_MTTF_S = 1.8 * 3600.0
CLUSTER_MTTF_ACCELERATORS = 16384
CLUSTER_SOURCE = "Kokolis et al., arXiv 2410.21680"


def young_interval_s(blocked_s: float, mtbf_s: float) -> float:
    """Young (1974): compute time between checkpoints, ``sqrt(2 * delta * M)``."""
    _check_positive(blocked_s=blocked_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * blocked_s * mtbf_s)


def daly_interval_s(blocked_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: for ``delta < 2M``,
    ``sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta``, else ``M``."""
    _check_positive(blocked_s=blocked_s, mtbf_s=mtbf_s)
    if blocked_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = blocked_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * blocked_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - blocked_s


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value}")


@dataclass(kw_only=True)
class PlanInputs:
    """What the plan is computed from. Defaults describe Llama 3 405B on 16,384 H100s."""

    params: float = 405e9
    """Model parameters."""
    weight_bytes_per_param: float = 2.0
    """Bytes of weights per parameter in the checkpoint (bf16: 2, fp32: 4)."""
    optimizer_bytes_per_param: float = 12.0
    """Bytes of optimizer state per parameter (Adam with fp32 master weights, m and v: 12)."""
    accelerators: int = LLAMA3_ACCELERATORS
    ranks_per_node: int = 8
    replicas: int = 1
    """Copies of the model state across the job (HSDP: the replica groups, each sharding the
    whole state over ``accelerators / replicas``). Ranks holding the same chunk agree on one
    writer (``ckptstore.save.once``): a save sends the distinct bytes once."""
    failures: float = LLAMA3_FAILURES
    """Failures observed in ``failure_days`` on ``failure_accelerators``; scaled linearly."""
    failure_days: float = LLAMA3_DAYS
    failure_accelerators: int = LLAMA3_ACCELERATORS
    mtbf_s: float | None = None
    """The job's mean time between failures; overrides the three fields above."""
    write_bw_bytes_s: float = 2e12
    """Aggregate storage write bandwidth available to the job's checkpoints."""
    read_bw_bytes_s: float = 2e12
    """Aggregate storage read bandwidth for a restore."""
    node_storage_bw_bytes_s: float = 25e9
    """One node's bandwidth to storage (front-end network); caps its share of a save."""
    staging_bw_bytes_s: float = 100e9
    """One node's device-to-host (and host-to-device) copy bandwidth."""
    peer_bw_bytes_s: float = 50e9
    """One node's bandwidth to a peer node's memory (restore from a peer replica)."""
    blocked_overhead_s: float = 0.0
    """Fixed time training blocks per save beyond staging (planning, barriers)."""
    restart_s: float = PUBLISHED_RESTART_S
    """Time per failure to detect it, reschedule and re-initialise, before the restore."""
    interval_s: float | None = None
    """Evaluate this interval (compute seconds between saves) instead of the optimum."""
    sync: bool = False
    """Saves block training until durable (no asynchronous persist)."""
    max_write_duty: float = 1.0
    """Most of the time storage may spend writing checkpoints (raises the interval if needed)."""
    save_every_s: float | None = None
    """Tiers: seconds from one save to the next (local tier and peer copies); default the plan's
    period (its interval plus the blocked time)."""
    durable_every: int = 1
    """Tiers: every this many saves also goes to durable storage."""
    local_restore_s: float | None = None
    """Tiers: a node's restore from its own local tier; default its shard copied to the devices
    at the staging bandwidth (a RAM disk read at memory speed)."""
    peer_restore_s: float | None = None
    """Tiers: a node's restore from a peer's copy; default the plan's restore from peer memory."""
    durable_restore_s: float | None = None
    """Tiers: a restore from durable storage; default the plan's restore from storage."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each input came from: default, flag, or a file name."""
    warnings: list[str] = field(default_factory=list)
    """What an input taken from a file is not (see :func:`storage_json_warnings`)."""

    def __post_init__(self) -> None:
        positive = (
            "params", "accelerators", "ranks_per_node", "failures", "failure_days",
            "failure_accelerators", "write_bw_bytes_s", "read_bw_bytes_s",
            "node_storage_bw_bytes_s", "staging_bw_bytes_s", "peer_bw_bytes_s",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{_flag(name)} must be positive, got {value}")
        for name in (
            "weight_bytes_per_param",
            "optimizer_bytes_per_param",
            "blocked_overhead_s",
            "restart_s",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{_flag(name)} must be >= 0, got {value}")
        if self.weight_bytes_per_param + self.optimizer_bytes_per_param <= 0:
            raise ValueError("the checkpoint is empty: give --weight-bytes-per-param > 0")
        if not 0 < self.max_write_duty <= 1:
            raise ValueError(f"--max-write-duty must be within (0, 1], got {self.max_write_duty}")
        for name in ("mtbf_s", "interval_s", "save_every_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{_flag(name)} must be positive, got {value}")
        for name in ("local_restore_s", "peer_restore_s", "durable_restore_s"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{_flag(name)} must be >= 0, got {value}")
        if isinstance(self.durable_every, bool) or int(self.durable_every) != self.durable_every:
            raise ValueError(f"--durable-every must be a whole number, got {self.durable_every}")
        if self.durable_every < 1:
            raise ValueError(f"--durable-every must be 1 or more, got {self.durable_every}")
        if isinstance(self.replicas, bool) or int(self.replicas) != self.replicas:
            raise ValueError(f"--replicas must be a whole number, got {self.replicas}")
        if self.replicas < 1 or (self.accelerators // self.ranks_per_node) % self.replicas:
            raise ValueError(
                f"--replicas {self.replicas} must be 1 or more and divide the "
                f"{self.accelerators // self.ranks_per_node} nodes"
            )
        if self.accelerators % self.ranks_per_node:
            raise ValueError(
                f"--accelerators {self.accelerators} is not a multiple of "
                f"--ranks-per-node {self.ranks_per_node}"
            )


def _flag(name: str) -> str:
    if name == "save_every_s":
        return "--save-every-min"
    flag = name.replace("_bytes_s", "").replace("_", "-")
    return f"--{flag}"


def plan(inputs: PlanInputs) -> dict[str, Any]:
    """The plan for ``inputs``, as a JSON-ready dict (all times in seconds)."""
    i = inputs
    checkpoint_bytes = i.params * (i.weight_bytes_per_param + i.optimizer_bytes_per_param)
    nodes = i.accelerators // i.ranks_per_node
    node_bytes = checkpoint_bytes * i.replicas / nodes  # what a node holds, and stages
    stage_s = node_bytes / i.staging_bw_bytes_s
    # Every node writes its share at once (a 1/replicas part of what it holds: one writer per
    # distinct chunk); the aggregate or the node's own link limits.
    write_s = max(
        checkpoint_bytes / i.write_bw_bytes_s,
        node_bytes / i.replicas / i.node_storage_bw_bytes_s,
    )
    # As if every replica wrote what it holds (DDP/HSDP without the agreement).
    every_replica_write_s = max(
        checkpoint_bytes * i.replicas / i.write_bw_bytes_s, node_bytes / i.node_storage_bw_bytes_s
    )
    persist_s = stage_s + write_s  # from the start of a save until it is durable
    blocked_s = i.blocked_overhead_s + (persist_s if i.sync else stage_s)
    if i.mtbf_s is not None:
        mtbf_s = i.mtbf_s
    else:
        rate_per_accelerator_s = i.failures / (i.failure_days * DAY_S * i.failure_accelerators)
        mtbf_s = 1.0 / (rate_per_accelerator_s * i.accelerators)

    young_s = young_interval_s(blocked_s, mtbf_s)
    daly_s = daly_interval_s(blocked_s, mtbf_s)
    interval_s, interval_source = (i.interval_s, "given") if i.interval_s else (daly_s, "daly")
    # The next save may only start once the previous one is durable (one save in flight).
    # A save that would start earlier waits for it, which is the same as a longer interval.
    persist_fits = persist_s <= interval_s + blocked_s
    if not persist_fits:
        interval_s, interval_source = persist_s - blocked_s, "persist"
    # Storage serves the job's reads too: cap the share of time it spends on checkpoint writes.
    if write_s / (interval_s + blocked_s) > i.max_write_duty:
        interval_s, interval_source = write_s / i.max_write_duty - blocked_s, "duty"
    period_s = interval_s + blocked_s

    # A failure at a uniform time within a period loses the work since the last durable save:
    # period/2 on average, plus a whole period when it strikes before the newest save is durable
    # (probability persist/period), so period/2 + persist.
    lost_storage_s = period_s / 2.0 + persist_s
    peer_copy_s = node_bytes / i.peer_bw_bytes_s
    lost_peer_s = period_s / 2.0 + min(stage_s + peer_copy_s, period_s)
    h2d_s = node_bytes / i.staging_bw_bytes_s
    restore_storage_s = (
        max(checkpoint_bytes / i.read_bw_bytes_s, node_bytes / i.node_storage_bw_bytes_s) + h2d_s
    )
    restore_peer_s = peer_copy_s + h2d_s
    efficiency = interval_s / period_s

    def goodput(lost_s: float, restore_s: float) -> float:
        return max(0.0, efficiency * (1.0 - (lost_s + restore_s + i.restart_s) / mtbf_s))

    return {
        "bench": "plan",
        "inputs": {k: v for k, v in asdict(i).items() if k not in ("sources", "warnings")},
        "sources": dict(i.sources),
        "warnings": list(i.warnings),
        "checkpoint_bytes": checkpoint_bytes,
        "replicas": i.replicas,
        "bytes_sent_per_save": checkpoint_bytes,
        "every_replica_writes": {
            "bytes_sent_per_save": checkpoint_bytes * i.replicas,
            "write_s": every_replica_write_s,
            "persist_s": stage_s + every_replica_write_s,
        },
        "nodes": nodes,
        "bytes_per_node": node_bytes,
        "stage_s": stage_s,
        "write_s": write_s,
        "blocked_s": blocked_s,
        "persist_s": persist_s,
        "mtbf_s": mtbf_s,
        "failures_per_day": DAY_S / mtbf_s,
        "young_interval_s": young_s,
        "daly_interval_s": daly_s,
        "interval_s": interval_s,
        "interval_source": interval_source,
        "period_s": period_s,
        "persist_fits": persist_fits,
        "checkpoints_per_day": DAY_S / period_s,
        "bytes_written_per_day": checkpoint_bytes * DAY_S / period_s,
        "storage_write_duty": min(1.0, write_s / period_s),
        "lost_work_per_failure_s": lost_storage_s,
        "lost_work_per_failure_peer_s": lost_peer_s,
        "restore_from_storage_s": restore_storage_s,
        "restore_from_peer_s": restore_peer_s,
        "checkpoint_efficiency": efficiency,
        "goodput": goodput(lost_storage_s, restore_storage_s),
        "goodput_peer": goodput(lost_peer_s, restore_peer_s),
        "tiers": tiers(
            i,
            period_s=period_s,
            blocked_s=blocked_s,
            mtbf_s=mtbf_s,
            restore_s={"local": h2d_s, "peer": restore_peer_s, "durable": restore_storage_s},
            persist_s={"durable": persist_s, "local": stage_s + peer_copy_s},
        ),
    }


def tier_goodput(
    *,
    interval_s: float,
    persist_s: float,
    restore_s: float,
    restart_s: float,
    blocked_s: float,
    mtbf_s: float,
) -> dict[str, float]:
    """One failure's cost and the goodput when saves come every ``interval_s`` seconds (each
    blocking ``blocked_s``, committed to the tier ``persist_s`` after it starts) and a failure
    falls back to the last of them: half an interval of work lost on average plus the persist
    time (a failure before the newest save is committed loses one more interval, with
    probability persist/T), then the restore and the restart,
    ``(1 - blocked / T) * (1 - (T / 2 + P + R + S) / M)``, as the plan's own goodput."""
    _check_positive(interval_s=interval_s, mtbf_s=mtbf_s)
    if blocked_s >= interval_s:
        raise ValueError(
            f"a save every {format_seconds(interval_s)} but each blocks "
            f"{format_seconds(blocked_s)}: give a longer --save-every-min"
        )
    lost_s = interval_s / 2.0 + persist_s + restore_s
    efficiency = 1.0 - blocked_s / interval_s
    return {
        "interval_s": interval_s,
        "restore_s": restore_s,
        "lost_s": lost_s,
        "cost_per_failure_s": lost_s + restart_s,
        "goodput": max(0.0, efficiency * (1.0 - (lost_s + restart_s) / mtbf_s)),
    }


def tiers(
    i: PlanInputs,
    *,
    period_s: float,
    blocked_s: float,
    mtbf_s: float,
    restore_s: dict[str, float],
    persist_s: dict[str, float],
) -> dict[str, Any]:
    """Goodput with tiers and without, at Llama 3's failure rate, at Meta's projected 1.8 h
    MTTF for 16,384 GPUs (both scaled per accelerator to ``i.accelerators``) and, when it
    differs, at the plan's own MTBF. ``restore_s``: the defaults of each tier's restore;
    ``persist_s``: from the start of a save until it is committed to durable storage
    (``durable``) and to the local tier with its peer copy (``local``)."""
    every = i.save_every_s or period_s
    given = {"local": i.local_restore_s, "peer": i.peer_restore_s}
    given["durable"] = i.durable_restore_s
    restore = {tier: restore_s[tier] if given[tier] is None else given[tier] for tier in given}
    scale = i.accelerators
    rates = [
        (f"Llama 3: {LLAMA3_FAILURES} in {LLAMA3_DAYS:g} d on {LLAMA3_ACCELERATORS:,}",
         LLAMA3_DAYS * DAY_S / LLAMA3_FAILURES * LLAMA3_ACCELERATORS / scale),
        (f"MTTF 1.8 h at {CLUSTER_MTTF_ACCELERATORS:,} ({CLUSTER_SOURCE})",
         CLUSTER_MTTF_S * CLUSTER_MTTF_ACCELERATORS / scale),
    ]  # fmt: skip
    if all(not math.isclose(mtbf_s, m, rel_tol=1e-9) for _, m in rates):
        rates.append(("this plan's MTBF", mtbf_s))
    common = {"restart_s": i.restart_s, "blocked_s": blocked_s}
    durable_persist = {"persist_s": persist_s["durable"]}
    local_persist = {"persist_s": min(persist_s["local"], every)}
    out = []
    for name, mtbf in rates:
        without = tier_goodput(
            interval_s=every * i.durable_every, restore_s=restore["durable"], mtbf_s=mtbf,
            **durable_persist, **common,
        )  # fmt: skip
        node_lost = tier_goodput(
            interval_s=every, restore_s=max(restore["local"], restore["peer"]), mtbf_s=mtbf,
            **local_persist, **common,
        )  # fmt: skip
        local = tier_goodput(
            interval_s=every, restore_s=restore["local"], mtbf_s=mtbf, **local_persist, **common
        )
        out.append(
            {
                "failure_rate": name,
                "mtbf_s": mtbf,
                "without_tiers": without,
                "with_tiers": node_lost,
                "with_tiers_local": local,
                "gain": node_lost["goodput"] - without["goodput"],
            }
        )
    return {
        "save_every_s": every,
        "save_every_source": "flag" if i.save_every_s else "the plan's period",
        "durable_every": i.durable_every,
        "durable_interval_s": every * i.durable_every,
        "restore_s": restore,
        "restore_sources": {t: "default" if given[t] is None else "flag" for t in given},
        "restart_s": i.restart_s,
        "blocked_s": blocked_s,
        "persist_s": {"durable": persist_s["durable"], "local": local_persist["persist_s"]},
        "formula": "goodput = (1 - blocked/T) * (1 - (T/2 + P + R + S) / MTBF); with tiers T = "
        "the save interval, P = staging + the peer copy, R = max(local, peer restore); without, "
        "T = durable_every x the save interval, P = the durable persist, R = the durable restore",
        "rates": out,
    }


# -- measured inputs ---------------------------------------------------------------------------


def apply_storage_json(
    inputs: dict[str, Any], sources: dict[str, str], path: str
) -> dict[str, Any]:
    """Take bandwidths from ``ckptbench storage --json`` output: the burst's aggregate write
    throughput (else the puts'), and the gets' throughput unless they were burst background
    reads (small, paced: not a bandwidth). Returns the output."""
    obj = load_json_object(path, what="--from-storage file")
    if obj.get("bench") != "storage":
        raise ValueError(f"--from-storage {path!r} is not `ckptbench storage --json` output")
    burst = obj.get("burst") or {}
    write = burst.get("write_throughput_bytes_s") or (obj.get("put") or {}).get(
        "throughput_bytes_s"
    )
    read = None if burst else (obj.get("get") or {}).get("throughput_bytes_s")
    if not write and not read:
        raise ValueError(f"--from-storage {path!r} measured no put or get throughput")
    if write:
        inputs["write_bw_bytes_s"] = float(write)
        sources["write_bw_bytes_s"] = path
    if read:
        inputs["read_bw_bytes_s"] = float(read)
        sources["read_bw_bytes_s"] = path
    return obj


def storage_json_warnings(
    obj: dict[str, Any], path: str, sources: dict[str, str], nodes: int
) -> list[str]:
    """One line for each way the figures the plan took from ``obj`` (read from ``path``; flags
    win over it) are not the aggregate storage bandwidth it uses them as: a ``memory://`` run,
    gets served from a local disk's page cache, and, always, one client's figures."""
    taken = {
        what: (obj.get(workers), workers)
        for what, name, workers in (
            ("write", "write_bw_bytes_s", "writers"),
            ("read", "read_bw_bytes_s", "readers"),
        )
        if sources.get(name) == path
    }
    if not taken:
        return []
    uri = str(obj.get("uri", ""))
    out = []
    if uri.startswith("memory://"):
        out.append(
            f"--from-storage {path}: a memory:// run: its {' and '.join(taken)} figures are "
            "this process's memory speed, not storage bandwidth"
        )
    cached = obj.get("gets_from_page_cache")  # absent from output of older versions
    if cached is None:
        cached = "://" not in uri or uri.startswith("file://")
    if "read" in taken and cached:
        out.append(
            f"--from-storage {path}: its gets read objects the run had just written to a local "
            "disk, mostly from the page cache: its read figure is memory speed, not the disk's"
        )
    clients = ", ".join(
        what if n is None else f"{what} by {n} {workers.removesuffix('s') if n == 1 else workers}"
        for what, (n, workers) in taken.items()
    )
    out.append(
        f"--from-storage {path}: one process's figures ({clients}, one host) taken as the "
        f"aggregate bandwidth of all {nodes} nodes, not scaled with them (each node's share is "
        "capped only by --node-storage-bw): for the cluster's, run the bench from several "
        "nodes at once or give --write-bw / --read-bw"
    )
    return out


# -- command line ------------------------------------------------------------------------------

_RATE_FLAGS = {
    "write_bw": "write_bw_bytes_s",
    "read_bw": "read_bw_bytes_s",
    "node_storage_bw": "node_storage_bw_bytes_s",
    "staging_bw": "staging_bw_bytes_s",
    "peer_bw": "peer_bw_bytes_s",
}
_NUMBER_FLAGS = (
    "weight_bytes_per_param", "optimizer_bytes_per_param", "accelerators", "ranks_per_node",
    "replicas",
    "failures", "failure_days", "failure_accelerators", "mtbf_s", "blocked_overhead_s",
    "restart_s", "interval_s", "max_write_duty", "durable_every", "local_restore_s",
    "peer_restore_s", "durable_restore_s",
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = PlanInputs()
    p = sub.add_parser(
        "plan",
        help="checkpoint interval, blocked time, lost work, restore time and goodput",
        description="Plan checkpointing for a training job: blocked time per save, time to "
        "persist, the interval maximising goodput (Young/Daly), expected lost work per failure, "
        "restore time from storage and from peer memory, and goodput. Defaults describe Llama 3 "
        "405B on 16,384 H100s; see docs/plan.md for the model and its assumptions.",
    )
    model = p.add_argument_group("model and job")
    model.add_argument("--params", default="405B", help="parameters, e.g. 7B, 70B, 405e9")
    model.add_argument(
        "--weight-bytes-per-param",
        type=float,
        help=f"bytes of weights per parameter (default {d.weight_bytes_per_param:g})",
    )
    model.add_argument(
        "--optimizer-bytes-per-param",
        type=float,
        help="bytes of optimizer state per parameter "
        f"(default {d.optimizer_bytes_per_param:g}: Adam m, v, fp32 master)",
    )
    model.add_argument("--accelerators", type=int, help=f"accelerators (default {d.accelerators})")
    model.add_argument("--ranks-per-node", type=int, help=f"default {d.ranks_per_node}")
    model.add_argument(
        "--replicas",
        type=int,
        help="copies of the model state (HSDP replica groups; default 1: fully sharded); "
        "the plan shows what one writer per distinct chunk saves against every replica writing",
    )
    model.add_argument("--sync", action="store_true", help="saves block until durable")
    fail = p.add_argument_group("failures (default: Llama 3, 419 in 54 days on 16,384 GPUs)")
    fail.add_argument("--failures", type=float, help="failures observed ...")
    fail.add_argument("--failure-days", type=float, help="... in this many days ...")
    fail.add_argument("--failure-accelerators", type=int, help="... on this many accelerators")
    fail.add_argument("--mtbf-s", type=float, help="the job's mean time between failures")
    fail.add_argument(
        "--restart-s",
        type=float,
        help="detect + reschedule + init per failure (default "
        f"{d.restart_s:g}: {RESTART_SOURCE}, a fast recovery; 0 leaves restarts out)",
    )
    bw = p.add_argument_group("bandwidths (e.g. 2TB/s, 500GiB/s)")
    bw.add_argument(
        "--from-storage",
        action="append",
        default=[],
        metavar="JSON",
        help="`ckptbench storage --json` output to take write/read bandwidth from "
        "(repeatable: a burst run for writes, a read run for reads)",
    )
    bw.add_argument("--write-bw", help="aggregate storage write bandwidth (default 2TB/s)")
    bw.add_argument("--read-bw", help="aggregate storage read bandwidth (default 2TB/s)")
    bw.add_argument("--node-storage-bw", help="per-node bandwidth to storage (default 25GB/s)")
    bw.add_argument("--staging-bw", help="per-node device<->host bandwidth (default 100GB/s)")
    bw.add_argument("--peer-bw", help="per-node bandwidth to a peer's memory (default 50GB/s)")
    p.add_argument(
        "--blocked-overhead-s", type=float, help="fixed blocked time per save (default 0)"
    )
    p.add_argument("--interval-s", type=float, help="evaluate this interval, not the optimum")
    p.add_argument(
        "--max-write-duty",
        type=float,
        help="most of the time storage may spend writing checkpoints, 0-1 (default 1)",
    )
    tier = p.add_argument_group(
        "tiers (Checkpointer local_dir, peer_copies, durable_every)",
        "Goodput with and without tiers at Llama 3's failure rate and at an MTTF of 1.8 h for "
        f"16,384 GPUs ({CLUSTER_SOURCE}), each scaled per accelerator. A failure costs half "
        "the save interval of the tier restored from, the time a save takes to commit there, "
        "the restore and the restart: goodput = (1 - blocked/T) (1 - (T/2 + P + R + S) / MTBF), "
        "as the plan's own goodput. With tiers T is the save interval, P the staging and the "
        "peer copy, and R "
        "the slower of the local and peer restores (a node replaced); without, the job saves "
        "to durable storage only, every --durable-every saves (T = durable-every x the "
        "interval), P is the durable persist and R the durable restore.",
    )
    tier.add_argument(
        "--save-every-min",
        type=float,
        help="minutes between saves to the local tier and its peer copies (default: the "
        "plan's interval)",
    )
    tier.add_argument(
        "--durable-every",
        type=int,
        help=f"every this many saves also to durable storage (default {d.durable_every})",
    )
    tier.add_argument(
        "--local-restore-s",
        type=float,
        help="a node's restore from its own local tier (default: its shard to the devices at "
        "--staging-bw)",
    )
    tier.add_argument(
        "--peer-restore-s",
        type=float,
        help="a node's restore from a peer's copy (default: the restore from peer memory)",
    )
    tier.add_argument(
        "--durable-restore-s",
        type=float,
        help="a restore from durable storage (default: the restore from storage)",
    )
    req = p.add_argument_group(
        "request-bound floor on S3 (a save and a restore at --accelerators ranks)"
    )
    req.add_argument(
        "--scale-json",
        metavar="JSON",
        help="`ckptbench scale --json` output to take the requests per save and per rank from "
        "(default: the counts recorded in docs/BENCHMARKS.md)",
    )
    req.add_argument("--chunk-bytes", default="32MiB", help="chunk size (default 32MiB)")
    for flag, kind, default, text in (
        ("--s3-writes-per-prefix", float, request_floor.S3_WRITES_PER_PREFIX_S,
         "PUT/DELETE per second per prefix"),
        ("--s3-reads-per-prefix", float, request_floor.S3_READS_PER_PREFIX_S,
         "GET/HEAD/LIST per second per prefix"),
        ("--chunk-prefixes", int, request_floor.CHUNK_PREFIXES,
         "prefixes chunk keys spread over (chunks/<h[:2]>/)"),
        ("--index-prefixes", int, request_floor.CHUNK_PREFIXES,
         "prefixes rank indexes spread over (indexes/<x[:2]>/ since format version 2; "
         "1 for a version 1 store)"),
        ("--hot-prefixes", int, 1,
         "prefixes the coordinator's requests (lease, listings, manifest) spread over"),
    ):  # fmt: skip
        req.add_argument(flag, type=kind, default=default, help=f"{text} (default %(default)g)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)
    return p


def request_floor_from_args(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """The request-bound floor at the plan's accelerators (one rank each) and checkpoint size."""
    if args.scale_json:
        scale = load_json_object(args.scale_json, what="--scale-json file")
        counts = request_floor.counts_from_scale(scale, source=args.scale_json)
    else:
        counts = request_floor.RequestCounts()
    limits = request_floor.Limits(
        writes_per_prefix_s=args.s3_writes_per_prefix,
        reads_per_prefix_s=args.s3_reads_per_prefix,
        chunk_prefixes=args.chunk_prefixes,
        index_prefixes=args.index_prefixes,
        hot_prefixes=args.hot_prefixes,
    )
    return request_floor.floor(
        counts,
        limits,
        ranks=result["inputs"]["accelerators"],
        state_bytes=result["checkpoint_bytes"],
        chunk_bytes=parse_bytes(args.chunk_bytes, what="--chunk-bytes"),
    )


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    files = {path: apply_storage_json(values, sources, path) for path in args.from_storage}
    values["params"] = parse_count(args.params, what="--params")
    if args.params != "405B":
        sources["params"] = "flag"
    for name in _NUMBER_FLAGS:
        value = getattr(args, name)
        if value is not None:
            values[name] = value
            sources[name] = "flag"
    for flag, name in _RATE_FLAGS.items():
        text = getattr(args, flag)
        if text is not None:
            values[name] = parse_rate(text, what=f"--{flag.replace('_', '-')}")
            sources[name] = "flag"
    if args.sync:
        values["sync"] = True
    if args.save_every_min is not None:
        values["save_every_s"] = args.save_every_min * 60.0
        sources["save_every_s"] = "flag"
    for name in PlanInputs.__dataclass_fields__:
        if name not in ("sources", "warnings", "sync", "mtbf_s", "interval_s", "save_every_s"):
            sources.setdefault(name, "default")
    inputs = PlanInputs(**values, sources=sources)
    nodes = inputs.accelerators // inputs.ranks_per_node
    for path, obj in files.items():
        inputs.warnings += storage_json_warnings(obj, path, sources, nodes)
    return inputs


def print_table(result: dict[str, Any], out=None) -> None:
    out = out or sys.stdout
    i, src = result["inputs"], result["sources"]

    def s(name: str) -> str:
        return src.get(name, "")

    failures = (
        f"MTBF {format_seconds(i['mtbf_s'])}"
        if i["mtbf_s"]
        else f"{i['failures']:g} in {i['failure_days']:g} d on {i['failure_accelerators']}"
    )
    rows = [
        ["parameters", f"{i['params']:.4g}", s("params")],
        ["bytes/param (weights + optimizer)",
         f"{i['weight_bytes_per_param']:g} + {i['optimizer_bytes_per_param']:g}",
         s("weight_bytes_per_param")],
        ["accelerators / per node", f"{i['accelerators']} / {i['ranks_per_node']}",
         s("accelerators")],
        ["failures", failures, s("mtbf_s") or s("failures")],
        ["storage write / read", f"{_rate(i['write_bw_bytes_s'])} / "
         f"{_rate(i['read_bw_bytes_s'])}", f"{s('write_bw_bytes_s')} / {s('read_bw_bytes_s')}"],
        ["per node: storage / staging / peer",
         " / ".join(_rate(i[k]) for k in ("node_storage_bw_bytes_s", "staging_bw_bytes_s",
                                                 "peer_bw_bytes_s")),
         s("staging_bw_bytes_s")],
        ["restart per failure", format_seconds(i["restart_s"]),
         f"default ({RESTART_SOURCE})" if s("restart_s") == "default" else s("restart_s")],
    ]  # fmt: skip
    print("inputs", file=out)
    table(["input", "value", "from"], rows, out=out)
    r = result
    interval_note = {
        "daly": "Daly's optimum",
        "given": "given",
        "persist": "raised so that each save is durable before the next starts",
        "duty": f"raised to keep checkpoint writes under {i['max_write_duty']:.0%} of the time",
    }[r["interval_source"]]
    rows = [
        ["checkpoint size", _bytes(r["checkpoint_bytes"]),
         f"{_bytes(r['bytes_per_node'])} held per node x {r['nodes']} nodes"
         + (f" ({r['replicas']} replicas)" if r["replicas"] > 1 else "")],
        ["blocked per save", format_seconds(r["blocked_s"]),
         "synchronous" if i["sync"] else "staging to host memory"],
        ["time to persist", format_seconds(r["persist_s"]),
         f"write {format_seconds(r['write_s'])} after staging"],
        *([["sent per save", _bytes(r["bytes_sent_per_save"]),
            f"one writer per chunk of {r['replicas']} replicas; every replica writing: "
            f"{_bytes(r['every_replica_writes']['bytes_sent_per_save'])}, persist "
            f"{format_seconds(r['every_replica_writes']['persist_s'])}"]]
          if r["replicas"] > 1 else []),
        ["job MTBF", format_seconds(r["mtbf_s"]), f"{r['failures_per_day']:.3g} failures/day"],
        ["interval (Young)", format_seconds(r["young_interval_s"]), "sqrt(2 blocked MTBF)"],
        ["interval (Daly)", format_seconds(r["daly_interval_s"]), "higher-order"],
        ["interval used", format_seconds(r["interval_s"]), interval_note],
        ["persist fits in interval", "yes" if r["persist_fits"] else "NO",
         f"storage busy {r['storage_write_duty']:.1%} of the time"],
        ["checkpoints per day", f"{r['checkpoints_per_day']:.4g}",
         f"{_bytes(r['bytes_written_per_day'])}/day written"],
        ["lost work per failure", format_seconds(r["lost_work_per_failure_s"]),
         f"{format_seconds(r['lost_work_per_failure_peer_s'])} with a peer replica"],
        ["restore from storage", format_seconds(r["restore_from_storage_s"]), ""],
        ["restore from peer memory", format_seconds(r["restore_from_peer_s"]), ""],
        ["goodput (restore from storage)", f"{r['goodput']:.2%}",
         f"checkpoint efficiency {r['checkpoint_efficiency']:.2%}"],
        ["goodput (restore from peer)", f"{r['goodput_peer']:.2%}", ""],
    ]  # fmt: skip
    print("\nplan", file=out)
    table(["quantity", "value", "note"], rows, out=out)
    if not r["persist_fits"]:
        wanted = i["interval_s"] or r["daly_interval_s"]
        print(
            f"warning: persisting a save takes {format_seconds(r['persist_s'])}, longer than "
            f"the {format_seconds(wanted)} interval; planned with the persist time instead",
            file=out,
        )


def print_tiers(t: dict[str, Any], out=None) -> None:
    out = out or sys.stdout
    r = t["restore_s"]
    n = t["durable_every"]
    print(
        f"\ntiers: a save every {format_seconds(t['save_every_s'])} "
        f"({t['save_every_source']}) to the local tier and its peer copies, "
        f"{'every save' if n == 1 else f'one in {n}'} to durable storage (every "
        f"{format_seconds(t['durable_interval_s'])}); restore local {format_seconds(r['local'])}, "
        f"peer {format_seconds(r['peer'])}, durable {format_seconds(r['durable'])}; restart "
        f"{format_seconds(t['restart_s'])}; blocked {format_seconds(t['blocked_s'])} per save",
        file=out,
    )
    print(
        "goodput = (1 - blocked/T) (1 - (T/2 + P + R + S) / MTBF): T the save interval of the "
        "tier restored from, P the time a save takes to commit there, R its restore, S the "
        "restart; node replaced: R = the slower of local and peer restore; processes restarted "
        "(nodes kept): R = the local restore",
        file=out,
    )
    rows = []
    for rate in t["rates"]:
        rows.append(
            [rate["failure_rate"], format_seconds(rate["mtbf_s"]),
             f"{rate['without_tiers']['goodput']:.2%}", f"{rate['with_tiers']['goodput']:.2%}",
             f"{rate['with_tiers_local']['goodput']:.2%}", f"{rate['gain'] * 100:+.2f} pt"]
        )  # fmt: skip
    table(
        ["failure rate", "MTBF", "without tiers", "tiers (node replaced)",
         "tiers (processes restarted)", "gain"],
        rows,
        out=out,
    )  # fmt: skip


def print_request_floor(floor: dict[str, Any], out=None) -> None:
    out = out or sys.stdout
    rows = []
    for name in ("save", "restore"):
        f = floor[name]
        other = f["other_requests"]
        rows.append(
            [name, f"{f['chunk_requests']:,.0f}", f"{other['write']:,.0f} / {other['read']:,.0f}",
             format_seconds(f["floor_s"]), f["bound_by"]]
        )  # fmt: skip
    lim = floor["limits"]
    print(
        f"\nrequest-bound floor on S3: {floor['ranks']:,} ranks, {_bytes(floor['state_bytes'])} "
        f"in {floor['chunks']:,} chunks of {format_bytes(floor['chunk_bytes'])}; per prefix "
        f"{lim['writes_per_prefix_s']:g} writes/s and {lim['reads_per_prefix_s']:g} reads/s, "
        f"chunks over {lim['chunk_prefixes']} prefixes, indexes over {lim['index_prefixes']}, "
        f"the rest over {lim['hot_prefixes']} "
        f"(counts: {floor['counts']['source']})",
        file=out,
    )
    table(["", "chunk requests", "other writes / reads", "floor", "bound by"], rows, out=out)


def run(args: argparse.Namespace) -> int:
    result = plan(inputs_from_args(args))
    result["request_floor"] = request_floor_from_args(args, result)
    for warning in result["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        print_table(result)
        print_tiers(result["tiers"])
        print_request_floor(result["request_floor"])
    return 0
