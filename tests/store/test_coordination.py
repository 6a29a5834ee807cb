"""Coordination that does not grow per rank (issue 23): one save lease per save, held by the
coordinator (rank 0), which waits for gc and lists the committed steps once; every other rank
reads only its own index of the latest step (one GET) and puts its own index.

Requests are counted in each rank's process at the store's backend (local) or at the S3 client
(moto), as tests/store/test_requests.py counts them. ``python -m tests.store.test_coordination``
(from the repository's root) prints the LIST counts recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, StorageOptions, Store
from ckptstore.catalog import list_steps, load_rank_indexes, open_step
from ckptstore.leases import SAVE, find_leases
from ckptstore.retention import collect
from ckptstore.save import SaveSession
from tests.helpers.counting import (
    CHUNK_BYTES,
    CountingBackend,
    Tally,
    counted_checkpointer,
    moto_server,
)
from tests.helpers.dist import _rank_main, free_port, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]

N_CHUNKS = 4  # per rank and save
DIED = 7  # the exit status of a rank killed mid-save


def _rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Fresh bytes for every rank and step, ``N_CHUNKS`` chunks of them."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    return {"w": torch.rand(N_CHUNKS * CHUNK_BYTES // 4, generator=generator)}


def _count_a_save(rank: int, world: int, uri: str, out: str) -> None:
    """Save step 1, then count the requests of step 2's save (this rank's, into ``out``)."""
    tally = Tally()
    with counted_checkpointer(uri, tally) as ckpt:
        ckpt.save(1, _rank_state(rank, 1)).wait()
        tally.clear()
        ckpt.save(2, _rank_state(rank, 2)).wait()
        counts = {"chunks": dict(tally.chunks), "others": dict(tally.others)}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(counts))


def requests_per_rank(uri: str, world: int, out: Path) -> list[dict[str, dict[str, int]]]:
    """The requests each rank of a ``world``-rank save sends, by kind, for its chunks and for
    the rest (the save follows a committed step)."""
    out.mkdir()
    run_ranks(_count_a_save, world, f"{uri}/ranks-{world}", str(out), timeout_s=300)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def list_requests(ranks: list[dict[str, dict[str, int]]]) -> int:
    return sum(r["others"].get("list", 0) + r["chunks"].get("list", 0) for r in ranks)


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_uri")
    return str(tmp_path / "ckpt")


def test_lists_per_save_do_not_grow_with_ranks(uri, tmp_path):
    counts = {world: requests_per_rank(uri, world, tmp_path / f"w{world}") for world in (1, 2, 4)}
    lists = {world: list_requests(ranks) for world, ranks in counts.items()}
    assert lists[1] > 0  # the coordinator lists the gc leases and the committed steps
    assert abs(lists[2] - lists[1]) <= 2 and abs(lists[4] - lists[1]) <= 2, lists
    for world, ranks in counts.items():
        for rank, sent in enumerate(ranks):
            assert sent["chunks"] == {"put": N_CHUNKS}, (world, rank)
            if rank:  # its index of the latest step read, its index of this one put
                assert sent["others"] == {"get": 1, "put": 1}, (world, rank)
    # The coordinator's own requests beyond its chunks: the same at 1 rank and at 4 (a lease
    # renewal, a put and a delete, may fall into one save and not the other).
    coordinator = {world: sum(ranks[0]["others"].values()) for world, ranks in counts.items()}
    assert abs(coordinator[4] - coordinator[1]) <= 2, coordinator


def _unchanged_saves_dcp(rank: int, world: int, root: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreWriter

    tally = Tally()
    store = Store(root)
    store.backend = CountingBackend(store.backend, tally)
    writer = StoreWriter(
        root,
        storage=StorageOptions(store=store),
        encoding=EncodingOptions(chunk_bytes=CHUNK_BYTES, compression="none"),
    )
    state = {f"rank{rank}": _rank_state(rank, 1)["w"]}  # items of this rank's own
    dcp.save(state, storage_writer=writer, checkpoint_id=1)
    tally.clear()
    dcp.save(state, storage_writer=writer, checkpoint_id=2)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(dict(tally.chunks)))


def test_every_dcp_rank_knows_its_chunks_from_the_coordinators_plan(tmp_path):
    """The coordinator's plan hands each rank its index of the latest step: a rank other than
    the coordinator, which holds no lease, sends no request for a chunk that step holds."""
    root, out = tmp_path / "dcp", tmp_path / "counts"
    out.mkdir()
    run_ranks(_unchanged_saves_dcp, 2, str(root), str(out))
    for rank in range(2):
        assert json.loads((out / f"rank-{rank}.json").read_text()) == {}, rank
    assert list_steps(Store(root)) == [1, 2]


# -- a rank killed mid-save -----------------------------------------------------------------------


def _save_and_die(rank: int, world: int, root: str, dying: int, out: str) -> None:
    """Step 1 committed; then ``dying`` exits once its chunks of step 2 are written, and every
    other rank records how its save of step 2 ended."""
    ckpt = Checkpointer(
        root,
        encoding=EncodingOptions(chunk_bytes=CHUNK_BYTES, compression="none"),
        storage=StorageOptions(timeout_s=3.0),
    )
    ckpt.save(1, _rank_state(rank, 1)).wait()
    if rank == dying:
        SaveSession.put_index = lambda *args, **kwargs: os._exit(DIED)
    handle = ckpt.save(2, _rank_state(rank, 2))
    try:
        handle.wait(timeout_s=120)
        ended = "committed"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        ended = f"failed: {exc}"
    ckpt.close()
    Path(out, f"rank-{rank}.txt").write_text(ended)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the group lost a rank: no teardown that could wait for it


def _run_with_a_death(world: int, root: str, dying: int, out: Path) -> dict[int, int]:
    """Run ``_save_and_die`` on ``world`` processes of one gloo group (which end themselves:
    ``_rank_main`` never reaches its closing barrier); their exit codes by rank."""
    ctx = multiprocessing.get_context("spawn")
    args = (_save_and_die, world, free_port(), (root, dying, str(out)))
    procs = [ctx.Process(target=_rank_main, args=(rank, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 240
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in alive:
        procs[rank].kill()
    assert not alive, f"ranks {alive} did not finish"
    return {rank: proc.exitcode for rank, proc in enumerate(procs)}


def _chunk_keys(store: Store) -> set[str]:
    return set(store.list("chunks"))


def _referenced(store: Store) -> set[str]:
    indexes = load_rank_indexes(store, open_step(store, "latest"))
    return {f"chunks/{d[:2]}/{d}" for index in indexes for d in index.chunks}


@pytest.mark.parametrize("dying", [1, 0], ids=["a worker dies", "the coordinator dies"])
def test_a_rank_dying_mid_save_commits_nothing_and_gc_sweeps_what_it_left(tmp_path, dying):
    """Under the coordinator's single lease a dead rank still ends the save: the gather fails,
    nothing is committed, the coordinator's lease is released (or, if the coordinator died,
    stale at once on this machine), and the next gc removes the chunks of step 2."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    codes = _run_with_a_death(3, str(root), dying, out)
    assert codes == {rank: DIED if rank == dying else 0 for rank in range(3)}
    for rank in range(3):
        if rank != dying:
            assert (out / f"rank-{rank}.txt").read_text().startswith("failed:"), rank
    store = Store(root)
    assert list_steps(store) == [1]
    leases = find_leases(store, SAVE)
    assert all(not lease.live for lease in leases), leases
    assert len(leases) == (1 if dying == 0 else 0)  # a dead coordinator's lease is left behind
    kept = _referenced(store)
    assert _chunk_keys(store) > kept  # step 2's chunks, written before the death
    report = collect(store, keep_last=None)
    assert report.swept
    assert _chunk_keys(store) == kept
    assert find_leases(store) == []
    with Checkpointer(root) as ckpt:
        ckpt.verify(1)


