"""The burst mode: every writer writes a checkpoint at once while background readers measure
the read latency before, during and after it."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING, Any

from bench.storage.config import MAX_TIMELINE_POINTS
from bench.storage.stats import _Timeline
from ckptstore.telemetry import LatencyHistogram

if TYPE_CHECKING:
    from bench.storage.run import StorageBench


def run_burst(bench: StorageBench) -> dict[str, Any]:
    cfg = bench.config
    bench._seed(cfg.objects, [(cfg.read_bytes, 1.0)])
    small = list(bench._readable)
    phases = {name: LatencyHistogram() for name in ("before", "during", "after")}
    timeline = _Timeline()
    marks: dict[str, float] = {}  # burst_start / burst_end, seconds since t0
    readers_stop = threading.Event()
    go_writers = threading.Event()
    done_writers: list[float | None] = [None] * cfg.writers  # when each writer's last put ended
    writers_done = threading.Event()
    written = [0] * cfg.writers

    def reader(index: int) -> None:
        rng = random.Random(None if cfg.seed is None else cfg.seed * 1000 - index)
        stats = bench._new_stats("get")
        while not readers_stop.is_set():
            key, _ = small[rng.randrange(len(small))]
            start = time.perf_counter() - bench._t0
            latency = bench._get(stats, key)
            if latency is not None:
                begin, end = marks.get("burst_start"), marks.get("burst_end")
                if begin is None or start < begin:
                    phase = "before"
                elif end is None or start < end:
                    phase = "during"
                else:
                    phase = "after"
                phases[phase].record(latency)
                if len(timeline.t_s) < MAX_TIMELINE_POINTS:
                    timeline.t_s.append(start)
                    timeline.latency_s.append(latency)
                else:
                    timeline.dropped += 1
            if cfg.read_interval_s:
                readers_stop.wait(cfg.read_interval_s)

    def writer(index: int) -> None:
        rng = random.Random(None if cfg.seed is None else cfg.seed * 1000 + index)
        sizes, weights = zip(*cfg.sizes)
        plan: list[tuple[int, int]] = []
        remaining = cfg.checkpoint_bytes
        while remaining > 0:
            size = min(rng.choices(sizes, weights)[0], remaining)
            plan.append((len(plan), size))
            remaining -= size
        stats = bench._new_stats("put")

        def put_one(item: tuple[int, int]) -> None:
            seq, size = item
            if bench._stop.is_set():
                return
            if bench._put(stats, f"{bench.prefix}/rank{index:05d}-{seq:06d}", size) is not None:
                written[index] += size

        go_writers.wait()
        for _ in bench.store.map(put_one, plan, max_concurrency=cfg.queue_depth):
            pass
        done_writers[index] = time.perf_counter() - bench._t0
        if all(d is not None for d in done_writers):
            writers_done.set()

    readers = [
        threading.Thread(target=reader, args=(i,), name=f"ckptbench-bg-reader-{i}", daemon=True)
        for i in range(cfg.readers)
    ]
    writers = [
        threading.Thread(target=writer, args=(i,), name=f"ckptbench-writer-{i}", daemon=True)
        for i in range(cfg.writers)
    ]
    total_bytes = cfg.checkpoint_bytes * cfg.writers
    with bench._progress(total=total_bytes, unit="B") as bar:
        bar.unit_scale = True
        bench._t0 = time.perf_counter()
        for thread in readers + writers:
            thread.start()
        try:
            readers_stop.wait(cfg.baseline_s)  # nothing sets it yet: a bounded pause
        except BaseException:  # Ctrl-C: no reader reads what the cleanup deletes
            readers_stop.set()
            raise
        marks["burst_start"] = time.perf_counter() - bench._t0
        go_writers.set()
        deadline = time.perf_counter() + cfg.duration_s
        try:
            while any(t.is_alive() for t in writers) and not writers_done.is_set():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    bench._finish("duration")
                    break
                writers_done.wait(min(0.2, remaining))
                bar.update(sum(written) - bar.n)
        except BaseException:
            readers_stop.set()
            raise
        finally:  # also on Ctrl-C or SIGTERM: no writer puts while the cleanup deletes
            truncated = bench._stop.is_set() or not writers_done.is_set()
            bench._finish(bench._stop_reason or "done")
            bench._join(writers)
        # the burst ends with its last put, not when this loop next looked
        finished = [d for d in done_writers if d is not None]
        ended = max(finished) if not truncated and finished else None
        marks["burst_end"] = ended if ended is not None else time.perf_counter() - bench._t0
        bar.update(sum(written) - bar.n)
        readers_stop.wait(cfg.after_s)
        readers_stop.set()
        elapsed = bench._join(readers)
    burst_s = marks["burst_end"] - marks["burst_start"]
    result = bench._ops_result(burst_s)
    # Reads ran for the whole run, not only the burst: rate them over the run.
    result["get"] = bench._op_result("get", elapsed)
    read_phases = {name: h.summary() for name, h in phases.items()}
    before_p99 = read_phases["before"]["p99_s"]
    burst = {
        "writers": cfg.writers,
        "checkpoint_bytes": cfg.checkpoint_bytes,
        "bytes_written": sum(written),
        "burst_s": burst_s,
        "write_throughput_bytes_s": sum(written) / burst_s if burst_s > 0 else 0.0,
        "truncated": truncated,
        "start_s": marks["burst_start"],
        "end_s": marks["burst_end"],
        "read_bytes": cfg.read_bytes,
        "read": read_phases,
        "read_p99_during_over_before": (
            read_phases["during"]["p99_s"] / before_p99 if before_p99 > 0 else None
        ),
    }
    bench._timeline = timeline
    bench._phases = phases
    return {"duration_s": elapsed, "stop_reason": bench._stop_reason} | result | {"burst": burst}
