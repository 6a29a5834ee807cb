"""Tiers for DCP steps (issue 22): ``StoreWriter(local_dir=..., durable_every=M)`` commits every
save to each rank's local tier first and every M-th to durable storage; ``StoreReader(local_dir=
...)`` loads the newest step every rank can get, each chunk from a rank's local copy where one
holds it (sent over the group to the ranks that need it), else from durable storage.

Real gloo ranks (``tests/helpers/dist.py``), real files; durable chunk reads counted at the store's
backend. DCP writes each replicated item once, on one rank, so every load here needs chunks
that only another rank's local tier holds.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

import ckptstore.tiers.open_step as dcp_tiers
from ckptstore import StorageOptions, TierOptions
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.dcp import StoreReader
from ckptstore.store import Store
from ckptstore.tiers.identity import store_identity
from ckptstore.tiers.local import tier_copies
from ckptstore.tiers.policy import rank_dir
from tests.helpers.counting import Tally, counting_store
from tests.helpers.dcp_tiers import (
    CHUNK,
    assert_loaded,
    blank_state,
    log_records,
    node_dir,
    step_state,
    tier_writer,
)
from tests.helpers.dist import gathered, run_ranks

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


def _save_steps(root: str, local: str, steps, **options) -> None:
    writer = tier_writer(root, local, **options)
    for step in steps:
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    writer.close()  # the durable steps' drains


def _load(root: str, local: str, tally: Tally, **options) -> tuple[dict, StoreReader]:
    reader = StoreReader(
        root,
        tiers=TierOptions(local_dir=local),
        storage=StorageOptions(store=counting_store(root, tally)),
        **options,
    )
    target = blank_state()
    dcp.load(target, storage_reader=reader)
    return target, reader


def _saves_go_to_local_tiers_and_every_other_to_durable(rank: int, world: int, root: str, base):
    local = node_dir(base, rank)
    empty = StoreReader(root, tiers=TierOptions(local_dir=local))
    assert empty.latest() is None  # nothing to resume (collective, as a load)
    _save_steps(root, local, [1, 2, 3, 4])
    assert list_steps(Store(root)) == [1, 3]  # the first save and every 2nd after it
    assert empty.latest() == 4 and StoreReader(root).latest() == 3
    assert sorted(tier_copies(local, store_identity(Store(root))).copies) == [3, 4]  # keep 2
    dist.barrier()

    tally = Tally()
    target, reader = _load(root, local, tally)
    assert_loaded(target, 4)  # the newest step, which only the local tiers hold
    assert tally.chunks["get"] == 0, tally.chunks  # not one chunk from durable storage
    report = reader.last_load
    assert report is not None and report.step == 4 and report.source == "local"
    assert report.seconds > 0 and report.sources["local"].bytes > 0
    assert "durable" not in report.sources and report.sources["local"].chunks > 0
    exchange = reader.last_load_exchange
    assert exchange is not None and exchange.received > 0  # items only the other rank holds

    # An explicit durable step loads too (from the local copies, which hold it as well).
    group = dcp_tiers._load_groups[0][2]
    tally.clear()
    target, _ = _load(root, local, tally, step=3)
    assert_loaded(target, 3)
    assert tally.chunks["get"] == 0
    assert dcp_tiers._load_groups[0][2] is group  # readers share one gloo group per process


@pytest.mark.dist
def test_saves_go_to_the_local_tiers_first_and_load_from_them(tmp_path):
    run_ranks(
        _saves_go_to_local_tiers_and_every_other_to_durable,
        2,
        str(tmp_path / "durable"),
        str(tmp_path),
    )


def _wiped_node(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    _save_steps(root, local, [1, 2, 3, 4])
    dist.barrier()
    if rank == 1:  # its node replaced: the local dir is empty
        shutil.rmtree(local)
    dist.barrier()
    tally = Tally()
    target, reader = _load(root, local, tally)
    # Step 4 was on the local tiers only, and rank 1's copy is gone: step 3, the newest
    # durable one, rank 0's chunks from its local copy, rank 1's from durable storage.
    assert_loaded(target, 3)
    report = reader.last_load
    assert report is not None and report.step == 3
    store = Store(root)
    own = [set(load_rank_index(store, load_manifest(store, 3), r).chunks) for r in range(world)]
    gets = gathered(tally.chunks["get"])
    # Durable storage served rank 1's chunks, each once (either rank fetching it), and no
    # chunk that rank 0's local copy holds.
    assert sum(gets) == len(own[1] - own[0]), (gets, own)
    if rank == 0:
        assert report.source == "local" and report.sources["local"].chunks == len(own[0])
    else:
        assert report.source == "durable" and "local" not in report.sources


@pytest.mark.dist
def test_a_wiped_node_loads_the_newest_durable_step_its_peers_reading_locally(tmp_path):
    run_ranks(_wiped_node, 2, str(tmp_path / "durable"), str(tmp_path))


def _bad_local_chunk(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    _save_steps(root, local, [1, 2], durable_every=1)
    dist.barrier()
    if rank == 0:  # flip a byte of one chunk of rank 0's local copy
        chunks = sorted(
            p
            for p in (rank_dir(local, store_identity(Store(root)), 0) / "chunks").rglob("*")
            if p.is_file()
        )
        _flip_a_byte(chunks[0])
    dist.barrier()
    records = log_records("ckptstore.tiers.fetch")
    tally = Tally()
    target, reader = _load(root, local, tally)
    assert_loaded(target, 2)  # the same step, the bad chunk read from durable storage
    gets = gathered(tally.chunks["get"])
    assert sum(gets) <= 1, gets  # only that chunk (if step 2 still needs it) came from durable
    if rank == 0 and gets[0]:
        warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "local tier" in warned[0], warned


@pytest.mark.dist
def test_a_bad_chunk_in_a_local_copy_is_read_from_durable_storage(tmp_path):
    run_ranks(_bad_local_chunk, 2, str(tmp_path / "durable"), str(tmp_path))


def _no_common_step(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    _save_steps(root, local, [1, 2], durable_every=5)  # step 1 durable, step 2 local only
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local)
    dist.barrier()
    with pytest.raises(CheckpointException) as raised:
        dcp.load(
            blank_state(),
            storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=2),
        )
    for exc, _ in raised.value.failures.values():  # DCP words it as "metadata is None; ..."
        assert "no tier holds step 2 for every rank" in str(exc), exc
    target = blank_state()  # "latest" is the durable step 1
    assert StoreReader(root, tiers=TierOptions(local_dir=local)).latest() == 1
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local)))
    assert_loaded(target, 1)


@pytest.mark.dist
def test_a_step_no_tier_holds_whole_is_refused_by_name(tmp_path):
    run_ranks(_no_common_step, 2, str(tmp_path / "durable"), str(tmp_path))


def _full_local_disk(rank: int, world: int, root: str, disk: str) -> None:
    local = str(Path(disk) / f"node-{rank}")
    # ~0.7 MiB per save per rank (replicated items split between the ranks), 4 MiB shared.
    gen = torch.Generator().manual_seed(7)  # the same on both ranks: DCP saves it once
    big = {
        f"t{i}": torch.randint(0, 2**30, (CHUNK // 4,), dtype=torch.int32, generator=gen)
        for i in range(24)
    }
    writer = tier_writer(root, local, durable_every=100, local_keep_last=10)
    records = log_records("ckptstore.tiers.saving")
    for step in range(1, 7):
        state = {k: v + step for k, v in big.items()}
        dcp.save(state, storage_writer=writer, checkpoint_id=step)
    writer.wait()
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    # A few lines, not one per save: the tier full (it keeps fewer drained copies: step 1's
    # goes, and step 4 fits), steps 3 and 5 not committed there (6 in a row after 5: INFO)
    assert "not committed to the local tier" in warned[-1] and len(warned) <= 3, warned
    assert all("not committed to the local tier" in w or "is full: it keeps" in w for w in warned)
    durable = list_steps(Store(root))
    held = tier_copies(local, store_identity(Store(root))).copies
    # Every step is somewhere: the local disk filled up, and later saves went to durable.
    assert durable[0] == 1 and len(durable) > 1, durable
    assert set(durable) | set(held) == set(range(1, 7)), (durable, held)
    dist.barrier()
    target = {k: torch.zeros_like(v) for k, v in big.items()}
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local)))
    assert all(torch.equal(target[k], big[k] + 6) for k in big)


@pytest.mark.dist
def test_a_full_local_disk_sends_dcp_saves_to_durable_and_loses_nothing(tmp_path, small_disk):
    run_ranks(_full_local_disk, 2, str(tmp_path / "durable"), str(small_disk))


def test_one_process_without_torch_distributed(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    writer = tier_writer(root, local)
    for step in (1, 2):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step, no_dist=True)
    writer.wait()
    assert list_steps(Store(root)) == [1]
    tally = Tally()
    reader = StoreReader(
        root,
        tiers=TierOptions(local_dir=local),
        storage=StorageOptions(store=counting_store(root, tally)),
    )
    target = blank_state()
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_loaded(target, 2)
    assert tally.chunks["get"] == 0


def test_ls_lists_local_copies_of_dcp_steps_even_without_a_durable_store(tmp_path, capsys):
    from ckptstore.cli import main

    root, local = tmp_path / "durable", tmp_path / "local"
    writer = tier_writer(str(root), str(local))
    for step in (1, 2, 3):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step, no_dist=True)
    writer.wait()  # the durable steps' drains
    assert main(["ls", str(root), "--local-dir", str(local), "--json"]) == 0
    rows = {r["step"]: r["tiers"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows == {
        1: {"durable": True, "local": {}},  # local_keep_last=2
        2: {"durable": False, "local": {str(local): [0]}},
        3: {"durable": True, "local": {str(local): [0]}},
    }
    shutil.rmtree(root)  # the job never reached durable storage (or lost it)
    assert main(["ls", str(root), "--local-dir", str(local), "--json"]) == 0
    rows = {r["step"]: r["tiers"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows == {s: {"durable": False, "local": {str(local): [0]}} for s in (2, 3)}
    assert main(["ls", str(root)]) == 1  # without --local-dir a missing store is an error
    assert "no ckptstore checkpoints" in capsys.readouterr().err


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _copy_chunks(copy: Path, step: int) -> list[Path]:
    """The chunk files of a rank's local copy of ``step`` (its index is rank 0's there)."""
    store = Store(str(copy))
    digests = sorted(load_rank_index(store, load_manifest(store, step), 0).chunks)
    return [p for d in digests for p in (copy / "chunks").rglob(d) if p.is_file()]


def _two_nodes_save_a_local_only_step(rank: int, root: str, base: str) -> tuple[int, str]:
    """4 ranks as 2 nodes with peer copies: step 1 durable, step 2 in the local tiers (and
    peers) only. This rank's node and its local dir."""
    node = rank // 2
    local = str(Path(base) / f"node-{node}")
    writer = tier_writer(root, local, durable_every=5, peer_copies=1, node_rank=node)
    for step in (1, 2):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    writer.close()
    return node, local


