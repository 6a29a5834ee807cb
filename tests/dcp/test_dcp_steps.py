"""ckptstore.dcp: one StoreWriter for many saves, each with its own step.

Back-to-back ``dcp.async_save`` calls on one writer get distinct steps without awaiting each
other, a save can name its step through DCP's ``checkpoint_id`` (an int or a string of digits;
any other ``checkpoint_id`` is still a store URI), and the writer's staging buffer is reused.
"""

from __future__ import annotations

import logging
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ckptstore import EncodingOptions, StorageOptions
from ckptstore.catalog import list_steps
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.errors import StepExistsError
from ckptstore.format import commit_key
from ckptstore.store import Store
from tests.helpers.dist import run_ranks
from tests.helpers.states import assert_same, blank_like

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "ids": torch.randint(-1000, 1000, (50,), generator=g),
        "step": seed,
    }


def _assert_step_holds(uri: str, step: int, want: dict) -> None:
    target = blank_like(want)
    dcp.load(target, storage_reader=StoreReader(uri, step=step), no_dist=True)
    assert_same(target, want, f"step {step}")


class _CommitsAfterTwoPlans(StoreWriter):
    """Commits no save before two were planned: the second save is planned while the first
    is still in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plans_lock = threading.Lock()
        self._plans = 0
        self.two_planned = threading.Event()

    def prepare_global_plan(self, plans):
        planned = super().prepare_global_plan(plans)
        with self._plans_lock:
            self._plans += 1
            if self._plans == 2:
                self.two_planned.set()
        return planned

    def finish(self, metadata, results):
        if not self.two_planned.wait(timeout=60):
            raise AssertionError("the second save was not planned while the first was in flight")
        super().finish(metadata, results)


def _record_staging(writer: StoreWriter) -> list[int]:
    """The storage address of every staging buffer ``writer.engine.pool`` hands out, in order."""
    seen: list[int] = []
    acquire = writer.engine.pool.acquire

    def recording(*args, **kwargs):
        buf = acquire(*args, **kwargs)
        if buf is not None:
            seen.append(buf.untyped_storage().data_ptr())
        return buf

    writer.engine.pool.acquire = recording
    return seen


def test_back_to_back_async_saves_get_distinct_steps(tmp_path):
    uri = str(tmp_path / "s")
    writer = _CommitsAfterTwoPlans(uri, encoding=EncodingOptions(chunk_bytes=4096))
    buffers = _record_staging(writer)
    first, second = _state(1), _state(2)
    f1 = dcp.async_save(first, storage_writer=writer, no_dist=True)
    f2 = dcp.async_save(second, storage_writer=writer, no_dist=True)  # f1 not awaited
    f1.result(timeout=60)
    f2.result(timeout=60)
    assert list_steps(Store(uri)) == [0, 1]
    _assert_step_holds(uri, 0, first)
    _assert_step_holds(uri, 1, second)
    # both saves staged into the one buffer the writer keeps
    assert writer.engine.pool.allocations == 1
    assert len(buffers) == 2 and buffers[0] == buffers[1], buffers
    # the next save (awaited or not) goes on after them
    dcp.save(_state(3), storage_writer=writer, no_dist=True)
    assert writer.saved_step == 2 and list_steps(Store(uri)) == [0, 1, 2]


def test_saves_named_by_training_step_through_checkpoint_id(tmp_path):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096))
    buffers = _record_staging(writer)
    state = _state(0)
    futures, saved = [], {}
    for step, checkpoint_id in [(100, 100), (200, "200"), (300, 300)]:
        state["step"] = step
        futures.append(
            dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id, no_dist=True)
        )
        saved[step] = pickle.loads(pickle.dumps(state))
        state["model"]["w"].mul_(-2.0)  # training goes on while the saves persist
    for future in futures:
        future.result(timeout=60)
    assert list_steps(Store(uri)) == [100, 200, 300]
    for step, want in saved.items():
        _assert_step_holds(uri, step, want)
    assert writer.engine.pool.allocations == 1 and len(set(buffers)) == 1, buffers
    # a save naming no step goes after the steps named so far; its own checkpoint_id did not
    # stick to the writer
    dcp.async_save(_state(4), storage_writer=writer, no_dist=True).result(timeout=60)
    assert writer.saved_step == 301
    dcp.save(_state(5), storage_writer=writer, checkpoint_id=1000, no_dist=True)
    dcp.save(_state(6), storage_writer=writer, no_dist=True)
    assert list_steps(Store(uri)) == [100, 200, 300, 301, 1000, 1001]
    assert StoreWriter.validate_checkpoint_id(1000) and StoreWriter.validate_checkpoint_id("7")


def test_a_fixed_step_writer_is_reusable_with_per_save_steps(tmp_path):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, step=5)
    dcp.save(_state(5), storage_writer=writer, no_dist=True)
    dcp.save(_state(6), storage_writer=writer, checkpoint_id=6, no_dist=True)
    dcp.async_save(_state(7), storage_writer=writer, checkpoint_id="7", no_dist=True).result(
        timeout=60
    )
    assert list_steps(Store(uri)) == [5, 6, 7]
    for step in (5, 6, 7):
        _assert_step_holds(uri, step, _state(step))
    # a save naming no step still targets the fixed one
    with pytest.raises(CheckpointException, match="step 5 is already committed"):
        dcp.save(_state(8), storage_writer=writer, no_dist=True)


def test_a_committed_checkpoint_id_step_fails_and_clobbers_nothing(tmp_path):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, storage=StorageOptions(timeout_s=10.0))
    original = _state(100)
    dcp.save(original, storage_writer=writer, checkpoint_id=100, no_dist=True)
    store = Store(uri)
    committed = store.get(commit_key(100))
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(0), storage_writer=writer, checkpoint_id=100, no_dist=True)
    assert isinstance(info.value.failures[0][0], StepExistsError)
    assert "step 100 is already committed" in str(info.value)
    future = dcp.async_save(_state(0), storage_writer=writer, checkpoint_id="100", no_dist=True)
    with pytest.raises(CheckpointException, match="step 100 is already committed") as info:
        future.result(timeout=60)
    assert isinstance(info.value.failures[0][0], StepExistsError)
    assert store.get(commit_key(100)) == committed
    assert list_steps(store) == [100]
    assert len({k.split("/")[2] for k in store.list("steps")}) == 1  # nothing else written
    _assert_step_holds(uri, 100, original)
    # The writer is still usable, and the failed saves' step did not stick to it. (The failed
    # async save's exception references its staged state, which holds the staging buffer:
    # drop it, as a caller would, before the next save.)
    del info, future
    dcp.async_save(_state(1), storage_writer=writer, no_dist=True).result(timeout=60)
    assert writer.saved_step == 101
    dcp.save(_state(2), storage_writer=writer, no_dist=True)
    assert list_steps(store) == [100, 101, 102]


def test_a_failed_async_save_kept_by_the_loop_holds_no_staging_buffer(
    tmp_path, monkeypatch, caplog
):
    """Tier adversary of stop 80 (MED): a loop that keeps the last ``async_save``'s future
    until its next one (checking it first) made that next one wait 60 s for the staging buffer
    a failed save's future kept alive, then stage it in a new buffer. A save's buffer comes
    back as its thread ends."""
    monkeypatch.setattr("ckptstore.dcp.stager._STAGING_WAIT_S", 20.0)
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, storage=StorageOptions(timeout_s=10.0))
    dcp.save(_state(0), storage_writer=writer, checkpoint_id=5, no_dist=True)
    future = dcp.async_save(_state(1), storage_writer=writer, checkpoint_id=5, no_dist=True)
    with pytest.raises(CheckpointException, match="step 5 is already committed"):
        future.result(timeout=60)  # kept: the loop's variable until its next async_save
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        nxt = dcp.async_save(_state(2), storage_writer=writer, checkpoint_id=6, no_dist=True)
        nxt.result(timeout=60)
    assert not [r for r in caplog.records if "staging buffer" in r.getMessage()], caplog.text
    assert writer.engine.pool.allocations == 1  # the failed save's buffer, staged into again
    _assert_step_holds(uri, 6, _state(2))
    assert future.exception() is not None
    for step in (7, 8, 9):  # fix adversary of stop 81: each save's binding was kept for good
        dcp.async_save(
            _state(step), storage_writer=writer, checkpoint_id=step, no_dist=True
        ).result(timeout=60)
    assert len(writer._saving) <= 1, writer._saving


def test_a_uri_checkpoint_id_still_switches_store(tmp_path, monkeypatch):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    writer = StoreWriter(a)
    dcp.save(_state(0), storage_writer=writer, checkpoint_id=5, no_dist=True)
    dcp.async_save(_state(1), storage_writer=writer, checkpoint_id=b, no_dist=True).result(
        timeout=60
    )
    assert list_steps(Store(a)) == [5] and list_steps(Store(b)) == [0]  # b's own next step
    dcp.save(_state(2), storage_writer=writer, checkpoint_id=9, no_dist=True)  # stays on b
    assert list_steps(Store(a)) == [5] and list_steps(Store(b)) == [0, 9]
    _assert_step_holds(b, 9, _state(2))
    # a local directory named by digits is a path, not a step
    monkeypatch.chdir(tmp_path)
    dcp.save(_state(3), storage_writer=writer, checkpoint_id="./1000", no_dist=True)
    dcp.save(_state(4), storage_writer=writer, checkpoint_id=Path("2000"), no_dist=True)
    assert list_steps(Store(str(tmp_path / "1000"))) == [0]
    assert list_steps(Store(str(tmp_path / "2000"))) == [0]
    assert not (tmp_path / "b" / "1000").exists()


def test_an_invalid_checkpoint_id_is_refused(tmp_path):
    writer = StoreWriter(str(tmp_path / "s"))
    for bad in (-1, True, 10**20, 1.5):
        with pytest.raises(ValueError, match="neither a step"):
            dcp.save(_state(0), storage_writer=writer, checkpoint_id=bad, no_dist=True)
        assert not StoreWriter.validate_checkpoint_id(bad)
    assert list_steps(Store(str(tmp_path / "s"))) == []


# -- two ranks (gloo) ----------------------------------------------------------------------


def _overlapping_worker(rank: int, world: int, uri: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48.0).reshape(8, 6)
    writer = StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096))
    # Overlapping saves must not share a process group: DCP's collectives of both would be
    # issued from two threads on each rank, in an order the ranks need not agree on.
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    for checkpoint_ids in [(None, None), (100, "200")]:
        futures = []
        for i, checkpoint_id in enumerate(checkpoint_ids):
            state = {"w": distribute_tensor(full * (i + 1), mesh, [Shard(0)]), "tag": i}
            futures.append(
                dcp.async_save(
                    state,
                    storage_writer=writer,
                    checkpoint_id=checkpoint_id,
                    process_group=groups[i],
                )
            )
        for future in futures:  # neither awaited before the other was started
            future.result(timeout=60)
    assert writer.engine.pool.allocations == 1, (
        f"rank {rank}: {writer.engine.pool.allocations} buffers"
    )


@pytest.mark.dist
def test_two_ranks_overlapping_async_saves(tmp_path):
    uri = str(tmp_path / "s")
    run_ranks(_overlapping_worker, 2, uri, timeout_s=90.0)
    assert list_steps(Store(uri)) == [0, 1, 100, 200]
    full = torch.arange(48.0).reshape(8, 6)
    for step, factor in [(0, 1), (1, 2), (100, 1), (200, 2)]:
        _assert_step_holds(uri, step, {"w": full * factor, "tag": factor - 1})


def test_overlapping_saves_to_different_stores_each_commit_where_they_were_aimed(tmp_path):
    """A second async_save naming another store must not redirect the first, still writing."""
    uri_a, uri_b = str(tmp_path / "a"), str(tmp_path / "b")
    writer = _CommitsAfterTwoPlans(uri_a, encoding=EncodingOptions(chunk_bytes=4096))
    first, second = _state(1), _state(2)
    f1 = dcp.async_save(first, storage_writer=writer, checkpoint_id=uri_a, no_dist=True)
    f2 = dcp.async_save(second, storage_writer=writer, checkpoint_id=uri_b, no_dist=True)
    f1.result(timeout=60)
    f2.result(timeout=60)
    assert list_steps(Store(uri_a)) == [0] and list_steps(Store(uri_b)) == [0]
    _assert_step_holds(uri_a, 0, first)
    _assert_step_holds(uri_b, 0, second)


def test_a_reader_takes_the_step_to_load_as_checkpoint_id(tmp_path):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096))
    states = {100: _state(1), 200: _state(2)}
    for step, state in states.items():
        dcp.save(state, storage_writer=writer, checkpoint_id=step, no_dist=True)
    reader = StoreReader(uri)
    for step in (100, "200"):
        target = blank_like(states[int(step)])
        dcp.load(target, storage_reader=reader, checkpoint_id=step, no_dist=True)
        assert_same(target, states[int(step)], f"step {step}")
    # DCP migrator: a checkpoint_id's step stuck to the reader, so an eval loop's next load of
    # latest on it was step 100 (its id) forever, unseen; it is that load's only, as a save's
    target = blank_like(states[100])
    dcp.load(target, storage_reader=reader, checkpoint_id=100, no_dist=True)
    states[300] = _state(3)
    dcp.save(states[300], storage_writer=writer, checkpoint_id=300, no_dist=True)
    for _ in range(2):
        target = blank_like(states[300])
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert reader.step == "latest"
        assert_same(target, states[300], "latest")


def _reader_racing_a_save(
    uri: str, step: int, newer: dict, at: str = "indexes/"
) -> tuple[StoreReader, list[str]]:
    """A reader of ``uri`` that, at its first read of a key under ``at`` (a rank index: after
    its plan), lets another writer save ``newer`` as ``step`` with ``keep_last=1``: the step it
    read so far is removed under it."""
    reader = StoreReader(uri)
    get = reader.store.get
    raced: list[str] = []

    def get_racing_a_save(key, *args, **kwargs):
        if key.startswith(at) and not raced:
            raced.append(key)
            dcp.save(newer, storage_writer=_keeping_one(uri, step), no_dist=True)
        return get(key, *args, **kwargs)

    reader.store.get = get_racing_a_save
    return reader, raced


def test_a_latest_load_whose_step_is_removed_meanwhile_reads_the_newer_one(tmp_path, caplog):
    """An evaluator loading "latest" while training saves with keep_last=1: the step DCP
    planned against is removed under it; the same plan is read from the newer step (same
    layout), not a "rank index is missing" error."""
    uri = str(tmp_path / "s")
    dcp.save(_state(1), storage_writer=_keeping_one(uri, 1), no_dist=True)
    reader, raced = _reader_racing_a_save(uri, 2, _state(2))
    target = blank_like(_state(1))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert raced and list_steps(Store(uri)) == [2]
    assert_same(target, _state(2))
    assert "step 1 of" in caplog.text and "reading step 2, the newest now" in caplog.text


def test_a_latest_step_removed_between_its_listing_and_its_manifest_read_is_listed_again(
    tmp_path,
):
    """Reviewer: 1-3 of ~500 evaluator loads of "latest" beside a keep_last=1 writer failed with
    "step N is not committed": the step was removed between the listing and the manifest's
    read (before any plan), a window the replan did not cover. The steps are listed again."""
    uri = str(tmp_path / "s")
    dcp.save(_state(1), storage_writer=_keeping_one(uri, 1), no_dist=True)
    reader, raced = _reader_racing_a_save(uri, 2, _state(2), at="commits/")
    target = blank_like(_state(1))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert raced == [commit_key(1)] and list_steps(Store(uri)) == [2]
    assert_same(target, _state(2))


def test_a_removed_step_whose_successor_has_another_layout_fails_clearly(tmp_path):
    uri = str(tmp_path / "s")
    dcp.save(_state(1), storage_writer=_keeping_one(uri, 1), no_dist=True)
    reader, _ = _reader_racing_a_save(uri, 2, {**_state(2), "extra": torch.ones(3)})
    with pytest.raises(CheckpointException, match="holds another state layout: load again"):
        dcp.load(blank_like(_state(1)), storage_reader=reader, no_dist=True)
    # An explicit step keeps its not-found error: it names what it wants.
    dcp.save(_state(3), storage_writer=_keeping_one(uri, 3), no_dist=True)
    explicit = StoreReader(uri, step=3)
    get = explicit.store.get

    def get_after_removal(key, *args, **kwargs):
        if key.startswith("indexes/"):
            dcp.save(_state(4), storage_writer=_keeping_one(uri, 4), no_dist=True)
        return get(key, *args, **kwargs)

    explicit.store.get = get_after_removal
    with pytest.raises(CheckpointException, match="rank index .* is missing"):
        dcp.load(blank_like(_state(3)), storage_reader=explicit, no_dist=True)


def _keeping_one(uri: str, step: int) -> StoreWriter:
    return StoreWriter(uri, step=step, keep_last=1)


def _saving_after_the_group_is_gone(rank: int, world: int, uri: str) -> None:
    import os
    import sys

    writer = StoreWriter(uri)
    dcp.save(_state(rank), storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()  # as a job ending with a thread async_save still pending
    with pytest.raises(CheckpointException, match="made in a process group of 2 ranks"):
        dcp.save(_state(rank), storage_writer=writer)  # DCP now runs it as this process alone
    assert list_steps(Store(uri)) == [0]
    sys.stdout.flush()
    os._exit(0)  # the group the helper would close is gone


@pytest.mark.dist
def test_a_save_reaching_a_writer_after_its_group_is_destroyed_commits_nothing(tmp_path):
    """A reviewer (HIGH): destroy_process_group() with a thread async_save pending let DCP run
    the save as one process on each rank: one rank committed a step of its own data alone,
    and its future said success."""
    run_ranks(_saving_after_the_group_is_gone, 2, str(tmp_path / "s"), timeout_s=120)


_UNWAITED_AFTER_THE_GROUP = """
import os, sys, threading, warnings
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckptstore.dcp import StoreWriter
warnings.simplefilter("ignore")
rank, uri, port, made = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
writer = StoreWriter(uri) if made == "before" else None
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
writer = writer or StoreWriter(uri)
gate = threading.Event()  # the save reaches the writer only once the group is gone
came = threading.Event()  # (DCP's own set-up before the writer needs the group)
set_up = StoreWriter.set_up_storage_writer
def set_up_after_the_gate(self, *args, **kwargs):
    came.set()
    gate.wait(60)
    return set_up(self, *args, **kwargs)
