"""``ckptbench recover``'s flags and the run they start: the report as JSON or as tables, and
exit status 1 when a restored state differs from the saved one, or the tiered load did not
read where the scenario put the copies (its figures would be another scenario's)."""

from __future__ import annotations

import argparse
import logging
import sys

from bench.recover.plan import DAMAGES, DEFAULT_BUCKET, FRONTENDS
from bench.recover.run import run_recover
from bench.recover.table import print_table
from bench.report import parse_bytes, print_json

logger = logging.getLogger("bench.recover")


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
        damage=args.damage,
        progress=logger.info,
    )
    if args.json:
        print_json(result)
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
    tiers = result["restore"]["tiers"]
    if not tiers["as_expected"]:  # its figures are another scenario's: durable reads, say
        print(
            "ckptbench recover: error: the tiered load did not read where the scenario put the "
            f"copies (sources by rank: {', '.join(map(str, tiers['sources']))}); were the saves "
            "committed to the local tier (a full or unwritable --local-root)? See the log above",
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
        "the job, wipe one node's local directory (--damage chunk: flip a byte in one chunk of "
        "each of its copies), and restore in a fresh job: time back to a "
        "loaded state and bytes per source (local, peer, durable) side by side with DCP's "
        "load of the same state from the durable store, and save() blocking with and without "
        "tiers. Every restored state is checked against the saved one. Works under a fresh "
        "ckptbench-recover-<random>/ directory of the durable store and deletes it. "
        "--frontend dcp does the same with dcp.async_save / dcp.load through ckptstore.dcp's "
        "StoreWriter(local_dir=, peer_copies=1, durable_every=1) and StoreReader(local_dir=), "
        "with and without tiers, beside DCP's own writer and reader (the wiped node's ranks "
        "load from their peers' copies).",
    )
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--frontend",
        choices=FRONTENDS,
        default="checkpointer",
        help="what saves and restores: Checkpointer (default), or dcp.async_save / dcp.load "
        "with ckptstore.dcp's StoreWriter / StoreReader",
    )
    p.add_argument(
        "--damage",
        choices=DAMAGES,
        default="node",
        help="before each restore round: wipe the last node's local directory (node, the "
        "default: its ranks restore their copies from peers), or flip one byte in one chunk "
        "of each of its ranks' copies (chunk: each reads that chunk alone from durable storage)",
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
