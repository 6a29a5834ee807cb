"""Read once, broadcast (issue 23): ranks restoring the same chunks fetch each from storage once.

Real gloo ranks (``tests/helpers/dist.py``) restore through ``Checkpointer.load``; each rank's chunk
GETs are counted at its store's backend (``tests.helpers.counting.CountingBackend``).

``python -m tests.store.test_shared_read`` prints the figures recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckptstore import Checkpointer, EncodingOptions, ReadOptions, StorageOptions
from ckptstore.errors import CheckpointCorruptError
from ckptstore.format import ChunkInfo
from ckptstore.shared_read import ExchangePlan
from tests.helpers.counting import PathTally, Tally, counting_store
from tests.helpers.dist import gathered, run_ranks

CHUNK = 64 * 1024
ENCODING = EncodingOptions(chunk_bytes=CHUNK, compression="none", hedge_uploads=False)


def _replicated(step: int, n_chunks: int = 8) -> torch.Tensor:
    """The same on every rank: ``n_chunks`` chunks of fresh bytes per step."""
    return torch.rand(n_chunks * CHUNK // 4, generator=torch.Generator().manual_seed(step))


def _private(rank: int, n_chunks: int = 2) -> torch.Tensor:
    return torch.rand(n_chunks * CHUNK // 4, generator=torch.Generator().manual_seed(1000 + rank))


def _chunk_gets(tally: Tally) -> int:
    return tally.chunks["get"]


def _replicated_restore(rank: int, world: int, root: str, budget: int | None) -> None:
    with Checkpointer(root, encoding=ENCODING) as ckpt:
        ckpt.save(1, {"w": _replicated(1), "rank": rank}).wait()
    tally = Tally()
    reads = None if budget is None else ReadOptions(shared_read_budget_bytes=budget)
    with Checkpointer(
        root,
        storage=StorageOptions(store=counting_store(root, tally)),
        encoding=ENCODING,
        reads=reads,
    ) as ckpt:
        target = {"w": torch.zeros(8 * CHUNK // 4), "rank": -1}
        assert ckpt.load(target) == 1
        stats = ckpt.last_load_exchange
    assert target["rank"] == rank
    assert torch.equal(target["w"], _replicated(1)), f"rank {rank}"
    gets = gathered(_chunk_gets(tally))
    assert sum(gets) == 8, gets  # 8 distinct chunks, each fetched by one rank
    assert max(gets) == 2, gets  # and the fetches spread: 2 per rank
    assert stats.fetched + stats.received == 8
    if budget is not None:
        assert stats.buffer_bytes <= budget + CHUNK, stats
        assert stats.rounds >= 8 * CHUNK // budget, stats


@pytest.mark.dist
def test_a_replicated_restore_reads_each_chunk_once(tmp_path):
    run_ranks(_replicated_restore, 4, str(tmp_path), None)


@pytest.mark.dist
def test_the_exchange_holds_at_most_its_budget_and_one_chunk(tmp_path):
    run_ranks(_replicated_restore, 4, str(tmp_path), 3 * CHUNK)


def _mixed_restore(rank: int, world: int, root: str) -> None:
    def state(rank: int) -> dict:
        return {"shared": _replicated(7, n_chunks=4), "own": _private(rank)}

    with Checkpointer(root, encoding=ENCODING) as ckpt:
        ckpt.save(1, state(rank)).wait()
    tally = Tally()
    with Checkpointer(
        root, storage=StorageOptions(store=counting_store(root, tally)), encoding=ENCODING
    ) as ckpt:
        # The last rank loads only its own tensor: it shares no chunk with the others.
        alone = rank == world - 1
        target = {k: torch.zeros_like(v) for k, v in state(rank).items() if not alone or k == "own"}
        assert ckpt.load(target, strict=not alone) == 1
        stats = ckpt.last_load_exchange
    for key, value in target.items():
        assert torch.equal(value, state(rank)[key]), f"rank {rank}: {key}"
    assert (stats is None) == alone, stats
    gets = gathered(_chunk_gets(tally))
    assert gets[-1] == 2, gets  # its own 2 chunks, nothing of the shared tensor
    assert sum(gets) == 4 + 2 * world, gets  # the shared 4 once, each rank's own 2


@pytest.mark.dist
def test_a_mix_of_replicated_and_private_tensors(tmp_path):
    run_ranks(_mixed_restore, 4, str(tmp_path))


def _corrupt_restore(rank: int, world: int, root: str) -> None:
    with Checkpointer(root, encoding=ENCODING) as ckpt:
        ckpt.save(1, {"w": _replicated(1)}).wait()
        before = {p.name for p in Path(root, "chunks").rglob("*") if p.is_file()}
        ckpt.save(2, {"w": _replicated(2)}).wait()
    new = sorted(p for p in Path(root, "chunks").rglob("*") if p.is_file() and p.name not in before)
    bad = new[3]  # a chunk of step 2 only
    dist.barrier()
    if rank == 0:
        data = bytearray(bad.read_bytes())
        data[-1] ^= 0xFF
        bad.write_bytes(bytes(data))
    dist.barrier()

    tally = PathTally()
    with Checkpointer(
        root, storage=StorageOptions(store=counting_store(root, tally)), encoding=ENCODING
    ) as ckpt:
        target = {"w": torch.zeros(8 * CHUNK // 4)}
        with pytest.raises(CheckpointCorruptError) as raised:
            ckpt.load(target)
        assert bad.name in str(raised.value), raised.value
        assert "failed to load on" in str(raised.value)
    bad_gets = gathered(sum(1 for path in tally.paths if path.endswith(bad.name)))
    assert sum(bad_gets) == 1, bad_gets  # read and found corrupt by its owner alone

    with Checkpointer(root, encoding=ENCODING) as ckpt:
        target = {"w": torch.zeros(8 * CHUNK // 4)}
        assert ckpt.load(target, fallback=True) == 1  # on every rank
        assert torch.equal(target["w"], _replicated(1))


@pytest.mark.dist
def test_a_corrupt_chunk_fails_or_falls_back_on_every_rank(tmp_path):
    run_ranks(_corrupt_restore, 4, str(tmp_path))


def _info(raw: int) -> ChunkInfo:
    return ChunkInfo(raw, raw)


def test_owners_spread_by_bytes_and_rounds_keep_the_budget():
    chunks = {f"{i:032x}": _info(100) for i in range(8)}
    plan = ExchangePlan.build(0, [chunks] * 4, budget_bytes=250)
    owned = [sum(1 for o in plan.owners.values() if o == r) for r in range(4)]
    assert owned == [2, 2, 2, 2]
    assert [len(r) for r in plan.rounds] == [2, 2, 2, 2]  # 101 bytes each with its status byte
    assert all(sum(plan.sizes[d].raw + 1 for d in r) <= 250 for r in plan.rounds)


def test_private_and_disputed_chunks_are_not_exchanged():
    shared, private, disputed = "a" * 32, "b" * 32, "c" * 32
    needs = [
        {shared: _info(10), private: _info(10), disputed: _info(10)},
        {shared: _info(10), disputed: ChunkInfo(10, 11)},
        {},
    ]
    plan = ExchangePlan.build(1, needs, budget_bytes=1000)
    assert plan.owners == {shared: 1}  # rank 0 fetches its private chunk already
    assert plan.needers == {shared: [0, 1]}
    assert ExchangePlan.build(1, needs, budget_bytes=0).owners == {}


def test_a_chunk_over_the_budget_is_a_round_alone():
    needs = [{"a" * 32: _info(500), "b" * 32: _info(10), "c" * 32: _info(10)}] * 2
    plan = ExchangePlan.build(0, needs, budget_bytes=100)
    assert plan.rounds == [["a" * 32], ["b" * 32, "c" * 32]]


def _count_restore(rank: int, world: int, root: str, out: str) -> None:
    """The figures of docs/BENCHMARKS.md: chunk GETs of a 4-rank restore of replicated state."""
    with Checkpointer(root, encoding=ENCODING) as ckpt:
        ckpt.save(1, {"w": _replicated(1)}).wait()
    tally = Tally()
    with Checkpointer(
        root, storage=StorageOptions(store=counting_store(root, tally)), encoding=ENCODING
    ) as ckpt:
        target = {"w": torch.zeros(8 * CHUNK // 4)}
        ckpt.load(target)
    assert torch.equal(target["w"], _replicated(1))
    Path(out, f"{rank}.json").write_text(json.dumps(_chunk_gets(tally)))


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        run_ranks(_count_restore, world, root, out)
        gets = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
    print(f"{world} ranks, 8 distinct chunks: chunk GETs per rank {gets}, total {sum(gets)}")
    print(f"GETs per distinct chunk {sum(gets) / 8:.2f}")
