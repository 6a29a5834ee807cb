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

With ``--device cuda`` the loop is a real GPU training step instead (an MLP of ``--tensors``
square layers holding ``--size`` of float32 weights, AdamW, a batch of ``--batch`` rows), run
three ways side by side: no saves, ``Checkpointer.save`` of the model and optimizer every
``--every`` steps (staging auto: through a device buffer where it fits), and DCP ``async_save``
of the same state every ``--every`` steps (each waiting for the one before, as DCP asks). The
step rate counts every step until the GPU finished it; the loss of each is reported against no
saves (measured before and after).

Noise: the loop without saves runs ``--baseline-runs`` times (3; half before the run with saves,
rounded up, the rest after), and the spread of their step rates (max - min over their mean) is
printed beside every loss figure (``±``), the figure marked ``(noise)`` when it is no larger
than that spread: a loss within it is not told apart from the run-to-run variation of the loop
itself (short runs on a shared machine vary by tens of percent). ``--json`` has the spread
(``loss_noise_fraction``, ``background_noise_fraction``) and the verdict (``*_within_noise``).

The defaults (64 MiB, 20 steps of ~0.1 s, three kinds, 3 baseline runs) take about a minute on
two shared cores. The stores are made under a fresh ``ckptbench-<random>/`` directory (of
``--uri``, or a temporary one), removed on any exit: an error, Ctrl-C, or SIGTERM; nothing else
under ``--uri`` is touched.

The Checkpointer's warning for each skipped save is counted (the table's ``skipped`` column),
not printed, and its other log lines are printed to stderr after the table (``-v``: all of them
as they come).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Iterator

import torch

