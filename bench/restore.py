"""``ckptbench restore``: how long a restore takes, ckptstore vs DCP vs torch.load.

The state is saved once with each method, then loaded ``--warmup`` + ``--repeat`` times into
preallocated tensors; every round loads with each method once and checks (untimed) that the
tensors equal the saved state.

- ``ckptstore``: ``Checkpointer(uri).load(state, step)``; every chunk is hash-verified.
- ``dcp``: ``torch.distributed.checkpoint.load`` with ``FileSystemReader`` on local paths,
  ``FsspecReader`` otherwise (single process); no checksums.
- ``torch_load``: ``torch.load`` of one file (``weights_only=True``), then ``copy_`` into the
  preallocated tensors, for reference; no checksums.

With ``--device cuda`` the state is saved from the GPU and loaded into preallocated GPU
tensors (each timed load ends once the device has the bytes); ``ckptstore_host`` loads the same
step into host tensors, the speed a GPU restore is measured against.

On local disk ``--cache warm`` (the default) loads files this run just wrote from the page
cache: the figures measure decode, verification and copy paths. ``--cache cold`` drops every
file's cached pages (``POSIX_FADV_DONTNEED``) before each timed load, so each load reads the disk.

By default every load runs in this process, which has imported everything and loaded before.
``--fresh-process`` runs each load (warm-up and timed, every method) in a new Python process, as
a restarted job would: the child imports torch, ckptstore and DCP and allocates its destination
tensors (the state's names, shapes, dtypes and device) untimed, then times the load call alone:
for ``ckptstore`` constructing the ``Checkpointer`` and ``load`` (a restarted job pays both),
for ``dcp`` building the reader and ``dcp.load``, for ``torch_load`` ``torch.load`` and the copy.
It reports, as one JSON line on stdout, that time, its peak RSS growth, and its minor and major
page faults and system and user CPU time over the load (``getrusage(RUSAGE_SELF)`` deltas), with
the xxh3_64 digest of every loaded tensor's bytes, which this process checks against the saved
state. ``--cache cold`` drops the page cache before each child is started. Each child is killed
after ``CHILD_TIMEOUT_S``; a child that fails ends the run with its stderr's last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import _ckpt_common as common
from bench.report import (
    format_bytes,
    format_seconds,
    parse_bytes,
    print_json,
    ratio_line,
    rounds,
    table,
)
from ckptstore.cli.signals import raise_if_stopped

logger = logging.getLogger(__name__)

METHODS = ("ckptstore", "dcp", "torch_load")
CUDA_METHODS = ("ckptstore", "ckptstore_host", "dcp", "torch_load")
CACHE_NOTES = {
    "warm": "warm page cache: the files were just written and are read from memory",
    "cold": "cold page cache: every file's cached pages were dropped before each timed load",
}
PROCESS_NOTES = {
    False: "in-process: every load ran in the bench's own process (modules imported, earlier "
    "loads done); its tensors were compared with the state",
    True: "fresh process: every load ran in a new Python process (imports and destination "
    "tensors untimed; timed: building the Checkpointer or reader, and the load); faults and "
    "sys/user CPU are the child's getrusage deltas over the load; the xxh3_64 digests of its "
    "tensors were checked against the state",
}
CHILD_TIMEOUT_S = 1800
# What a child reports besides restore_s and peak_rss_bytes: the report gives their medians.
FRESH_FIELDS = ("minor_faults", "major_faults", "sys_s", "user_s")


class _Method:
    name = ""
    into_host = False  # loads into host tensors even when the state is on a device

    @property
    def directory(self) -> str:
        """Where under the workspace its save is stored."""
        return self.name

    def __init__(
        self, ws: common.Workspace, compression: str, read_concurrency: int | None = None
    ) -> None:
        self.ws = ws
        self.compression = compression
        self.read_concurrency = read_concurrency  # ckptstore's loads; None: its default

    def save(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class _Ckptstore(_Method):
    name = "ckptstore"

    @property
    def encoding(self) -> Any:
        from ckptstore import EncodingOptions

        return EncodingOptions(compression=self.compression)

    def save(self, state):
        from ckptstore import Checkpointer

        with Checkpointer(self.ws.child(self.name), encoding=self.encoding) as ckpt:
            ckpt.save(0, state).wait()

    def load(self, dest):
        from ckptstore import Checkpointer, ReadOptions

        reads = None
        if self.read_concurrency is not None:
            reads = ReadOptions(read_concurrency=self.read_concurrency)
        directory = self.ws.child(self.directory)
        with Checkpointer(directory, encoding=self.encoding, reads=reads) as ckpt:
            ckpt.load(dest, step=0)


class _CkptstoreHost(_Ckptstore):
    name = "ckptstore_host"
    into_host = True

    @property
    def directory(self) -> str:
        return _Ckptstore.name

    def save(self, state):
        """Nothing: it loads the step ``ckptstore`` saved."""


class _Dcp(_Method):
    name = "dcp"

    def save(self, state):
        import torch.distributed.checkpoint as dcp

        if self.ws.is_local:
            writer = dcp.FileSystemWriter(self.ws.path(self.name))
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(self.ws.child(self.name))
        with common.quiet_dcp():
            dcp.save(state, storage_writer=writer, no_dist=True)

    def load(self, dest):
        import torch.distributed.checkpoint as dcp

        if self.ws.is_local:
            reader = dcp.FileSystemReader(self.ws.path(self.name))
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(self.ws.child(self.name))
        with common.quiet_dcp():
            dcp.load(dest, storage_reader=reader, no_dist=True)


class _TorchLoad(_Method):
    name = "torch_load"

    def _path(self) -> str:
        return self.ws.path(self.name, "state.pt")

    def save(self, state):
        if self.ws.is_local:
            os.makedirs(self.ws.path(self.name), exist_ok=True)
            with open(self._path(), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.ws.fs.open(self._path(), "wb") as f:
                torch.save(state, f)

    def load(self, dest):
        opener = open if self.ws.is_local else self.ws.fs.open
        with opener(self._path(), "rb") as f:
            loaded = torch.load(f, map_location="cpu", weights_only=True)
        for k, t in loaded.items():
            dest[k].copy_(t)


_CLASSES: dict[str, Callable[..., _Method]] = {
    c.name: c for c in (_Ckptstore, _CkptstoreHost, _Dcp, _TorchLoad)
}


def methods_for(device: str) -> tuple[str, ...]:
    return CUDA_METHODS if device == "cuda" else METHODS


def _load_here(
    method: _Method,
    dest: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    probe: common.MemoryProbe,
    dev: torch.device,
    *,
    cold: bool,
) -> dict[str, Any]:
    """One load of ``method`` in this process into ``dest`` (zeroed first), compared with
    ``state``; its time and peak RSS growth."""
    for t in dest.values():
        t.zero_()
    if cold:
        common.drop_page_cache(method.ws.root)
    rss_before = probe.reset()
    common.settle(dev)
    t0 = time.perf_counter()
    method.load(dest)
    common.settle(dev)
    restore_s = time.perf_counter() - t0
    peak = probe.peak()
    if not common.same_state(dest, state):
        raise RuntimeError(f"{method.name} restored tensors that differ from the save")
    return {
        "restore_s": restore_s,
        "peak_rss_bytes": None if peak is None else max(0, peak - rss_before),
    }


# -- --fresh-process -----------------------------------------------------------------------------


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The xxh3_64 hex digest of each tensor's bytes (read on the host)."""
    import xxhash

    return {
        k: xxhash.xxh3_64_hexdigest(
            t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        )
        for k, t in tensors.items()
    }


