"""ckptstore.dcp: DCP save / async_save / load through StoreWriter and StoreReader."""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from ckptstore import Checkpointer, EncodingOptions, StorageOptions
from ckptstore.catalog import list_steps, load_manifest, load_rank_index, read_object
from ckptstore.dcp import StoreReader, StoreWriter, load_full_state_dict, storage_key
from ckptstore.errors import CheckpointCorruptError, StepExistsError, UnsupportedStateError
from ckptstore.format import KIND_DCP, chunk_key, commit_key
from ckptstore.pipeline import fetch_chunk
from ckptstore.store import Store
from tests.helpers.child import run_child, run_script
from tests.helpers.dist import run_ranks
from tests.helpers.states import assert_same, blank_like

CHILD_TIMEOUT_S = 120

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g),
            "b16": torch.randn(33, generator=g).to(torch.bfloat16),
            "h16": torch.randn(5, 3, generator=g).half(),
        },
        "ids": torch.arange(-20, 20, dtype=torch.int64),
        "small": torch.tensor([3, -1, 7], dtype=torch.int8),
        "mask": torch.tensor([True, False, True, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
        "step": 42,
        "meta": {"name": "run-1", "lrs": [0.1, 0.01], "none": None},
    }


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_uri")


def test_round_trip_bit_exact(uri):
    state = _state()
    writer = StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096))
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.saved_step == 0
    target = blank_like(state)
    dcp.load(target, storage_reader=StoreReader(uri), no_dist=True)
    assert_same(target, state)


def test_a_dcp_writer_stages_on_the_host_and_refuses_device_staging(tmp_path):
    # DCP stages the state itself (async) or saves it in place: the default "auto" means host.
    default = StoreWriter(tmp_path / "ck")
    try:
        assert default.options["staging"].mode == "host" and default.engine.staging == "host"
    finally:
        default.close()
    with pytest.raises(ValueError, match="a DCP save stages on the host"):
        StoreWriter(tmp_path / "ck", staging="device")


def test_step_none_is_latest_plus_one_and_loads_chosen_step(tmp_path):
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri)
    first = {"x": torch.arange(6.0)}
    second = {"x": torch.arange(6.0) * 2}
    dcp.save(first, storage_writer=writer, no_dist=True)
    dcp.save(second, storage_writer=writer, no_dist=True)
    dcp.save({"x": torch.ones(6)}, storage_writer=StoreWriter(uri, step=10), no_dist=True)
    dcp.save({"x": torch.full((6,), 3.0)}, storage_writer=StoreWriter(uri), no_dist=True)
    assert list_steps(Store(uri)) == [0, 1, 10, 11]
    for step, want in [(0, first["x"]), (1, second["x"]), ("latest", torch.full((6,), 3.0))]:
        target = {"x": torch.empty(6)}
        dcp.load(target, storage_reader=StoreReader(uri, step=step), no_dist=True)
        assert torch.equal(target["x"], want), step


def test_async_save(tmp_path):
    uri = str(tmp_path / "s")
    state = _state()
    future = dcp.async_save(state, storage_writer=StoreWriter(uri, step=5), no_dist=True)
    future.result(timeout=60)
    target = blank_like(state)
    dcp.load(target, storage_reader=StoreReader(uri, step=5), no_dist=True)
    assert_same(target, state)


def _scaled(state: dict, factor: float) -> None:
    """Update every float tensor of ``state`` in place, as an optimizer step would."""
    for value in state.values():
        if isinstance(value, dict):
            _scaled(value, factor)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            value.mul_(factor)


def test_async_save_stages_once_into_the_writers_reused_buffer(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.staging import DefaultStager

    def not_this_one(self, state_dict):
        raise AssertionError("DCP's DefaultStager staged the state; StoreWriter.stage should")

    monkeypatch.setattr(DefaultStager, "stage", not_this_one)
    uri = str(tmp_path / "s")
    writer = StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096))
    state = _state()
    saved = []
    for _ in range(3):
        future = dcp.async_save(state, storage_writer=writer, no_dist=True)
        saved.append(pickle.loads(pickle.dumps(state)))  # what that save must hold
        _scaled(state, -2.0)  # the loop goes on while the save persists
        future.result(timeout=60)
    assert writer.engine.pool.allocations == 1
    assert list_steps(Store(uri)) == [0, 1, 2]
    for step, want in enumerate(saved):
        target = blank_like(want)
        dcp.load(target, storage_reader=StoreReader(uri, step=step), no_dist=True)
        assert_same(target, want)