if made != "raced":  # raced: the group destroyed wherever the save thread is
    StoreWriter.set_up_storage_writer = set_up_after_the_gate
group = dist.new_group(backend="gloo")
dcp.async_save({"w": torch.full((64,), float(rank))}, storage_writer=writer,
               checkpoint_id=7, process_group=group)
came.wait(60 if made != "raced" else 0)
dist.destroy_process_group()  # a torchrun script's last line, the save not waited for
gate.set()
print("RETURNED", flush=True)
"""


def _two_scripts(script: str, uri: str, *args: str) -> tuple[list, list[tuple[str, str]]]:
    """``script`` run as ranks 0 and 1 of a gloo group (argv: rank, uri, port, ``args``):
    the processes, ended, and what each wrote (stdout, stderr)."""
    import subprocess
    import sys

    from tests.helpers import ROOT
    from tests.helpers.dist import free_port

    port = str(free_port())
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    ranks = [
        subprocess.Popen([sys.executable, "-c", script, str(r), uri, port, *args], env=env,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(2)
    ]  # fmt: skip
    try:
        return ranks, [p.communicate(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            p.kill()


@pytest.mark.dist
@pytest.mark.parametrize("made", ["after", "before", "raced"])
def test_an_unwaited_async_save_refused_after_the_group_is_destroyed_is_named_at_exit(
    tmp_path, made
):
    """A new user of stop 80 (HIGH): ``async_save`` then ``destroy_process_group()`` without
    waiting: the writer refused the save as it reached it (as above), before recording it,
    and both ranks exited 0 in silence with nothing committed; the next resume went back a
    step without a word. Each rank now names it at exit and exits 1. The fix's adversary: a
    writer made before ``init_process_group`` knew no group, refused nothing, and rank 0 at
    times committed step 7 alone; it learns the group as ``async_save`` stages. Raced: the
    group destroyed at once, the save's thread anywhere (in DCP's own code, where it never
    reaches the writer, or in the writer's): committed on both ranks, or named on each."""
    uri = str(tmp_path / "s")
    ranks, outs = _two_scripts(_UNWAITED_AFTER_THE_GROUP, uri, made)
    if made == "raced" and all(p.returncode == 0 for p in ranks):
        assert list_steps(Store(uri)) == [7]  # the save won the race on both ranks
        return
    for rank, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert "RETURNED" in out, err[-2000:]
        said = [x for x in err.splitlines() if f"rank {rank}: dcp.async_save of step 7" in x]
        assert len(said) == 1, err[-2000:]
        assert made == "raced" or "made in a process group of 2 ranks" in said[0], said
        assert p.returncode == 1, err[-2000:]
    assert list_steps(Store(uri)) == []