def child_main() -> None:
    """One load in this fresh process (``--fresh-process``). Reads the request (JSON on stdin:
    method, workspace URI, compression, destination device, and the tensors as ``[name, shape,
    dtype]``), loads once, prints one JSON line: ``restore_s``, ``peak_rss_bytes``,
    ``minor_faults``, ``major_faults``, ``sys_s``, ``user_s``, ``pid`` and ``digests``."""
    request = json.loads(sys.stdin.read())
    with common.quiet_dcp():
        import torch.distributed.checkpoint  # noqa: F401 - imported before the timed load

        from ckptstore import Checkpointer, EncodingOptions  # noqa: F401

    ws = common.Workspace.open(request["workspace"])
    method = _CLASSES[request["method"]](
        ws, request["compression"], request.get("read_concurrency")
    )
    dev = torch.device(request["device"])
    dest = {
        name: torch.zeros(shape, dtype=getattr(torch, dtype), device=dev)
        for name, shape, dtype in request["tensors"]
    }
    probe = common.MemoryProbe()
    rss_before = probe.reset()
    common.settle(dev)
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    method.load(dest)
    common.settle(dev)
    restore_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    peak = probe.peak()
    result = {
        "restore_s": restore_s,
        "peak_rss_bytes": None if peak is None else max(0, peak - rss_before),
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "major_faults": after.ru_majflt - before.ru_majflt,
        "sys_s": after.ru_stime - before.ru_stime,
        "user_s": after.ru_utime - before.ru_utime,
        "pid": os.getpid(),
        "digests": tensor_digests(dest),
    }
    print(json.dumps(result), flush=True)


