"""``ckptbench scale``: many ranks on one machine, each saving a small state a few times and
restoring it once, counting requests by kind at each rank's store (``StoreCounters``, summed
over ranks) and timing the coordinator's own work per save (its lease and listings, the
exchanges with the other ranks, the manifest and its commit; ``bench._scale_rank``).

Ranks run as processes on gloo (as many as the machine's memory allows: each holds a torch) or,
with ``--threads``, as threads of one process (``bench._thread_ranks``), which reaches 1,024.
The growth of the coordinator's time and of the requests per rank with the rank count is fitted
as ``y ~ ranks^k`` by least squares on their logarithms; ``ckptbench plan --scale-json`` turns
the request counts into the request-bound floor of a save and a restore at 16,384 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bench._ckpt_common import Workspace, host_info, now_iso
from bench._gloo import free_port, run_ranks
from bench._scale_rank import PHASES, PhaseTimes, RankPlan, process_main, run_rank
from bench._thread_ranks import CollectiveCall, ThreadWorld
from bench.report import format_bytes, format_seconds, parse_bytes, print_json, table
from ckptstore.catalog import list_steps
from ckptstore.cli.parser import _storage_option
from ckptstore.cli.signals import raise_if_stopped
from ckptstore.format import commit_key
from ckptstore.store import Store

MAX_PROCESSES = 16
RANKS_TIMEOUT_S = 1800  # one rank count's saves and restores; a rank stuck past it fails the run
"""Most ranks run as processes (each imports torch: ~0.3 GB); more need --threads."""
HEAD_OPS = ("size", "exists", "modified")
Received = Callable[[], dict[str, int]]
"""What the bench's own S3 server received so far: ``puts``, ``put_bytes``, ``chunk_put_bytes``."""
"""Store operations that are HEAD requests on S3."""
BUCKET = "ckptbench-scale"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "scale",
        help="requests and coordinator time per save as the rank count grows",
        description="Run N ranks on this machine (processes on gloo, or threads with "
        "--threads), each saving a small fresh state --saves times and restoring it once; "
        "print per rank count the requests by kind (summed over the ranks' stores), the "
        "coordinator's time per save (lease, listings, exchanges, manifest, commit) and the "
        "growth of both fitted as ranks^k.",
    )
    p.add_argument(
        "--ranks",
        default="1,2,4,8",
        help="comma-separated rank counts (default 1,2,4,8); above "
        f"{MAX_PROCESSES} needs --threads",
    )
    p.add_argument("--threads", action="store_true", help="ranks as threads of one process")
    p.add_argument(
        "--uri",
        help="the store: a local directory or s3://bucket/prefix (default: a moto S3 server "
        "started on 127.0.0.1); the bench works under <uri>/ckptbench-scale-<random>/ and "
        "deletes it",
    )
    p.add_argument(
        "--storage-option",
        "-o",
        dest="storage_options",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help="fsspec storage option for --uri, e.g. endpoint_url=http://127.0.0.1:9000 "
        "(repeatable)",
    )
    p.add_argument("--state-bytes", default="256KiB", help="state of each rank (default 256KiB)")
    p.add_argument("--chunk-bytes", default="64KiB", help="chunk size (default 64KiB)")
    p.add_argument("--saves", type=int, default=3, help="saves per rank count (default 3)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="each state is held alike by R consecutive ranks, as data-parallel replicas "
        "(default 1: every rank's state is its own); the bytes sent per distinct byte show "
        "how often a replicated chunk crosses the wire",
    )
    p.add_argument(
        "--compression",
        choices=("none", "zstd", "auto"),
        default="none",
        help="chunk encoding (default none: the requests are the subject)",
    )
    p.add_argument(
        "--every-rank-writes",
        action="store_true",
        help="the baseline: each rank puts every chunk it holds, as before ranks agreed on one "
        "writer per distinct chunk (processes only)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run every rank count twice in one invocation, against one store (its S3 server "
        "counting both): with one writer per distinct chunk, then with every rank writing (the "
        "baseline, in the JSON as 'baseline'), and print the two side by side (processes only)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)
    return p


def parse_ranks(text: str, *, threads: bool) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"bad --ranks {text!r}: expected comma-separated counts") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"bad --ranks {text!r}: counts must be 1 or more")
    if not threads and counts[-1] > MAX_PROCESSES:
        raise ValueError(
            f"--ranks {counts[-1]}: at most {MAX_PROCESSES} ranks run as processes here; "
            "add --threads"
        )
    return counts


