"""One load path (issue 31, drift 3): a tiered ``Checkpointer.load`` that reads a step from
durable storage keeps the plain load's guarantees: the manifest read once (by rank 0, shared),
each chunk several ranks need fetched once and sent to the others, the ranks agreeing after each
phase, fallback to an older step; a local copy is still read by its own rank alone.

Real gloo ranks (``tests/_dist.py``); each rank's durable GETs are counted at its store's
backend (``test_requests.CountingBackend``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckptstore import Checkpointer, EncodingOptions, StorageOptions, Store, TierOptions
from ckptstore.catalog import load_manifest, read_rank_index
from ckptstore.tiers.restore import DURABLE, LOCAL
from tests.helpers.counting import CountingBackend
from tests.helpers.dist import gathered, run_ranks

CHUNK = 64 * 1024
ENCODING = EncodingOptions(chunk_bytes=CHUNK, compression="none", hedge_uploads=False)
SHARED_CHUNKS, OWN_CHUNKS = 6, 2


def _state(rank: int, step: int) -> dict:
    """``shared``: the same on every rank (``SHARED_CHUNKS`` chunks); ``own``: the rank's."""
    shared = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "shared": torch.rand(SHARED_CHUNKS * CHUNK // 4, generator=shared),
        "own": torch.rand(OWN_CHUNKS * CHUNK // 4, generator=own),
        "step": step,
    }


def _blank() -> dict:
    return {
        "shared": torch.zeros(SHARED_CHUNKS * CHUNK // 4),
        "own": torch.zeros(OWN_CHUNKS * CHUNK // 4),
        "step": -1,
    }


class _Gets:
    """What a ``CountingBackend`` saw: the path of each GET."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def add(self, kind: str, path: str) -> None:
        if kind == "get":
            self.paths.append(str(path))

    def of(self, part: str) -> int:
        """GETs of paths that contain ``part`` (``/commits/``: manifests)."""
        return sum(part in p for p in self.paths)


def _ckpt(root: Path, rank: int, store: Store | None = None) -> Checkpointer:
    return Checkpointer(
        root / "durable",
        tiers=TierOptions(local_dir=root / f"node{rank}", node_rank=rank, durable_every=1),
        storage=StorageOptions(store=store, timeout_s=20.0),
        encoding=ENCODING,
    )


def _counted(root: Path, tally: _Gets) -> Store:
    store = Store(str(root / "durable"))
    store.backend = CountingBackend(store.backend, tally)
    return store


def _save(rank: int, root: Path, steps: list[int]) -> None:
    ckpt = _ckpt(root, rank)
    for step in steps:
        handle = ckpt.save(step, _state(rank, step))
        handle.wait(timeout_s=60)
        handle.durable.result(timeout=60)
    ckpt.wait()
    ckpt.close()


def _wipe(root: Path, rank: int) -> None:
    dist.barrier()
    shutil.rmtree(root / f"node{rank}")
    dist.barrier()


def _load(rank: int, root: Path, tally: _Gets, **kw) -> tuple[int, Checkpointer, dict]:
    ckpt = _ckpt(root, rank, store=_counted(root, tally))
    state = _blank()
    step = ckpt.load(state, **kw)
    expected = _state(rank, step)
    for key in ("shared", "own"):
        assert torch.equal(state[key], expected[key]), f"rank {rank}: {key} of step {step}"
    assert state["step"] == step
    return step, ckpt, state


def _wiped_nodes_read_durable_once(rank: int, world: int, root: str) -> None:
    root = Path(root)
    _save(rank, root, [1])
    _wipe(root, rank)  # every node replaced: only durable storage holds step 1
    tally = _Gets()
    step, ckpt, _ = _load(rank, root, tally)
    source, exchange = ckpt.last_load.source, ckpt.last_load_exchange
    ckpt.close()
    assert step == 1 and source == DURABLE, (step, source)
    manifests = gathered(tally.of("/commits/"))
    assert sum(manifests) == 1, f"manifest GETs by rank: {manifests}"  # rank 0's, shared
    chunks = gathered(tally.of("/chunks/"))
    # The shared tensor's chunks once in all, each rank's own chunks by that rank.
    assert sum(chunks) == SHARED_CHUNKS + OWN_CHUNKS * world, f"chunk GETs by rank: {chunks}"
    assert exchange is not None and exchange.fetched + exchange.received == SHARED_CHUNKS


@pytest.mark.dist
def test_ranks_restoring_from_durable_storage_read_the_manifest_and_shared_chunks_once(tmp_path):
    run_ranks(_wiped_nodes_read_durable_once, 2, str(tmp_path), timeout_s=150)


def _one_node_wiped(rank: int, world: int, root: str) -> None:
    root = Path(root)
    _save(rank, root, [1])
    if rank == 1:
        shutil.rmtree(root / "node1")
    dist.barrier()
    tally = _Gets()
    step, ckpt, _ = _load(rank, root, tally)
    source = ckpt.last_load.source
    ckpt.close()
    assert step == 1 and source == (LOCAL if rank == 0 else DURABLE), (rank, source)
    manifests = gathered(tally.of("/commits/"))
    # Rank 0 read the manifest to plan (its attempt) and shared it: rank 1 reads none.
    assert manifests == [1, 0], f"manifest GETs by rank: {manifests}"
    chunks = gathered(tally.of("/chunks/"))
    # Rank 0 reads its own copy; rank 1 alone reads durable storage, all of its chunks.
    assert chunks == [0, SHARED_CHUNKS + OWN_CHUNKS], f"chunk GETs by rank: {chunks}"


@pytest.mark.dist
def test_a_local_copy_stays_one_ranks_read_while_another_reads_durable_storage(tmp_path):
    run_ranks(_one_node_wiped, 2, str(tmp_path), timeout_s=150)


def _spoil_a_shared_chunk(root: Path, rank: int) -> str:
    """Flip a byte of a chunk of step 2's shared tensor in durable storage (rank 0; the name
    of the chunk on every rank)."""
    name = None
    if rank == 0:
        chunks = sorted(p for p in (root / "durable" / "chunks").rglob("*") if p.is_file())
        index = Store(str(root / "durable"))
        manifest = load_manifest(index, 2)
        older = read_rank_index(index, load_manifest(index, 1).ranks[0])
        newer = read_rank_index(index, manifest.ranks[0])
        fresh = sorted(set(newer.chunks) - set(older.chunks))
        shared = {seg.chunk for seg in newer.tensors[0].segments}
        name = sorted(set(fresh) & shared)[0]
        (bad,) = [p for p in chunks if p.name == name]
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0x20
        bad.write_bytes(bytes(data))
    return gathered(name)[0]


def _fallback_through_a_shared_chunk(rank: int, world: int, root: str) -> None:
    root = Path(root)
    _save(rank, root, [1, 2])
    _wipe(root, rank)
    bad = _spoil_a_shared_chunk(root, rank)
    dist.barrier()
    tally = _Gets()
    step, ckpt, _ = _load(rank, root, tally, fallback=True)
    ckpt.close()
    assert step == 1, f"rank {rank} loaded step {step}"  # every rank skipped step 2
    bad_gets = gathered(tally.of(bad))
    # Once by the load; then three times by rank 0's quarantine of step 2 (re-checked as a
    # verify does, its own bytes judged, then judged again under the quarantine's lease).
    assert sum(bad_gets) == 4 and bad_gets[0] >= 3, f"GETs of the corrupt chunk by rank: {bad_gets}"


@pytest.mark.dist
def test_a_corrupt_shared_chunk_is_read_once_and_every_rank_falls_back(tmp_path):
    run_ranks(_fallback_through_a_shared_chunk, 2, str(tmp_path), timeout_s=150)


def test_a_tiered_load_from_durable_storage_reads_the_manifest_once(tmp_path):
    """One process: the manifest the planner read for the step's attempt is the one loaded."""
    with _ckpt(tmp_path, 0) as ckpt:
        ckpt.save(3, _state(0, 3)).wait()
        ckpt.wait()
    shutil.rmtree(tmp_path / "node0")
    tally = _Gets()
    with _ckpt(tmp_path, 0, store=_counted(tmp_path, tally)) as ckpt:
        state = _blank()
        assert ckpt.load(state) == 3 and ckpt.last_load.source == DURABLE
    assert torch.equal(state["shared"], _state(0, 3)["shared"])
    assert tally.of("/commits/") == 1, tally.paths