def _peer_restore(rank: int, world: int, root: str, base: str) -> None:
    node, local = _two_nodes_save_a_local_only_step(rank, root, base)
    assert list_steps(Store(root)) == [1]
    dist.barrier()
    if rank == 2:  # node 1 replaced: its local dir, with its ranks' copies, is gone
        shutil.rmtree(local)
    dist.barrier()
    tally = Tally()
    target, reader = _load(root, local, tally)
    assert_loaded(target, 2)  # the newest step, from the peers' copies
    assert tally.chunks["get"] == 0, tally.chunks  # nothing from durable storage
    report = reader.last_load
    assert report is not None and report.step == 2
    if node == 1:  # what it read of its restored copy counts as the peer's, once
        assert report.source == "peer" and report.sources["peer"].chunks > 0, report
        assert "local" not in report.sources, report
    else:
        assert report.source == "local" and "peer" not in report.sources, report
    # The replaced node holds its ranks' copies again: the next load reads them locally.
    dist.barrier()
    target, reader = _load(root, local, tally)
    assert_loaded(target, 2)
    assert reader.last_load.source == "local" and tally.chunks["get"] == 0


@pytest.mark.dist
def test_a_replaced_node_restores_a_local_only_step_from_its_peers_copies(tmp_path):
    run_ranks(_peer_restore, 4, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _two_rank_local_only(rank: int, world: int, root: str, base: str) -> None:
    _save_steps(root, node_dir(base, rank), [1, 2])  # step 2 in the local tiers only


def test_verify_checks_a_local_dcp_copy_and_restore_refuses_it_by_name(tmp_path, capsys):
    from ckptstore.cli import main

    root = str(tmp_path / "durable")
    run_ranks(_two_rank_local_only, 2, root, str(tmp_path))
    for rank in (0, 1):  # each copy holds its rank's items only: that is whole for a copy
        copy = str(rank_dir(node_dir(str(tmp_path), rank), store_identity(Store(root)), rank))
        assert main(["verify", copy, "--all"]) == 0, capsys.readouterr()
        assert "FAILED" not in capsys.readouterr().out
    chunk = _copy_chunks(Path(copy), 2)[0]
    _flip_a_byte(chunk)
    assert main(["verify", copy, "--step", "2"]) == 1
    out, err = capsys.readouterr()
    assert chunk.name in out + err, (out, err)
    assert main(["restore", copy, "--step", "1", "--to", str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert "rank 1's local tier copy of a DCP step" in err and "durable store" in err, err


def _bad_chunk_of_a_local_only_step(rank: int, world: int, root: str, base: str) -> None:
    _, local = _two_nodes_save_a_local_only_step(rank, root, base)
    dist.barrier()
    if rank == 2:  # a byte of every chunk of rank 2's own copy of step 2 flipped
        for chunk in _copy_chunks(rank_dir(local, store_identity(Store(root)), 2), 2):
            _flip_a_byte(chunk)
    dist.barrier()
    with pytest.raises(CheckpointException) as raised:
        dcp.load(
            blank_state(), storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local))
        )
    why = " ".join(str(e) for e, _ in raised.value.failures.values())
    assert "this rank's copy was unlisted: a load takes a peer's copy" in why, why
    # The second load restores rank 2's copy from its holder on node 0: step 2, whole.
    target, reader = _load(root, local, Tally())
    assert_loaded(target, 2)
    assert reader.last_load.source == ("peer" if rank == 2 else "local"), reader.last_load


@pytest.mark.dist
def test_a_bad_own_copy_of_a_local_only_step_is_unlisted_and_restored_from_a_peer(tmp_path):
    run_ranks(
        _bad_chunk_of_a_local_only_step, 4, str(tmp_path / "durable"), str(tmp_path), timeout_s=240
    )


def test_a_writer_moved_to_another_store_saves_its_first_step_there_durably(tmp_path):
    """A reviewer: a StoreWriter given another store (``checkpoint_id=<uri>``) went on with the
    first store's count of saves, so its first save there stayed in the local tier alone, and
    ``durable(step)`` answered with the first store's drain of that step number."""
    first, other, local = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "local")
    writer = tier_writer(first, local, durable_every=3)
    for step in (0, 1):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step, no_dist=True)
    writer.wait()
    assert list_steps(Store(first)) == [0]
    dcp.save(step_state(5), storage_writer=writer, checkpoint_id=other, no_dist=True)
    writer.wait()
    assert list_steps(Store(other)) == [0]
    assert writer.durable(1) is None  # the first store's step 1 was never bound there
    writer.close()
    target = blank_state()
    dcp.load(target, storage_reader=StoreReader(other), no_dist=True)
    assert_loaded(target, 5)


def test_a_tiered_writer_saves_after_close_as_before(tmp_path):
    """A reviewer: a tiered StoreWriter closed (its drains stopped) and saved with again failed
    on a bare AssertionError; its next save opens the tiers again and drains as the first."""
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    writer = tier_writer(root, local, durable_every=1)
    dcp.save(step_state(1), storage_writer=writer, checkpoint_id=1, no_dist=True)
    writer.close()
    writer.close()  # twice: nothing left to finish
    dcp.save(step_state(2), storage_writer=writer, checkpoint_id=2, no_dist=True)
    writer.close()
    assert list_steps(Store(root)) == [1, 2]
    target = blank_state()
    dcp.load(target, storage_reader=StoreReader(root, step=2), no_dist=True)
    assert_loaded(target, 2)
