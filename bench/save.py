"""``ckptbench save``: how long a save blocks the training loop, how long until it is durable,
what it stores and what memory it takes, for ckptstore and the PyTorch baselines side by side.

Methods, each timed from the call on the caller's thread:

- ``ckptstore``: ``Checkpointer.save()`` returns once the state is staged (``blocked_s``);
  ``handle.wait()`` returns once the step is committed (``commit_s``, from the call).
  ``commit_user_s`` / ``commit_system_s``: the process's CPU (every thread) over the same span.
- ``ckptstore_dcp``: ``torch.distributed.checkpoint.async_save`` through ckptstore's DCP backend
  (``ckptstore.dcp.StoreWriter``, which also stages the state for DCP); timed like ``dcp_async``.
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (thread executor, single process,
  ``FileSystemWriter`` on local paths, ``FsspecWriter`` otherwise); blocked until it returns the
  future, committed when ``future.result()`` returns.
- ``dcp_sync``: ``torch.distributed.checkpoint.save``; blocked = commit.
- ``torch_save``: ``torch.save`` into one file (``fsync``-ed on local disk, as the others are;
  through ``fsspec.open`` for remote URIs); blocked = commit.

``memcpy_s`` is a plain ``copy_`` of the same state into preallocated tensors (median of three
copies), timed in every round right before the first method's save: the floor for staging.
Every round runs memcpy then each method once, so drift of this shared machine hits all of
them alike; medians over ``--repeat`` rounds are reported, ratios are
ratios of those medians.

With ``--device cuda`` the state lives on the GPU, and each method also reports ``stall_s``:
from the call until a kernel enqueued on the training stream right after the call returned has
run (the host's blocked time included; the device-to-device ``memcpy_s`` is its floor, and
``d2h_s``, a copy into pinned host memory, the floor of staging through the host).
``ckptstore`` then stages through a device buffer (``staging="auto"``) and ``ckptstore_host``
through pinned host memory; ``first_blocked_s`` / ``first_stall_s`` are each method's first
save (a warm-up save unless ``--warmup 0``), which allocates the staging memory.

Between any two saves every tensor is rotated by one element, so no save can deduplicate
against an earlier one (same statistics, new bytes); ``--incremental`` rotates only the first
tensor, showing what content addressing saves. Each method keeps its output under its own
directory; ``bytes_stored`` is what that directory grew by during the save (files walked on
local disk, objects listed on S3).

``peak_rss_bytes`` is the peak resident memory during the save above the resident memory just
before it (high-water mark reset through ``/proc/self/clear_refs``, read from ``VmHWM``), plus
``held_rss_bytes``: memory the method keeps resident between saves (ckptstore's reusable staging
buffer), measured across its setup and warm-up saves (so 0 with ``--warmup 0``: then the
first round counts the buffer and later rounds do not). It is not updated after measured
saves: DCP's thread frees its staged copy a moment after ``future.result()`` returns, so an
RSS reading right then would count that copy as held. ``reserved_bytes``: with ``--reserve``,
the staging memory ``Checkpointer.reserve`` allocated before the first save (0 without).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import _ckpt_common as common
from bench.report import format_bytes, format_seconds, print_json, ratio_line, rounds, table
from ckptstore.cli.signals import raise_if_stopped

logger = logging.getLogger(__name__)

METHODS = ("ckptstore", "ckptstore_dcp", "dcp_async", "dcp_sync", "torch_save")
CUDA_METHODS = ("ckptstore", "ckptstore_host", *METHODS[1:])
OPT_IN_METHODS = ("ckptstore_noscan", "ckptstore_norecheck")  # run only when --methods names them


FINISH_S = 120.0


class _Method:
    """One way of saving; ``save`` returns (blocked_s, stall_s, commit_s), stall_s None on
    the cpu."""

    name = ""

    def __init__(self, ws: common.Workspace, compression: str, device: torch.device) -> None:
        self.ws = ws
        self.compression = compression
        self.device = device

    def stall(self, t0: float) -> float | None:
        """The training stream's stall of a save called at ``t0`` (right after it returned)."""
        return None if self.device.type == "cpu" else common.stall_s(t0, self.device)

    def open(self) -> None:
        pass

    @staticmethod
    def committed(future: Any) -> None:
        """``future.result()`` of an async save; stopped meanwhile (Ctrl-C, SIGTERM), the save
        thread's writes end first (up to ``FINISH_S``), so that the run's cleanup does not
        remove its directory while the thread still writes files into it (reviewer K)."""
        try:
            future.result()
        except BaseException:
            try:
                future.result(timeout=FINISH_S)
            except BaseException:  # noqa: BLE001, S110 - the first error is the one raised
                pass
            raise

    def reserve(self, state: dict[str, torch.Tensor]) -> int:
        """Allocate the staging memory for saves of ``state`` ahead (``--reserve``), untimed;
        the bytes reserved (host and device)."""
        return 0

    def save(self, state: dict[str, torch.Tensor], n: int) -> tuple[float, float]:
        raise NotImplementedError

    def discard(self, n: int) -> None:
        """Delete save ``n`` (after it was measured) to bound disk use; no-op if unsafe."""

    def close(self) -> None:
        pass


