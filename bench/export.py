"""``ckptbench export``: a step to Hugging Face safetensors, ckptstore vs DCP's consolidation.

The state is saved once with each, then exported ``--repeat`` times (after ``--warmup``), each
export in a child process of its own so that peak memory is that export's alone:

- ``ckptstore``: ``ckptstore.export.export_safetensors`` of the Checkpointer step (every chunk
  fetched, decoded and hash-verified on the way).
- ``dcp``: the state saved by DCP's ``HuggingFaceStorageWriter`` (a ``FileSystemWriter`` writing
  per-rank safetensors, ``save_distributed=True``: the input DCP's consolidation reads), then
  ``torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files``
  into the same shard layout. No checksums.

Both read files this run just wrote (warm page cache). After the last round both outputs are
loaded with ``safetensors`` and compared with the state, tensor by tensor (untimed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from bench import _ckpt_common as common
from bench.report import format_bytes, format_seconds, print_json, ratio_line, rounds, table
from ckptstore.cli.signals import raise_if_stopped

logger = logging.getLogger(__name__)

METHODS = ("ckptstore", "dcp")
CHILD_TIMEOUT_S = 1800


def _export_ckptstore(src: str, out: str, max_shard_size: str) -> None:
    from ckptstore.export import export_safetensors

    export_safetensors(src, out, max_shard_size=max_shard_size)


def _export_dcp(src: str, out: str, max_shard_size: str) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    with open(os.path.join(src, "shards.json"), encoding="utf-8") as f:
        mapping = json.load(f)
    os.makedirs(out, exist_ok=True)
    consolidate_safetensors_files(src, out, mapping)


_EXPORTS = {"ckptstore": _export_ckptstore, "dcp": _export_dcp}


def child_main(argv: list[str]) -> None:
    """One export, in this process: prints ``{"seconds", "rss_before", "peak_rss"}``."""
    method, src, out, max_shard_size = argv
    probe = common.MemoryProbe()
    with common.quiet_dcp():
        import torch.distributed.checkpoint  # noqa: F401 - imported before the baseline

        import ckptstore.export  # noqa: F401

        before = probe.reset()
        t0 = time.perf_counter()
        _EXPORTS[method](src, out, max_shard_size)
        seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "rss_before": before, "peak_rss": probe.peak()}))


def _run_child(method: str, src: str, out: str, max_shard_size: str) -> dict[str, Any]:
    code = "import sys; from bench.export import child_main; child_main(sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, method, src, out, max_shard_size],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ChildProcessError(f"{method} export failed (exit {proc.returncode}): {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shard_mapping(state: dict[str, torch.Tensor], max_bytes: int) -> dict[str, int]:
    """Tensor -> 1-based shard, split as Hugging Face (and ckptstore's export) do."""
    mapping, shard, size = {}, 1, 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if size and size + n > max_bytes:
            shard, size = shard + 1, 0
        mapping[name] = shard
        size += n
    return mapping


def _save_both(ws: common.Workspace, state: dict[str, torch.Tensor], max_bytes: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from ckptstore import Checkpointer

    with Checkpointer(ws.path("ckptstore")) as ckpt:
        ckpt.save(0, state).wait()
    with common.quiet_dcp():
        writer = HuggingFaceStorageWriter(ws.path("dcp"), save_distributed=True)
        dcp.save(state, storage_writer=writer, no_dist=True)
    with open(ws.path("dcp", "shards.json"), "w", encoding="utf-8") as f:
        json.dump(_shard_mapping(state, max_bytes), f)


def _output_equals(out: str, state: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``state``, and nothing else, in the safetensors files under ``out``."""
    from safetensors import safe_open

    seen = set()
    for name in sorted(os.listdir(out)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(out, name), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key in seen or key not in state or t.dtype != state[key].dtype:
                    return False
                if not torch.equal(t.view(torch.uint8), state[key].view(torch.uint8)):
                    return False
                seen.add(key)
    return seen == set(state)


def run_export(
    *,
    spec: common.StateSpec,
    repeat: int,
    warmup: int,
    max_shard_size: str,
    workdir: str | None,
    progress=logger.info,
) -> dict[str, Any]:
    from ckptstore.export import parse_size

    max_bytes = parse_size(max_shard_size)
    date = common.now_iso()
    state = common.build_state(spec)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    with common.Workspace(workdir, command="export") as ws:
        if not ws.is_local:
            raise ValueError("ckptbench export writes safetensors to local disk: --dir is local")
        progress("saving the state with ckptstore and with DCP")
        _save_both(ws, state, max_bytes)
        equal: dict[str, bool] = {}
        for r in range(warmup + repeat):
            for method in METHODS:
                out = ws.path(f"out-{method}")
                shutil.rmtree(out, ignore_errors=True)
                result = _run_child(method, ws.path(method), out, max_shard_size)
                if r >= warmup:
                    runs[method].append(result)
                progress(f"round {r + 1}/{warmup + repeat} {method}: {result['seconds']:.2f} s")
        for method in METHODS:
            equal[method] = _output_equals(ws.path(f"out-{method}"), state)
    raw = common.state_bytes(state)
    report: dict[str, Any] = {
        "command": "export",
        "date": date,
        "config": {
            "size_bytes": raw,
            "tensors": len(state),
            "dtype": spec.dtype,
            "max_shard_size": max_shard_size,
            "repeat": repeat,
            "warmup": warmup,
            "host": common.host_info(),
        },
    }
    for method in METHODS:
        rs = runs[method]
        report[method] = {
            "seconds": common.median([r["seconds"] for r in rs]),
            "peak_rss_bytes": int(common.median([r["peak_rss"] for r in rs])),
            "rss_growth_bytes": int(common.median([r["peak_rss"] - r["rss_before"] for r in rs])),
            "output_equal": equal[method],
            "verified": method == "ckptstore",
            "runs": rs,
        }
    c, d = report["ckptstore"], report["dcp"]
    report["ratios"] = {
        "time_ckptstore_vs_dcp": common.ratio(c["seconds"], d["seconds"]),
        "peak_rss_ckptstore_vs_dcp": common.ratio(c["peak_rss_bytes"], d["peak_rss_bytes"]),
        "rss_growth_ckptstore_vs_dcp": common.ratio(c["rss_growth_bytes"], d["rss_growth_bytes"]),
    }
    report["notes"] = [
        "each export runs in a child process of its own; peak RSS is that process's VmHWM, "
        "growth is VmHWM minus the RSS after imports",
        "medians over rounds; both read files this run just wrote (warm page cache)",
        "verified: whether the method checks every byte against a stored hash",
    ]
    return report


def print_table(report: dict[str, Any]) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    cfg = report["config"]
    print(
        f"ckptbench export  {report['date']}  {format_bytes(cfg['size_bytes'])} "
        f"{cfg['dtype']} in {cfg['tensors']} tensors, max shard {cfg['max_shard_size']}"
    )
    print(f"medians of {rounds(cfg['repeat'])} (after {cfg['warmup']} warm-up)")
    rows = []
    for method in METHODS:
        m = report[method]
        rows.append(
            [
                method,
                format_seconds(m["seconds"]),
                format_bytes(m["peak_rss_bytes"]),
                format_bytes(m["rss_growth_bytes"]),
                "yes" if m["verified"] else "no",
                "yes" if m["output_equal"] else "NO",
            ]
        )
    table(["method", "time", "peak RSS", "RSS growth", "verified", "output equal"], rows)
    print(ratio_line(report["ratios"]))
    for note in report["notes"]:
        print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    common.check_counts(args)
    size = args.size if args.size is not None else "1GiB"
    from bench.report import parse_bytes

    spec = common.StateSpec(
        size_bytes=parse_bytes(size, what="--size"),
        tensors=args.tensors,
        dtype=args.dtype,
        seed=args.seed,
    )
    report = run_export(
        spec=spec,
        repeat=args.repeat,
        warmup=args.warmup,
        max_shard_size=args.max_shard_size,
        workdir=args.dir,
    )
    if args.json:
        print_json(report)
    else:
        print_table(report)
    return 0 if all(report[m]["output_equal"] for m in METHODS) else 1


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="time a step's export to safetensors: ckptstore vs DCP's consolidation",
        description="Save a state with ckptstore and with DCP's HuggingFaceStorageWriter, then "
        "time and measure the peak RSS of ckptstore's export_safetensors and DCP's "
        "consolidate_safetensors_files, each in a child process, side by side in one run.",
    )
    p.add_argument("--size", help="state size (default 1GiB)")
    p.add_argument("--tensors", type=int, default=16, help="equal tensors (default 16)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="element type (default float32)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="output shard size (default 5GB)")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the state (default 0)")
    p.add_argument(
        "--dir", help="local directory to work under (default: a fresh temporary directory)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)
    return p