def test_a_save_failing_before_its_write_hands_the_staging_buffer_back(tmp_path):
    uri = str(tmp_path / "s")
    dcp.save({"x": torch.ones(4)}, storage_writer=StoreWriter(uri), no_dist=True)
    writer = StoreWriter(uri, step=0, storage=StorageOptions(timeout_s=5.0))
    with pytest.raises(CheckpointException, match="already committed"):
        dcp.async_save({"x": torch.zeros(4)}, storage_writer=writer, no_dist=True).result(
            timeout=60
        )
    writer.step = None  # the next save picks the step after the latest
    dcp.async_save({"x": torch.full((4,), 5.0)}, storage_writer=writer, no_dist=True).result(
        timeout=60
    )
    # Neither save keeps the pool's one buffer: the failed one handed it back.
    assert writer.engine.pool.allocations == 1
    assert writer.engine.pool.acquire(1, block=False) is not None
    target = {"x": torch.empty(4)}
    dcp.load(target, storage_reader=StoreReader(uri, step=1), no_dist=True)
    assert torch.equal(target["x"], torch.full((4,), 5.0))


def test_saved_step_is_listed_and_every_object_verifies(tmp_path):
    uri = str(tmp_path / "s")
    state = _state()
    dcp.save(
        state,
        storage_writer=StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096)),
        no_dist=True,
    )
    store = Store(uri)
    assert list_steps(store) == [0]
    assert store.list("pending") == []
    manifest = load_manifest(store, 0)
    assert manifest.kind == KIND_DCP and manifest.world_size == 1
    assert manifest.dcp_metadata is not None
    blob = read_object(store, manifest.dcp_metadata, "dcp metadata")
    assert json.loads(blob)["type"] == "dcp_metadata"  # plain JSON: nothing to unpickle
    index = load_rank_index(store, manifest, 0)
    assert index.tree is None
    assert "model.w@0,0" in index.items and "step" in index.items
    byte_item = index.tensors[index.items["step"]]
    assert byte_item.dtype == "uint8" and len(byte_item.shape) == 1
    assert len(index.chunks) >= 2
    raw = 0
    for digest, info in index.chunks.items():
        raw += fetch_chunk(store, digest, info).size
    assert raw == manifest.raw_bytes


class _CachingPlanner(DefaultSavePlanner):
    """DCP's plan caching, under a cache key (the class name) no other test shares."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)

    @classmethod
    def forget(cls) -> None:
        """DCP's plan caches of this class emptied (they live on the class, across tests)."""
        for cache in ("save_plan", "final_save_plan", "all_plans", "global_plan", "metadata"):
            getattr(SavePlanner, f"_cached_{cache}", {}).pop(cls.__name__, None)


@pytest.mark.parametrize("one_writer", [False, True])
def test_cached_save_plans_are_refused_clearly(tmp_path, one_writer):
    """DCP migrator: with one writer the save after the first failed as StepExistsError of the
    first step (its message said nothing of caching); each is refused before it writes."""
    uri = str(tmp_path / "s")
    state = {"x": torch.arange(4.0)}
    writer = StoreWriter(uri)
    _CachingPlanner.forget()
    dcp.save(state, storage_writer=writer, planner=_CachingPlanner(), no_dist=True)
    writer = writer if one_writer else StoreWriter(uri)
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=writer, planner=_CachingPlanner(), no_dist=True)
    assert isinstance(info.value.failures[0][0], ValueError)
    assert "StoreWriter does not support DCP plan caching" in str(info.value)
    assert list_steps(Store(uri)) == [0] and Store(uri).list("pending") == []
    _CachingPlanner.forget()
    dcp.save(state, storage_writer=writer, no_dist=True)  # without caching: the next step
    assert list_steps(Store(uri)) == [0, 1]