def run(args: argparse.Namespace) -> int:
    counts = parse_ranks(args.ranks, threads=args.threads)
    state_bytes = parse_bytes(args.state_bytes, what="--state-bytes")
    chunk_bytes = parse_bytes(args.chunk_bytes, what="--chunk-bytes")
    if state_bytes < 4 or chunk_bytes < 1:
        raise ValueError("--state-bytes must be 4 or more and --chunk-bytes 1 or more")
    if args.saves < 1:
        raise ValueError(f"bad --saves {args.saves}: must be at least 1")
    options = dict(args.storage_options) or None
    if args.replicas < 1:
        raise ValueError(f"bad --replicas {args.replicas}: must be at least 1")
    if args.threads and (args.every_rank_writes or args.replicas > 1 or args.compare):
        raise ValueError(
            "--replicas, --every-rank-writes and --compare run ranks as processes (replicas "
            "restore by point-to-point sends, which thread ranks do not serve): leave out "
            "--threads"
        )
    if args.compare and args.every_rank_writes:
        raise ValueError("--compare runs the baseline itself: leave out --every-rank-writes")
    with store_under_test(args.uri) as (uri, store_kind, received):
        settings = dict(
            uri=uri,
            storage_options=options,
            threads=args.threads,
            state_bytes=state_bytes,
            chunk_bytes=chunk_bytes,
            saves=args.saves,
            replicas=args.replicas,
            compression=args.compression,
            received=received,
        )
        result = scale(counts, every_rank_writes=args.every_rank_writes, **settings)
        if args.compare:
            result["baseline"] = scale(counts, every_rank_writes=True, **settings)
    result["store"] = store_kind
    if args.json:
        print_json(result)
    else:
        print_tables(result)
        if args.compare:
            print_comparison(result)
    return 0


def scale(
    counts: list[int],
    *,
    uri: str,
    storage_options: dict[str, Any] | None = None,
    threads: bool,
    state_bytes: int,
    chunk_bytes: int,
    saves: int,
    replicas: int = 1,
    every_rank_writes: bool = False,
    compression: str = "none",
    received: Received | None = None,
) -> dict[str, Any]:
    """Every rank count in ``counts`` run against a fresh directory under ``uri``; each state
    held alike by ``replicas`` consecutive ranks. ``received``: what the store's server
    received so far (counted before and after each rank count)."""
    runs = []
    with Workspace(uri, command="scale", storage_options=storage_options) as ws:
        for n in counts:
            plan = RankPlan(
                uri=ws.child(f"ranks-{n}"),
                storage_options=storage_options,
                state_bytes=state_bytes,
                chunk_bytes=chunk_bytes,
                saves=saves,
                replicas=replicas,
                every_rank_writes=every_rank_writes,
                compression=compression,
            )
            before = received() if received is not None else None
            reports = _run_threads(plan, n) if threads else _run_processes(plan, n)
            run = summarize(plan, reports)
            if received is not None and before is not None:
                after = received()
                got = {k: after[k] - before[k] for k in after}
                run["server_received"] = got
                run["server_put_bytes_per_distinct_byte"] = got["put_bytes"] / (
                    run["distinct_bytes_per_save"] * saves
                )
            runs.append(run)
    nbytes = state_bytes // 4 * 4
    return {
        "bench": "scale",
        "date": now_iso(),
        "mode": "threads" if threads else "processes",
        "state_bytes_per_rank": nbytes,
        "chunk_bytes": chunk_bytes,
        "chunks_per_rank": math.ceil(nbytes / chunk_bytes),
        "saves": saves,
        "replicas": replicas,
        "every_rank_writes": every_rank_writes,
        "compression": compression,
        "host": host_info(),
        "runs": runs,
        "growth": {
            "coordinator_s": growth_exponent(
                [r["ranks"] for r in runs], [r["coordinator_s"] for r in runs]
            ),
            "requests_per_rank": growth_exponent(
                [r["ranks"] for r in runs], [r["save_requests_per_rank"] for r in runs]
            ),
        },
    }


