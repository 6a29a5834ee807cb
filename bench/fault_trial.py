"""Fault trial of the tiers (issue 32): kill a tiered job at random, restart it, check the load.

``python -m bench.fault_trial --frontend checkpointer|dcp --rounds N --seed S [--json]``

Each round starts a job of 4 ranks as 2 nodes (ranks 0,1 on node 0; 2,3 on node 1) on a real
gloo group (processes over loopback; the rendezvous store lives in this process, as torchrun's
agent holds it, so ranks can die). Every node has its own ``local_dir``; saves go local first,
then to one peer node, and every 2nd (and the first of each run) is drained to a durable store
in a local directory. The job loads what is there (``Checkpointer.load(fallback=True)``, or a
tiered DCP ``StoreReader``), then saves steps 1, 2, ... after it, each a deterministic state of
(rank, step). Each rank logs when ``wait()`` (the DCP ``save``) returned for a step and when its
durable future completed. At a seeded random moment (during the load or the save loop) one
fault is injected: SIGKILL of one rank, of one node's ranks or of all ranks, or SIGTERM of one
node's ranks (a Checkpointer then saves its step durably and leaves: ``handle_sigterm=True``; a
DCP rank dies of it). The moment is 0-8 s after every rank joined the group (so a fault may
come during the load), or after every rank loaded with ``--after-load``. About a third of the
rounds also wipe the struck node's ``local_dir``. Survivors get ``--bound-s`` to end on their
own; any still alive then is a *hang*: its stacks go to its ``rank-<r>.out`` (SIGUSR1,
``faulthandler``), then it is killed. After the last round a job only loads, to check it.

Every restart is checked, per rank (a *violation* otherwise):

* the step S loaded is >= the newest step any rank of any earlier job saw reported durable,
  before or after the fault (and nothing loads only if nothing was ever reported durable);
* every rank loads the same S, and its tensors equal the state of (rank, S) bit for bit
  (never a mix of saves);
* no load raised an error before the fault (one that fails after it, a rank of the load lost,
  is counted as ``failed (after the fault)``).

Also reported: loads by source tier (``last_load.source``), local commits lost (the newest
step ``wait()`` returned for in the jobs before, less the step loaded), rank exits. The fault
schedule is a function of the seed; the moments a process reaches are the machine's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD, NODES = 4, 2
FAULTS = ("kill-rank", "kill-node", "kill-all", "term-node")
CHUNK = 64 * 1024
TENSORS = 3  # of CHUNK bytes each, per rank
LOST_S = 8.0  # StorageOptions.lost_rank_timeout_s
PG_S = 15.0  # the default group's timeout (DCP's own exchanges wait up to it)


def state_of(rank: int, step: int) -> dict[str, Any]:
    """What rank ``rank`` saves at ``step`` (its own keys: DCP writes a shared key once)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"r{rank}.t{i}": torch.randn(CHUNK // 4, generator=g) for i in range(TENSORS)}


def _same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


# -- a rank ------------------------------------------------------------------------------------


class _Log:
    """One JSON line per event, appended to the rank's file (it outlives a SIGKILL)."""

    def __init__(self, path: Path) -> None:
        import threading

        self._f, self._lock = open(path, "a", buffering=1), threading.Lock()

    def __call__(self, ev: str, **kw: Any) -> None:
        with self._lock:
            self._f.write(json.dumps({"t": time.time(), "ev": ev, **kw}) + "\n")


class _CheckpointerRank:
    def __init__(self, root: str, tiers: Any, storage: Any, encoding: Any) -> None:
        from ckptstore import Checkpointer, PreemptionOptions

        preemption = PreemptionOptions(handle_sigterm=True, sigterm_grace_s=20)
        self.ckpt = Checkpointer(
            root, tiers=tiers, storage=storage, encoding=encoding, preemption=preemption
        )

    def load(self, state: dict) -> tuple[int | None, str | None]:
        from ckptstore.errors import CheckpointNotFoundError

        try:
            step = self.ckpt.load(state, fallback=True)
        except CheckpointNotFoundError:
            return None, None
        assert self.ckpt.last_load.step in (None, step), (step, self.ckpt.last_load)
        return step, self.ckpt.last_load.source

    def save(self, step: int, state: dict) -> Any:
        handle = self.ckpt.save(step, state)
        handle.wait()
        return handle.durable

    @property
    def preempted(self) -> bool:
        return self.ckpt.preempted

    def close(self) -> None:
        self.ckpt.close()


class _DCPRank:
    def __init__(self, root: str, tiers: Any, storage: Any, encoding: Any) -> None:
        self.root, self.tiers, self.storage, self.encoding = root, tiers, storage, encoding
        self.writer = None

    def load(self, state: dict) -> tuple[int | None, str | None]:
        import torch.distributed.checkpoint as dcp

        from ckptstore.dcp import StoreReader

        reader = StoreReader(self.root, tiers=self.tiers, storage=self.storage)
        if reader.latest() is None:
            return None, None
        dcp.load(state, storage_reader=reader)
        return reader.last_load.step, reader.last_load.source

    def save(self, step: int, state: dict) -> Any:
        import torch.distributed.checkpoint as dcp

        from ckptstore.dcp import StoreWriter

        if self.writer is None:
            self.writer = StoreWriter(
                self.root, tiers=self.tiers, storage=self.storage, encoding=self.encoding
            )
        dcp.save(state, storage_writer=self.writer, checkpoint_id=step)
        return self.writer.durable(step)

    preempted = False

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _rank_main(rank: int, cfg: dict[str, Any]) -> None:
    """One rank of one job: join, load and check, then save until the fault ends it."""
    out = os.open(Path(cfg["logs"]) / f"rank-{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    import faulthandler
    import warnings

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks, before its kill

    import torch
    import torch.distributed as dist

    from ckptstore import EncodingOptions, StorageOptions, TierOptions

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    log = _Log(Path(cfg["logs"]) / f"rank-{rank}.jsonl")
    pg = timedelta(seconds=PG_S)
    store = dist.TCPStore("127.0.0.1", cfg["port"], WORLD, is_master=False, timeout=pg)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=pg)
    log("start")
    node = rank // (WORLD // NODES)
    tiers = TierOptions(
        local_dir=Path(cfg["base"]) / f"node-{node}", node_rank=node, peer_copies=1, durable_every=2
    )
    storage = StorageOptions(lost_rank_timeout_s=LOST_S)
    encoding = EncodingOptions(chunk_bytes=CHUNK, compression="none")
    front_type = _CheckpointerRank if cfg["frontend"] == "checkpointer" else _DCPRank
    front = front_type(cfg["root"], tiers, storage, encoding)
    code = 0
    try:
        target = {k: torch.zeros_like(v) for k, v in state_of(rank, 0).items()}
        t0 = time.monotonic()
        try:
            step, source = front.load(target)
        except Exception as exc:  # noqa: BLE001 - the parent judges it
            log("load", step=None, error=f"{type(exc).__name__}: {exc}")
            raise
        equal, matches = None, None
        if step is not None:
            equal = _same_bits(target, state_of(rank, step))
            if not equal:  # which steps near it each tensor came from
                near = range(max(0, step - 30), step + 31)
                matches = {
                    k: [s for s in near if state_of(rank, s)[k].equal(v)] for k, v in target.items()
                }
        log("load", step=step, source=source, equal=equal, matches=matches, s=time.monotonic() - t0)
        if cfg["load_only"]:
            return
        step = 0 if step is None else step
        while True:
            step += 1
            last = front.preempted  # SIGTERM: save this step (durably) and leave
            durable = front.save(step, state_of(rank, step))
            log("wait", step=step)
            if durable is not None:
                durable.add_done_callback(
                    lambda f, s=step: (
                        log("durable", step=s)
                        if not f.cancelled() and f.exception() is None
                        else None
                    )
                )
            if last:
                log("preempted", step=step)
                break
            time.sleep(0.05)  # the step's compute
    except BaseException as exc:  # noqa: BLE001 - logged; the parent counts exits
        log("error", error=f"{type(exc).__name__}: {exc}"[:500])
        code = 1
    finally:
        try:
            front.close()
            log("closed")
        except BaseException as exc:  # noqa: BLE001
            log("close-error", error=f"{type(exc).__name__}: {exc}"[:500])
            code = 1
    if front.preempted:
        sys.exit(0)  # the SIGTERM guard's exit hook ends the process as SIGTERM would have
    if cfg["load_only"]:  # none leaves while another may still be in the load's exchanges
        store.set(f"trial/done/{rank}", "1")
        store.wait([f"trial/done/{r}" for r in range(WORLD)], timedelta(seconds=60))
    # Leave without finalization (a gloo thread may still hold a collective's tensors).
    os._exit(code)


# -- the trial ---------------------------------------------------------------------------------


def _events(logs: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in range(WORLD):
        path = logs / f"rank-{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out[r] = [json.loads(line) for line in lines if line.endswith("}")]
    return out


def _join(procs: list[Any], within_s: float) -> list[int]:
    """Join ``procs`` for up to ``within_s``; the ranks still alive then, their stacks dumped."""
    deadline = time.monotonic() + within_s
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1 if alive else 0)
    return alive


