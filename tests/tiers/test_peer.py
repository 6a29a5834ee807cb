"""Peer-memory staging over real gloo groups: restore from the guard, fall back to storage."""

from __future__ import annotations

import pytest
import torch

from ckptstore import Checkpointer, StagingOptions
from ckptstore.peer import PeerReplicas, guard_of, ward_of
from tests.helpers.dist import run_ranks


def _state(rank: int, step: int) -> dict:
    return {
        "w": torch.full((3000,), float(100 * rank + step)),
        "b": torch.arange(7) * rank,
        "meta": {"rank": rank, "step": step},
    }


def _blank() -> dict:
    return {"w": torch.zeros(3000), "b": torch.zeros(7, dtype=torch.int64), "meta": {}}


def _worker(rank: int, world: int, root: str) -> None:
    ckpt = Checkpointer(root, staging=StagingOptions(mode="peer", ranks_per_node=1))
    assert ckpt._peers.guard == (rank + 1) % world
    for step in (1, 2):
        ckpt.save(step, _state(rank, step))
    ckpt.wait()
    assert ckpt._peers.held.step == 2

    # a rank that lost its state gets it back from its guard's memory
    state = _blank()
    assert ckpt.load(state) == 2 and ckpt.last_load_source == "peer"
    assert torch.equal(state["w"], _state(rank, 2)["w"])
    assert torch.equal(state["b"], _state(rank, 2)["b"]) and state["meta"]["rank"] == rank

    # a stale replica (step 1 asked, step 2 held): storage
    state = _blank()
    assert ckpt.load(state, step=1) == 1 and ckpt.last_load_source == "storage"
    assert torch.equal(state["w"], _state(rank, 1)["w"])

    # rank 0 restarted: it lost the replica it guarded, so its ward falls back to storage;
    # everyone else, rank 0 included, restores from memory
    if rank == 0:
        ckpt._peers = ckpt._saver._peers = PeerReplicas(ckpt._group.group, ranks_per_node=1)
    state = _blank()
    ckpt.load(state)
    ward_of_0 = ward_of(0, world)
    assert ckpt.last_load_source == ("storage" if rank == ward_of_0 else "peer")
    assert torch.equal(state["w"], _state(rank, 2)["w"])

    # a corrupted replica is detected by its hash and the ward reads storage instead
    ckpt.save(3, _state(rank, 3)).wait()
    if rank == 1:
        ckpt._peers.held.buffer[5] ^= 0xFF
    state = _blank()
    ckpt.load(state)
    assert ckpt.last_load_source == ("storage" if rank == ward_of(1, world) else "peer")
    assert torch.equal(state["w"], _state(rank, 3)["w"])
    ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_restore_from_guard_memory_and_fallbacks(tmp_path, world):
    run_ranks(_worker, world, str(tmp_path))


def test_guard_is_one_node_over():
    assert [guard_of(r, 8, ranks_per_node=4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [ward_of(guard_of(r, 6, 2), 6, 2) for r in range(6)] == list(range(6))
    with pytest.raises(ValueError, match="at least 2 ranks"):
        guard_of(0, 1)


def test_peer_staging_needs_a_process_group(tmp_path):
    with pytest.raises(ValueError, match="staging='peer' needs torch.distributed"):
        Checkpointer(tmp_path, staging="peer")