def test_existing_step_fails_and_clobbers_nothing(tmp_path):
    uri = str(tmp_path / "s")
    original = {"x": torch.arange(4.0)}
    dcp.save(original, storage_writer=StoreWriter(uri, step=3), no_dist=True)
    store = Store(uri)
    committed = store.get(commit_key(3))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"x": torch.zeros(4)}, storage_writer=StoreWriter(uri, step=3), no_dist=True)
    assert isinstance(info.value.failures[0][0], StepExistsError)
    assert "step 3 is already committed" in str(info.value)
    assert store.get(commit_key(3)) == committed
    assert len({k.split("/")[2] for k in store.list("steps")}) == 1  # nothing else written
    target = {"x": torch.empty(4)}
    dcp.load(target, storage_reader=StoreReader(uri, step=3), no_dist=True)
    assert torch.equal(target["x"], original["x"])


class _RacingPlanner(DefaultSavePlanner):
    """Commits the same step through another writer between planning and writing."""

    def __init__(self, uri: str, step: int) -> None:
        super().__init__()
        self._uri, self._step = uri, step

    def finish_plan(self, new_plan):
        dcp.save(
            {"x": torch.full((4,), 9.0)},
            storage_writer=StoreWriter(self._uri, step=self._step),
            no_dist=True,
        )
        return super().finish_plan(new_plan)


def test_losing_a_commit_race_fails_clearly(tmp_path):
    uri = str(tmp_path / "s")
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            {"x": torch.zeros(4)},
            storage_writer=StoreWriter(uri, step=7),
            planner=_RacingPlanner(uri, 7),
            no_dist=True,
        )
    assert isinstance(info.value.failures[0][0], StepExistsError)
    store = Store(uri)
    assert list_steps(store) == [7] and store.list("pending") == []
    target = {"x": torch.empty(4)}
    dcp.load(target, storage_reader=StoreReader(uri, step=7), no_dist=True)
    assert torch.equal(target["x"], torch.full((4,), 9.0))


def test_checkpointer_step_is_refused(tmp_path):
    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"x": torch.ones(3)}).wait()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"x": torch.empty(3)}, storage_reader=StoreReader(uri), no_dist=True)
    assert "saved by ckptstore.Checkpointer" in str(info.value)
    with pytest.raises(UnsupportedStateError, match="Checkpointer.load"):
        StoreReader(uri).read_metadata()
    with pytest.raises(UnsupportedStateError, match="saved by ckptstore.Checkpointer"):
        load_full_state_dict(Store(uri), 1)


def test_flipped_bit_is_an_error_naming_the_chunk(tmp_path):
    uri = str(tmp_path / "s")
    dcp.save(
        {"x": torch.randn(64)},
        storage_writer=StoreWriter(uri, encoding=EncodingOptions(compression=None)),
        no_dist=True,
    )
    store = Store(uri)
    index = load_rank_index(store, load_manifest(store, 0), 0)
    (digest,) = index.chunks
    path = Path(store.path(chunk_key(digest)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"x": torch.empty(64)}, storage_reader=StoreReader(uri), no_dist=True)
    assert any(isinstance(e, CheckpointCorruptError) for e, _ in info.value.failures.values())
    assert digest in str(info.value)
    with pytest.raises(CheckpointCorruptError, match=digest):  # unwrapped for the CLI
        load_full_state_dict(store, 0)