def _stuck_in(out: Path) -> str:
    """The ckptstore frames (innermost first) of a hung rank's main thread, from the stacks
    faulthandler wrote on SIGUSR1."""
    text = out.read_text(errors="replace") if out.exists() else ""
    stack = text.rpartition("Current thread")[2].split("\n\n")[0]
    frames = re.findall(r'File "[^"]*/(ckptstore/[^"]+)", line (\d+) in (\w+)', stack)
    return " < ".join(f"{f}:{n} {fn}" for f, n, fn in frames[:3]) or "?"


def _until(pred: Any, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class Trial:
    """The rounds of one front-end on one durable store, and what their restarts loaded."""

    def __init__(
        self, frontend: str, seed: int, work: Path, bound_s: float, after_load: bool = False
    ) -> None:
        self.frontend, self.seed, self.work, self.bound_s = frontend, seed, work, bound_s
        self.after_load = after_load  # the moment counts from the loads, not from joining
        self.rng = random.Random(seed)
        self.durable_max: int | None = None  # the newest step any job saw reported durable
        self.waited_max: int | None = None  # the newest step the last job's wait() returned for
        self.last_fault = "none (an empty store)"
        self.jobs = self.rounds = self.wipes = 0
        self.faults: Counter[str] = Counter()
        self.loads: Counter[str] = Counter()
        self.exits: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.violations: list[dict[str, Any]] = []
        self.hangs: list[dict[str, Any]] = []
        self.slow: list[dict[str, Any]] = []  # ranks alive past slow_s, ended by bound_s or not
        # The bound on a survivor's end that the tier conformance tests hold each front-end to:
        # the lost-rank bound, plus DCP's own two exchanges on the default group.
        self.slow_s = LOST_S + 10 + (2 * PG_S if frontend == "dcp" else 0)
        self.lost_steps: list[int] = []  # per restart: steps past the load that wait() returned

    def _start(self, load_only: bool) -> tuple[list[Any], Path, Any]:
        import torch.distributed as dist

        from bench._gloo import free_port

        self.jobs += 1
        logs = self.work / "jobs" / f"job-{self.jobs:03d}"
        logs.mkdir(parents=True)
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=True, wait_for_workers=False)
        cfg = dict(
            port=port, logs=str(logs), root=str(self.work / "durable"),
            base=str(self.work / "local"), frontend=self.frontend, load_only=load_only,
        )  # fmt: skip
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, cfg), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
        return procs, logs, store

    def _finish(
        self, procs: list[Any], logs: Path, bound_s: float, phase: str, fault_t: float
    ) -> None:
        """Bound the job's end, then check its load and take in what it reported."""
        t0 = time.monotonic()
        slow = _join(procs, min(self.slow_s, bound_s)) if fault_t < float("inf") else []
        if slow:  # past the bound the library documents on a lost rank
            where = {r: _stuck_in(logs / f"rank-{r}.out") for r in slow}
            self.slow.append({"job": self.jobs, "ranks": slow, "phase": phase, "where": where})
        hung = _join(procs, bound_s - (time.monotonic() - t0))
        for r in hung:
            procs[r].kill()
            procs[r].join(10)
        if hung:
            where = {r: _stuck_in(logs / f"rank-{r}.out") for r in hung}
            self.hangs.append({"job": self.jobs, "ranks": hung, "phase": phase, "where": where})
        events = _events(logs)
        for r in set(slow) - set(hung):  # its last word, after the fault
            last = events[r][-1]
            self.slow[-1]["where"][r] += f" ({last['ev']} {last['t'] - fault_t:.0f}s after it)"
        for r, p in enumerate(procs):
            self.exits[str(p.exitcode)] += 1
            for e in events[r]:
                if e["ev"] in ("error", "close-error"):
                    self.errors[f"{e['ev']}: {e['error'].split(':')[0]}"] += 1
        self._check(events, fault_t)
        seen = [e["step"] for evs in events.values() for e in evs if e["ev"] == "durable"]
        if seen:
            self.durable_max = max(seen + [self.durable_max or 0])
        waited = [e["step"] for evs in events.values() for e in evs if e["ev"] == "wait"]
        self.waited_max = max(waited, default=self.waited_max)  # a job that saved none: as was

    def _check(self, events: dict[int, list[dict[str, Any]]], fault_t: float) -> None:
        loads = {r: next((e for e in evs if e["ev"] == "load"), None) for r, evs in events.items()}

        def violation(rank: int | None, what: str) -> None:
            self.violations.append(
                {"seed": self.seed, "job": self.jobs, "after": self.last_fault, "rank": rank,
                 "what": what, "durable_max": self.durable_max}
            )  # fmt: skip

        steps = {}
        for r, e in loads.items():
            if e is None:
                continue  # the fault came before this rank's load ended
            if "error" in e and e["t"] >= fault_t:
                self.loads["failed (after the fault)"] += 1  # a rank of the load was lost
                continue
            if "error" in e:
                violation(r, f"the load raised {e['error']} (before the fault)")
                continue
            steps[r], source = e["step"], e["source"]
            self.loads[source or "nothing"] += 1
            if e["step"] is None and self.durable_max is not None:
                violation(r, f"loaded nothing, but step {self.durable_max} was reported durable")
            elif e["step"] is not None and e["step"] < (self.durable_max or 0):
                violation(r, f"loaded step {e['step']} ({source}), but step {self.durable_max} "
                             "was reported durable")  # fmt: skip
            if e["equal"] is False:
                violation(r, f"step {e['step']} ({source}) is not rank {r}'s state of it: its "
                             f"tensors equal those of steps {e['matches']}")  # fmt: skip
        if len(set(steps.values())) > 1:
            violation(None, f"the ranks loaded different steps: {steps}")
        if steps and self.waited_max is not None:
            self.lost_steps.append(self.waited_max - min(s or 0 for s in steps.values()))

    def round(self, i: int) -> None:
        kind, moment = self.rng.choice(FAULTS), self.rng.uniform(0.0, 8.0)
        wipe, node, one = (
            self.rng.random() < 1 / 3,
            self.rng.randrange(NODES),
            self.rng.randrange(WORLD),
        )
        struck = {"kill-rank": [one], "kill-all": list(range(WORLD))}.get(
            kind, [2 * node, 2 * node + 1]
        )
        wiped = one // 2 if kind == "kill-rank" else node
        t0 = time.monotonic()
        procs, logs, store = self._start(load_only=False)
        anchor = "load" if self.after_load else "start"
        if not _until(lambda: all(any(e["ev"] == anchor for e in evs)
                                  for evs in _events(logs).values()), self.bound_s):  # fmt: skip
            self.hangs.append(
                {"job": self.jobs, "ranks": list(range(WORLD)), "phase": f"before {anchor}"}
            )
        time.sleep(moment)  # after every rank joined the group (or loaded): the load or the loop
        fault_t = time.time()
        for r in struck:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGTERM if kind == "term-node" else signal.SIGKILL)
        self._finish(procs, logs, self.bound_s, f"after {kind}", fault_t)
        del store
        if wipe:
            shutil.rmtree(self.work / "local" / f"node-{wiped}", ignore_errors=True)
            self.wipes += 1
        self.faults[kind] += 1
        self.rounds += 1
        self.last_fault = f"round {i}: {kind} of ranks {struck} {moment:.1f}s after {anchor}" + (
            f", node {wiped}'s local_dir wiped" if wipe else ""
        )
        print(f"[{self.frontend}] job {self.jobs} ({time.monotonic() - t0:.0f}s): "
              f"{self.last_fault}; reported durable <= {self.durable_max}, waited <= "
              f"{self.waited_max}; violations {len(self.violations)}, hangs {len(self.hangs)}",
              file=sys.stderr, flush=True)  # fmt: skip

    def run(self, rounds: int) -> dict[str, Any]:
        t0 = time.monotonic()
        for i in range(rounds):
            self.round(i)
        procs, logs, store = self._start(load_only=True)  # the restart after the last fault
        self._finish(procs, logs, 2 * self.bound_s, "the last restart's load", float("inf"))
        del store
        return {
            "frontend": self.frontend, "seed": self.seed, "rounds": self.rounds,
            "jobs": self.jobs, "seconds": round(time.monotonic() - t0, 1),
            "faults": dict(sorted(self.faults.items())), "wipes": self.wipes,
            "loads": dict(sorted(self.loads.items())), "violations": self.violations,
            "hangs": self.hangs, "hung_ranks": sum(len(h["ranks"]) for h in self.hangs),
            "slow_ends": self.slow,
            "rank_exits": dict(sorted(self.exits.items())), "rank_errors": dict(self.errors),
            "lost_local_steps": self.lost_steps, "durable_max": self.durable_max,
            "slow_s": self.slow_s,
        }  # fmt: skip


