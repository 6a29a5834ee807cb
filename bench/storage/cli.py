"""``ckptbench storage``: its argument parser and the run it starts."""

from __future__ import annotations

import argparse
import os
import sys

from bench.faults import ALL_OPS, Faults, parse_latency
from bench.report import (
    check_output_file,
    parse_bytes,
    print_json,
)
from bench.storage.config import (
    DEFAULT_SIZES,
    MODES,
    StorageBenchConfig,
    parse_sizes,
)
from bench.storage.report import _require_matplotlib, plot, print_table
from bench.storage.run import StorageBench
from bench.storage.stats import failed_requests
from ckptstore.store import RetryPolicy


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "storage",
        help="load-generate against a store: steady put/get, checkpoint bursts, ranged reads",
        description="Load generator for any store ckptstore reaches (local path, memory://, "
        "s3://...), through the same storage layer the checkpointer uses. Works under a fresh "
        "ckptbench-<random>/ prefix and deletes what it wrote. Exit status 1 when a request "
        "failed that no injected fault explains (the figures then count only those that "
        "succeeded).",
    )
    p.add_argument(
        "--uri", required=True, help="store URI: a path, memory://..., s3://bucket/prefix"
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="steady",
        help="steady: mixed put/get; burst: all writers write a checkpoint at once while "
        "a background reader measures read latency; read: ranged gets (default steady)",
    )
    p.add_argument("--writers", type=int, help="concurrent writers (steady 4, burst 8)")
    p.add_argument("--readers", type=int, help="concurrent readers (steady 4, burst 1, read 4)")
    p.add_argument(
        "--sizes",
        help="object-size mix SIZE[:WEIGHT],... "
        f"(steady {DEFAULT_SIZES['steady']}; burst and read {DEFAULT_SIZES['burst']})",
    )
    p.add_argument("--count", type=int, help="steady/read: stop after this many requests")
    p.add_argument(
        "--duration-s",
        type=float,
        help="steady/read: stop after this long (default "
        "5 unless --count); burst: cap on the burst (default 30)",
    )
    p.add_argument(
        "--max-write-bytes",
        default="512MiB",
        help="steady: stop after writing this much (default 512MiB)",
    )
    p.add_argument(
        "--checkpoint-bytes",
        default="32MiB",
        help="burst: bytes each writer writes (default 32MiB)",
    )
    p.add_argument("--queue-depth", type=int, default=4, help="burst: puts in flight per writer")
    p.add_argument(
        "--read-bytes", help="burst: background read size (4KiB); read: range size (1MiB)"
    )
    p.add_argument(
        "--read-interval-s",
        type=float,
        default=0.002,
        help="burst: pause between background reads (default 0.002)",
    )
    p.add_argument("--baseline-s", type=float, default=1.0, help="burst: reads before the burst")
    p.add_argument("--after-s", type=float, default=1.0, help="burst: reads after the burst")
    p.add_argument(
        "--objects",
        type=int,
        default=16,
        help="read: objects to write and read; burst: small objects read in background",
    )
    p.add_argument(
        "--read-prefix",
        help="read: read the existing objects under this prefix (nothing is written or deleted)",
    )
    faults = p.add_argument_group("fault injection (into the store under test)")
    faults.add_argument(
        "--latency",
        default="none",
        help="added latency per request: none, fixed:S or lognormal:MEDIAN_S[:SIGMA] (seconds)",
    )
    faults.add_argument(
        "--error-rate",
        type=float,
        default=0.0,
        help="fraction of requests failing with a transient error (default 0)",
    )
    faults.add_argument(
        "--slow-rate", type=float, default=0.0, help="fraction of slow requests (default 0)"
    )
    faults.add_argument(
        "--slow-factor",
        type=float,
        default=20.0,
        help="a slow request takes this many times the median latency",
    )
    faults.add_argument(
        "--hang-rate", type=float, default=0.0, help="fraction of requests that hang (default 0)"
    )
    faults.add_argument(
        "--hang-s", type=float, default=3600.0, help="how long a hang lasts (default 3600)"
    )
    faults.add_argument(
        "--fault-ops", default="put,get", help="operations faults apply to (default put,get)"
    )
    retry = p.add_argument_group("retries")
    retry.add_argument(
        "--attempts",
        type=int,
        default=RetryPolicy.attempts,
        help="attempts per request of the run (default %(default)s; the check that the store "
        "is usable, before the run, takes the store's default: up to 30 s a request, retries "
        "included)",
    )
    retry.add_argument(
        "--timeout-s",
        type=float,
        default=RetryPolicy.timeout_s,
        help="deadline of one attempt of a request of the run (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, help="seed for sizes, keys and faults (default: a random one)"
    )
    p.add_argument("--keep", action="store_true", help="do not delete what the bench wrote")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write latency CDFs (and the burst timeline) here")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> StorageBenchConfig:
    latency = parse_latency(args.latency)
    fault_ops = frozenset(op.strip() for op in args.fault_ops.split(",") if op.strip())
    unknown = fault_ops - ALL_OPS
    if unknown:
        raise ValueError(f"--fault-ops: unknown operations {sorted(unknown)}")
    for name in ("error_rate", "slow_rate", "hang_rate"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be within 0 and 1, got {value}")
    if args.hang_s <= 0 or args.slow_factor < 0:
        raise ValueError("--hang-s must be > 0 and --slow-factor >= 0")
    inject = latency is not None or args.error_rate or args.slow_rate or args.hang_rate
    faults = (
        Faults(
            latency=latency,
            error_rate=args.error_rate,
            slow_rate=args.slow_rate,
            slow_factor=args.slow_factor,
            hang_rate=args.hang_rate,
            hang_s=args.hang_s,
            ops=fault_ops,
            seed=args.seed,
        )
        if inject
        else None
    )
    return StorageBenchConfig(
        uri=args.uri,
        mode=args.mode,
        writers=args.writers,
        readers=args.readers,
        sizes=parse_sizes(args.sizes) if args.sizes else None,
        count=args.count,
        duration_s=args.duration_s,
        max_write_bytes=parse_bytes(args.max_write_bytes, what="--max-write-bytes"),
        checkpoint_bytes=parse_bytes(args.checkpoint_bytes, what="--checkpoint-bytes"),
        queue_depth=args.queue_depth,
        read_bytes=parse_bytes(args.read_bytes, what="--read-bytes") if args.read_bytes else None,
        read_interval_s=args.read_interval_s,
        baseline_s=args.baseline_s,
        after_s=args.after_s,
        objects=args.objects,
        read_prefix=args.read_prefix,
        faults=faults,
        retry=RetryPolicy(attempts=args.attempts, timeout_s=args.timeout_s),
        seed=args.seed,
        keep=args.keep,
        progress=sys.stderr.isatty(),
        verbose_retries=getattr(args, "verbose", False),
    )


def _first_missing(uri: str) -> str | None:
    """For a local ``uri`` that does not exist, the first directory of it the run makes (said
    on stderr: a mistyped mount point would be measured on the disk it lands on)."""
    if "://" in uri and not uri.startswith("file://"):
        return None
    path = os.path.abspath(uri.removeprefix("file://"))
    if os.path.exists(path):
        return None
    first = path
    while not os.path.exists(os.path.dirname(first)):
        first = os.path.dirname(first)
    print(
        f"note: --uri {uri} does not exist: made for this run, removed after it unless --keep (a "
        "mistyped mount point measures the disk it lands on)",
        file=sys.stderr,
    )
    return first


def _remove_made(first: str, uri: str) -> None:
    """Remove the directories the run made for ``uri`` (what the run wrote is gone already),
    from the deepest up to ``first``; a directory not empty stays."""
    path = os.path.abspath(uri.removeprefix("file://"))
    while True:
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == first:
            return
        path = os.path.dirname(path)


def run(args: argparse.Namespace) -> int:
    if args.plot:  # fail before the run, not after it
        check_output_file(args.plot, flag="--plot")
    config = config_from_args(args)
    if args.plot:
        _require_matplotlib()
    bench = StorageBench(config)  # a --uri refused is refused before the note of one made
    made = _first_missing(args.uri)
    try:
        result = bench.run()
    finally:
        if made is not None:
            _remove_made(made, args.uri)
    if args.plot:
        plot(bench, result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print_json(result)
    else:
        print_table(result)
        if args.plot:
            print(f"plot: {args.plot}")
    # A kind of request that never once succeeded measured nothing (a burst whose every put
    # failed on a full disk beside reads that worked): the run failed.
    failed = [
        op
        for op in ("put", "get")
        if op in result and not result[op]["ops"] and result[op]["errors"]
    ]
    if failed:
        what = "every request" if len(failed) == 2 else f"every {failed[0]}"
        first = result[failed[0]].get("first_error")
        print(f"ckptbench storage: error: {what} failed, first: {first}", file=sys.stderr)
        return 1
    # Without injected faults a request that failed is the store failing (a disk that filled
    # mid-burst): the figures count only the requests that landed, and the run says so.
    failed = failed_requests(result)
    if failed and config.faults is None:
        print(
            f"ckptbench storage: error: {failed}; the figures above count only the requests "
            "that succeeded",
            file=sys.stderr,
        )
        return 1
    return 0