# -- running ranks ------------------------------------------------------------------------------


def _run_threads(plan: RankPlan, n: int) -> list[dict[str, Any]]:
    world = ThreadWorld(n)
    phases = PhaseTimes()

    def rank_main(rank: int) -> dict[str, Any]:
        return run_rank(plan, rank, world.barrier)

    with phases.timing():
        reports = world.run(rank_main)
    for rank, report in enumerate(reports):
        report["calls"] = world.calls[rank]
    reports[0]["phases"] = phases.by_step
    return reports


def _run_processes(plan: RankPlan, n: int) -> list[dict[str, Any]]:
    reports = run_ranks(
        process_main, (plan, n, free_port()), n, what=f"run of {n} ranks", timeout_s=RANKS_TIMEOUT_S
    )
    for report in reports:
        report["calls"] = [CollectiveCall(**c) for c in report["calls"]]
        report["phases"] = {int(step): p for step, p in report["phases"].items()}
    return reports


# -- what the ranks reported ------------------------------------------------------------------


def summarize(plan: RankPlan, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank count's figures from its ranks' reports."""
    n = len(reports)
    admin = Store(plan.uri, storage_options=plan.storage_options)
    committed = list_steps(admin)
    saves = []
    for i, save in enumerate(reports[0]["saves"]):
        step = save["step"]
        phases = dict(reports[0]["phases"].get(step, dict.fromkeys(PHASES, 0.0)))
        phases["exchange"] = exchange_s(
            [r["saves"][i] for r in reports], [r["calls"] for r in reports]
        )
        saves.append(
            {
                "step": step,
                "committed": step in committed,
                "wall_s": max(r["saves"][i]["end"] for r in reports)
                - min(r["saves"][i]["start"] for r in reports),
                "coordinator_s": sum(phases.values()),
                "phases_s": phases,
                "manifest_bytes": admin.size(commit_key(step)) if step in committed else None,
                "requests": sum_requests(r["saves"][i]["requests"] for r in reports),
                "put_exists": sum(r["saves"][i]["put_exists"] for r in reports),
                "sent_put_bytes": sum(r["saves"][i]["sent_put_bytes"] for r in reports),
                "cpu_s_per_rank": statistics.mean(r["saves"][i]["cpu_s"] for r in reports),
                "encode_cpu_s_per_rank": statistics.mean(
                    r["saves"][i]["encode_cpu_s"] for r in reports
                ),
                "peak_rss_bytes": save["peak_rss_bytes"],
            }
        )
    steady = saves[1:] or saves  # the first save finds no earlier step to read
    last = saves[-1]["requests"]
    restore = [r["restore"] for r in reports]
    restore_requests = sum_requests(r["requests"] for r in restore)
    distinct = math.ceil(n / plan.replicas) * (plan.state_bytes // 4 * 4)
    return {
        "ranks": n,
        "saves": saves,
        "distinct_bytes_per_save": distinct,
        "sent_per_distinct_byte": statistics.median(s["sent_put_bytes"] / distinct for s in saves),
        "put_exists_per_save": statistics.median(s["put_exists"] for s in saves),
        "coordinator_s": statistics.median(s["coordinator_s"] for s in steady),
        "save_requests": last,
        "save_requests_per_rank": sum(last.values()) / n,
        "restore": {
            "wall_s": max(r["end"] for r in restore) - min(r["start"] for r in restore),
            "requests": restore_requests,
            "requests_per_rank": sum(restore_requests.values()) / n,
            "equal_on_every_rank": all(r["equal"] for r in restore),
        },
    }


def sum_requests(per_rank: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for requests in per_rank:
        for op, count in requests.items():
            total[op] = total.get(op, 0) + count
    return dict(sorted(total.items()))


def exchange_s(windows: list[dict[str, Any]], calls: list[list[CollectiveCall]]) -> float:
    """Rank 0's time in the collectives of one save (``windows[r]``: rank r's start and end):
    on thread ranks each collective's own work (``CollectiveCall.work_s``); on gloo from the
    last rank's arrival (the latest entry among the ranks' matching calls) to rank 0's return."""

    def within(rank: int) -> list[CollectiveCall]:
        start, end = windows[rank]["start"], windows[rank]["end"]
        return [c for c in calls[rank] if start <= c.enter <= end]

    ranks = [within(r) for r in range(len(windows))]
    total = 0.0
    for k, call in enumerate(ranks[0]):
        work = call.work_s()
        if work is None:
            work = call.exit - max(r[k].enter for r in ranks if k < len(r))
        total += max(0.0, work)
    return total