def test_checkpoint_id_is_a_store_uri(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert StoreWriter.validate_checkpoint_id(b) and StoreReader.validate_checkpoint_id(b)
    assert StoreWriter.validate_checkpoint_id("memory://x")
    assert not StoreReader.validate_checkpoint_id("nosuchproto://bucket/x")
    dcp.save({"x": torch.arange(3)}, checkpoint_id=b, storage_writer=StoreWriter(a))
    assert list_steps(Store(a)) == [] and list_steps(Store(b)) == [0]
    target = {"x": torch.zeros(3, dtype=torch.int64)}
    dcp.load(target, checkpoint_id=b, storage_reader=StoreReader(a))
    assert torch.equal(target["x"], torch.arange(3))


def test_memory_store_and_keep_last():
    uri = f"memory://dcp-{uuid.uuid4().hex[:12]}"
    writer = StoreWriter(uri, keep_last=2)
    for i in range(4):
        dcp.save({"x": torch.full((8,), float(i))}, storage_writer=writer, no_dist=True)
    store = Store(uri)
    assert list_steps(store) == [2, 3]
    assert len(store.list("chunks")) == 2
    target = {"x": torch.empty(8)}
    dcp.load(target, storage_reader=StoreReader(uri, step=2), no_dist=True)
    assert torch.equal(target["x"], torch.full((8,), 2.0))


def test_load_full_state_dict_single_process(tmp_path):
    uri = str(tmp_path / "s")
    state = _state()
    dcp.save(state, storage_writer=StoreWriter(uri), no_dist=True)
    full = load_full_state_dict(Store(uri), 0)
    assert_same(full, state)


def test_storage_key():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    assert storage_key(MetadataIndex("a.b")) == "a.b"
    assert storage_key(MetadataIndex("a", torch.Size([4, 0]))) == "a@4,0"


# -- multi-process (gloo) ------------------------------------------------------------------


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "rows": torch.randn(7, 6, generator=g),  # 7 rows: uneven shards at 2 and 4 ranks
        "cols": torch.randn(4, 10, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-1000, 1000, (9,), generator=g),
    }


def _sharded(mesh, full: dict[str, torch.Tensor], dims: dict[str, int]) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(dims[k])]) for k, v in full.items()}


def _save_worker(rank: int, world: int, uri: str, dims: dict, use_async: bool):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    state = {
        "model": _sharded(mesh, full, dims),
        "replicated": torch.arange(5.0),
        "rank_count": world,
    }
    for expected_step in (0, 1):
        writer = StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096))
        if use_async:
            dcp.async_save(state, storage_writer=writer).result(timeout=60)
        else:
            dcp.save(state, storage_writer=writer)
        steps = [None] * world
        dist.all_gather_object(steps, writer.saved_step)
        assert steps == [expected_step] * world, f"rank {rank}: steps {steps}"
    # read back at the same world size, in place into zeroed DTensors
    target = {
        "model": _sharded(mesh, {k: torch.zeros_like(v) for k, v in full.items()}, dims),
        "replicated": torch.zeros(5),
        "rank_count": 0,
    }
    dcp.load(target, storage_reader=StoreReader(uri, step=1))
    for k, v in full.items():
        assert torch.equal(target["model"][k].full_tensor(), v), f"rank {rank}: {k}"
    assert torch.equal(target["replicated"], torch.arange(5.0))
    assert target["rank_count"] == world


def _load_worker(rank: int, world: int, uri: str, dims: dict):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    target = {
        "model": _sharded(mesh, {k: torch.zeros_like(v) for k, v in full.items()}, dims),
        "replicated": torch.zeros(5),
        "rank_count": 0,
    }
    dcp.load(target, storage_reader=StoreReader(uri))
    for k, v in full.items():
        local = target["model"][k].to_local()
        want = torch.tensor_split(v, world, dim=dims[k])[rank]
        assert torch.equal(local, want), f"rank {rank}: {k} local shard differs"
        assert torch.equal(target["model"][k].full_tensor(), v), f"rank {rank}: {k}"
    assert torch.equal(target["replicated"], torch.arange(5.0))


def _check_single_process(uri: str, world: int) -> None:
    store = Store(uri)
    assert list_steps(store) == [0, 1]
    manifest = load_manifest(store, 1)
    assert manifest.kind == KIND_DCP and manifest.world_size == world
    assert len(manifest.ranks) == world  # every rank wrote its own shards
    assert store.list("pending") == []
    for ref in manifest.ranks:
        rank = int(ref.key.rsplit("rank-", 1)[1].split(".")[0])
        for digest, info in load_rank_index(store, manifest, rank).chunks.items():
            fetch_chunk(store, digest, info)
    full = _full()
    # the sharded step loaded whole into one process, into plain tensors
    target = {
        "model": {k: torch.zeros_like(v) for k, v in full.items()},
        "replicated": torch.zeros(5),
        "rank_count": 0,
    }
    dcp.load(target, storage_reader=StoreReader(uri), no_dist=True)
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k
    assert target["rank_count"] == world
    everything = load_full_state_dict(store, 1)
    assert_same(everything, {"model": full, "replicated": torch.arange(5.0), "rank_count": world})