_FAILING_BEFORE_THE_WRITER = """
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from ckptstore.dcp import StoreWriter
warnings.simplefilter("ignore")
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.staging import AsyncStager
class Failing(DefaultSavePlanner):
    def set_up_planner(self, *args, **kwargs):
        raise RuntimeError("a planner failing before the writer")
class Wrapped(StorageWriter, AsyncStager):  # a script's writer handing its calls on
    def __init__(self, inner):
        self.inner = inner
    validate_checkpoint_id = classmethod(lambda cls, c: StoreWriter.validate_checkpoint_id(c))
for name in ("reset", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
             "write_data", "finish", "storage_meta", "stage", "synchronize_staging"):
    setattr(Wrapped, name, (lambda n: lambda self, *a, **k: getattr(self.inner, n)(*a, **k))(name))
Wrapped.__abstractmethods__ = frozenset()
writer = StoreWriter(sys.argv[1])
writer = Wrapped(writer) if sys.argv[2] == "wrapped" else writer
dcp.async_save({"w": torch.ones(64)}, storage_writer=writer, checkpoint_id=7)
dcp.async_save({"w": torch.ones(64)}, storage_writer=writer, checkpoint_id=8, planner=Failing())
print("RETURNED", flush=True)
"""


_A_WRITER_AS_ANOTHERS_STAGER = """
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from ckptstore.dcp import StoreWriter
warnings.simplefilter("ignore")
stager = StoreWriter(sys.argv[1] + "/stager")
dcp.async_save({"w": torch.ones(64)}, storage_writer=FileSystemWriter(sys.argv[1] + "/fs"),
               async_stager=stager).result()
dcp.async_save({"w": torch.ones(64)}, storage_writer=StoreWriter(sys.argv[1] + "/s"),
               async_stager=stager, checkpoint_id=3).result()
print("RETURNED", flush=True)
"""