def _print_figures() -> None:
    """LIST requests of one save (the one after a committed step) at 1, 2 and 4 ranks, on a
    local store and on a moto server, for docs/BENCHMARKS.md."""
    import tempfile

    with moto_server() as new_bucket, tempfile.TemporaryDirectory() as tmp:
        for where, uri in (("local", f"{tmp}/ckpt"), ("moto S3", f"s3://{new_bucket()}/ckpt")):
            for world in (1, 2, 4):
                ranks = requests_per_rank(uri, world, Path(tmp, f"{where}-{world}"))
                others = [sum(r["others"].values()) for r in ranks]
                print(
                    f"{where}, {world} rank(s): {list_requests(ranks)} LIST, requests "
                    f"beyond chunks per rank {others}"
                )


if __name__ == "__main__":
    _print_figures()


def _count_a_restore(rank: int, world: int, uri: str, out: str) -> None:
    tally = Tally()
    with counted_checkpointer(uri, tally) as ckpt:
        ckpt.save(1, _rank_state(rank, 1)).wait()
        state = {"w": torch.zeros(N_CHUNKS * CHUNK_BYTES // 4)}
        tally.clear()
        assert ckpt.load(state) == 1
        assert torch.equal(state["w"], _rank_state(rank, 1)["w"])
        counts = {"chunks": dict(tally.chunks), "others": dict(tally.others)}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(counts))


def test_a_restore_reads_the_manifest_once_whatever_the_ranks(tmp_path):
    """``commits/`` is one prefix: rank 0 reads the manifest and sends it to the others, which
    read only their own index (spread over hash prefixes) and their chunks."""
    out = tmp_path / "counts"
    out.mkdir()
    run_ranks(_count_a_restore, 4, str(tmp_path / "ckpt"), str(out), timeout_s=300)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    for rank, sent in enumerate(ranks):
        assert sent["chunks"] == {"get": N_CHUNKS}, rank
        if rank:
            assert sent["others"] == {"get": 1}, (rank, sent)  # its index alone
    assert ranks[0]["others"]["get"] == 2  # the manifest and its index