class _Ckptstore(_Method):
    name = "ckptstore"
    staging = "auto"

    def open(self) -> None:
        from ckptstore import Checkpointer, EncodingOptions, StagingOptions

        self.ckpt = Checkpointer(
            self.ws.child(self.name),
            encoding=EncodingOptions(compression=self.compression),
            staging=StagingOptions(mode=self.staging),
        )

    def reserve(self, state) -> int:
        self.ckpt.reserve(state).result(timeout=600)
        device_pool = self.ckpt.engine.device_pool
        held = 0 if device_pool is None else device_pool.allocated_bytes
        return self.ckpt.engine.pool.allocated_bytes + held

    def save(self, state, n):
        t0 = time.perf_counter()
        handle = self.ckpt.save(n, state)
        t1 = time.perf_counter()
        stall = self.stall(t0)
        handle.wait()
        t2 = time.perf_counter()
        return t1 - t0, stall, t2 - t0

    def close(self) -> None:
        self.ckpt.close()


class _CkptstoreHost(_Ckptstore):
    name = "ckptstore_host"
    staging = "host"


class _CkptstoreNoScan(_Ckptstore):
    """The Checkpointer without its health scan (``HealthPolicy(scan=False)``): what the
    scan costs, measured beside ``ckptstore`` (only when named in ``--methods``)."""

    name = "ckptstore_noscan"

    def open(self) -> None:
        from ckptstore import Checkpointer, EncodingOptions, HealthPolicy, StagingOptions

        self.ckpt = Checkpointer(
            self.ws.child(self.name),
            encoding=EncodingOptions(compression=self.compression),
            staging=StagingOptions(mode=self.staging),
            health=HealthPolicy(scan=False),
        )


class _CkptstoreNoRecheck(_Ckptstore):
    """The Checkpointer reading back none of the unchanged chunks it references
    (``EncodingOptions(recheck_every=0)``): what the rechecks cost, measured beside
    ``ckptstore`` with ``--incremental`` (only when named in ``--methods``)."""

    name = "ckptstore_norecheck"

    def open(self) -> None:
        from ckptstore import Checkpointer, EncodingOptions, StagingOptions

        self.ckpt = Checkpointer(
            self.ws.child(self.name),
            encoding=EncodingOptions(compression=self.compression, recheck_every=0),
            staging=StagingOptions(mode=self.staging),
        )