def test_a_writer_staging_for_another_writers_save_names_nothing_at_exit(tmp_path):
    """The fix adversary of stop 82 (MED): a StoreWriter given as ``async_stager`` of another
    writer's ``async_save`` counted the save as its own, and at exit named it as failed
    ("before it reached the StoreWriter") although it committed: exit status 1."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", _A_WRITER_AS_ANOTHERS_STAGER, str(tmp_path)],
        env=env, text=True, capture_output=True, timeout=180,
    )  # fmt: skip
    assert "RETURNED" in p.stdout and p.returncode == 0, p.stderr[-2000:]
    assert "dcp.async_save of" not in p.stderr, p.stderr[-2000:]
    assert list_steps(Store(str(tmp_path / "s"))) == [3]


@pytest.mark.parametrize("writer", ["plain", "wrapped"])
def test_an_unwaited_async_save_failing_before_it_reaches_the_writer_is_named_at_exit(
    tmp_path, writer
):
    """Stop 81's gap: a thread-based ``async_save`` whose thread failed in DCP's own code
    (its group destroyed, a planner's set-up) never reached the writer, and a script that did
    not wait exited 0 with the step not saved. The writer counts the saves it staged on
    ``async_save``'s thread against those that reached it; the one that did not is named.
    Wrapped: through a script's writer handing its calls on to the StoreWriter (the second
    fix adversary: a first narrowing took it for another writer's save, and said nothing)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    uri = str(tmp_path / "s")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", _FAILING_BEFORE_THE_WRITER, uri, writer],
        env=env, text=True, capture_output=True, timeout=180,
    )  # fmt: skip
    assert "RETURNED" in p.stdout, p.stderr[-2000:]
    said = [x for x in p.stderr.splitlines() if "dcp.async_save of step" in x]
    assert len(said) == 1 and "step 8" in said[0] and "before it reached" in said[0], p.stderr
    assert p.returncode == 1, p.stderr[-2000:]
    assert list_steps(Store(uri)) == [7]