@pytest.mark.dist
def test_two_ranks_async_save_then_one_process_load(tmp_path):
    uri = str(tmp_path / "s")
    run_ranks(_save_worker, 2, uri, {"rows": 0, "cols": 1, "ids": 0}, True)
    _check_single_process(uri, 2)


@pytest.mark.dist
def test_four_ranks_save_then_reshard_to_two(tmp_path):
    uri = str(tmp_path / "s")
    run_ranks(_save_worker, 4, uri, {"rows": 0, "cols": 0, "ids": 0}, False)
    # loaded at 2 ranks, with "cols" now sharded along the other dimension
    run_ranks(_load_worker, 2, uri, {"rows": 0, "cols": 1, "ids": 0})
    _check_single_process(uri, 4)


def _replicated_async_worker(rank: int, world: int, uri: str):
    writer = StoreWriter(uri, storage=StorageOptions(timeout_s=10.0))
    state = {"r": torch.arange(10.0)}  # replicated: DCP has one rank write it, the other nothing
    for step in range(3):
        dcp.async_save(state, storage_writer=writer).result(timeout=60)
        state["r"].add_(1.0)
        assert writer.saved_step == step
    # A rank DCP left nothing to write must not keep its staging buffer (the next stage()
    # would wait timeout_s for it, then stage into a new one).
    assert writer.engine.pool.allocations == 1, (
        f"rank {rank}: {writer.engine.pool.allocations} buffers"
    )
    assert writer.engine.pool.acquire(1, block=False) is not None, f"rank {rank}: buffer still held"


@pytest.mark.dist
def test_async_save_of_replicated_state_frees_every_ranks_staging(tmp_path):
    uri = str(tmp_path / "s")
    run_ranks(_replicated_async_worker, 2, uri)
    target = {"r": torch.empty(10)}
    dcp.load(target, storage_reader=StoreReader(uri), no_dist=True)
    assert torch.equal(target["r"], torch.arange(10.0) + 2)


@pytest.mark.s3
@pytest.mark.parametrize("end", ["exit", "close"])
def test_an_async_save_a_script_does_not_wait_for_is_committed_on_s3(s3_uri, end):
    """Reviewer of stop 60: a script that ended (or closed its writer) right after
    ``dcp.async_save`` to S3, without waiting on the future, lost the save: at exit
    ``concurrent.futures`` refused the S3 client's work ("cannot schedule new futures after
    interpreter shutdown"), nothing was stored and the script exited 0. The saves DCP runs in
    threads are finished first, as DCP's own writer's are."""
    lines = run_script(
        f"""
        import torch, warnings
        import torch.distributed.checkpoint as dcp
        from ckptstore.dcp import StoreWriter
        warnings.simplefilter("ignore")
        writer = StoreWriter({s3_uri!r})
        state = {{"w": torch.arange(4 << 20, dtype=torch.float32)}}
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=7)
        future.add_done_callback(lambda f: print("DONE", repr(f.exception()), flush=True))
        if {end!r} == "close":
            writer.close()
            print("CLOSED", future.done(), flush=True)
        print("RETURNED", flush=True)
        """,
        CHILD_TIMEOUT_S,
    )
    assert "DONE None" in lines, lines
    if end == "close":
        assert "CLOSED True" in lines, lines
    assert list_steps(Store(s3_uri)) == [7]
    target = {"w": torch.zeros(4 << 20)}
    dcp.load(target, storage_reader=StoreReader(s3_uri))
    assert torch.equal(target["w"], torch.arange(4 << 20, dtype=torch.float32))


