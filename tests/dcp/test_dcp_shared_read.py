"""Read once, broadcast through DCP (issue 23): ``dcp.load`` with ``StoreReader`` on several
ranks fetches each distinct chunk from storage once.

Real gloo ranks (``tests/helpers/dist.py``) save replicated state with ``StoreWriter`` and load it with
``StoreReader``; each rank's chunk GETs are counted at its store's backend, as
``tests/store/test_shared_read.py`` counts them.

``python -m tests.dcp.test_dcp_shared_read`` prints the figures recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

import ckptstore.tiers.open_step as dcp_tiers
from ckptstore import EncodingOptions, ReadOptions, StorageOptions
from ckptstore.catalog import load_manifest, load_rank_index
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.errors import CheckpointCorruptError, CheckpointError
from ckptstore.format import commit_key
from ckptstore.retention import drop_step
from ckptstore.store import Store
from tests.helpers.counting import PathTally, Tally, counting_store
from tests.helpers.dist import gathered, run_ranks

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)

CHUNK = 64 * 1024


def _state(step: int) -> dict:
    """The same on every rank (DCP has one rank write it): 8 + 4 chunks and a pickled value."""

    def rand(n_chunks: int, seed: int) -> torch.Tensor:
        return torch.rand(n_chunks * CHUNK // 4, generator=torch.Generator().manual_seed(seed))

    return {"w": rand(8, step), "v": rand(4, 100 + step), "step": step}


def _blank() -> dict:
    return {"w": torch.zeros(8 * CHUNK // 4), "v": torch.zeros(4 * CHUNK // 4), "step": -1}


def _save(root: str, step: int) -> None:
    writer = StoreWriter(
        root, step=step, encoding=EncodingOptions(chunk_bytes=CHUNK, compression=None)
    )
    dcp.save(_state(step), storage_writer=writer)


def _distinct_chunks(root: str, step: int) -> set[str]:
    store = Store(root)
    manifest = load_manifest(store, step)
    digests: set[str] = set()
    for ref in manifest.ranks:
        rank = int(ref.key.rsplit("rank-", 1)[1].split(".")[0])
        digests |= set(load_rank_index(store, manifest, rank).chunks)
    return digests


def _assert_loaded(target: dict, step: int, rank: int) -> None:
    want = _state(step)
    for key in ("w", "v"):
        got = target[key]
        assert got.dtype == want[key].dtype, f"rank {rank}: {key}"
        # bit for bit, not just equal as floats
        assert torch.equal(got.view(torch.int32), want[key].view(torch.int32)), (
            f"rank {rank}: {key}"
        )
    assert target["step"] == step, f"rank {rank}: step {target['step']}"


def _replicated_load(
    rank: int, world: int, root: str, reads: ReadOptions | None, shared: bool
) -> None:
    _save(root, 1)
    distinct = len(_distinct_chunks(root, 1))
    assert distinct >= 12, distinct  # w, v, and the pickled value
    tally = Tally()
    storage = StorageOptions(store=counting_store(root, tally))
    reader = StoreReader(root, step=1, storage=storage, reads=reads)
    target = _blank()
    dcp.load(target, storage_reader=reader)
    _assert_loaded(target, 1, rank)
    gets = gathered(tally.chunks["get"])
    if not shared:  # every rank reads every chunk it needs, as before
        assert gets == [distinct] * world, gets
        assert reader.last_load_exchange is None
        return
    assert sum(gets) == distinct, (gets, distinct)  # each distinct chunk read once
    assert max(gets) <= -(-distinct // world) + 1, gets  # and the reads spread over the ranks
    stats = reader.last_load_exchange
    assert stats is not None and stats.fetched + stats.received == distinct, stats
    budget = None if reads is None else reads.shared_read_budget_bytes
    if budget:
        assert stats.buffer_bytes <= budget + CHUNK, stats
    # over a gloo group of the readers' own (the default group may be NCCL's), with the bound
    # on a lost rank of an untiered load, the Checkpointer's (four times the option); gloo's
    # collectives keep the group's timeout: a holder may read slow durable storage
    _, tiered, group = dcp_tiers._load_groups[0]
    assert group.active and not tiered
    assert group.lost_rank_s == 4 * StorageOptions().lost_rank_timeout_s
    assert group.timeout_s == StorageOptions().group_timeout_s(0.0)


@pytest.mark.dist
@pytest.mark.parametrize(
    "reads",
    [
        None,
        # several batches (w, then v and the value) and rounds of at most 3 chunks
        ReadOptions(read_batch_bytes=4 * CHUNK, shared_read_budget_bytes=3 * CHUNK),
    ],
    ids=["defaults", "batches-and-rounds"],
)
def test_a_replicated_dcp_load_reads_each_chunk_once(tmp_path, reads):
    run_ranks(_replicated_load, 4, str(tmp_path), reads, True)


@pytest.mark.dist
def test_a_budget_of_zero_reads_on_every_rank(tmp_path):
    reads = ReadOptions(shared_read_budget_bytes=0)
    run_ranks(_replicated_load, 4, str(tmp_path), reads, False)


def _one_rank_opts_out(rank: int, world: int, root: str) -> None:
    # Ranks agree through the coordinator: one rank's 0 turns the shared read off for all.
    reads = ReadOptions(shared_read_budget_bytes=0) if rank == 2 else None
    _replicated_load(rank, world, root, reads, False)


@pytest.mark.dist
def test_one_rank_opting_out_turns_it_off_for_every_rank(tmp_path):
    run_ranks(_one_rank_opts_out, 4, str(tmp_path))


def _failures(raised: CheckpointException) -> dict[int, BaseException]:
    return {r: exc for r, (exc, _) in raised.failures.items()}


def _corrupt_load(rank: int, world: int, root: str) -> None:
    _save(root, 1)
    before = _distinct_chunks(root, 1)
    _save(root, 2)
    bad = sorted(_distinct_chunks(root, 2) - before)[3]  # a chunk of step 2 only
    dist.barrier()
    if rank == 0:
        (path,) = [p for p in Path(root, "chunks").rglob("*") if p.is_file() and p.name == bad]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()

    tally = PathTally()
    reader = StoreReader(root, step=2, storage=StorageOptions(store=counting_store(root, tally)))
    with pytest.raises(CheckpointException) as raised:
        dcp.load(_blank(), storage_reader=reader)
    failures = _failures(raised.value)
    assert sorted(failures) == list(range(world)), failures  # every rank needed it: all fail
    for r, exc in failures.items():
        assert isinstance(exc, CheckpointCorruptError), (r, exc)
        assert bad in str(exc) and "corrupt" in str(exc), (r, exc)
    bad_gets = gathered(sum(1 for path in tally.paths if path.endswith(bad)))
    assert sum(bad_gets) == 1, bad_gets  # read and found corrupt by its owner alone

    # Nothing was left waiting: the ranks load the intact step right after.
    target = _blank()
    dcp.load(target, storage_reader=StoreReader(root, step=1))
    _assert_loaded(target, 1, rank)


@pytest.mark.dist
def test_a_corrupt_chunk_fails_the_load_on_every_rank_that_needed_it(tmp_path):
    run_ranks(_corrupt_load, 4, str(tmp_path))


class _Broken(RuntimeError):
    pass


def _one_rank_fails(rank: int, world: int, root: str, where: str) -> None:
    _save(root, 1)
    reader = StoreReader(root, step=1, reads=ReadOptions(read_batch_bytes=4 * CHUNK))
    if rank == 1:

        def broken(*args, **kwargs):
            raise _Broken(f"rank 1 broke in {where}")

        # "prepare": before the batch's collective; "read": after it, the exchange not run.
        setattr(reader, "_prepare_batch" if where == "prepare" else "_read", broken)
    with pytest.raises(CheckpointException) as raised:
        dcp.load(_blank(), storage_reader=reader)
    failures = _failures(raised.value)
    assert sorted(failures) == list(range(world)), failures  # every rank stopped, none hung
    assert isinstance(failures[1], _Broken), failures[1]
    for r in (0, 2, 3):
        assert isinstance(failures[r], CheckpointError), (r, failures[r])
        assert "rank 1" in str(failures[r]), (r, failures[r])

    target = _blank()
    dcp.load(target, storage_reader=StoreReader(root, step=1))
    _assert_loaded(target, 1, rank)


@pytest.mark.dist
@pytest.mark.parametrize("where", ["prepare", "read"])
def test_a_rank_failing_stops_every_rank_without_a_wait(tmp_path, where):
    run_ranks(_one_rank_fails, 4, str(tmp_path), where)


def _load_racing_keep_last(rank: int, world: int, root: str) -> None:
    _save(root, 1)
    _save(root, 2)
    held = Path(root + ".held")
    if rank == 0:  # step 2 unlisted: "latest" is step 1
        Path(root, commit_key(2)).rename(held)
    dist.barrier()
    reader = StoreReader(root)
    get = reader.store.get
    raced: list[str] = []

    def get_racing_a_save(key, *args, **kwargs):
        # On rank 0's first rank-index read, step 2 commits and keep_last removes step 1.
        if rank == 0 and key.startswith("indexes/") and not raced:
            raced.append(key)
            held.rename(Path(root, commit_key(2)))
            drop_step(Store(root), 1)
            for path in Path(root, "indexes").rglob("*"):
                if path.is_file() and f"/{1:020d}/" in path.as_posix():
                    path.unlink()
        return get(key, *args, **kwargs)

    reader.store.get = get_racing_a_save
    target = _blank()
    dcp.load(target, storage_reader=reader)
    _assert_loaded(target, 2, rank)
    assert gathered(bool(raced)) == [True] + [False] * (world - 1)
    assert reader.last_load_exchange is not None  # read shared, over the ranks' group


@pytest.mark.dist
def test_a_shared_latest_load_whose_step_is_removed_meanwhile_reads_the_newer_one(tmp_path):
    """Every rank agrees the step was removed (one found it gone, the others stopped for it)
    and all read the newer one: no rank left with the old step's tensors."""
    run_ranks(_load_racing_keep_last, 2, str(tmp_path / "store"))


def _count_load(rank: int, world: int, root: str, out: str, budget: int) -> None:
    """The figures of docs/BENCHMARKS.md: chunk GETs of a DCP load of replicated state."""
    if budget == 0:  # the first run saves the step
        _save(root, 1)
    tally = Tally()
    reader = StoreReader(
        root,
        step=1,
        storage=StorageOptions(store=counting_store(root, tally)),
        reads=ReadOptions(shared_read_budget_bytes=budget),
    )
    target = _blank()
    dcp.load(target, storage_reader=reader)
    _assert_loaded(target, 1, rank)
    Path(out, f"{rank}.json").write_text(json.dumps(tally.chunks["get"]))


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        for label, budget in (("shared read off (budget 0)", 0), ("shared read on", 256 << 20)):
            run_ranks(_count_load, world, root, out, budget)
            gets = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
            distinct = len(_distinct_chunks(root, 1))
            print(
                f"{label}: {world} ranks, {distinct} distinct chunks: chunk GETs per rank {gets}, "
                f"total {sum(gets)}, per distinct chunk {sum(gets) / distinct:.2f}"
            )
