"""The health scan's own cost in a save's hashing pass, per GiB (issue 33):
``python -m bench.scan_cost [--size 1GiB] [--repeat 7]``.

A state of equal tensors laid out as a save lays it out (``pipeline.plan_layout``) is hashed
chunk by chunk three ways, alternated each round: hash only; hash, then the separate scan of
every tensor (``health.scan``, the device path's and the old host path's); hashed through
``health.ChunkScan``, the scan fused into the hashing pass. Medians; the scan's share is each
way's time above hash only. One thread: what a hashing thread of the save pays.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import parse_bytes
from ckptstore.codec import hash_bytes
from ckptstore.health import ChunkScan, scan
from ckptstore.pipeline import PipelineConfig, plan_layout


def measure(dtype: torch.dtype, size: int, repeat: int) -> dict[str, float]:
    """Median seconds per GiB of each way, for a state of ``size`` bytes of ``dtype``."""
    tensors = [torch.randn(size // 16 // dtype.itemsize).to(dtype) for _ in range(16)]
    layout = plan_layout(tensors, PipelineConfig())
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for t, offset in zip(tensors, layout.offsets):
        buffer[offset : offset + t.nbytes] = t.view(torch.uint8)
    raw = buffer.numpy()
    views = [buffer[o : o + t.nbytes].view(dtype) for t, o in zip(tensors, layout.offsets)]

    def hash_only() -> None:
        for c in layout.chunks:
            hash_bytes(raw[c.start : c.end])

    def separate() -> list:
        found = scan(views)
        hash_only()
        return found

    def fused() -> list:
        chunk_scan = ChunkScan(tensors, layout.offsets, layout.chunks)
        for c in layout.chunks:
            chunk_scan.hash(c.start, raw[c.start : c.end])
        return chunk_scan.result()

    if [r[:2] for r in fused()] != [r[:2] for r in separate()]:
        raise AssertionError("the fused scan counts other NaN/Inf than the separate one")
    ways = {"hash only": hash_only, "hash + separate scan": separate, "fused": fused}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeat):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - t0)
    gib = size / 2**30
    return {k: statistics.median(v) / gib for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scan_cost", description=__doc__)
    parser.add_argument("--size", default="1GiB", help="bytes of state per dtype (default 1GiB)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    args = parser.parse_args(argv)
    size = parse_bytes(args.size, what="--size")
    for dtype in (torch.float32, torch.bfloat16):
        per_gib = measure(dtype, size, args.repeat)
        for name, seconds in per_gib.items():
            share = seconds - per_gib["hash only"]
            print(
                f"{str(dtype):15s} {name:21s} {seconds * 1e3:7.1f} ms/GiB"
                f"  (scan's share {share * 1e3:6.1f} ms/GiB)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
