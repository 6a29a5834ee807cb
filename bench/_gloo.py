"""A gloo process group of ranks on this machine, over loopback (the bench's process ranks)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from ckptstore.errors import one_line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_loopback_group(rank: int, world: int, port: int, *, timeout_s: float) -> None:
    """Join the gloo group of ``world`` ranks rendezvousing on 127.0.0.1:``port``, one
    intra-op thread per rank (many ranks share few cores)."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


class RankFailed(OSError):
    """A rank of the run failed, or the ranks did not finish in time (exit status 1)."""


# What a rank fails with because another rank failed first: never the cause to name.
_CONSEQUENCES = ("RankLostError", "RanksOutOfStepError", "DistBackendError", "DistNetworkError")
_GRACE_S = 5.0  # after a rank failed, how long the others get to fail with their own reason


def run_ranks(
    fn: Callable[..., dict], args: tuple, world: int, *, what: str, timeout_s: float
) -> list[dict]:
    """``fn(rank, *args)`` on ``world`` spawned processes (``torch.multiprocessing``); the
    report each returned, by rank. A rank that raises makes the run :class:`RankFailed`, in one
    line naming the rank whose error caused the others' (not one that lost a peer); so do ranks
    not all done within ``timeout_s``. Ctrl-C stops every rank; no rank prints a traceback
    and none leaves a file behind."""
    import torch.multiprocessing as mp

    # torch logs a line per rank it terminates once one failed; the error says which failed
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="ckptbench-ranks-") as out:
        # Started with Ctrl-C ignored: one that comes while a rank still imports torch would
        # print its traceback; each rank takes Ctrl-C again once running (_rank_entry).
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            ctx = mp.spawn(_rank_entry, args=(fn, args, out), nprocs=world, join=False)
        finally:
            signal.signal(signal.SIGINT, interrupt)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(
                timeout=max(0.1, deadline - time.monotonic()), grace_period=_GRACE_S
            ):
                if time.monotonic() > deadline:
                    raise RankFailed(f"the {what} did not finish within {timeout_s:.0f} s")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            raise RankFailed(f"the {what}: {_cause(out, world, exc)}") from None
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]


def _rank_entry(rank: int, fn: Callable[..., dict], args: tuple, out: str) -> None:
    """One spawned rank: its report, or its error in one line, into ``out``. It leaves without
    interpreter finalization, which a gloo thread still dropping a finished collective can turn
    into SIGABRT (pytorch/pytorch#179291)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # and the parent's death signal
    status = 0
    try:
        Path(out, f"rank-{rank}.json").write_text(json.dumps(fn(rank, *args)))
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the parent says it
        status = 130
    except BaseException as exc:  # noqa: BLE001 - told to the parent, which names it
        Path(out, f"rank-{rank}.error").write_text(one_line(exc))
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _cause(out: str, world: int, exc: Exception) -> str:
    """The rank whose error to name: the first whose error is not a consequence of another's
    (``_CONSEQUENCES``), else the first that failed; how the process ended when none wrote one."""
    errors = {}
    for rank in range(world):
        path = Path(out, f"rank-{rank}.error")
        if path.exists():
            errors[rank] = path.read_text()
    if not errors:
        return str(exc)
    causes = [r for r, e in errors.items() if not e.startswith(_CONSEQUENCES)]
    rank = causes[0] if causes else min(errors)
    others = len(errors) - 1
    return f"rank {rank} failed: {errors[rank]}" + (
        f" ({others} other rank(s) failed too)" if others else ""
    )
