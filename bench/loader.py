"""``ckptbench loader``: read latency of the data loader, healthy and under injected storage
faults, unhedged and hedged (the same dataset, four runs in one process) and, with
``--throughput``, delivered bytes/s of token files, MDS and WebDataset shards against a raw
sequential read of the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import statistics
import struct
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench._ckpt_common import drop_page_cache
from bench.faults import Faults, parse_latency, with_faults
from bench.report import check_directory, format_rate, format_seconds, print_json, table
from bench.storage.stats import retry_records
from ckptstore.store import Store
from loaders import MDS, LoaderConfig, ReplicaConfig, ShardDataset, TokenFiles, WebDataset
from loaders.replicas import replica_retry_policy

logger = logging.getLogger(__name__)

SAMPLE_TOKENS = 2048
MODES = ("healthy", "healthy_hedged", "unhedged", "hedged")
"""Runs of one latency bench: no faults unhedged (the reference) and hedged (what hedging costs
when nothing is wrong), then the faults unhedged and hedged."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "loader",
        help="loader read latency, healthy and under faults, unhedged and hedged; throughput",
        description="Reads a generated token dataset from several replicas with injected "
        "latency and faults, four ways in one run: all healthy (unhedged, then hedged), and "
        "with the faults unhedged, then hedged.",
    )
    p.add_argument("--replicas", type=int, default=3, help="replicas of the dataset")
    p.add_argument(
        "--latency",
        default="lognormal:0.01:0.5",
        help="per-read latency: none, fixed:S or lognormal:MEDIAN_S[:SIGMA]",
    )
    p.add_argument(
        "--slow-rate",
        type=float,
        default=0.05,
        help="fraction of each replica's reads delayed",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=20.0,
        help="a delayed read takes this many times the median more",
    )
    p.add_argument(
        "--slow-replica",
        type=int,
        default=None,
        metavar="I",
        help="replica I delays every one of its reads",
    )
    p.add_argument("--error-rate", type=float, default=0.0, help="fraction of reads that fail (0)")
    p.add_argument("--hang-rate", type=float, default=0.0, help="fraction of reads that hang (0)")
    p.add_argument("--reads", type=int, default=4000, help="reads, one 4 KiB sample each")
    p.add_argument("--concurrency", type=int, default=16, help="reads in flight")
    p.add_argument("--hedge-budget", type=float, default=0.1, help="hedges per read")
    p.add_argument(
        "--attempt-timeout",
        type=float,
        default=1.0,
        help="deadline of one attempt in seconds",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the data and of the faults (default 0)"
    )
    p.add_argument(
        "--throughput",
        action="store_true",
        help="instead: delivered bytes/s of token files, MDS and WebDataset "
        "against a raw sequential read, from local files",
    )
    p.add_argument(
        "--size-mib",
        type=int,
        default=256,
        help="token data for --throughput, MiB, at least 4 (default 256; MDS and tar get a quarter)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per --throughput case (median)")
    p.add_argument(
        "--cache",
        choices=("warm", "cold", "both"),
        default="both",
        help="--throughput from the page cache (warm), from the disk (cold: every file's cached "
        "pages are dropped before each case), or both (default)",
    )
    p.add_argument("--dir", default=None, help="where --throughput writes its files (a tmp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dir is not None:
        check_directory(args.dir, flag="--dir")
    if args.throughput:
        result = throughput(args)
        if args.json:
            print_json(result)
        else:
            rows = [
                (
                    cache,
                    name,
                    format_rate(r["bytes_per_s"]),
                    f"{r['samples_per_s']:.0f}",
                    f"{r['vs_raw']:.2f}",
                )
                for cache, cases in result["cache"].items()
                for name, r in cases.items()
            ]
            table(["cache", "case", "delivered", "samples/s", "vs raw"], rows)
        return 0
    # The per-event warnings of injected faults are held back for the whole run, output
    # included: a hedge's loser can still fail after the reads are done.
    with _held_back_fault_warnings(getattr(args, "verbose", False)) as held:
        return _run_latency(args, held)


def _run_latency(args: argparse.Namespace, held: dict[str, int]) -> int:
    result = latency(args)
    result["held_back_warnings"] = dict(held)
    if args.json:
        print_json(result)
    else:
        rows = [
            (
                mode,
                format_seconds(r["p50_s"]),
                format_seconds(r["p99_s"]),
                format_seconds(r["p999_s"]),
                r["requests"],
                f"{100 * r['extra_requests']:.1f}%",
                f"{r['samples_per_s']:.0f}",
            )
            for mode, r in result.items()
            if isinstance(r, dict) and "p50_s" in r
        ]
        table(["mode", "p50", "p99", "p99.9", "requests", "extra", "samples/s"], rows)
        print(
            f"hedged p99 / unhedged p99 = {result['hedged_vs_unhedged_p99']:.3f}, "
            f"hedged p99 / healthy p99 = {result['hedged_vs_healthy_p99']:.3f}"
        )
    summary = fault_summary(result, held, verbose=getattr(args, "verbose", False))
    if summary:
        print(summary, file=sys.stderr)
    return 0


def fault_summary(
    result: dict[str, Any], held: dict[str, int], *, verbose: bool = False
) -> str | None:
    """One line of the errors, hangs and slow reads injected per run, and of the failed attempts and
    replica benchings they caused (whose one warning each is held back unless -v), from the
    bench's own counters; None when no fault was injected and none failed."""
    modes = [
        f"{mode} {f['errors']} injected errors, {f['hangs']} hangs, {f.get('slow', 0)} slow reads"
        for mode in ("unhedged", "hedged")
        if (f := result.get(mode, {}).get("faults"))
        and (f["errors"] or f["hangs"] or f.get("slow"))
    ]
    if not modes and not held["failed_attempts"] and not held["benched"]:
        return None
    shown = "shown above" if verbose else "one warning each with -v"
    return (
        "ckptbench loader: faults: "
        + ("; ".join(modes) or "none injected")
        + f"; {held['failed_attempts']} failed attempts (retried or failed over), "
        + f"{held['benched']} replica benchings ({shown})"
    )


# -- latency under faults -------------------------------------------------------------------


def _check(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.reads < 1 or args.concurrency < 1:
        raise ValueError("--reads and --concurrency must be >= 1")
    if args.slow_replica is not None and not 0 <= args.slow_replica < args.replicas:
        raise ValueError(
            f"--slow-replica {args.slow_replica} is not one of the {args.replicas} replicas"
        )
    for name in ("slow_rate", "error_rate", "hang_rate"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be within [0, 1]")


@contextlib.contextmanager
def _held_back_fault_warnings(show: bool) -> Iterator[dict[str, int]]:
    """Count, and unless ``show`` drop, the records each injected fault causes: one per failed
    attempt (the store's, marked ``ckptstore_retry``, and the replica set's warning for a read
    attempt given up at its deadline) and the replica set's warning per replica benched. The
    run reports the totals instead of hundreds of lines."""
    counts = {"failed_attempts": 0, "benched": 0}
    lock = threading.Lock()

    def counted(name: str) -> None:
        with lock:
            counts[name] += 1

    def replicas_filter(record: logging.LogRecord) -> bool:
        timeout = getattr(record, "loaders_attempt_timeout", False)
        if not timeout and not str(record.msg).startswith("replica %s benched"):
            return True
        counted("failed_attempts" if timeout else "benched")
        return show

    replicas = logging.getLogger("loaders.replicas")
    replicas.addFilter(replicas_filter)
    try:
        with retry_records(show, lambda: counted("failed_attempts")):
            yield counts
    finally:
        replicas.removeFilter(replicas_filter)


def latency(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    dist = parse_latency(args.latency)
    base = f"memory://ckptbench-loader-{uuid.uuid4().hex[:10]}"
    data = (
        np.random.default_rng(args.seed)
        .integers(0, 50_000, args.reads * SAMPLE_TOKENS, dtype=np.uint16)
        .tobytes()
    )
    uris = [f"{base}/r{i}" for i in range(args.replicas)]
    for uri in uris:
        store = Store(uri)
        store.put("tokens.bin", data)
        # fsspec's memory file shares the bytes it was given until its first read, which copies
        # them all (~6 ms for 8 MiB, holding the GIL): done here, not in the first timed read.
        store.get("tokens.bin", 0, 1)
    out: dict[str, Any] = {
        "scenario": {
            "replicas": args.replicas,
            "latency": args.latency,
            "slow_rate": args.slow_rate,
            "slow_factor": args.slow_factor,
            "slow_replica": args.slow_replica,
            "error_rate": args.error_rate,
            "hang_rate": args.hang_rate,
            "reads": args.reads,
            "concurrency": args.concurrency,
            "hedge_budget": args.hedge_budget,
        }
    }
    for mode in MODES:
        # The heap (numpy, torch and the data, a few hundred thousand objects) leaves the
        # cyclic GC's view first, so that a full collection, ~90 ms on the 2-core VM, does not
        # stall whichever run it lands in.
        gc.collect()
        gc.freeze()
        try:
            out[mode] = _latency_run(args, uris, dist, mode)
        finally:
            gc.unfreeze()
        logger.info("loader bench %s: %s", mode, out[mode])
    out["hedged_vs_unhedged_p99"] = out["hedged"]["p99_s"] / max(out["unhedged"]["p99_s"], 1e-9)
    out["hedged_vs_healthy_p99"] = out["hedged"]["p99_s"] / max(out["healthy"]["p99_s"], 1e-9)
    return out


def _latency_run(args: argparse.Namespace, uris: list[str], dist: Any, mode: str) -> dict:
    healthy = mode.startswith("healthy")
    config = ReplicaConfig(
        hedge=mode in ("hedged", "healthy_hedged"),
        hedge_budget=args.hedge_budget,
        attempt_timeout_s=args.attempt_timeout,
        read_deadline_s=30.0,
        verify_replicas=False,
    )
    stores, all_faults = [], []
    for i, uri in enumerate(uris):
        slow_rate = 0.0 if healthy else (1.0 if i == args.slow_replica else args.slow_rate)
        faults = Faults(
            latency=dist,
            slow_rate=slow_rate,
            slow_factor=args.slow_factor,
            error_rate=0.0 if healthy else args.error_rate,
            hang_rate=0.0 if healthy else args.hang_rate,
            hang_s=60.0,
            ops=frozenset({"get"}),
            seed=args.seed * 1000 + i,
        )
        all_faults.append(faults)
        stores.append(with_faults(Store(uri, retry=replica_retry_policy(config)), faults))
    loader_config = LoaderConfig(
        seed=args.seed, shuffle_block_units=64, window_reads=args.concurrency, log_interval_s=0
    )
    fmt = TokenFiles(
        files=["tokens.bin"], sample_tokens=SAMPLE_TOKENS, read_bytes=SAMPLE_TOKENS * 2
    )
    try:
        ds = ShardDataset(stores, fmt, config=loader_config, replica_config=config)
        # Requests at open (the first file's head) are not reads of samples.
        opening = sum(f.counts["requests"] for f in all_faults)
        t0 = time.perf_counter()
        samples = sum(1 for _ in ds)
        elapsed = time.perf_counter() - t0
    finally:
        for f in all_faults:
            f.release()
    m = ds.metrics()
    reads = m["reads"]["reads"]
    requests = sum(r["requests"] for r in m["replicas"].values())
    get_requests = sum(f.counts["requests"] for f in all_faults) - opening
    lat = ds.replicas.stats.latency.summary()
    return {
        "p50_s": lat["p50_s"],
        "p99_s": lat["p99_s"],
        "p999_s": lat["p999_s"],
        "max_s": lat["max_s"],
        "reads": reads,
        "requests": get_requests,
        "extra_requests": (get_requests - reads) / max(reads, 1),
        "hedges": m["reads"]["hedges"],
        "hedges_won": sum(r["hedges_won"] for r in m["replicas"].values()),
        "failovers": m["reads"]["failovers"],
        "all_requests": requests,
        "samples_per_s": samples / elapsed,
        "consumer_wait_s": m["consumer"]["wait_s"],
        "hedge_delay_s": m["hedge_delay_s"],
        "faults": {
            "errors": sum(f.counts["errors"] for f in all_faults),
            "hangs": sum(f.counts["hangs"] for f in all_faults),
            "slow": sum(f.counts["slow"] for f in all_faults),
        },
        "per_replica": {
            uri.rsplit("/", 1)[-1]: {
                "requests": r["requests"],
                "wins": r["wins"],
                "p99_s": r["p99_s"],
            }
            for uri, r in m["replicas"].items()
        },
    }


# -- throughput from local files ------------------------------------------------------------


def _write_mds(root: str, samples: np.ndarray, per_shard: int) -> None:
    """MDS v2 shards of one fixed-size ``ndarray:uint16:2048`` column, with xxh64 hashes."""
    import xxhash

    os.makedirs(root, exist_ok=True)
    shards = []
    for s, lo in enumerate(range(0, len(samples), per_shard)):
        chunk = samples[lo : lo + per_shard]
        head = 4 + 4 * (len(chunk) + 1)
        offsets = head + np.arange(len(chunk) + 1, dtype=np.int64) * chunk.shape[1] * 2
        blob = struct.pack("<I", len(chunk)) + offsets.astype("<u4").tobytes() + chunk.tobytes()
        name = f"shard.{s:05d}.mds"
        with open(os.path.join(root, name), "wb") as f:
            f.write(blob)
        shards.append(
            {
                "column_encodings": [f"ndarray:uint16:{chunk.shape[1]}"],
                "column_names": ["tokens"],
                "column_sizes": [chunk.shape[1] * 2],
                "compression": None,
                "format": "mds",
                "hashes": ["xxh64"],
                "raw_data": {
                    "basename": name,
                    "bytes": len(blob),
                    "hashes": {"xxh64": xxhash.xxh64(blob).hexdigest()},
                },
                "samples": len(chunk),
                "size_limit": 1 << 26,
                "version": 2,
                "zip_data": None,
            }
        )
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump({"shards": shards, "version": 2}, f)


def _write_tar(root: str, samples: np.ndarray, per_shard: int) -> None:
    os.makedirs(root, exist_ok=True)
    for s, lo in enumerate(range(0, len(samples), per_shard)):
        with tarfile.open(os.path.join(root, f"shard-{s:05d}.tar"), "w") as tar:
            for i in range(lo, min(lo + per_shard, len(samples))):
                data = samples[i].tobytes()
                info = tarfile.TarInfo(f"{i:09d}.tokens.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _raw_read(root: str, keys: list[str], chunk: int = 8 << 20) -> int:
    store = Store(root)
    total = 0
    for key in keys:
        size = store.size(key)
        for lo in range(0, size, chunk):
            total += len(store.get(key, lo, min(size, lo + chunk)))
    return total


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    if args.size_mib < 4 or args.repeat < 1:
        raise ValueError("--size-mib must be >= 4 and --repeat >= 1")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckptbench-loader-") as tmp:
        rng = np.random.default_rng(args.seed)
        n_files = 4
        per_file = args.size_mib * 2**20 // n_files // (SAMPLE_TOKENS * 2)
        tok_root = os.path.join(tmp, "tokens")
        os.makedirs(tok_root)
        keys = []
        for f in range(n_files):
            rng.integers(0, 50_000, per_file * SAMPLE_TOKENS, dtype=np.uint16).tofile(
                os.path.join(tok_root, f"part{f}.bin")
            )
            keys.append(f"part{f}.bin")
        small = rng.integers(0, 50_000, (per_file * n_files // 4, SAMPLE_TOKENS), dtype=np.uint16)
        _write_mds(os.path.join(tmp, "mds"), small, per_shard=1024)
        _write_tar(os.path.join(tmp, "wds"), small, per_shard=1024)
        token_bytes = per_file * n_files * SAMPLE_TOKENS * 2
        cases = {
            "raw sequential read": lambda: (_raw_read(tok_root, keys), 0),
            "tokens, in order, batches of 64": lambda: _tokens(tok_root, False),
            "tokens, shuffled, batches of 64": lambda: _tokens(tok_root, True),
            "MDS (xxh64 verified), samples": lambda: _samples(os.path.join(tmp, "mds"), MDS()),
            "WebDataset tar, samples": lambda: _samples(os.path.join(tmp, "wds"), WebDataset()),
        }
        caches = ["warm", "cold"] if args.cache == "both" else [args.cache]
        return {
            "token_bytes": token_bytes,
            "sample_bytes": SAMPLE_TOKENS * 2,
            "repeat": args.repeat,
            "cache": {cache: _measure(cases, tmp, args.repeat, cache) for cache in caches},
        }


def _measure(cases: dict[str, Any], root: str, repeat: int, cache: str) -> dict[str, Any]:
    """Each case ``repeat`` times, interleaved so that drift hits every case alike; medians."""
    runs: dict[str, list[tuple[float, int, int]]] = {k: [] for k in cases}
    if cache == "warm":
        for fn in cases.values():
            fn()  # read everything once, so that the page cache holds what it can
    for _ in range(repeat):
        for name, fn in cases.items():
            if cache == "cold":
                drop_page_cache(root)
            t0 = time.perf_counter()
            nbytes, nsamples = fn()
            runs[name].append((time.perf_counter() - t0, nbytes, nsamples))
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        seconds = statistics.median(r[0] for r in rs)
        nbytes, nsamples = rs[0][1], rs[0][2] or rs[0][1] // (SAMPLE_TOKENS * 2)
        out[name] = {
            "seconds": seconds,
            "bytes": nbytes,
            "bytes_per_s": nbytes / seconds,
            "samples_per_s": nsamples / seconds,
        }
    raw = out["raw sequential read"]["bytes_per_s"]
    for r in out.values():
        r["vs_raw"] = r["bytes_per_s"] / raw
    return out


def _tokens(root: str, shuffle: bool) -> tuple[int, int]:
    config = LoaderConfig(
        shuffle=shuffle,
        shuffle_block_units=4,
        window_reads=4,
        window_bytes=64 << 20,
        log_interval_s=0,
    )
    ds = ShardDataset(
        root, TokenFiles(sample_tokens=SAMPLE_TOKENS, read_bytes=4 << 20), config=config
    )
    nbytes = nsamples = 0
    for batch in ds.iter_batches(64):
        nbytes += batch["tokens"].nbytes
        nsamples += len(batch["__index__"])
    return nbytes, nsamples


def _samples(root: str, fmt: Any) -> tuple[int, int]:
    config = LoaderConfig(
        shuffle=True, shuffle_block_units=4, window_reads=4, window_bytes=64 << 20, log_interval_s=0
    )
    ds = ShardDataset(root, fmt, config=config)
    nbytes = nsamples = 0
    for sample in ds:
        value = sample.get("tokens", sample.get("tokens.bin"))
        nbytes += len(value) if isinstance(value, bytes) else value.nbytes
        nsamples += 1
    return nbytes, nsamples
