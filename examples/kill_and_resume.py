"""The README's main job: train, get killed mid-run, resume, and match an uninterrupted run.

1. trains examples/train_gpt.py uninterrupted into runs/demo/reference; its first run writes
   the token files to two replica directories, runs/demo/data-a and runs/demo/data-b, and every
   run reads them through the loader;
2. trains it again into runs/demo/crashy with tiers (``--local-dir runs/demo/local
   --durable-every 2``: every save committed to the node-local directory first, the first and
   every second save also drained to runs/demo/crashy in the background) and SIGKILLs it at
   --crash-at (mid-interval, so work since the last save is lost and a drain may be in flight);
3. runs it again: it resumes model and loader from the newest save any tier holds, here the
   local copy of a step newer than the newest durable one;
4. checks that every step after the resume has the uninterrupted run's loss and batch (a hash of
   its tokens), bit for bit.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOSS = re.compile(r"^step (\d+) loss (\S+) .*\bdata (\w+)$")


def train(ckpt: str, *extra: str) -> tuple[int, dict[int, tuple[str, str]], str]:
    """Runs train_gpt.py; its exit code, ``{step: (loss, batch hash)}`` and its output."""
    cmd = [sys.executable, str(HERE / "train_gpt.py"), "--ckpt", ckpt, *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    losses = {}
    for line in proc.stdout.splitlines():
        m = LOSS.match(line)
        if m:
            losses[int(m.group(1))] = (m.group(2), m.group(3))
    tail = [ln for ln in proc.stdout.splitlines() if not LOSS.match(ln)]
    for line in tail:
        print("   ", line)
    if proc.returncode not in (0, -9):
        sys.stderr.write(proc.stderr)
    return proc.returncode, losses, proc.stdout


def show_tiers(ckpt: str, local_dir: str) -> None:
    """Prints ``ckptstore ls CKPT --local-dir LOCAL_DIR``: each step and the tiers holding it."""
    print("$ ckptstore ls", ckpt, "--local-dir", local_dir, flush=True)
    cmd = [sys.executable, "-m", "ckptstore.cli", "ls", ckpt, "--local-dir", local_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for line in (proc.stdout + proc.stderr).splitlines():
        print("   ", line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="runs/demo", help="where the two runs checkpoint")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--crash-at", type=int, default=160)
    p.add_argument(
        "--durable-every",
        type=int,
        default=2,
        help="the killed job's tiers: every save to <root>/local, the first and every Nth to "
        "durable storage (0: no tiers, every save to durable storage)",
    )
    p.add_argument("--report", help="write every run's {step: [loss, batch hash]} here (JSON)")
    args = p.parse_args()
    root = Path(args.root)
    common = ["--steps", str(args.steps), "--every", str(args.every)]
    common += ["--data", str(root / "data-a"), "--data", str(root / "data-b")]
    tiers = []
    if args.durable_every:
        tiers = ["--local-dir", str(root / "local"), "--durable-every", str(args.durable_every)]
    for sub in ("reference", "crashy", "local", "data-a", "data-b"):
        shutil.rmtree(root / sub, ignore_errors=True)

    rc, reference, _ = train(str(root / "reference"), *common)
    if rc != 0:
        print(f"reference run failed (exit {rc})")
        return 1
    crashy = str(root / "crashy")
    rc, before, _ = train(crashy, *common, *tiers, "--crash-at", str(args.crash_at))
    if rc != -9:
        print(f"expected the crashing run to be killed (SIGKILL), got exit {rc}")
        return 1
    if tiers:  # which tier holds which step at the kill
        show_tiers(crashy, str(root / "local"))
    rc, after, out = train(crashy, *common, *tiers)
    if rc != 0 or "resumed from step" not in out:
        print(f"resume run failed (exit {rc})")
        return 1
    resumed = int(re.search(r"resumed from step (\d+)", out).group(1))
    source = "durable"
    if tiers:
        m = re.search(r"resumed from step \d+ \(source (\w+): .*; durable steps \[([\d, ]*)\]", out)
        source, durable = m.group(1), [int(s) for s in m.group(2).split(",") if s.strip()]
        newest = f"newest durable step {max(durable)}" if durable else "no durable step"
        print(
            f"killed at step {args.crash_at}, resumed from step {resumed} from the {source} tier "
            f"({newest}); {args.crash_at - resumed} steps of work redone"
        )
        if source != "local":
            print(f"expected the resume from the local tier {root / 'local'}, got {source}")
            return 1
    else:
        print(
            f"killed at step {args.crash_at}, resumed from committed step {resumed}; "
            f"{args.crash_at - resumed} steps of work redone"
        )
    if args.report:
        runs = {
            "reference": reference,
            "before": before,
            "after": after,
            "resumed": resumed,
            "source": source,
        }
        Path(args.report).write_text(json.dumps(runs))
    for what, i in (("losses", 0), ("batches", 1)):
        mismatched = [s for s in after if after[s][i] != reference.get(s, ("", ""))[i]]
        mismatched += [s for s in before if before[s][i] != reference.get(s, ("", ""))[i]]
        if mismatched or not after:
            print(f"MISMATCH of {what} at steps {sorted(mismatched)[:10]}")
            return 1
    print(
        f"OK: losses and batches of steps 1-{args.crash_at} (before the kill) and {resumed + 1}-"
        f"{args.steps} (after resume) equal the uninterrupted run bit for bit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