_UNWAITED_REFUSED_BY_THE_COORDINATOR = """
import sys, warnings, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckptstore.dcp import StoreWriter
warnings.simplefilter("ignore")
rank, uri, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
writer = StoreWriter(uri)
state = {"w": torch.full((64,), float(rank))}
dcp.save(state, storage_writer=writer, checkpoint_id=7, process_group=group)
dcp.async_save(state, storage_writer=writer, checkpoint_id=7, process_group=group)
print("RETURNED", flush=True)
"""


@pytest.mark.dist
def test_an_unwaited_async_save_the_coordinator_refused_is_named_on_every_rank(tmp_path):
    """A reviewer (stop 82): an unwaited ``async_save`` refused in rank 0's planning (its
    store gone; here its step already committed) failed on every rank, and was named at exit
    on rank 0 alone: rank 1 exited 0 without a word. Each rank now follows how its saves'
    futures end, and names one that failed wherever it failed."""
    uri = str(tmp_path / "s")
    ranks, outs = _two_scripts(_UNWAITED_REFUSED_BY_THE_COORDINATOR, uri)
    for rank, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert "RETURNED" in out, err[-2000:]
        said = [x for x in err.splitlines() if f"rank {rank}: dcp.async_save of step 7" in x]
        assert len(said) == 1 and "StepExistsError" in said[0], err[-2000:]
        assert p.returncode == 1, err[-2000:]
    assert list_steps(Store(uri)) == [7]


