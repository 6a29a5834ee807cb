"""Run a test body on several ranks of a real gloo process group (spawned processes, loopback)."""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, world: int, port: int, args: tuple) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without interpreter finalization. A gloo worker thread may still
    # be dropping a finished collective whose tensors need the GIL; once finalization has begun,
    # CPython ends such a thread with pthread_exit, and the unwind through torch's C++ frames
    # calls std::terminate (SIGABRT after the test passed; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks of one gloo group; fails the test if any
    rank fails or they have not all finished within ``timeout_s``."""
    ctx = mp.spawn(_rank_main, args=(fn, world, free_port(), args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world}-rank test did not finish within {timeout_s:.0f}s")


def gathered(value):
    """Every rank's ``value``, in rank order (a collective: every rank of the group calls it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _lossy_rank_main(
    rank: int, fn, world: int, port: int, pg_timeout_s: float, lost: set[int], args: tuple
) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    code = 0
    try:
        fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - the exit code tells the parent
        import traceback

        traceback.print_exc()
        code = 1
    # No barrier on the group, no destroy_process_group (a rank of it is gone): the ranks that
    # were not to be lost wait for each other on the store, so none is taken for lost by leaving.
    store.set(f"test/done/{rank}", str(code))
    try:
        store.wait([f"test/done/{r}" for r in range(world) if r not in lost], timedelta(seconds=60))
    except Exception:  # noqa: BLE001 - the parent fails the test on a rank that never ended
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks_losing(
    fn, world: int, *args, lost: set[int], timeout_s: float, pg_timeout_s: float = 60.0
) -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks of one gloo group (default timeout
    ``pg_timeout_s``) of which the ranks ``lost`` die on their own (killed, exited): fails the
    test if another rank fails or has not finished within ``timeout_s`` (a hang). The job's
    rendezvous store lives in this process, as torchrun's agent holds it, so it outlives any
    rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore(  # noqa: F841 - serves the ranks until this function returns
        "127.0.0.1", port, world, is_master=True, wait_for_workers=False
    )
    procs = [
        ctx.Process(target=_lossy_rank_main, args=(r, fn, world, port, pg_timeout_s, lost, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    if hung:
        pytest.fail(f"rank(s) {hung} of {world} did not finish within {timeout_s:.0f}s (a hang)")
    failed = [r for r, p in enumerate(procs) if r not in lost and p.exitcode != 0]
    if failed:
        pytest.fail(f"rank(s) {failed} failed (exit codes {[procs[r].exitcode for r in failed]})")