def growth_exponent(ranks: list[int], values: list[float]) -> float | None:
    """``k`` of ``value ~ ranks^k``, least squares on logarithms; None without two rank
    counts that have a positive value."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ranks, values, strict=True) if v > 0]
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


# -- the store under test -----------------------------------------------------------------------

_MOTO = """
import json, sys, threading
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app,
)
from werkzeug.serving import make_server

app = DomainDispatcherApplication(create_backend_app)
received = {"put_bytes": 0, "chunk_put_bytes": 0, "puts": 0}
lock = threading.Lock()

def counted(environ, start_response):
    if environ["REQUEST_METHOD"] == "PUT":
        body = int(environ.get("CONTENT_LENGTH") or 0)
        with lock:
            received["puts"] += 1
            received["put_bytes"] += body
            if "/chunks/" in environ.get("PATH_INFO", ""):
                received["chunk_put_bytes"] += body
    return app(environ, start_response)

server = make_server("127.0.0.1", 0, counted, True, request_handler=MotoRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_address[1], flush=True)
for line in sys.stdin:
    with lock:
        print(json.dumps(received), flush=True)
server.shutdown()
"""
_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@contextlib.contextmanager
def store_under_test(uri: str | None) -> Iterator[tuple[str, str, Received | None]]:
    """``uri`` as given, or a bucket on a moto S3 server of our own, in a process of its own
    (so the ranks' threads do not slow it down); its endpoint is in the environment the ranks
    inherit while this is open. With the server comes what it received so far (PUT requests
    and their bodies, counted in front of moto's app), else None."""
    if uri is not None:
        yield uri, "s3" if uri.startswith("s3://") else "local", None
        return
    server = subprocess.Popen(
        [sys.executable, "-c", _MOTO],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # a line per request
        text=True,
        start_new_session=True,  # Ctrl-C stops the run, whose cleanup still needs the server
    )
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    try:
        line = server.stdout.readline().strip()
        if not line.isdigit():
            raise OSError(
                "the moto S3 server did not start (pip install 'moto[server]'), or give --uri"
            )
        port = int(line)
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)

        def received() -> dict[str, int]:
            server.stdin.write("count\n")
            server.stdin.flush()
            return json.loads(server.stdout.readline())

        yield f"s3://{BUCKET}", "moto", received
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# -- output -----------------------------------------------------------------------------------


def _kinds(requests: dict[str, int]) -> list[int]:
    """put, delete, get, head, list counts of ``requests`` (by store operation)."""
    head = sum(requests.get(op, 0) for op in HEAD_OPS)
    return [requests.get("put", 0), requests.get("delete", 0), requests.get("get", 0), head,
            requests.get("list", 0)]  # fmt: skip


def print_tables(result: dict[str, Any], out: Any = None) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    out = out or sys.stdout
    print(
        f"ckptbench scale: ranks as {result['mode']} on {result['store']}; each rank saves "
        f"{format_bytes(result['state_bytes_per_rank'])} in {result['chunks_per_rank']} chunks "
        f"of {format_bytes(result['chunk_bytes'])}, {result['saves']} times (a fresh state "
        "each time), then restores it",
        file=out,
    )
    rows = []
    for r in result["runs"]:
        steady = r["saves"][1:] or r["saves"]
        phase = {
            p: statistics.median(s["phases_s"][p] for s in steady) for p in (*PHASES, "exchange")
        }
        manifest = r["saves"][-1]["manifest_bytes"]
        peak = r["saves"][-1]["peak_rss_bytes"]
        rows.append(
            [r["ranks"], format_seconds(r["coordinator_s"]), format_seconds(phase["begin"]),
             format_seconds(phase["exchange"]), format_seconds(phase["commit"]),
             format_seconds(phase["release"] + phase["retain"]),
             format_bytes(manifest) if manifest is not None else "-",
             format_seconds(statistics.median(s["wall_s"] for s in steady)),
             format_bytes(peak) if peak else "-"]
        )  # fmt: skip
    print("\ncoordinator per save (median of saves 2..n)", file=out)
    table(
        ["ranks", "coordinator", "begin", "exchange", "commit", "release", "manifest",
         "save wall", "peak RSS"],
        rows,
        out=out,
    )  # fmt: skip
    rows = []
    for r in result["runs"]:
        rs = r["restore"]
        rows.append(
            [r["ranks"], sum(r["save_requests"].values()), f"{r['save_requests_per_rank']:.2f}",
             *_kinds(r["save_requests"]), sum(rs["requests"].values()),
             f"{rs['requests_per_rank']:.2f}", *_kinds(rs["requests"])[2:],
             "yes" if rs["equal_on_every_rank"] else "NO"]
        )  # fmt: skip
    print("\nrequests (summed over ranks): the last save, and the restore", file=out)
    table(
        ["ranks", "save", "per rank", "put", "delete", "get", "head", "list", "restore",
         "per rank", "get", "head", "list", "restored equal"],
        rows,
        out=out,
    )  # fmt: skip
    rows = []
    for r in result["runs"]:
        server = r.get("server_put_bytes_per_distinct_byte")
        rows.append(
            [r["ranks"], format_bytes(r["distinct_bytes_per_save"]),
             f"{r['sent_per_distinct_byte']:.2f}", "-" if server is None else f"{server:.2f}",
             r["put_exists_per_save"],
             format_seconds(statistics.median(s["cpu_s_per_rank"] for s in r["saves"]))]
        )  # fmt: skip
    print(
        f"\nbytes put per distinct byte stored (each state held by {result['replicas']} "
        "rank(s)): sent by the ranks' stores (every attempt; median of saves), received by "
        "the S3 server (all saves); puts answered 'exists' per save; CPU per rank per save "
        "(the rank's process: hashing, encoding, requests; median of saves)"
        + (" -- every rank writes (the baseline)" if result.get("every_rank_writes") else ""),
        file=out,
    )
    table(["ranks", "distinct/save", "sent", "received", "exists", "CPU/rank"], rows, out=out)
    g = result["growth"]
    points = len({r["ranks"] for r in result["runs"]})
    how = (
        "a line through 2 rank counts only: noise as much as growth; give --ranks three or more"
        if points == 2
        else f"least squares on logs over {points} rank counts"
        if points > 2
        else "one rank count: none"
    )
    print(
        f"\ngrowth with ranks ({how}): coordinator time ~ ranks^"
        f"{_exponent(g['coordinator_s'])}, save requests per rank ~ ranks^"
        f"{_exponent(g['requests_per_rank'])}",
        file=out,
    )


def print_comparison(result: dict[str, Any], out: Any = None) -> None:
    """One writer per distinct chunk beside every rank writing (``--compare``), per rank
    count: what the server received per distinct byte, puts answered "exists", CPU and wall
    time per save."""
    out = out or sys.stdout
    rows = []
    for mine, base in zip(result["runs"], result["baseline"]["runs"], strict=True):
        row = [mine["ranks"]]
        for key, shown in (
            ("server_put_bytes_per_distinct_byte", lambda v: f"{v:.3f}"),
            ("put_exists_per_save", str),
        ):
            row += ["-" if r.get(key) is None else shown(r[key]) for r in (mine, base)]
        for per_save in ("cpu_s_per_rank", "encode_cpu_s_per_rank", "wall_s"):
            row += [format_seconds(statistics.median(s[per_save] for s in r["saves"]))
                    for r in (mine, base)]  # fmt: skip
        rows.append(row)
    print(
        f"\none writer per distinct chunk (1w) vs every rank writing (all), same store and "
        f"server, each state held by {result['replicas']} rank(s): PUT bytes the server "
        "received per distinct raw byte, puts answered 'exists' per save, CPU per rank (the "
        "process's, and its encode threads' alone) and wall per save (medians of saves)",
        file=out,
    )
    table(
        ["ranks", "received 1w", "received all", "exists 1w", "exists all", "CPU/rank 1w",
         "CPU/rank all", "encode/rank 1w", "encode/rank all", "wall 1w", "wall all"],
        rows,
        out=out,
    )  # fmt: skip


def _exponent(k: float | None) -> str:
    return "? (one rank count)" if k is None else f"{k:.2f}"
