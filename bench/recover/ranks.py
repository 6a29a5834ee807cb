"""The ranks of a job: gloo processes on this machine, each running its front-end's save or
restore job and writing its report (:func:`run_job`)."""

from __future__ import annotations

from bench._gloo import free_port, join_loopback_group, run_ranks
from bench.recover.adapters import frontend_of
from bench.recover.frontend import restore_job, save_job
from bench.recover.plan import RecoverPlan


def rank_main(rank: int, plan: RecoverPlan, world: int, port: int, job: str) -> dict:
    """One rank of one job (``bench._gloo.run_ranks``): its report. The save job ends without
    close() or teardown, as a killed job does."""
    import torch.distributed as dist

    join_loopback_group(rank, world, port, timeout_s=plan.group_timeout_s)
    run = save_job if job == "save" else restore_job
    report = run(frontend_of(plan.frontend), plan, rank)
    dist.barrier()
    if job == "restore":
        dist.destroy_process_group()
    return report


def run_job(plan: RecoverPlan, world: int, job: str, *, timeout_s: float) -> list[dict]:
    """``job`` on ``world`` spawned ranks; their reports, by rank. Raises ``RankFailed`` when a
    rank fails or they are not all done within ``timeout_s``."""
    args = (plan, world, free_port(), job)
    return run_ranks(rank_main, args, world, what=f"{job} job", timeout_s=timeout_s)
