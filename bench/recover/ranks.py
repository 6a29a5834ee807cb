"""The ranks of a job: gloo processes on this machine, each running its front-end's save or
restore job and writing its report (:func:`run_job`)."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from bench._gloo import free_port, join_loopback_group
from bench.recover.adapters import frontend_of
from bench.recover.frontend import restore_job, save_job
from bench.recover.plan import RankFailed, RecoverPlan


def rank_main(rank: int, plan: RecoverPlan, world: int, port: int, out: str, job: str) -> None:
    """One rank of one job (``torch.multiprocessing.spawn``): its report into ``out``."""
    import torch.distributed as dist

    join_loopback_group(rank, world, port, timeout_s=plan.group_timeout_s)
    run = save_job if job == "save" else restore_job
    report = run(frontend_of(plan.frontend), plan, rank)
    dist.barrier()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    if job == "restore":
        dist.destroy_process_group()
    # The save job is killed here: no close(), no teardown. Either way, leave without
    # interpreter finalization, which a gloo thread can turn into SIGABRT (tests/helpers/dist.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(plan: RecoverPlan, world: int, job: str, *, timeout_s: float) -> list[dict]:
    """``job`` on ``world`` spawned ranks; their reports, by rank. Raises ``RankFailed`` when a
    rank fails or they are not all done within ``timeout_s``."""
    import torch.multiprocessing as mp

    # torch logs a line per rank it terminates once one failed; the error says which failed
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="ckptbench-recover-") as out:
        ctx = mp.spawn(
            rank_main, args=(plan, world, free_port(), out, job), nprocs=world, join=False
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise RankFailed(f"the {job} job did not finish within {timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise RankFailed(
                f"the {job} job: rank {exc.error_index} failed: {lines[-1].strip()}"
            ) from None
        except mp.ProcessExitedException as exc:
            raise RankFailed(f"the {job} job: {exc}") from None
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]