def test_a_checkpoint_id_inside_the_writers_store_is_said_to_be_a_store_of_its_own(
    tmp_path, caplog
):
    """A reviewer: torchtitan's ``checkpoint_id=<folder>/step-<N>`` made each step a one-step
    store inside the writer's own, silently: no chunk shared between steps, keep_last idle."""
    root = tmp_path / "ckpt"
    writer = StoreWriter(str(root), keep_last=2)
    with caplog.at_level("WARNING", logger="ckptstore"):
        for step in (10, 20):
            dcp.save(_state(step), storage_writer=writer, checkpoint_id=f"{root}/step-{step}")
        dcp.save(_state(1), storage_writer=writer, checkpoint_id=str(root))  # its own: no word
    said = [r.getMessage() for r in caplog.records if "lies inside the writer's store" in r.message]
    assert len(said) == 2 and "checkpoint_id=10 saves that step" in said[0], said
    assert list_steps(Store(str(root / "step-10"))) == [0]  # what it says: a store of its own
    with pytest.raises(ValueError, match="begins or ends with whitespace"):
        dcp.save(_state(1), storage_writer=writer, checkpoint_id=" 7")
    assert not Path(" 7").exists()


def _a_save_failing_on_rank_1(rank: int, world: int, uri: str) -> None:
    """Ranks 0 and 1 save over a group of their own (so no round of one writer per chunk tells
    rank 0 of rank 1's failure); rank 1's write of step 1 fails; steps 2 and 3 commit."""
    from ckptstore.leases import SAVE, find_leases

    group = dist.new_group([0, 1])
    if rank == 2:
        dist.barrier()
        return
    writer = StoreWriter(uri, keep_last=1, encoding=EncodingOptions(chunk_bytes=4096))

    def save(step: int, value: float) -> None:
        state = {f"w{rank}": torch.full((4096,), value + rank)}
        dcp.save(state, storage_writer=writer, checkpoint_id=step, process_group=group)

    save(0, 0.0)
    write = StoreWriter._write

    def failing(self, items, planner, target, **kwargs):
        if target.step == 1:
            raise OSError("rank 1's disk went away")
        return write(self, items, planner, target, **kwargs)

    if rank == 1:
        StoreWriter._write = failing
    with pytest.raises(CheckpointException):
        save(1, 10.0)
    StoreWriter._write = write
    for step in (2, 3):
        save(step, 100.0 * step)
    if rank == 0:  # the failed save's lease was let go once its thread planned the next save
        assert not [s.key for s in find_leases(Store(uri), SAVE) if s.live]
    dist.barrier()