def _child_command() -> list[str]:
    return [sys.executable, "-c", "from bench.restore import child_main; child_main()"]


def _load_in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Run one load in a fresh process; its result. ChildProcessError naming the method when
    the child fails, runs past ``CHILD_TIMEOUT_S`` or prints no result."""
    name = request["method"]
    try:
        proc = subprocess.run(
            _child_command(),
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
    except subprocess.TimeoutExpired:
        raise ChildProcessError(
            f"{name}: the load in a fresh process ran past {CHILD_TIMEOUT_S:g} s and was killed"
        ) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["nothing on stderr"])[-1]
        raise ChildProcessError(
            f"{name}: the load in a fresh process failed (exit {proc.returncode}): {last}"
        )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ChildProcessError(
            f"{name}: the load in a fresh process printed no result line"
        ) from None


def _fresh_load(
    method: _Method,
    ws: common.Workspace,
    compression: str,
    state: dict[str, torch.Tensor],
    dev: torch.device,
    expected: dict[str, str],
) -> dict[str, Any]:
    """One load of ``method`` in a fresh process, its digests checked against ``expected``."""
    result = _load_in_child(
        {
            "method": method.name,
            "workspace": ws.uri,
            "compression": compression,
            "read_concurrency": method.read_concurrency,
            "device": "cpu" if method.into_host else str(dev),
            "tensors": [
                [k, list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in state.items()
            ],
        }
    )
    got = result.pop("digests", None)
    if got != expected:
        differ = sorted(k for k in expected if (got or {}).get(k) != expected[k])
        raise RuntimeError(
            f"{method.name} restored tensors that differ from the save (in a fresh process: "
            f"{len(differ)} of {len(expected)} tensors, first {differ[:1]})"
        )
    return {**result, "digests_matched": len(expected)}


def run_restore(
    *,
    uri: str | None,
    spec: common.StateSpec,
    repeat: int = 3,
    warmup: int = 1,
    compression: str = "auto",
    methods: list[str] | None = None,
    cache: str = "warm",
    device: str = "cpu",
    fresh_process: bool = False,
    read_concurrency: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns the report as a JSON-ready dict. ``fresh_process`` runs
    every load in a new Python process (module docstring)."""
    if cache not in CACHE_NOTES:
        raise ValueError(f"cache must be one of {', '.join(CACHE_NOTES)}, got {cache!r}")
    from ckptstore.codec import CodecConfig

    CodecConfig.parse(compression)
    if read_concurrency is not None and read_concurrency < 1:
        raise ValueError(f"--read-concurrency must be >= 1, got {read_concurrency}")
    dev = common.check_device(device)
    methods = list(methods_for(device)) if methods is None else methods
    if "ckptstore_host" in methods and "ckptstore" not in methods:
        raise ValueError("--methods ckptstore_host reads the step ckptstore saves: name both")
    say = progress or (lambda _msg: None)
    date = common.now_iso()
    say(f"building the {spec.state} state on {dev}")
    state = common.build_state(spec, dev)
    raw = common.state_bytes(state)
    probe = common.MemoryProbe()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    stored: dict[str, int] = {}
    with common.Workspace(uri, command="restore") as ws:
        is_local = ws.is_local
        if cache == "cold" and not is_local:
            raise ValueError("--cache cold needs a local --uri: only local files have a page cache")
        chosen = [_CLASSES[name](ws, compression, read_concurrency) for name in methods]
        for method in chosen:
            say(f"{method.name}: saving")
            method.save(state)
            stored[method.name] = ws.bytes_under(method.directory)
        expected = tensor_digests(state) if fresh_process else {}
        if not fresh_process:
            on_device = common.zeros_like_state(state)
            on_host = {k: torch.zeros_like(t, device="cpu") for k, t in state.items()}
        for r in range(warmup + repeat):
            for method in chosen:
                if fresh_process:
                    if cache == "cold":
                        common.drop_page_cache(ws.root)
                    run = _fresh_load(method, ws, compression, state, dev, expected)
                else:
                    dest = on_host if method.into_host else on_device
                    run = _load_here(method, dest, state, probe, dev, cold=cache == "cold")
                if r < warmup:
                    continue
                runs[method.name].append(run)
                say(
                    f"round {r + 1 - warmup}/{repeat} {method.name}: "
                    f"{format_seconds(run['restore_s'])}"
                    + (
                        f" in pid {run['pid']}, {run['minor_faults']} minor faults, "
                        f"sys {format_seconds(run['sys_s'])}"
                        if fresh_process
                        else ""
                    )
                )
    report: dict[str, Any] = {
        "command": "restore",
        "date": date,
        "uri": uri or "(temporary local directory)",
        "config": {
            "state": spec.state,
            "dtype": spec.dtype,
            "size_bytes": spec.size_bytes if spec.state == "synthetic" else None,
            "tensors": spec.tensors if spec.state == "synthetic" else None,
            "repeat": repeat,
            "warmup": warmup,
            "compression": compression,
            "read_concurrency": read_concurrency,
            "methods": methods,
            "cache": cache if is_local else None,
            "fresh_process": fresh_process,
            "device": common.device_info(dev),
            **common.describe_state(state),
            **({"model": common.TRAINED_MODEL} if spec.state == "trained" else {}),
            "host": common.host_info(),
        },
    }
    for name in methods:
        rs = runs[name]
        restore_s = common.median([r["restore_s"] for r in rs])
        peaks = [r["peak_rss_bytes"] for r in rs if r["peak_rss_bytes"] is not None]
        report[name] = {
            "restore_s": restore_s,
            "bytes_per_s": raw / restore_s,
            "bytes_stored": stored[name],
            "stored_vs_raw": stored[name] / raw,
            "peak_rss_bytes": int(common.median(peaks)) if peaks else None,
            "verified": name.startswith("ckptstore"),
            "runs": rs,
        }
        if fresh_process:
            for field in FRESH_FIELDS:
                report[name][field] = common.median([r[field] for r in rs])
    ratios: dict[str, float | None] = {}
    if "ckptstore" in methods:
        for base in ("ckptstore_host", "dcp", "torch_load"):
            if base in methods:
                ratios[f"ckptstore_vs_{base}"] = common.ratio(
                    report["ckptstore"]["restore_s"], report[base]["restore_s"]
                )
    report["ratios"] = ratios
    report["notes"] = [
        "medians over rounds; each round loads with every method once into preallocated "
        "tensors and checks the result (untimed)",
        "verified: whether the method itself checks every byte against a stored hash",
    ]
    if is_local:
        report["notes"].append(CACHE_NOTES[cache])
    report["notes"].append(PROCESS_NOTES[fresh_process])
    return report


