"""Adversarial tests of the DCP tier policy (``StoreWriter(local_dir=, durable_every=M,
local_keep_last=)`` / ``StoreReader(local_dir=)``, as first landed in 8e093f1).

Every test runs real saves and loads: real files, real gloo ranks (``tests/helpers/dist.py``), no
mock of the code under test. Each attacks one promise:

1. a load never returns the bytes of another save than the one the store committed last under
   that step, nor mixes two saves;
2. no step that ``dcp.save`` committed is lost (durable every M, local retention, fallback);
3. a damaged local copy loads the durable copy of the same step, or fails with a clear error;
4. no rank is left waiting in a collective when another rank fails (every test is bounded);
5. ``dcp.async_save`` works with tiers;
6. a world-size change loads from durable storage or fails clearly.

The review found seven bugs (a re-saved step loading the superseded save, twice; a rank failing
before the local commit hanging the other; a holder with nothing to read in a batch never
sending; a bad local chunk whose durable copy is encoded otherwise; a misleading error for a
corrupt local-only chunk); each test below reproduced its bug and passes since the fix. Two
limits are documented instead (docs/FORMAT.md, "DCP steps in tiers"): ``no_dist=True`` on some
ranks of an initialized job, and local copies outliving a durable store made again at the same
path.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckptstore import EncodingOptions, ReadOptions, TierOptions
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.store import Store
from ckptstore.tiers.identity import store_identity
from ckptstore.tiers.local import tier_copies
from ckptstore.tiers.policy import rank_dir
from tests.helpers.dcp_tiers import (
    CHUNK,
    assert_loaded,
    blank_state,
    called_late,
    log_records,
    node_dir,
    step_state,
    tier_writer,
)
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)

HANG_S = 150.0  # run_ranks bound for tests whose failure mode is a hang


# -- helpers ----------------------------------------------------------------------------------


def _same(target: dict, want: dict) -> bool:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            if not torch.equal(target[key].view(torch.int32), value.view(torch.int32)):
                return False
        elif target[key] != value:
            return False
    return True


def _loaded_seed(target: dict, seeds) -> int | None:
    """Which ``step_state(seed)`` of ``seeds`` ``target`` holds (None: none of them, or a mix)."""
    for seed in seeds:
        if _same(target, step_state(seed)):
            return seed
    return None


def _rank_store(local: str, root: str, rank: int) -> Path:
    return rank_dir(local, store_identity(Store(root)), rank)


def _failures(exc: CheckpointException) -> str:
    return " | ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in exc.failures.items())


def _load_latest(root: str, local: str, **options) -> tuple[dict, StoreReader]:
    reader = StoreReader(root, tiers=TierOptions(local_dir=local), **options)
    target = blank_state()
    dcp.load(target, storage_reader=reader)
    return target, reader


def _flip_every_chunk(store_dir: Path) -> int:
    n = 0
    for path in sorted((store_dir / "chunks").rglob("*")):
        if path.is_file():
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            n += 1
    return n


def _damage(store_dir: Path, step: int, how: str) -> None:
    if how == "flipped-chunks":
        assert _flip_every_chunk(store_dir) > 0
    elif how == "missing-chunks":
        shutil.rmtree(store_dir / "chunks")
        (store_dir / "chunks").mkdir()
    elif how == "missing-index":
        found = list((store_dir / "indexes").glob(f"*/{step:020d}/*/rank-*.json"))
        assert found, list((store_dir / "indexes").rglob("*"))
        for path in found:
            path.unlink()
    elif how == "truncated-manifest":
        path = store_dir / "commits" / f"{step:020d}.json"
        path.write_bytes(path.read_bytes()[:40])
    else:
        raise AssertionError(how)


# -- 1. a load never returns another save's bytes ----------------------------------------------


def _resave_local_only_step(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    writer = tier_writer(root, local)  # durable_every=2
    dcp.save(step_state(1), storage_writer=writer, checkpoint_id=1)  # durable + local
    dcp.save(step_state(2), storage_writer=writer, checkpoint_id=2)  # local only
    writer.wait()
    assert list_steps(Store(root)) == [1]
    # The job rolls back (or simply names step 2 again): a second save of step 2, other values.
    try:
        dcp.save(step_state(102), storage_writer=writer, checkpoint_id=2)
    except CheckpointException as exc:  # refused as write-once: fine
        assert "StepExistsError" in _failures(exc) or "already" in _failures(exc), _failures(exc)
        return
    durable = Store(root)
    assert 2 in list_steps(durable)  # the second save went to durable storage
    target = blank_state()
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=2))
    seed = _loaded_seed(target, (2, 102))
    assert seed == 102, (
        f"rank {rank}: dcp.save of step 2 returned (committed to {root} as attempt "
        f"{load_manifest(durable, 2).attempt}) but loading step 2 returned "
        f"{'the earlier save' if seed == 2 else 'a mix'} (step_state({seed}))"
    )


@pytest.mark.dist
def test_a_resaved_local_only_step_never_loads_the_superseded_save(tmp_path):
    """Re-saving a step number that only the local tiers hold (same writer): the save is not
    refused as write-once; its local commit fails (the old local manifest is there), so it
    goes to durable storage with one warning, and dcp.save returns. A later load of that step
    (or of "latest") picks the local copies of the *old* save, since ``open_tiered_step``
    prefers a step every rank holds locally without checking that durable storage holds the
    same attempt of it."""
    run_ranks(_resave_local_only_step, 2, str(tmp_path / "durable"), str(tmp_path))


def _world_change_collision_save(rank: int, world: int, root: str, local: str) -> None:
    writer = tier_writer(root, local)  # both ranks share one local dir (one node)
    dcp.save(step_state(1), storage_writer=writer, checkpoint_id=1)  # durable
    dcp.save(step_state(2), storage_writer=writer, checkpoint_id=2)  # local only
    writer.close()  # step 1's drain


def _world_change_collision_load(rank: int, world: int, root: str, local: str, want: int):
    target, reader = _load_latest(root, local)
    seed = _loaded_seed(target, (2, want))
    assert seed == want, (
        f"rank {rank}: durable storage commits step 2 as step_state({want}) (a later save by one "
        f"process), but the 2-rank load of 'latest' returned step_state({seed}) "
        f"(from {reader.last_load.source if reader.last_load else '?'})"
    )


@pytest.mark.dist
def test_a_world_size_change_that_reuses_a_step_number_loads_the_durable_save(tmp_path):
    """2 ranks save steps 1 (durable) and 2 (local only) into one local dir; the job then
    runs as one process (no_dist) with the same local dir and durable store: its next save
    gets step 2 (the 2-rank copies of step 2 are not its own, so the free-step search skips
    them), its local commit collides with the 2-rank copy and it goes to durable storage. The
    durable store now commits step 2 = the 1-process save; a 2-rank load of 'latest' must not
    return the older 2-rank save of step 2."""
    root, local = str(tmp_path / "durable"), str(tmp_path / "node")
    run_ranks(_world_change_collision_save, 2, root, local)
    writer = tier_writer(root, local)
    try:
        dcp.save(step_state(50), storage_writer=writer, no_dist=True)
    except CheckpointException:
        return  # refused: nothing can be mixed up
    writer.close()  # its drain to durable storage
    assert writer.saved_step == 2 and 2 in list_steps(Store(root)), writer.saved_step
    target = blank_state()  # the one process loads its own save back
    dcp.load(
        target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local)), no_dist=True
    )
    assert _loaded_seed(target, (2, 50)) == 50
    run_ranks(_world_change_collision_load, 2, root, local, 50)


def _mixed_attempts(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    backup = Path(base) / f"backup-{rank}"
    # First run: 1 durable, 2 and 3 local only.
    writer = tier_writer(root, local, durable_every=3, local_keep_last=3)
    for step in (1, 2, 3):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    dist.barrier()
    if rank == 1:  # rank 1's node keeps the first run's copies aside
        shutil.copytree(local, backup)
    dist.barrier()
    # Second run, resumed from step 1: saves steps 2 (durable: the writer's first) and 3 again.
    target = blank_state()
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=1))
    assert_loaded(target, 1)
    writer = tier_writer(root, local, durable_every=3, local_keep_last=3)
    for step in (2, 3):
        dcp.save(step_state(100 + step), storage_writer=writer, checkpoint_id=step)
    writer.wait()
    assert list_steps(Store(root)) == [1, 2]
    dist.barrier()
    if rank == 1:  # its local dir goes back to the first run's copies (e.g. a stale node)
        shutil.rmtree(local)
        shutil.copytree(backup, local)
    dist.barrier()
    # Rank 0 holds 2 and 3 of the second run, rank 1 of the first: "latest" is durable 2.
    target, reader = _load_latest(root, local)
    seed = _loaded_seed(target, (2, 102, 3, 103))
    assert seed == 102, f"rank {rank}: loaded step_state({seed}) (source {reader.last_load})"
    with pytest.raises(CheckpointException) as raised:
        dcp.load(
            blank_state(),
            storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=3),
        )
    assert "step 3" in _failures(raised.value), _failures(raised.value)


@pytest.mark.dist
def test_ranks_holding_different_saves_of_a_step_load_the_durable_one(tmp_path):
    """Two saves of steps 2 and 3 (two runs), rank 0's local dir holding the second run's,
    rank 1's the first's: the ranks agree on durable step 2 of the second run (rank 1 reading
    nothing of its stale copy) and refuse step 3, which no tier holds as one save."""
    run_ranks(_mixed_attempts, 2, str(tmp_path / "durable"), str(tmp_path))


def _restart_resaves(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    writer = tier_writer(root, local, durable_every=3, local_keep_last=3)
    for step in (1, 2, 3):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    # A restarted job resumes from step 1 and saves 2 and 3 again (a new writer).
    target = blank_state()
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=1))
    assert_loaded(target, 1)
    writer = tier_writer(root, local, durable_every=3, local_keep_last=3)
    dcp.save(step_state(102), storage_writer=writer, checkpoint_id=2)
    dcp.save(step_state(103), storage_writer=writer, checkpoint_id=3)
    target, _ = _load_latest(root, local)
    assert _loaded_seed(target, (3, 103)) == 103
    target = blank_state()
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=2))
    assert _loaded_seed(target, (2, 102)) == 102


@pytest.mark.dist
def test_a_restarted_job_resaving_steps_loads_only_its_new_saves(tmp_path):
    """A new writer (a restarted job) unlists its local copies of the step numbers it saves
    again: loads see the new saves only."""
    run_ranks(_restart_resaves, 2, str(tmp_path / "durable"), str(tmp_path))


def _foreign_job(rank: int, world: int, root: str, other: str, base: str) -> None:
    local = node_dir(base, rank)
    # Another job (another durable store) saves into the same local dir.
    writer = tier_writer(other, local, durable_every=1)
    for step in (1, 2, 3):
        dcp.save(step_state(500 + step), storage_writer=writer, checkpoint_id=step)
    writer = tier_writer(root, local)
    dcp.save(step_state(1), storage_writer=writer, checkpoint_id=1)  # durable
    dcp.save(step_state(2), storage_writer=writer, checkpoint_id=2)  # local only
    dist.barrier()
    if rank == 1:  # rank 1's copies replaced by the other job's (a reused /dev/shm)
        mine, theirs = _rank_store(local, root, 1), _rank_store(local, other, 1)
        shutil.rmtree(mine)
        shutil.copytree(theirs, mine)
    dist.barrier()
    target, _ = _load_latest(root, local)
    assert _loaded_seed(target, (1, 2, 501, 502, 503)) == 1  # the durable step 1


@pytest.mark.dist
def test_another_jobs_copies_in_a_ranks_local_dir_are_never_loaded(tmp_path):
    run_ranks(_foreign_job, 2, str(tmp_path / "durable"), str(tmp_path / "other"), str(tmp_path))


# -- 2. no committed step is lost --------------------------------------------------------------


def _retention(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    writer = tier_writer(root, local, durable_every=3, local_keep_last=1)
    for step in range(1, 6):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
        target, _ = _load_latest(root, local)  # every committed save loads back at once
        assert_loaded(target, step)
    writer.wait()
    assert list_steps(Store(root)) == [1, 4]
    assert sorted(tier_copies(local, store_identity(Store(root))).copies) == [5]
    for step in (1, 4):
        target = blank_state()
        dcp.load(
            target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=step)
        )
        assert_loaded(target, step)


@pytest.mark.dist
def test_durable_every_and_local_keep_last_keep_each_committed_step_loadable(tmp_path):
    run_ranks(_retention, 2, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _one_rank_loses_its_local_tier(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    writer = tier_writer(root, local, durable_every=10)
    records = log_records("ckptstore.tiers.saving")
    dcp.save(step_state(1), storage_writer=writer, checkpoint_id=1)  # durable
    dcp.save(step_state(2), storage_writer=writer, checkpoint_id=2)  # local only
    writer.wait()  # step 1's drain reads the local dir (and leases it) in the background
    dist.barrier()
    if rank == 1:  # the node's local disk goes away: the path is now a file
        shutil.rmtree(local)
        Path(local).write_bytes(b"not a directory")
    dist.barrier()
    for step in (3, 4):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    assert list_steps(Store(root)) == [1, 3, 4]  # the failed local tier sent them to durable
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "not committed to the local tier" in warned[0], warned
    target, _ = _load_latest(root, local)
    assert_loaded(target, 4)


@pytest.mark.dist
def test_a_rank_whose_local_tier_breaks_sends_every_later_save_to_durable(tmp_path):
    run_ranks(_one_rank_loses_its_local_tier, 2, str(tmp_path / "durable"), str(tmp_path))


# -- 3. a damaged local copy --------------------------------------------------------------------


def _damaged_durable_step(rank: int, world: int, root: str, base: str, how: str) -> None:
    local = node_dir(base, rank)
    _writer_ = tier_writer(root, local, durable_every=1)
    for step in (1, 2):
        dcp.save(step_state(step), storage_writer=_writer_, checkpoint_id=step)
    _writer_.wait()  # both drained to durable storage
    store = Store(str(_rank_store(local, root, rank)))
    assert load_rank_index(store, load_manifest(store, 2), 0).chunks  # it holds chunks
    dist.barrier()
    if rank == 1:
        _damage(_rank_store(local, root, 1), 2, how)
    dist.barrier()
    start = time.monotonic()
    target, reader = _load_latest(root, local)
    assert_loaded(target, 2)  # the same step, from durable storage where the copy is bad
    assert time.monotonic() - start < 60


@pytest.mark.dist
@pytest.mark.parametrize(
    "how", ["flipped-chunks", "missing-chunks", "missing-index", "truncated-manifest"]
)
def test_a_damaged_local_copy_of_a_durable_step_loads_it_from_durable(tmp_path, how):
    run_ranks(_damaged_durable_step, 2, str(tmp_path / "durable"), str(tmp_path), how)


def _damaged_local_only_step(rank: int, world: int, root: str, base: str, how: str) -> None:
    local = node_dir(base, rank)
    writer = tier_writer(root, local)  # durable_every=2: step 2 on the local tiers only
    for step in (1, 2):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    dist.barrier()
    if rank == 1:
        _damage(_rank_store(local, root, 1), 2, how)
    dist.barrier()
    start = time.monotonic()
    try:
        target, _ = _load_latest(root, local)
    except CheckpointException as exc:
        why = _failures(exc)
        assert time.monotonic() - start < 60
        assert how != "truncated-manifest", why
        # A clear error: it says what is wrong with the local copy, not something else.
        wanted = {
            "flipped-chunks": ("corrupt", "xxh3", "hash"),
            "missing-index": ("cannot be read",),
        }[how]
        assert any(w in why for w in wanted), f"rank {rank}: unclear error: {why}"
        return
    # Rank 1's copy of step 2 is not listed: every rank loads step 1, the newest they share.
    assert how == "truncated-manifest", "a damaged local-only step loaded"
    assert_loaded(target, 1)


@pytest.mark.dist
@pytest.mark.parametrize("how", ["flipped-chunks", "missing-index", "truncated-manifest"])
def test_a_damaged_local_only_step_fails_clearly_or_loads_an_older_step(tmp_path, how):
    """For a step only the local tiers hold (no durable copy to fall back to): a flipped
    byte in the local chunks must fail the load naming the corruption. ``open_tiered_step``
    passes ``durable=`` to ``TierFetch`` even for a step not in durable storage (contrary to
    tiers/fetch.py's docstring: "where it is not ..., the error stands"), so the corrupt local
    chunk is looked up in durable storage instead, and the error the load raises says the
    *durable* chunk is missing; the corruption is only in a log line."""
    run_ranks(_damaged_local_only_step, 2, str(tmp_path / "durable"), str(tmp_path), how)


def _compressible(seed: int) -> dict:
    n = 4 * CHUNK // 4
    base = torch.arange(n, dtype=torch.int32)
    return {"w": (base + seed) % 16, "v": (base * 3 + seed) % 7, "step": seed}


def _other_encoding_in_durable(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    state = _compressible(1)
    # An earlier run (no tiers) saved these values compressed.
    plain = StoreWriter(root, encoding=EncodingOptions(chunk_bytes=CHUNK, compression="zstd"))
    dcp.save(state, storage_writer=plain, checkpoint_id=1)
    # This run: tiers, no compression; step 2 (durable) holds the same values.
    tiered = StoreWriter(
        root,
        tiers=TierOptions(local_dir=local, durable_every=1),
        encoding=EncodingOptions(chunk_bytes=CHUNK, compression=None),
    )
    dcp.save(state, storage_writer=tiered, checkpoint_id=2)
    tiered.wait()  # its drain
    durable, mine = Store(root), Store(str(_rank_store(local, root, rank)))
    ours = load_rank_index(mine, load_manifest(mine, 2), 0).chunks
    theirs = {}
    for r in range(world):
        try:
            theirs.update(load_rank_index(durable, load_manifest(durable, 2), r).chunks)
        except Exception:  # noqa: BLE001 - a rank that wrote nothing
            pass
    # Precondition: durable storage holds this copy's chunks encoded otherwise (dedup).
    assert any(theirs[d].stored != info.stored for d, info in ours.items()), (ours, theirs)
    dist.barrier()
    _flip_every_chunk(_rank_store(local, root, rank))  # every local chunk goes bad
    dist.barrier()
    target = {"w": torch.zeros_like(state["w"]), "v": torch.zeros_like(state["v"]), "step": -1}
    dcp.load(target, storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=2))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["v"], state["v"])


@pytest.mark.dist
def test_a_bad_local_chunk_falls_back_to_a_durable_chunk_stored_with_another_encoding(tmp_path):
    """Durable storage deduplicates: a drained chunk it already holds keeps its durable
    encoding (here compressed by an earlier save), while the local copy stores it raw. When
    the local chunk is bad, ``TierFetch`` (tiers/fetch.py) reads the durable chunk with the
    *local* index's sizes, and the size check rejects the good durable chunk
    ("N bytes stored, the index says M"): the load fails though the step is durable."""
    run_ranks(_other_encoding_in_durable, 2, str(tmp_path / "durable"), str(tmp_path))


# -- 4. no hang -------------------------------------------------------------------------------


class _FailingPlanner(DefaultSavePlanner):
    """A planner whose data cannot be resolved on this rank (a device copy that runs out of
    memory, a lazily computed tensor that raises): user code, not the code under test."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def resolve_data(self, write_item):
        if self.fail:
            raise RuntimeError("simulated failure resolving a tensor on this rank")
        return super().resolve_data(write_item)


def _one_rank_fails_to_save(rank: int, world: int, root: str, base: str) -> None:
    # Without tiers DCP reports the failure to every rank at once.
    start = time.monotonic()
    with pytest.raises(CheckpointException):
        dcp.save(
            step_state(1),
            storage_writer=StoreWriter(
                str(Path(base) / "plain"), encoding=EncodingOptions(chunk_bytes=CHUNK)
            ),
            planner=_FailingPlanner(rank == 1),
        )
    assert time.monotonic() - start < 30
    writer = tier_writer(root, node_dir(base, rank))
    dcp.save(step_state(1), storage_writer=writer, checkpoint_id=1)
    start = time.monotonic()
    with pytest.raises(CheckpointException):
        dcp.save(
            step_state(2),
            storage_writer=writer,
            checkpoint_id=2,
            planner=_FailingPlanner(rank == 1),
        )
    assert time.monotonic() - start < 30, f"rank {rank}: the failed save took too long"


@pytest.mark.dist
def test_one_rank_failing_before_the_local_commit_does_not_hang_the_other(tmp_path):
    """``_write_tiered`` resolves the items' tensors before ``_commit_local``'s first
    ``group.gather``, outside its try: a rank that fails there leaves write_data and waits
    in DCP's result gather on the default group, while the other rank waits in the tier
    group's gather (timeout >= 600 s) -- a deadlock until the collective timeouts."""
    run_ranks(
        _one_rank_fails_to_save,
        2,
        str(tmp_path / "durable"),
        str(tmp_path),
        timeout_s=HANG_S,
    )


def _swapped_items(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)

    def tensor(seed: int) -> torch.Tensor:
        return torch.rand(2 * CHUNK // 4, generator=torch.Generator().manual_seed(seed))

    # Each rank saves items of its own (no replicated item): rank 0 "a0", "b0"; rank 1 "c1".
    own = {"a0": tensor(1), "b0": tensor(2)} if rank == 0 else {"c1": tensor(3)}
    writer = tier_writer(root, local)
    dcp.save({k: v + 1 for k, v in own.items()}, storage_writer=writer, checkpoint_id=1)
    dcp.save(own, storage_writer=writer, checkpoint_id=2)  # local only
    # The load reassigns items (e.g. a new pipeline split): rank 0 loads "a0" and "c1",
    # rank 1 loads "b0"; batches of one tensor each (read_batch_bytes).
    wanted = {"a0": tensor(1), "c1": tensor(3)} if rank == 0 else {"b0": tensor(2)}
    target = {k: torch.zeros_like(v) for k, v in wanted.items()}
    start = time.monotonic()
    dcp.load(
        target,
        storage_reader=StoreReader(
            root, tiers=TierOptions(local_dir=local), reads=ReadOptions(read_batch_bytes=CHUNK)
        ),
    )
    assert all(torch.equal(target[k], wanted[k]) for k in wanted)
    assert time.monotonic() - start < 30, f"rank {rank}: the load took too long"


@pytest.mark.dist
def test_a_rank_with_nothing_to_read_in_a_batch_still_sends_the_chunks_it_holds(tmp_path):
    """``ExchangePlan.build`` (shared_read.py) now makes a rank that *holds* a chunk its owner
    even when that rank needs nothing of it. ``StoreReader._read_shared`` (dcp/reader.py) runs
    the shared source only when this rank has items in the batch (``if prepared is not
    None``): a holder with no item in a batch never sends, and the rank that needs the chunk
    waits in ``irecv`` until the process group's timeout."""
    run_ranks(_swapped_items, 2, str(tmp_path / "durable"), str(tmp_path), timeout_s=HANG_S)


# -- 5. async_save ------------------------------------------------------------------------------


def _async_saves(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    writer = tier_writer(root, local)
    for step in (1, 2, 3, 4):
        dcp.async_save(step_state(step), storage_writer=writer, checkpoint_id=step).result(
            timeout=60
        )
        assert writer.saved_step == step
    writer.wait()  # the drains of steps 1 and 3
    assert list_steps(Store(root)) == [1, 3]
    assert sorted(tier_copies(local, store_identity(Store(root))).copies) == [3, 4]
    target, reader = _load_latest(root, local)
    assert_loaded(target, 4)
    assert reader.last_load is not None and reader.last_load.source == "local"


@pytest.mark.dist
def test_async_saves_with_tiers_commit_locally_and_every_other_durably(tmp_path):
    run_ranks(_async_saves, 2, str(tmp_path / "durable"), str(tmp_path))


def _two_writers_in_flight(rank: int, world: int, root: str, base: str) -> None:
    local = node_dir(base, rank)
    groups = [dist.new_group(backend="gloo") for _ in range(2)]  # one per save in flight
    writers = [tier_writer(root, local) for _ in groups]
    if rank == 1:
        # Rank 1 reaches its second save's set-up first.
        called_late(writers[0], "set_up_storage_writer", 1.0)
    futures = [
        dcp.async_save(step_state(step), storage_writer=w, checkpoint_id=step, process_group=g)
        for step, w, g in zip((1, 2), writers, groups)
    ]
    for future in futures:
        future.result(timeout=60)
    target, _ = _load_latest(root, local)
    assert_loaded(target, 2)


@pytest.mark.dist
def test_two_tiered_writers_saving_at_once_do_not_wait_on_each_other(tmp_path):
    """Lifecycle reviewer of stop 84: two thread-based ``async_save``s in flight, each with a
    fresh tiered ``StoreWriter``, hung both ranks for good: opening its tiers, each save's
    thread closed the writer, which joins every async save of the process, the other's
    included, while the other joined it. CI of stop 85: made on the save threads, the writers'
    groups paired rank 0's first with rank 1's second where rank 1's threads ran in the other
    order (here made to), each save exchanging with the other's until gloo's timeout."""
    run_ranks(_two_writers_in_flight, 2, str(tmp_path / "durable"), str(tmp_path), timeout_s=HANG_S)


def test_back_to_back_async_saves_with_tiers_in_one_process(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    writer = tier_writer(root, local)
    futures = [
        dcp.async_save(step_state(s), storage_writer=writer, checkpoint_id=s, no_dist=True)
        for s in (1, 2, 3)
    ]
    for f in futures:
        f.result(timeout=60)
    writer.wait()
    assert list_steps(Store(root)) == [1, 3]
    for step in (2, 3):
        target = blank_state()
        dcp.load(
            target,
            storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=step),
            no_dist=True,
        )
        assert_loaded(target, step)


# -- 6. world-size changes -----------------------------------------------------------------------


def _save_four(rank: int, world: int, root: str, local: str) -> None:
    writer = tier_writer(root, local)  # the two ranks share one local dir (one node)
    for step in (1, 2, 3, 4):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
    writer.close()


@pytest.mark.dist
def test_a_two_rank_save_loads_into_one_process_from_durable_or_fails_clearly(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "node")
    run_ranks(_save_four, 2, root, local)
    assert list_steps(Store(root)) == [1, 3]
    target = blank_state()  # the 2-rank copies are not this 1-process job's: durable step 3
    reader = StoreReader(root, tiers=TierOptions(local_dir=local))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_loaded(target, 3)
    assert reader.last_load is not None and reader.last_load.source == "durable"
    with pytest.raises(CheckpointException) as raised:  # only the 2-rank tiers hold step 4
        dcp.load(
            blank_state(),
            storage_reader=StoreReader(root, tiers=TierOptions(local_dir=local), step=4),
            no_dist=True,
        )
    assert "no tier holds step 4 for every rank" in _failures(raised.value), _failures(raised.value)