@pytest.mark.dist
def test_a_dcp_save_that_failed_on_another_rank_does_not_hold_its_lease_for_the_job(tmp_path):
    """A DCP save that failed on a rank other than the coordinator, outside a round of one
    writer per chunk (a save over a group of some ranks, or one overlapping another async save),
    never reaches ``finish``: the coordinator renewed its save lease until the process ended,
    and every retention after it (and any ``ckptstore gc``) swept no chunk, the store only
    growing. Its lease is now let go once the thread that ran it plans another save (a DCP save
    is over on that thread) or has ended, and the next retention sweeps what it left."""
    from tests.helpers.integrity import chunk_files, referenced_chunks

    uri = str(tmp_path / "s")
    run_ranks(_a_save_failing_on_rank_1, 3, uri, timeout_s=120)
    assert list_steps(Store(uri)) == [3]
    assert chunk_files(tmp_path / "s") == referenced_chunks(uri)


def test_a_save_made_from_within_another_on_its_thread_leaves_the_outer_ones_lease(tmp_path):
    """Adversary of the rule above: a save made from a signal handler while the job's save ran
    on the same thread (an emergency save) let the outer save's lease go as if it were over; its
    retention swept the chunks the outer save had written, and the outer save committed a step
    that lacked them. A save inside another on this thread lets no lease of the thread go."""
    from tests.helpers.integrity import verify_all

    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, keep_last=1, encoding=EncodingOptions(chunk_bytes=4096))
    dcp.save({"w": torch.full((4096,), 1.0)}, storage_writer=writer, no_dist=True)
    write = StoreWriter._write
    nested = []

    def emergency_save_midway(self, items, planner, target, **kwargs):
        results = write(self, items, planner, target, **kwargs)  # the outer save's chunks
        if not nested:  # as a signal handler would, between the outer save's write and commit
            nested.append(True)
            dcp.save({"w": torch.full((4096,), 9.0)}, storage_writer=writer, no_dist=True)
        return results

    StoreWriter._write = emergency_save_midway
    try:
        outer = {"w": torch.arange(8192.0)}
        dcp.save(outer, storage_writer=writer, no_dist=True)
    finally:
        StoreWriter._write = write
    assert list_steps(Store(uri)) == [1, 2]  # the outer save's step 1, below the nested one
    got = {"w": torch.zeros(8192)}
    dcp.load(got, storage_reader=StoreReader(uri), checkpoint_id=1, no_dist=True)
    assert torch.equal(got["w"], outer["w"])
    verify_all(uri)