from bench import _ckpt_common as common
from bench.report import parse_bytes
from ckptstore import Checkpointer, EncodingOptions, StagingOptions, StorageOptions
from ckptstore.cli.signals import raise_if_stopped, terminate_unwinds

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
        help="where to save: a local directory or s3://bucket/prefix (default: a fresh temporary "
        "directory); the bench works under <uri>/ckptbench-<random>/ and deletes it",
    )
    p.add_argument("--size", default="64MiB", help="state size (default 64MiB)")
    p.add_argument(
        "--tensors", type=int, default=16, help="equal float32 tensors of the state (default 16)"
    )
    p.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    p.add_argument("--step-s", type=float, default=0.1, help="target step time (default 0.1)")
    p.add_argument(
        "--baseline-runs",
        type=int,
        default=3,
        help="runs without saves, whose spread is the noise printed beside each loss "
        "(default 3, at least 2)",
    )
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
    common.add_device_arg(p)
    p.add_argument(
        "--every", type=int, default=40, help="--device cuda: save every N steps (default 40)"
    )
    p.add_argument(
        "--batch", type=int, default=8192, help="--device cuda: rows per step (default 8192)"
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
        with (
            terminate_unwinds(),
            _library_logs_held(held, hold=not getattr(args, "verbose", False)),
        ):
            if common.check_device(getattr(args, "device", "cpu")).type == "cuda":
                out = _measure_gpu_training(args)
                _print_gpu(out, as_json=args.json)
                return 0
            out = _measure(args)
        _print(out, as_json=args.json)
    finally:  # after the table (or the error), the records it does not already count
        for record in held:
            if not _is_skipped_save(record):
                logging.getLogger(record.name).handle(record)
    return 0


def spread(values: list[float]) -> float:
    """The noise of repeated runs: (max - min) over their mean."""
    return (max(values) - min(values)) / statistics.mean(values)


def _baseline_split(runs: int) -> tuple[int, int]:
    """Baseline runs before and after the run with saves (half before, rounded up)."""
    return runs - runs // 2, runs // 2


def _check_common(args: argparse.Namespace) -> None:
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2, got {args.steps}")
    if args.tensors < 1:
        raise ValueError(f"--tensors must be >= 1, got {args.tensors}")
    if args.baseline_runs < 2:
        raise ValueError("--baseline-runs must be >= 2 (their spread is the noise estimate)")


def _measure(args: argparse.Namespace) -> dict:
    size = parse_bytes(args.size)
    _check_common(args)
    if args.step_s <= 0:
        raise ValueError("--step-s must be > 0")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown step kind(s) {unknown}: expected some of {', '.join(KINDS)}")
    per = max(1, size // 4 // args.tensors)
    state = {f"t{i}": torch.randn(per) for i in range(args.tensors)}
    before, after = _baseline_split(args.baseline_runs)
    results = {}
    with common.Workspace(args.uri, command="interference") as ws:
        for kind in kinds:
            results[kind] = _measure_kind(args, ws.child(kind), kind, state, before, after)
    return {
        "state_bytes": per * 4 * args.tensors,
        "steps": args.steps,
        "step_s": args.step_s,
        "baseline_runs": args.baseline_runs,
        "nice": args.nice,
        "kinds": results,
    }


def _measure_kind(
    args: argparse.Namespace, uri: str, kind: str, state: dict, before: int, after: int
) -> dict:
    """One step kind's runs: saving into a store of its own at ``uri`` (each kind saves
    steps 0.. again), the loop without saves before and after."""
    step = _step_fn(kind, args.step_s)
    baselines = [_loop(step, args.steps, None, state) for _ in range(before)]
    with Checkpointer(
        uri,
        encoding=EncodingOptions(compression=args.compression),
        staging=StagingOptions(when_busy="skip"),
        storage=StorageOptions(background_nice=args.nice),
        keep_last=1,
    ) as ckpt:
        saving = _loop(step, args.steps, ckpt, state)
    # baselines after too: drift over the run counts in the spread
    baselines += [_loop(step, args.steps, None, state) for _ in range(after)]
    rates = [b["steps_per_s"] for b in baselines]
    owns = [b["own_steps_per_s"] for b in baselines]
    loss = 1.0 - saving["steps_per_s"] / statistics.mean(rates)
    background = 1.0 - saving["own_steps_per_s"] / statistics.mean(owns)
    return {
        "baseline_steps_per_s": statistics.mean(rates),
        "baseline_runs_steps_per_s": rates,
        "saving_steps_per_s": saving["steps_per_s"],
        "loss_fraction": loss,
        "loss_noise_fraction": spread(rates),
        "loss_within_noise": abs(loss) <= spread(rates),
        "blocked_fraction": saving["blocked_fraction"],
        "background_loss_fraction": background,
        "background_noise_fraction": spread(owns),
        "background_within_noise": abs(background) <= spread(owns),
        "saves_committed": saving["saves_committed"],
        "saves_skipped": saving["saves_skipped"],
        "blocked_s_median": saving["blocked_s_median"],
    }


def loss_cell(loss: float, noise: float) -> str:
    """A loss figure with its noise beside it, marked when it is within that noise."""
    return f"{loss:.1%} ±{noise:.1%}" + (" (noise)" if abs(loss) <= noise else "")


def _print(out: dict, *, as_json: bool) -> None:
    raise_if_stopped()  # a signal whose exception was dropped: no results
    if as_json:
        print(json.dumps(out))
        return
    print(
        f"state {out['state_bytes'] / 2**20:.0f} MiB, {out['steps']} steps of "
        f"~{out['step_s']}s, a save requested every step (skipped while one persists)"
    )
    print(
        f"{'kind':8} {'base steps/s':>12} {'saving':>8} {'loss':>22} {'in save':>8} "
        f"{'bg':>22} {'saved':>6} {'skipped':>8} {'blocked':>9}"
    )
    for kind, r in out["kinds"].items():
        loss = loss_cell(r["loss_fraction"], r["loss_noise_fraction"])
        bg = loss_cell(r["background_loss_fraction"], r["background_noise_fraction"])
        print(
            f"{kind:8} {r['baseline_steps_per_s']:12.2f} {r['saving_steps_per_s']:8.2f} "
            f"{loss:>22} {r['blocked_fraction']:8.1%} {bg:>22} {r['saves_committed']:6d} "
            f"{r['saves_skipped']:8d} {r['blocked_s_median']:8.3f}s"
        )
    print(_noise_legend(out["baseline_runs"]))


def _noise_legend(runs: int) -> str:
    return (
        f"±: noise, the spread of {runs} runs without saves (max - min over their mean); "
        "(noise): a loss no larger than it, not told apart from the loop's own variation"
    )


# -- --device cuda: a real training step -----------------------------------------------------------


def _gpu_training(args: argparse.Namespace, device: torch.device):
    """The model, its optimizer and one training step, the step's state already built."""
    torch.backends.cuda.matmul.allow_tf32 = True  # tensor cores, as training runs its matmuls
    size = parse_bytes(args.size)
    width = max(8, int(math.sqrt(size / 4 / args.tensors)))
    layers = [torch.nn.Linear(width, width, bias=False) for _ in range(args.tensors)]
    model = torch.nn.Sequential(*layers).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randn(args.batch, width, device=device)

    def step() -> None:
        model(batch).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)

    for _ in range(3):  # AdamW's moments exist from the first step on
        step()
    torch.accelerator.synchronize(device)
    return model, optim, step


def _dcp_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    moments = {
        f"{i}.{name}": value
        for i, per_param in optim.state_dict()["state"].items()
        for name, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }
    return {"model": model.state_dict(), "optim": moments}


def _gpu_loop(step, steps: int, every: int, save, device: torch.device) -> float:
    """Steps per second of ``steps`` steps, ``save(i)`` after every ``every``-th."""
    torch.accelerator.synchronize(device)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if save is not None and i % every == 0:
            save(i)
    torch.accelerator.synchronize(device)
    return steps / (time.perf_counter() - t0)


def _measure_gpu_training(args: argparse.Namespace) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    device = common.check_device("cuda")
    _check_common(args)
    if args.every < 1 or args.batch < 1:
        raise ValueError("--every and --batch must be >= 1")
    before, after = _baseline_split(args.baseline_runs)
    model, optim, step = _gpu_training(args, device)
    state_bytes = sum(
        t.numel() * t.element_size() for t in _dcp_state(model, optim)["optim"].values()
    )
    state_bytes += sum(p.numel() * p.element_size() for p in model.parameters())
    rates: dict[str, float] = {}
    failures: dict[str, str] = {}
    with common.Workspace(args.uri, command="interference") as ws:
        root = ws.uri
        baselines = [_gpu_loop(step, args.steps, args.every, None, device) for _ in range(before)]
        with Checkpointer(
            f"{root}/ckptstore",
            encoding=EncodingOptions(compression=args.compression),
            staging=StagingOptions(mode="auto"),
            storage=StorageOptions(background_nice=args.nice),
            keep_last=1,
        ) as ckpt:
            rates["ckptstore"] = _gpu_loop(
                step,
                args.steps,
                args.every,
                lambda i: ckpt.save(i, {"model": model, "optim": optim}),
                device,
            )
        pending = []

        def dcp_save(i: int) -> None:
            if pending:
                pending.pop().result()
            writer = dcp.FileSystemWriter(f"{root}/dcp/step-{i}")
            with common.quiet_dcp():
                pending.append(
                    dcp.async_save(_dcp_state(model, optim), storage_writer=writer, no_dist=True)
                )

        try:
            rates["dcp_async"] = _gpu_loop(step, args.steps, args.every, dcp_save, device)
            for future in pending:
                future.result()
        except (CheckpointException, RuntimeError, OSError) as e:  # ckptstore's figure stands
            failures["dcp_async"] = f"{type(e).__name__}: {e}"
        baselines += [_gpu_loop(step, args.steps, args.every, None, device) for _ in range(after)]
    base, noise = statistics.mean(baselines), spread(baselines)
    rates["none_before"], rates["none_after"] = baselines[0], baselines[-1]
    return {
        "device": common.device_info(device),
        "state_bytes": state_bytes,
        "steps": args.steps,
        "every": args.every,
        "baseline_steps_per_s": base,
        "baseline_runs": args.baseline_runs,
        "baseline_runs_steps_per_s": baselines,
        "methods": {
            name: {
                "steps_per_s": rates[name],
                "loss_fraction": 1.0 - rates[name] / base,
                "loss_noise_fraction": noise,
                "loss_within_noise": abs(1.0 - rates[name] / base) <= noise,
            }
            if name in rates
            else {"error": failures[name]}
            for name in ("ckptstore", "dcp_async")
        },
        "runs": rates,
    }


def _print_gpu(out: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    print(
        f"{out['device']['device']}: model + AdamW state {out['state_bytes'] / 2**20:.0f} MiB, "
        f"{out['steps']} steps, a save every {out['every']}; no saves "
        f"{out['baseline_steps_per_s']:.2f} steps/s"
    )
    print(f"{'method':10} {'steps/s':>8} {'loss':>22}")
    for name, r in out["methods"].items():
        if "error" in r:
            print(f"{name:10} failed: {r['error']}")
            continue
        loss = loss_cell(r["loss_fraction"], r["loss_noise_fraction"])
        print(f"{name:10} {r['steps_per_s']:8.2f} {loss:>22}")
    print(_noise_legend(out["baseline_runs"]))
