"""One writer per distinct chunk through DCP (issue 36): DCP's planner gives an item that
several ranks save under one name one writer; ``StoreWriter`` also gives one writer to the same
bytes saved under different names (a tied weight on two pipeline stages, a copy each rank keeps
under its own key), counted at the S3 server, and a writer killed mid-save leaves no step."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ckptstore import EncodingOptions, StorageOptions
from ckptstore.catalog import list_steps
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.store import Store
from tests.helpers.counting import CountingBackend, Tally
from tests.helpers.dcp_tiers import called_late
from tests.helpers.dist import run_ranks, run_ranks_losing

CHUNK = 64 * 1024
ENCODING = EncodingOptions(chunk_bytes=CHUNK, compression="none")
WORLD = 4


def _state(step: int, rank: int) -> dict[str, Any]:
    """The same 4 chunks under a name of each rank's own, an item every rank saves under one
    name (DCP writes it on one rank), and a tensor of the rank's own."""
    same = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return {
        f"emb.{rank}": torch.randn(CHUNK, generator=same),  # 4 chunks
        "shared": torch.randn(CHUNK // 4, generator=same),  # 1 chunk
        f"own.{rank}": torch.randn(CHUNK // 4, generator=own),  # 1 chunk
    }


DISTINCT = 4 + 1 + WORLD  # chunks per save


def _named_apart(rank: int, world: int, uri: str, out: str) -> None:
    tally = Tally()
    store = Store(uri)
    store.backend = CountingBackend(store.backend, tally)
    writer = StoreWriter(uri, encoding=ENCODING, storage=StorageOptions(store=store))
    puts = []
    for step in (0, 1):  # the second save changes every chunk: nothing of it is known stored
        tally.clear()
        dcp.save(_state(step, rank), storage_writer=writer)
        assert writer.saved_step == step
        puts.append(tally.chunks["put"])
    requests = store.counters.snapshot()["requests"].get("put", {})
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"puts": puts, **requests}))
    dist.barrier()
    target = {k: torch.zeros_like(v) for k, v in _state(1, rank).items()}
    dcp.load(target, storage_reader=StoreReader(uri))
    for k, v in _state(1, rank).items():
        assert torch.equal(target[k], v), (rank, k)


@pytest.mark.dist
def test_the_same_bytes_under_different_names_are_put_once(tmp_path):
    """Four ranks save 4 chunks alike under names of their own: each distinct chunk is put
    by one rank (none answered "exists"), and the server receives the distinct bytes once."""
    from bench.scale import store_under_test

    out = tmp_path / "counts"
    out.mkdir()
    with store_under_test(None) as (bucket, _, received):
        uri = f"{bucket}/named-apart"
        before = received()
        run_ranks(_named_apart, WORLD, uri, str(out), timeout_s=240)
        got = {k: v - before[k] for k, v in received().items()}
    counts = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    assert sum(c.get("exists", 0) for c in counts) == 0, counts
    for save in (0, 1):
        assert sum(c["puts"][save] for c in counts) == DISTINCT, counts
    # Every chunk raw (compression="none") plus its 29-byte header, sent once.
    distinct_bytes = 2 * DISTINCT * (CHUNK + 29)
    assert got["chunk_put_bytes"] <= 1.05 * distinct_bytes, (got, distinct_bytes)


LOST = 2


def _killed_writer(rank: int, world: int, uri: str) -> None:
    storage = StorageOptions(lost_rank_timeout_s=8.0)
    writer = StoreWriter(uri, encoding=ENCODING, storage=storage)
    dcp.save(_state(0, rank), storage_writer=writer)
    dist.barrier()
    if rank == LOST:  # killed once the first chunk of its share of step 1 is stored
        import ckptstore.pipeline as pipeline

        encode_and_put = pipeline._encode_and_put

        def put_then_die(*args: Any, **kwargs: Any) -> Any:
            encode_and_put(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        pipeline._encode_and_put = put_then_die
        dcp.save(_state(1, rank), storage_writer=writer)
        time.sleep(60)
        raise AssertionError(f"rank {LOST} was not killed")
    with pytest.raises((CheckpointException, RuntimeError)):  # DCP's, or gloo's error
        dcp.save(_state(1, rank), storage_writer=writer)
    assert list_steps(Store(uri)) == [0]


@pytest.mark.dist
def test_a_writer_killed_mid_save_leaves_no_step(tmp_path):
    """Rank 2 dies having put one chunk of its share of the chunks every rank holds: no rank's
    save commits (no manifest names the chunks it did not put), and the step before stays
    whole."""
    root = tmp_path / "store"
    run_ranks_losing(_killed_writer, WORLD, str(root), lost={LOST}, timeout_s=240)
    from ckptstore.cli import main

    assert list_steps(Store(str(root))) == [0]
    assert main(["verify", str(root), "--step", "0"]) == 0


def _holding_the_gil(rank: int, world: int, uri: str) -> None:
    import sys

    storage = StorageOptions(lost_rank_timeout_s=4.0)
    writer = StoreWriter(uri, encoding=ENCODING, storage=storage)
    dcp.save(_state(0, rank), storage_writer=writer)  # the writers' group is made
    if rank == 1:  # one call that holds the GIL for 3 s before the round's first exchange
        check = writer._check_not_committed

        def busy_then_check(*args: Any, **kwargs: Any) -> Any:
            sys.setswitchinterval(10.0)  # no other thread (the heartbeat) runs meanwhile
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                pass
            sys.setswitchinterval(0.005)
            return check(*args, **kwargs)

        writer._check_not_committed = busy_then_check
    dcp.save(_state(1, rank), storage_writer=writer)
    assert list_steps(Store(uri)) == [0, 1]


@pytest.mark.dist
def test_a_rank_holding_the_gil_is_not_taken_for_lost_by_an_untiered_save(tmp_path):
    """Reviewer: the DCP writer's one-writer group used the tiered bound (a quarter of
    lost_rank_timeout_s to see a heartbeat move), the Checkpointer's untiered groups four times
    it; a live rank whose one call held the GIL for 3 s of a 4 s bound was named lost."""
    run_ranks(_holding_the_gil, 2, str(tmp_path / "s"), timeout_s=120)


def _two_writers_in_flight(rank: int, world: int, uri: str) -> None:
    groups = [dist.new_group(backend="gloo") for _ in range(2)]  # one per save in flight
    writers = [StoreWriter(uri, encoding=ENCODING) for _ in groups]
    # The saves reach write_data in the order of their script on rank 0, the other on rank 1.
    called_late(writers[1 - rank], "write_data", 1.0)
    futures = [
        dcp.async_save(_state(step, rank), storage_writer=w, checkpoint_id=step, process_group=g)
        for step, w, g in zip((1, 2), writers, groups)
    ]
    for future in futures:
        future.result(timeout=60)
    assert list_steps(Store(uri)) == [1, 2]
    target = {k: torch.zeros_like(v) for k, v in _state(2, rank).items()}
    dcp.load(target, storage_reader=StoreReader(uri))
    assert all(torch.equal(target[k], v) for k, v in _state(2, rank).items())


@pytest.mark.dist
def test_two_writers_saving_at_once_each_write_their_own_step(tmp_path):
    """Each writer's group of rounds of one writer per chunk was made on its save's thread:
    where rank 1's threads ran in the other order than rank 0's, the first writer's group on
    rank 0 was the second's on rank 1, and each round exchanged with the other save's."""
    run_ranks(_two_writers_in_flight, 2, str(tmp_path / "s"), timeout_s=150)