def print_table(report: dict[str, Any]) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    cfg = report["config"]
    print(
        f"ckptbench restore  {report['date']}  {cfg['state']} {'/'.join(cfg['dtypes'])} state, "
        f"{format_bytes(cfg['raw_bytes'])} in {cfg['n_tensors']} tensors <- {report['uri']}"
    )
    fresh = cfg.get("fresh_process", False)
    print(
        f"medians of {rounds(cfg['repeat'])} (after {cfg['warmup']} warm-up), "
        + ("each load in a fresh process" if fresh else "every load in this process")
        + (
            f", ckptstore read_concurrency {cfg['read_concurrency']}"
            if cfg.get("read_concurrency")
            else ""
        )
    )
    rows = []
    for name in cfg["methods"]:
        m = report[name]
        peak = m["peak_rss_bytes"]
        row = [
            name,
            format_seconds(m["restore_s"]),
            f"{m['bytes_per_s'] / 1e9:.2f} GB/s",
            format_bytes(m["bytes_stored"]),
            "yes" if m["verified"] else "no",
            "n/a" if peak is None else format_bytes(peak),
        ]
        if fresh:
            row += [
                f"{m['minor_faults']:.0f}",
                format_seconds(m["sys_s"]),
                format_seconds(m["user_s"]),
            ]
        rows.append(row)
    headers = ["method", "restore", "rate", "stored", "verified", "peak RSS"]
    table(headers + (["minor faults", "sys CPU", "user CPU"] if fresh else []), rows)
    if report["ratios"]:
        print(ratio_line(report["ratios"]))
    for note in report["notes"]:
        print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    common.check_counts(args)
    common.check_device(args.device)
    spec = common.state_spec_from_args(args)
    sizes = [spec.size_bytes]
    if args.sizes is not None:
        if args.size is not None or args.state == "trained":
            raise ValueError(
                "--sizes is a sweep of synthetic sizes: not with --size or --state trained"
            )
        sizes = [parse_bytes(s.strip(), what="--sizes") for s in args.sizes.split(",") if s.strip()]
        if not sizes:
            raise ValueError("--sizes names no size: give e.g. --sizes 16MiB,64MiB,256MiB,1GiB")
    reports = [
        run_restore(
            uri=args.uri,
            spec=dataclasses.replace(spec, size_bytes=size),
            repeat=args.repeat,
            warmup=args.warmup,
            compression=args.compression,
            methods=common.parse_methods(args.methods, methods_for(args.device)),
            cache=args.cache,
            device=args.device,
            fresh_process=args.fresh_process,
            read_concurrency=args.read_concurrency,
            progress=logger.info,
        )
        for size in sizes
    ]
    if args.sizes is None:
        if args.json:
            print_json(reports[0])
        else:
            print_table(reports[0])
        return 0
    sweep = {"command": "restore", "sweep": reports, "by_size": sweep_rows(reports)}
    if args.json:
        print_json(sweep)
    else:
        for report in reports:
            print_table(report)
            print()
        print_sweep(sweep["by_size"])
    return 0