class _CkptstoreDcp(_Method):
    name = "ckptstore_dcp"

    def open(self) -> None:
        from ckptstore import EncodingOptions
        from ckptstore.dcp import StoreWriter

        self.writer = StoreWriter(
            self.ws.child(self.name), encoding=EncodingOptions(compression=self.compression)
        )

    def save(self, state, n):
        import torch.distributed.checkpoint as dcp

        with common.quiet_dcp():
            t0 = time.perf_counter()
            future = dcp.async_save(state, storage_writer=self.writer, no_dist=True)
            t1 = time.perf_counter()
            stall = self.stall(t0)
            self.committed(future)
            t2 = time.perf_counter()
        return t1 - t0, stall, t2 - t0


def _dcp_writer(ws: common.Workspace, path_parts: tuple[str, ...]):
    if ws.is_local:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(ws.path(*path_parts))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(ws.child(*path_parts))


class _DcpAsync(_Method):
    name = "dcp_async"

    def save(self, state, n):
        import torch.distributed.checkpoint as dcp

        writer = _dcp_writer(self.ws, (self.name, f"save-{n:04d}"))
        with common.quiet_dcp():
            t0 = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writer, no_dist=True)
            t1 = time.perf_counter()
            stall = self.stall(t0)
            self.committed(future)
            t2 = time.perf_counter()
        return t1 - t0, stall, t2 - t0

    def discard(self, n: int) -> None:
        self.ws.remove(self.name, f"save-{n:04d}")


class _DcpSync(_Method):
    name = "dcp_sync"

    def save(self, state, n):
        import torch.distributed.checkpoint as dcp

        writer = _dcp_writer(self.ws, (self.name, f"save-{n:04d}"))
        with common.quiet_dcp():
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writer, no_dist=True)
            t1 = time.perf_counter()
        return t1 - t0, self.stall(t0), t1 - t0

    def discard(self, n: int) -> None:
        self.ws.remove(self.name, f"save-{n:04d}")


class _TorchSave(_Method):
    name = "torch_save"

    def save(self, state, n):
        name = f"save-{n:04d}.pt"
        if self.ws.is_local:
            os.makedirs(self.ws.path(self.name), exist_ok=True)
            path = self.ws.path(self.name, name)
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            t1 = time.perf_counter()
        else:
            path = self.ws.path(self.name, name)
            t0 = time.perf_counter()
            with self.ws.fs.open(path, "wb") as f:
                torch.save(state, f)
            t1 = time.perf_counter()
        return t1 - t0, self.stall(t0), t1 - t0

    def discard(self, n: int) -> None:
        self.ws.remove(self.name, f"save-{n:04d}.pt")


_CLASSES: dict[str, Callable[..., _Method]] = {
    c.name: c
    for c in (
        _Ckptstore,
        _CkptstoreHost,
        _CkptstoreNoScan,
        _CkptstoreNoRecheck,
        _CkptstoreDcp,
        _DcpAsync,
        _DcpSync,
        _TorchSave,
    )
}


def methods_for(device: str) -> tuple[str, ...]:
    return CUDA_METHODS if device == "cuda" else METHODS