def table(s: dict[str, Any]) -> str:
    def kv(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"

    lost = s["lost_local_steps"]
    rows = [
        ("front-end", f"{s['frontend']} (seed {s['seed']}, {s['seconds']:.0f}s)"),
        ("rounds", f"{s['rounds']} faults, {s['jobs']} jobs"),
        ("faults", kv(s["faults"])),
        ("wipes", str(s["wipes"])),
        ("loads by source", kv(s["loads"])),
        ("violations", str(len(s["violations"]))),
        ("hangs", f"{s['hung_ranks']} rank(s) killed after the bound"),
        (
            "slow ends",
            f"{sum(len(h['ranks']) for h in s['slow_ends'])} rank(s) alive past "
            f"{s['slow_s']:g}s after the fault",
        ),
        ("rank exits", kv(s["rank_exits"])),
        ("rank errors", kv(s["rank_errors"])),
        ("local steps lost", f"per restart {lost}" if lost else "-"),
        ("newest durable", str(s["durable_max"])),
    ]
    lines = [f"{k:<17} {v}" for k, v in rows]
    lines += [f"  violation: {v}" for v in s["violations"]]
    lines += [f"  hang: {h}" for h in s["hangs"]]
    lines += [f"  slow end: {h}" for h in s["slow_ends"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fault_trial", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--frontend", choices=("checkpointer", "dcp"), required=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--bound-s", type=float, default=60.0, help="how long a rank may take to end"
    )
    parser.add_argument(
        "--after-load", action="store_true", help="strike only once every rank loaded"
    )
    parser.add_argument(
        "--dir",
        help="an empty directory to keep the stores and logs in (default: a temporary one)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fault-trial-") as tmp:
        work = Path(args.dir) if args.dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        trial = Trial(args.frontend, args.seed, work, args.bound_s, args.after_load)
        summary = trial.run(args.rounds)
    print(json.dumps(summary) if args.json else table(summary), flush=True)
    return 1 if summary["violations"] or summary["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