def test_an_async_save_that_fails_unwaited_is_named_at_exit(tmp_path):
    """Reviewer of stop 60: a script that ended right after a failing ``dcp.async_save`` exited
    0 in silence (its error in a future nobody read). The save's step is named at exit, with
    its error (a full-disk reviewer: the line did not say why)."""
    script = f"""
        import torch, warnings
        import torch.distributed.checkpoint as dcp
        import ckptstore.store.core as core
        from ckptstore.dcp import StoreWriter
        warnings.simplefilter("ignore")
        def refuse(self, *args, **kwargs):
            raise OSError("injected: the store refuses every put")
        core.Store.put = refuse
        writer = StoreWriter({str(tmp_path / "s")!r})
        dcp.async_save({{"w": torch.ones(10)}}, storage_writer=writer, checkpoint_id=5)
        print("RETURNED", flush=True)
        """
    done = run_child(script, CHILD_TIMEOUT_S)
    assert "RETURNED" in done.stdout, done.stderr[-2000:]
    said = f"rank 0: dcp.async_save of step 5 to {tmp_path / 's'} failed: "
    assert said in done.stderr, done.stderr[-2000:]
    line = next(x for x in done.stderr.splitlines() if said in x)
    assert "injected: the store refuses every put" in line, line  # why, not only where
    assert done.returncode == 1, done.stderr[-2000:]  # a scheduler does not read it as a success


@pytest.mark.parametrize("step", [5, None])
def test_an_async_save_refused_as_it_plans_unwaited_is_named_at_exit(tmp_path, step):
    """DCP user of stop 79: a save refused before it was recorded (its step already
    committed; with no step, a store it cannot list) exited 0 in silence."""
    uri = str(tmp_path / "s")
    dcp.save({"w": torch.ones(10)}, storage_writer=StoreWriter(uri), checkpoint_id=5)
    script = f"""
        import torch, warnings
        import torch.distributed.checkpoint as dcp
        import ckptstore.dcp.writer as writer_module
        from ckptstore.dcp import StoreWriter
        from ckptstore.errors import StorageError
        warnings.simplefilter("ignore")
        def refuse(store):
            raise StorageError("injected: the listing is refused")
        if {step!r} is None:
            writer_module.list_steps = refuse
        options = {{}} if {step!r} is None else {{"checkpoint_id": {step!r}}}
        dcp.async_save({{"w": torch.ones(10)}}, storage_writer=StoreWriter({uri!r}), **options)
        print("RETURNED", flush=True)
        """
    done = run_child(script, CHILD_TIMEOUT_S)
    assert "RETURNED" in done.stdout, done.stderr[-2000:]
    which = "the next step" if step is None else "step 5"
    said = [x for x in done.stderr.splitlines() if f"rank 0: dcp.async_save of {which} to" in x]
    assert len(said) == 1, done.stderr[-2000:]  # named once
    line = said[0]
    why = "injected: the listing is refused" if step is None else "step 5 is already committed"
    assert f"to {uri} failed: " in line and why in line, line
    assert done.returncode == 1, done.stderr[-2000:]
    assert list_steps(Store(uri)) == [5]