def test_a_tiered_writer_numbers_no_save_from_a_listing_that_does_not_answer(tmp_path):
    """The third fix adversary of stop 80 (HIGH): while the durable store's listing failed, a
    tiered writer on new nodes (an empty local tier) numbered its save 0, a step the store
    held (its drain refused) and then 1, below the store's newest: a resume took the older
    durable step and never these. A writer that has numbered no save of the store fails as
    before, naming the listing; one that has numbers on from its own saves."""
    from ckptstore import TierOptions

    uri = str(tmp_path / "durable")
    for step in (0, 2):  # an earlier job's, on other nodes
        dcp.save(_state(step), storage_writer=StoreWriter(uri), checkpoint_id=step, no_dist=True)
    store = Store(uri)
    listing, out = store.backend.list, threading.Event()

    def failing(path, *args, **kwargs):
        if out.is_set():
            raise ConnectionRefusedError(111, "Connection refused (an outage)")
        return listing(path, *args, **kwargs)

    store.backend.list = failing
    tiers = TierOptions(local_dir=str(tmp_path / "local"), durable_every=4)
    writer = StoreWriter(uri, tiers=tiers, storage=StorageOptions(store=store, timeout_s=1.0))
    out.set()
    with pytest.raises(CheckpointException, match="Connection refused"):
        dcp.save(_state(5), storage_writer=writer, no_dist=True)
    out.clear()
    dcp.save(_state(3), storage_writer=writer, no_dist=True)
    writer.wait()  # its drain (a writer's first save goes durable)
    out.set()
    dcp.save(_state(4), storage_writer=writer, no_dist=True)  # numbered on from its own
    assert writer.saved_step == 4
    out.clear()
    writer.close()
    target = blank_like(_state(4))
    reader = StoreReader(uri, tiers=tiers)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.last_load.step == 4
    assert_same(target, _state(4))