def _memcpy_s(dest: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> float:
    """One copy of ``state`` into ``dest``, finished (on the device too)."""
    device = next(iter(state.values())).device
    common.settle(device)
    t0 = time.perf_counter()
    for k, t in state.items():
        dest[k].copy_(t, non_blocking=True)
    common.settle(device)
    return time.perf_counter() - t0


def run_save(
    *,
    uri: str | None,
    spec: common.StateSpec,
    repeat: int = 3,
    warmup: int = 1,
    compression: str = "auto",
    methods: list[str] | None = None,
    incremental: bool = False,
    reserve: bool = False,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns the report as a JSON-ready dict."""
    from ckptstore.codec import CodecConfig

    CodecConfig.parse(compression)  # a bad --compression fails before any work
    dev = common.check_device(device)
    on_gpu = dev.type != "cpu"
    methods = list(methods_for(device)) if methods is None else methods
    say = progress or (lambda _msg: None)
    date = common.now_iso()
    say(f"building the {spec.state} state on {dev}")
    state = common.build_state(spec, dev)
    raw = common.state_bytes(state)
    probe = common.MemoryProbe()
    dest = common.zeros_like_state(state)
    _memcpy_s(dest, state)  # warm: fault in the destination pages
    pinned = (
        {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in state.items()}
        if on_gpu
        else None
    )
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    memcpy_runs: list[float] = []
    d2h_runs: list[float] = []
    first: dict[str, tuple[float, float | None]] = {}
    held: dict[str, int] = {}
    reserved: dict[str, int] = {}
    save_no = 0
    with common.Workspace(uri, command="save") as ws:
        is_local = ws.is_local
        opened: list[_Method] = []
        try:
            for name in methods:
                method = _CLASSES[name](ws, compression, dev)
                before = probe.rss()
                method.open()
                opened.append(method)
                reserved[name] = method.reserve(state) if reserve else 0
                for _ in range(warmup):
                    common.perturb(state, only_first=incremental and save_no > 0)
                    say(f"{name}: warm-up save")
                    common.settle(dev)
                    blocked_s, stall, _ = method.save(state, save_no)
                    first.setdefault(name, (blocked_s, stall))
                    if not incremental:
                        method.discard(save_no)
                    save_no += 1
                held[name] = max(0, probe.rss() - before)
            for r in range(repeat):
                for i, method in enumerate(opened):
                    common.perturb(state, only_first=incremental and save_no > 0)
                    if i == 0:  # right before the first save, in the same conditions
                        memcpy_runs.append(
                            common.median([_memcpy_s(dest, state) for _ in range(3)])
                        )
                        if pinned is not None:
                            d2h_runs.append(
                                common.median([_memcpy_s(pinned, state) for _ in range(3)])
                            )
                    bytes_before = ws.bytes_under(method.name)
                    rss_before = probe.reset()
                    common.settle(dev)
                    cpu0 = os.times()
                    blocked_s, stall, commit_s = method.save(state, save_no)
                    cpu1 = os.times()
                    first.setdefault(method.name, (blocked_s, stall))
                    peak = probe.peak()
                    peak_rss = (
                        None if peak is None else max(0, peak - rss_before) + held[method.name]
                    )
                    stored = ws.bytes_under(method.name) - bytes_before
                    if not incremental:
                        method.discard(save_no)
                    save_no += 1
                    run = {
                        "blocked_s": blocked_s,
                        "commit_s": commit_s,
                        "commit_user_s": cpu1.user - cpu0.user,
                        "commit_system_s": cpu1.system - cpu0.system,
                        "bytes_stored": stored,
                        "peak_rss_bytes": peak_rss,
                    }
                    if on_gpu:
                        run["stall_s"] = stall
                    runs[method.name].append(run)
                    say(
                        f"round {r + 1}/{repeat} {method.name}: blocked "
                        f"{format_seconds(blocked_s)}, committed {format_seconds(commit_s)}, "
                        f"{format_bytes(stored)} stored"
                    )
        finally:
            for method in opened:
                method.close()
    del dest, pinned
    memcpy_s = common.median(memcpy_runs)
    report: dict[str, Any] = {
        "command": "save",
        "date": date,
        "uri": uri or "(temporary local directory)",
        "config": {
            "state": spec.state,
            "dtype": spec.dtype,
            "size_bytes": spec.size_bytes if spec.state == "synthetic" else None,
            "tensors": spec.tensors if spec.state == "synthetic" else None,
            "repeat": repeat,
            "warmup": warmup,
            "reserve": reserve,
            "compression": compression,
            "incremental": incremental,
            "methods": methods,
            "device": common.device_info(dev),
            **common.describe_state(state),
            **({"model": common.TRAINED_MODEL} if spec.state == "trained" else {}),
            "host": common.host_info(),
        },
        "memcpy_s": memcpy_s,
        "memcpy_runs": memcpy_runs,
    }
    if on_gpu:
        report["d2h_s"] = common.median(d2h_runs)
    for name in methods:
        rs = runs[name]
        peaks = [r["peak_rss_bytes"] for r in rs if r["peak_rss_bytes"] is not None]
        blocked = common.median([r["blocked_s"] for r in rs])
        stored = int(common.median([r["bytes_stored"] for r in rs]))
        report[name] = {
            "blocked_s": blocked,
            "commit_s": common.median([r["commit_s"] for r in rs]),
            "commit_user_s": common.median([r["commit_user_s"] for r in rs]),
            "commit_system_s": common.median([r["commit_system_s"] for r in rs]),
            "bytes_stored": stored,
            "stored_vs_raw": stored / raw,
            "peak_rss_bytes": int(common.median(peaks)) if peaks else None,
            "held_rss_bytes": held[name],
            "reserved_bytes": reserved[name],
            "blocked_vs_memcpy": common.ratio(blocked, memcpy_s),
            "runs": rs,
        }
        if on_gpu:
            stall = common.median([r["stall_s"] for r in rs])
            report[name] |= {
                "stall_s": stall,
                "stall_vs_memcpy": common.ratio(stall, memcpy_s),
                "first_blocked_s": first[name][0],
                "first_stall_s": first[name][1],
                "first_stall_vs_stall": common.ratio(first[name][1], stall),
            }
    report["ratios"] = _ratios(report)
    report["notes"] = _notes(report, ws_local=is_local)
    return report


def _ratios(report: dict[str, Any]) -> dict[str, float | None]:
    ours = report.get("ckptstore")
    if ours is None:
        return {}
    out: dict[str, float | None] = {
        "blocked_vs_memcpy": common.ratio(ours["blocked_s"], report["memcpy_s"])
    }
    if "stall_s" in ours:
        out["stall_vs_memcpy"] = ours["stall_vs_memcpy"]
        out["first_stall_vs_stall"] = ours["first_stall_vs_stall"]
        out["first_blocked_vs_blocked"] = common.ratio(ours["first_blocked_s"], ours["blocked_s"])
        if "dcp_async" in report:
            out["stall_vs_dcp_async"] = common.ratio(
                ours["stall_s"], report["dcp_async"]["stall_s"]
            )
    for base in ("dcp_async", "dcp_sync", "torch_save"):
        other = report.get(base)
        if other is None:
            continue
        if base == "dcp_async":
            out["blocked_vs_dcp_async"] = common.ratio(ours["blocked_s"], other["blocked_s"])
        out[f"commit_vs_{base}"] = common.ratio(ours["commit_s"], other["commit_s"])
        out[f"stored_vs_{base}"] = common.ratio(ours["bytes_stored"], other["bytes_stored"])
    through_dcp, dcp_async = report.get("ckptstore_dcp"), report.get("dcp_async")
    if through_dcp is not None and dcp_async is not None:
        out["dcp_backend_blocked_vs_dcp_async"] = common.ratio(
            through_dcp["blocked_s"], dcp_async["blocked_s"]
        )
        out["dcp_backend_commit_vs_dcp_async"] = common.ratio(
            through_dcp["commit_s"], dcp_async["commit_s"]
        )
    return out


def _notes(report: dict[str, Any], *, ws_local: bool) -> list[str]:
    notes = [
        "medians over rounds; each round times memcpy then every method once",
        "state rotated by one element before every save: no save can dedupe against another"
        if not report["config"]["incremental"]
        else "incremental: only the first tensor changes between saves",
        "peak_rss_bytes: VmHWM after clear_refs, above RSS before the save, plus held_rss_bytes",
    ]
    if "d2h_s" in report:
        notes.append(
            "stall: from the call until a kernel enqueued on the training stream right after it "
            "ran; memcpy_s device to device, d2h_s device to pinned host"
        )
    if ws_local:
        notes.append("torch_save is fsync-ed; DCP FileSystemWriter and ckptstore fsync too")
    return notes


def print_table(report: dict[str, Any]) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    cfg = report["config"]
    print(
        f"ckptbench save  {report['date']}  {cfg['state']} {'/'.join(cfg['dtypes'])} state, "
        f"{format_bytes(cfg['raw_bytes'])} in {cfg['n_tensors']} tensors -> {report['uri']}"
    )
    on_gpu = "d2h_s" in report
    floors = f"memcpy {format_seconds(report['memcpy_s'])}"
    if on_gpu:
        floors = (
            f"on {cfg['device']['device']}: device-to-device {format_seconds(report['memcpy_s'])}"
            f", device-to-pinned-host {format_seconds(report['d2h_s'])}"
        )
    print(
        f"medians of {rounds(cfg['repeat'])} (after {cfg['warmup']} warm-up); ckptstore "
        f"compression {cfg['compression']}; {floors}"
    )
    rows = []
    for name in cfg["methods"]:
        m = report[name]
        peak = m["peak_rss_bytes"]
        row = [name, format_seconds(m["blocked_s"]), f"{m['blocked_vs_memcpy']:.1f}x"]
        if on_gpu:
            row += [
                format_seconds(m["stall_s"]),
                format_seconds(m["first_blocked_s"]),
                format_seconds(m["first_stall_s"]),
            ]
        row += [
            format_seconds(m["commit_s"]),
            format_bytes(m["bytes_stored"]),
            f"{m['stored_vs_raw']:.3f}",
            "n/a" if peak is None else format_bytes(peak),
        ]
        rows.append(row)
    gpu_columns = ["stall", "1st blocked", "1st stall"] if on_gpu else []
    table(
        [
            "method",
            "blocked",
            "vs memcpy",
            *gpu_columns,
            "committed",
            "stored",
            "stored/raw",
            "peak RSS",
        ],
        rows,
    )
    if report["ratios"]:
        print(ratio_line(report["ratios"], "ckptstore's ratios"))
    for note in report["notes"]:
        print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    common.check_counts(args)
    common.check_device(args.device)
    spec = common.state_spec_from_args(args)
    known = methods_for(args.device)
    methods = common.parse_methods(args.methods, known + OPT_IN_METHODS if args.methods else known)
    report = run_save(
        uri=args.uri,
        spec=spec,
        repeat=args.repeat,
        warmup=args.warmup,
        compression=args.compression,
        methods=methods,
        incremental=args.incremental,
        reserve=args.reserve,
        device=args.device,
        progress=logger.info,
    )
    if args.json:
        print_json(report)
    else:
        print_table(report)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "save",
        help="time checkpoint saves: ckptstore vs DCP async/sync vs torch.save, vs memcpy",
        description="Blocked time, time to commit, bytes stored and peak memory of one save, "
        "for ckptstore, DCP async_save through ckptstore's backend (ckptstore_dcp), DCP "
        "async_save, DCP save and torch.save side by side in one run (methods ckptstore, "
        "ckptstore_dcp, dcp_async, dcp_sync, torch_save), with a memcpy of the same state as "
        "the floor. Works under a fresh ckptbench-<random>/ "
        "directory and deletes it. --methods also takes, beside ckptstore, ckptstore_noscan "
        "(no health scan) and ckptstore_norecheck (no read-back of unchanged chunks; with "
        "--incremental, what the rechecks cost).",
    )
    common.add_common_args(p)
    p.add_argument(
        "--incremental",
        action="store_true",
        help="change only the first tensor between saves (shows deduplication)",
    )
    p.add_argument(
        "--reserve",
        action="store_true",
        help="ckptstore: reserve the staging memory (Checkpointer.reserve) before the first "
        "save, untimed; with --warmup 0 the first measured save is a reserved first save",
    )
    p.set_defaults(func=run)
    return p