def sweep_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size of a sweep: each method's restore time and ckptstore's ratios."""
    return [
        {
            "size_bytes": r["config"]["raw_bytes"],
            **{f"{m}_restore_s": r[m]["restore_s"] for m in r["config"]["methods"]},
            **r["ratios"],
        }
        for r in reports
    ]


def print_sweep(rows: list[dict[str, Any]]) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    ratios = [k for k in rows[0] if k.startswith("ckptstore_vs_")]
    times = [k for k in rows[0] if k.endswith("_restore_s")]
    table(
        ["size", *(k.removesuffix("_restore_s") for k in times), *ratios],
        [
            [
                format_bytes(row["size_bytes"]),
                *(format_seconds(row[k]) for k in times),
                *("n/a" if row[k] is None else f"{row[k]:.2f}" for k in ratios),
            ]
            for row in rows
        ],
    )


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "restore",
        help="time restores: ckptstore (verified) vs DCP load vs torch.load",
        description="Save a state once with ckptstore, DCP and torch.save, then time loads "
        "into preallocated tensors, side by side in one run. Works under a fresh "
        "ckptbench-<random>/ directory and deletes it.",
    )
    common.add_common_args(p)
    p.add_argument(
        "--cache",
        choices=tuple(CACHE_NOTES),
        default="warm",
        help="local disk: load from the page cache (warm, default) or drop every file's cached "
        "pages before each timed load (cold; refused on tmpfs, whose pages cannot be dropped)",
    )
    p.add_argument(
        "--fresh-process",
        action="store_true",
        help="run every load in a new Python process, as a restarted job would (imports and "
        "destination tensors untimed; the Checkpointer's construction timed); reports each "
        "method's page faults and system/user CPU time too (default: every load in this process)",
    )
    p.add_argument(
        "--read-concurrency",
        type=int,
        help="chunks one ckptstore load fetches and verifies at once (ReadOptions."
        "read_concurrency; default: its default, 8); DCP and torch.load are unaffected",
    )
    p.add_argument(
        "--sizes",
        help="a size sweep: comma-separated synthetic sizes (e.g. 16MiB,64MiB,256MiB,1GiB), each "
        "run as --size would be, then one row per size with ckptstore's ratio to each baseline",
    )
    p.set_defaults(func=run)
    return p