def test_a_chunk_damaged_since_the_last_save_is_written_again_by_the_next(tmp_path):
    """A reviewer's (HIGH), through DCP: a frozen tensor's chunk damaged where it lies was
    referenced by every later save; a save that reads it back (``recheck_every=1``) writes it
    again, and both steps load."""
    uri = str(tmp_path / "s")
    frozen = {"frozen": torch.arange(4096.0), "x": torch.ones(8)}
    encoding = EncodingOptions(chunk_bytes=4096, compression="none", recheck_every=1)
    writer = StoreWriter(uri, encoding=encoding)
    dcp.save(frozen, storage_writer=writer, no_dist=True)
    store = Store(uri)
    for key in store.list("chunks"):  # every chunk: a bit flipped in its middle
        data = bytearray(store.get(key))
        data[len(data) // 2] ^= 0x01
        store.delete(key)
        store.put(key, bytes(data))
    dcp.save(frozen, storage_writer=writer, no_dist=True)  # the same bytes: every chunk known
    for step in (0, 1):
        target = {"frozen": torch.empty(4096), "x": torch.empty(8)}
        dcp.load(target, storage_reader=StoreReader(uri, step=step), no_dist=True)
        assert_same(target, frozen)


def test_a_chunk_a_load_found_damaged_is_written_again_by_the_next_save(tmp_path):
    """A reviewer's (HIGH), through DCP: after a load named a frozen tensor's damaged chunk,
    the next save (not its turn to read chunks back) referenced it; it writes it again."""
    uri = str(tmp_path / "s")
    frozen = {"frozen": torch.arange(4096.0), "x": torch.ones(8)}
    encoding = EncodingOptions(chunk_bytes=4096, compression="none", recheck_every=0)
    dcp.save(frozen, storage_writer=StoreWriter(uri, encoding=encoding), no_dist=True)
    store = Store(uri)
    victim = store.list("chunks")[0]
    data = store.get(victim)
    store.delete(victim)
    store.put(victim, bytes(data[:-9]))
    target = {"frozen": torch.empty(4096), "x": torch.empty(8)}
    with pytest.raises(CheckpointException, match=victim.rsplit("/", 1)[-1]):
        dcp.load(target, storage_reader=StoreReader(uri), no_dist=True)
    dcp.save(frozen, storage_writer=StoreWriter(uri, encoding=encoding), no_dist=True)
    for step in (0, 1):
        target = {"frozen": torch.empty(4096), "x": torch.empty(8)}
        dcp.load(target, storage_reader=StoreReader(uri, step=step), no_dist=True)
        assert_same(target, frozen)


@pytest.mark.parametrize("dtype", ["complex32", "float8_e8m0fnu", "float4_e2m1fn_x2"])
def test_a_tensor_of_each_newer_dtype_saves_verifies_and_loads_through_both_front_ends(
    tmp_path, dtype
):
    """Reviewer X: a DCP save of float8_e8m0fnu (MX scales) or complex32 committed, then every
    load, verify and gc called it corrupt; float4's save failed in the health scan."""
    from ckptstore.cli import main

    raw = torch.arange(64, dtype=torch.uint8).view(-1, 8)
    value = raw.view(getattr(torch, dtype))
    dcp.save({"t": value}, storage_writer=StoreWriter(str(tmp_path / "dcp")), no_dist=True)
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, {"t": value}).wait()
        target = {"t": torch.zeros_like(raw).view(value.dtype)}
        assert ckpt.load(target) == 1 and torch.equal(target["t"].view(torch.uint8), raw)
    target = {"t": torch.zeros_like(raw).view(value.dtype)}
    dcp.load(target, storage_reader=StoreReader(str(tmp_path / "dcp")), no_dist=True)
    assert torch.equal(target["t"].view(torch.uint8), raw)
    for where in ("dcp", "ck"):
        assert main(["verify", str(tmp_path / where)]) == 0, where


def test_a_dcp_save_of_a_dtype_no_step_holds_is_refused_before_it_writes(tmp_path):
    store = Store(str(tmp_path / "s"))
    with pytest.raises(CheckpointException, match=r"t: a tensor of bits8, which a DCP step"):
        value = torch.arange(8, dtype=torch.uint8).view(torch.bits8)
        dcp.save({"t": value}, storage_writer=StoreWriter(store.uri), no_dist=True)
    assert list_steps(store) == [] and not store.list("chunks")


