"""``ckptbench interference``: how much background saving slows the training loop's own steps.

A loop of fixed steps runs twice side by side in one process: without checkpointing, then
calling ``Checkpointer.save`` every step (``when_busy="skip"``: a save requested while the last
one still persists is skipped, so the loop never waits for storage). The loss of step rate has
two parts, reported apart: the time inside ``save()`` (the staging copy, ``blocked_fraction``)
and what the background stages (encode threads, uploads, the GIL, memory bandwidth) take from
the loop's own steps (``background_loss_fraction``: the steps' own time, ``save()`` excluded,
against the same steps without saving). Step kinds:

- ``gpu``: the host mostly waits, as it does while a GPU computes (a sleep plus a small op);
- ``cpu``: a CPU matmul (this machine has no GPU: the loop and the save share the cores);
- ``python``: pure-Python work, which only runs while it holds the GIL.

The Checkpointer's warning for each skipped save is counted (the table's ``skipped`` column),
not printed, and its other log lines are printed to stderr after the table (``-v``: all of them
as they come).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch

from bench.report import parse_bytes
from ckptstore import Checkpointer

KINDS = ("gpu", "cpu", "python")
_TOUCH_STRIDE = 2**18  # one float per MiB


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "interference",
        help="training-loop slowdown caused by background saves",
        description=__doc__.replace("``", ""),  # reST literals read as plain text in --help
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--uri",
        default=None,
        help="store to save into, each step kind below it in URI/KIND (default: a temp dir)",
    )
    p.add_argument("--size", default="256MiB", help="state size (default 256MiB)")
    p.add_argument(
        "--tensors", type=int, default=16, help="equal float32 tensors of the state (default 16)"
    )
    p.add_argument("--steps", type=int, default=80, help="steps per run (default 80)")
    p.add_argument("--step-s", type=float, default=0.2, help="target step time (default 0.2)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"step kinds, of {', '.join(KINDS)}")
    p.add_argument(
        "--compression",
        default="auto",
        help="ckptstore codec: auto (the Checkpointer's default), zstd, zstd:LEVEL, none "
        "(default auto)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="Checkpointer(background_nice=...): lower the save threads' priority (default 0)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _step_fn(kind: str, step_s: float):
    if kind == "gpu":
        a = torch.randn(64, 64)

        def step() -> None:
            time.sleep(step_s)
            a.mul_(1.0)

        return step
    if kind == "cpu":
        n = 256
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(20):
            a @ b  # warm up before timing
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        reps = max(1, int(step_s / ((time.perf_counter() - t0) / 20)))
        return lambda: [a @ b for _ in range(reps)]
    if kind == "python":
        t0 = time.perf_counter()
        sum(i * i for i in range(20_000))
        reps = max(1, int(step_s / (time.perf_counter() - t0)))

        def step() -> None:
            for _ in range(reps):
                sum(i * i for i in range(20_000))

        return step
    raise ValueError(f"unknown step kind {kind!r}: expected {', '.join(KINDS)}")


def _loop(step, steps: int, ckpt: Checkpointer | None, state: dict) -> dict:
    blocked, skipped, times, own = [], 0, [], []
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        for t in state.values():
            # Every chunk changes (so no save is cheapened by dedup) at a negligible host cost:
            # in GPU training the update itself happens on the device.
            t[::_TOUCH_STRIDE].add_(1.0)
        own.append(time.perf_counter() - t0)
        if ckpt is not None:
            s0 = time.perf_counter()
            handle = ckpt.save(i, state)
            if handle.skipped:
                skipped += 1
            else:
                blocked.append(time.perf_counter() - s0)
        times.append(time.perf_counter() - t0)
    out = {
        "steps_per_s": len(times) / sum(times),
        "own_steps_per_s": len(own) / sum(own),
        "median_step_s": statistics.median(times),
    }
    if ckpt is not None:
        ckpt.wait()
        out |= {
            "saves_committed": steps - skipped,
            "saves_skipped": skipped,
            "blocked_s_median": statistics.median(blocked),
            "blocked_fraction": sum(blocked) / sum(times),
        }
    return out


class _HoldRecords(logging.Handler):
    def __init__(self, held: list[logging.LogRecord]) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        self.held.append(record)


@contextlib.contextmanager
def _library_logs_held(held: list[logging.LogRecord], *, hold: bool) -> Iterator[None]:
    """While the loops run, ckptstore's log records go to ``held`` instead of stderr, so that
    none lands between the lines of the table."""
    if not hold:
        yield
        return
    library = logging.getLogger("ckptstore")
    handler, propagate = _HoldRecords(held), library.propagate
    library.addHandler(handler)
    library.propagate = False
    try:
        yield
    finally:
        library.removeHandler(handler)
        library.propagate = propagate


def _is_skipped_save(record: logging.LogRecord) -> bool:
    return record.name == "ckptstore.checkpointer" and "skipping save" in record.getMessage()


def run(args: argparse.Namespace) -> int:
    held: list[logging.LogRecord] = []
    try:
        with _library_logs_held(held, hold=not getattr(args, "verbose", False)):
            out = _measure(args)
        _print(out, as_json=args.json)
    finally:  # after the table (or the error), the records it does not already count
        for record in held:
            if not _is_skipped_save(record):
                logging.getLogger(record.name).handle(record)
    return 0


def _measure(args: argparse.Namespace) -> dict:
    size = parse_bytes(args.size)
    if args.steps < 2 or args.tensors < 1 or args.step_s <= 0:
        raise ValueError("--steps must be >= 2, --tensors >= 1, --step-s > 0")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown step kind(s) {unknown}: expected some of {', '.join(KINDS)}")
    per = max(1, size // 4 // args.tensors)
    state = {f"t{i}": torch.randn(per) for i in range(args.tensors)}
    results = {}
    for kind in kinds:
        step = _step_fn(kind, args.step_s)
        with tempfile.TemporaryDirectory(prefix="ckptbench-") as tmp:
            # Each kind saves steps 0.. again: into a store of its own (below --uri if given).
            uri = f"{args.uri.rstrip('/')}/{kind}" if args.uri else tmp
            baseline = _loop(step, args.steps, None, state)
            with Checkpointer(
                uri,
                compression=args.compression,
                when_busy="skip",
                keep_last=1,
                background_nice=args.nice,
            ) as ckpt:
                saving = _loop(step, args.steps, ckpt, state)
            again = _loop(step, args.steps, None, state)  # baseline after, for drift
        base_rate = statistics.mean([baseline["steps_per_s"], again["steps_per_s"]])
        base_own = statistics.mean([baseline["own_steps_per_s"], again["own_steps_per_s"]])
        results[kind] = {
            "baseline_steps_per_s": base_rate,
            "saving_steps_per_s": saving["steps_per_s"],
            "loss_fraction": 1.0 - saving["steps_per_s"] / base_rate,
            "blocked_fraction": saving["blocked_fraction"],
            "background_loss_fraction": 1.0 - saving["own_steps_per_s"] / base_own,
            "saves_committed": saving["saves_committed"],
            "saves_skipped": saving["saves_skipped"],
            "blocked_s_median": saving["blocked_s_median"],
        }
    return {
        "state_bytes": per * 4 * args.tensors,
        "steps": args.steps,
        "step_s": args.step_s,
        "nice": args.nice,
        "kinds": results,
    }


def _print(out: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        print(
            f"state {out['state_bytes'] / 2**20:.0f} MiB, {out['steps']} steps of "
            f"~{out['step_s']}s, a save requested every step (skipped while one persists)"
        )
        print(
            f"{'kind':8} {'base steps/s':>12} {'saving':>8} {'loss':>7} {'in save':>8} "
            f"{'bg':>6} {'saved':>6} {'skipped':>8} {'blocked':>9}"
        )
        for kind, r in out["kinds"].items():
            print(
                f"{kind:8} {r['baseline_steps_per_s']:12.2f} {r['saving_steps_per_s']:8.2f} "
                f"{r['loss_fraction']:7.1%} {r['blocked_fraction']:8.1%} "
                f"{r['background_loss_fraction']:6.1%} {r['saves_committed']:6d} "
                f"{r['saves_skipped']:8d} {r['blocked_s_median']:8.3f}s"
            )
