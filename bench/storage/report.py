"""The output of a storage bench run: the table and the plot."""

from __future__ import annotations

import sys
from typing import Any

from bench.report import (
    format_bytes,
    format_rate,
    format_seconds,
    table,
)
from bench.storage.run import StorageBench
from ckptstore.cli.signals import raise_if_stopped
from ckptstore.telemetry import LatencyHistogram

MIN_P99_SAMPLES = 100  # fewer answers in a phase: its "p99" is its slowest read


def print_table(result: dict[str, Any], out=None) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    out = out or sys.stdout
    print(
        f"ckptbench storage {result['mode']} on {result['uri']} "
        f"({result['writers']} writers, {result['readers']} readers, "
        f"{format_seconds(result['duration_s'])}, stopped by {result['stop_reason']})",
        file=out,
    )
    rows = []
    for op in ("put", "get"):
        if op not in result:
            continue
        r = result[op]
        idle = result["writers" if op == "put" else "readers"] == 0
        if idle and not r["ops"] and not r["errors"]:
            continue
        rows.append(
            [op, r["ops"], f"{r['ops_s']:.0f}", format_rate(r["throughput_bytes_s"])]
            + [format_seconds(r[k]) for k in ("p50_s", "p90_s", "p99_s", "p999_s", "max_s")]
            + [r["errors"], r["retries"]]
        )
    table(
        [
            "op",
            "ops",
            "ops/s",
            "throughput",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "errors",
            "retries",
        ],
        rows,
        out=out,
    )
    for op in ("put", "get"):
        if op in result and result[op]["errors_by_type"]:
            kinds = ", ".join(f"{k}: {v}" for k, v in result[op]["errors_by_type"].items())
            print(f"{op} errors: {kinds}", file=out)
    if result.get("gets_from_page_cache"):
        print(
            "note: the gets of a local store read objects this run had just written, mostly "
            "from the page cache: memory speed, not the disk's",
            file=out,
        )
    burst = result.get("burst")
    if burst:
        print(
            f"\nburst: {burst['writers']} writers x {format_bytes(burst['checkpoint_bytes'])} "
            f"in {format_seconds(burst['burst_s'])} = "
            f"{format_rate(burst['write_throughput_bytes_s'])}"
            + (" (truncated by --duration-s)" if burst["truncated"] else ""),
            file=out,
        )
        rows = [
            [phase, s["count"]]
            + [format_seconds(s[k]) for k in ("p50_s", "p90_s", "p99_s", "p999_s", "max_s")]
            for phase, s in burst["read"].items()
        ]
        print(f"background reads of {format_bytes(burst['read_bytes'])}:", file=out)
        table(["phase", "reads", "p50", "p90", "p99", "p99.9", "max"], rows, out=out)
        ratio = burst["read_p99_during_over_before"]
        if ratio is not None:
            few = min(burst["read"]["before"]["count"], burst["read"]["during"]["count"])
            caveat = (
                f" (from as few as {few} reads in a phase: too few for a p99, read it as the "
                "max; a larger --checkpoint-bytes or more --writers lengthens the burst)"
                if few < MIN_P99_SAMPLES
                else ""
            )
            print(f"read p99 during / before the burst: {ratio:.2f}x{caveat}", file=out)
    if "faults" in result:
        injected = ", ".join(f"{k}: {v}" for k, v in sorted(result["faults"]["injected"].items()))
        print(f"injected: {injected or 'nothing'}", file=out)
    cleanup = result.get("cleanup", {})
    if cleanup.get("kept"):
        print(f"kept {result['uri'].rstrip('/')}/{result['prefix']}/", file=out)
    elif cleanup:
        print(f"cleanup: deleted {cleanup['deleted']} objects, {cleanup['left']} left", file=out)


def _cdf_points(hist: LatencyHistogram) -> tuple[list[float], list[float]]:
    """(latency_s, fraction) pairs from the histogram, dense in the tail."""
    fractions = [q / 1000 for q in range(1, 1000)]
    fractions += [1 - 10 ** (-k / 20) for k in range(61, 101)]  # 0.999 .. 0.99999
    return [hist.percentile_s(f * 100) for f in fractions], fractions


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install 'ckptstore[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(bench: StorageBench, result: dict[str, Any], path: str) -> None:
    """Latency CDFs per operation; for burst, background read latency over time as well."""
    plt = _require_matplotlib()
    burst = result.get("burst")
    ncols = 2 if burst else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.6), squeeze=False)
    ax = axes[0][0]
    curves = {op: s.hist for op, s in bench._merged_stats.items() if s.ops}
    if burst:
        curves = {"put (burst)": curves.get("put")} if "put" in curves else {}
        curves |= {f"get {name}": h for name, h in bench._phases.items() if h.count}
    for label, hist in curves.items():
        xs, ys = _cdf_points(hist)
        ax.step(xs, ys, where="post", label=f"{label} (n={hist.count})")
    ax.set_xscale("log")
    ax.set_yscale("logit")
    ax.set_ylim(0.001, 0.99999)
    ticks = [0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999, 0.99999]
    ax.set_yticks(ticks, [f"p{100 * t:.5g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("percentile")
    ax.set_title("latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if burst:
        _plot_read_timeline(axes[0][1], bench._timeline, burst)
    fig.suptitle(f"ckptbench storage {result['mode']}: {result['uri']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# A window with fewer reads than this has no meaningful p99 (its "p99" is about its maximum): it
# is still drawn, since during a burst the slow reads are exactly what makes a window sparse.
SPARSE_WINDOW_READS = 5


def p99_windows(t_s, latency_s) -> tuple[float, list[float], list[float], list[int]]:
    """Background reads cut into about 60 windows by start time: (window width, window centres,
    p99 latency, reads) for every window that holds at least one read."""
    import numpy as np

    t = np.asarray(t_s, dtype=np.float64)
    lat = np.asarray(latency_s, dtype=np.float64)
    if not len(t):
        return 0.0, [], [], []
    width = max(0.05, float(t.max() - t.min()) / 60)
    window = ((t - t.min()) // width).astype(np.int64)
    centers, p99, reads = [], [], []
    for w in np.unique(window):
        sel = lat[window == w]
        centers.append(float(t.min() + (w + 0.5) * width))
        p99.append(float(np.percentile(sel, 99)))
        reads.append(len(sel))
    return width, centers, p99, reads


def _plot_read_timeline(ax, timeline, burst: dict[str, Any]) -> None:
    """Each background read, the p99 per window through all windows, sparse ones marked."""
    import numpy as np

    t, lat = np.asarray(timeline.t_s), np.asarray(timeline.latency_s)
    ax.scatter(t, lat, s=3, alpha=0.35, color="tab:blue", label="read", linewidths=0)
    width, centers, p99, reads = p99_windows(t, lat)
    if centers:
        ax.plot(centers, p99, color="tab:red", lw=1.5, label=f"p99 per {width:.2g} s")
        sparse = [(c, p) for c, p, n in zip(centers, p99, reads) if n < SPARSE_WINDOW_READS]
        if sparse:
            xs, ys = zip(*sparse)
            label = f"sparse window (< {SPARSE_WINDOW_READS} reads: about its max)"
            ax.plot(xs, ys, "o", ms=5, mfc="none", mec="tab:red", label=label)
    ax.axvspan(
        burst["start_s"],
        burst["end_s"],
        color="tab:orange",
        alpha=0.2,
        label=f"burst: {burst['writers']} writers",
    )
    ax.set_yscale("log")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("read latency (s)")
    ax.set_title(f"{format_bytes(burst['read_bytes'])} reads during a checkpoint burst")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