def test_a_checkpoint_of_dcps_own_writer_is_named_as_one(tmp_path, capsys):
    """DCP migrator: StoreReader and `ckptstore ls` on a FileSystemWriter directory said only
    "no committed checkpoint" (a mistyped path?), though its .metadata was there."""
    from ckptstore.cli import main

    path = str(tmp_path / "fs")
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    with pytest.raises(CheckpointException, match="torch DCP's own FileSystemWriter") as raised:
        dcp.load({"w": torch.zeros(3)}, storage_reader=StoreReader(path), no_dist=True)
    assert "FileSystemReader" in str(raised.value)
    assert main(["ls", path]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "torch DCP's own FileSystemWriter, not a ckptstore store" in line


def test_nan_and_inf_of_float8_are_counted_by_the_health_scan(tmp_path):
    """float8_e8m0fnu's NaN (0xff) raised NotImplementedError in the scan's count (torch has
    no isinf for it), which failed the save."""
    state = {
        "scales": torch.full((4,), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "w": torch.tensor([float("inf"), 1.0, 2.0]).to(torch.float8_e5m2),
    }
    with Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, state)
        handle.wait()
    assert (handle.health.nan, handle.health.inf) == (4, 1)


def _async_on_the_default_group_worker(rank: int, world: int, uri: str):
    import logging

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ckptstore").addHandler(handler)
    writer = StoreWriter(uri, storage=StorageOptions(timeout_s=10.0))
    state = {"x": torch.arange(10.0)}
    own = torch.distributed.new_group(backend="gloo")
    dcp.async_save(state, storage_writer=writer, process_group=own).result(timeout=60)
    assert not [s for s in said if "default process group" in s], said
    dcp.async_save(state, storage_writer=writer).result(timeout=60)
    dcp.async_save(state, storage_writer=writer).result(timeout=60)
    warned = [s for s in said if "default process group" in s]
    assert len(warned) == 1 and 'process_group=dist.new_group(backend="gloo")' in warned[0]


@pytest.mark.dist
def test_an_async_save_on_the_default_gloo_group_says_it_can_deadlock_the_loop(tmp_path):
    """3 a.m. reviewer of stop 76: a loop making its own collectives on the default group hung
    for good at its first async_save (DCP's collectives, run in the save's thread, met the
    loop's; torch's FileSystemWriter does the same once a save takes longer than a step),
    with no line said. It is said once per process."""
    run_ranks(_async_on_the_default_group_worker, 2, str(tmp_path / "s"))


def _two_saves_on_one_group_worker(rank: int, world: int, uri: str):
    import logging
    import time

    import ckptstore.dcp.writer as writer_module

    # Two saves in flight on one group hang only where the group has peers; on this one rank
    # they do not, so the rule is shown here with the rank count the warning reads made 2.
    writer_module._world_size = lambda: 2
    slow = writer_module.StoreWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(1.0)  # the first save is still writing when the second starts
        return slow(self, plan, planner)

    writer_module.StoreWriter.write_data = write_data
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ckptstore").addHandler(handler)
    state = {"x": torch.arange(10.0)}
    first = dcp.async_save(state, storage_writer=StoreWriter(uri + "-a"))
    second = dcp.async_save(state, storage_writer=StoreWriter(uri + "-b"))
    first.result(timeout=60)
    second.result(timeout=60)
    crossed = [s for s in said if "another runs its collectives on the same process group" in s]
    assert len(crossed) == 1 and "(the default group)" in crossed[0], said


@pytest.mark.dist
def test_a_save_started_while_another_runs_on_its_group_says_they_can_hang(tmp_path):
    """New user of stop 76: two async_save calls in flight on one shared group hung for good
    (their collectives crossed) with nothing said."""
    run_ranks(_two_saves_on_one_group_worker, 1, str(tmp_path / "s"))


@pytest.mark.parametrize("where", ["above", "inside"])
@pytest.mark.parametrize("tiered", [False, True])
def test_a_dcp_resume_from_a_path_just_above_or_inside_a_store_names_it(
    tmp_path, caplog, where, tiered
):
    """A new user: ``StoreReader(uri).latest()`` and ``ckptstore.dcp.resume`` on the directory
    above a store, or one inside it, returned None without a word and the job started over,
    where ``Checkpointer.latest()`` names the store: now each says it once."""
    import logging

    from ckptstore import TierOptions
    from ckptstore.dcp import resume

    store = tmp_path / "runs" / "run1"
    dcp.save({"w": torch.ones(3)}, storage_writer=StoreWriter(store), checkpoint_id=1, no_dist=True)
    wrong = store.parent if where == "above" else store / "steps"
    hint = f"but {store} holds checkpoints" if where == "above" else f"inside the store {store}"
    tiers = TierOptions(local_dir=tmp_path / "local") if tiered else None
    reader = StoreReader(wrong, tiers=tiers)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert reader.latest() is None
        assert resume({"w": torch.zeros(3)}, reader, no_dist=True) is None
    said = [r.getMessage() for r in caplog.records if "mistyped path" in r.getMessage()]
    assert len(said) == 1 and hint in said[0], said  # once per reader
    caplog.clear()
    beside = StoreReader(store.parent / "run2", tiers=tiers)  # a new run beside it: no warning
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert resume({"w": torch.zeros(3)}, beside, no_dist=True) is None
    assert not [r for r in caplog.records if "mistyped path" in r.getMessage()]
