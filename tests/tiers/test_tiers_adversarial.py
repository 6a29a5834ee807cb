"""Adversarial cases of the tier protocol (docs/FORMAT.md, "Tiers"): rollbacks, a corrupt own
copy with a good peer copy, SIGTERM on one node only, a local tier that cannot be listed, an
unreachable durable store, chunks that went bad in a tier, drains into a durable store that
holds the chunks encoded otherwise, peer rounds smaller than a chunk."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, PreemptionOptions, StorageOptions, TierOptions
from ckptstore.catalog import list_steps
from ckptstore.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    RanksOutOfStepError,
    StorageError,
)
from ckptstore.store import Store, open_store
from ckptstore.tiers.restore import DURABLE, LOCAL, PEER
from tests.helpers.dist import run_ranks
from tests.helpers.tiers import (
    ENCODING,
    STORAGE,
    blank_state,
    copies_dir,
    index_doc,
    rank_state,
    save_steps,
    tier_checkpointer,
)

# -- helpers ---------------------------------------------------------------------------------


def _load_report(rank: int, world: int, root: str, out: str, kw: dict) -> None:
    """Load on every rank; each rank's outcome (or error) written to ``out``.rank-r.json."""
    fallback = kw.pop("fallback", False)
    ckpt = tier_checkpointer(Path(root), rank, **kw)
    state = blank_state()
    report: dict = {"rank": rank}
    try:
        step = ckpt.load(state, fallback=fallback)
        expected = rank_state(rank, step)
        report.update(
            step=step,
            equal=torch.equal(state["w"], expected["w"])
            and torch.equal(state["shared"], expected["shared"]),
            source=ckpt.last_load.source,
        )
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.rank-{rank}.json").write_text(json.dumps(report))
    ckpt.close()


def _reports(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank-{r}.json").read_text()) for r in range(world)]


def _sources_of_step_20(tmp_path: Path, kw: dict) -> list[str]:
    """Load on 4 ranks; every rank must load step 20 bit for bit: the tier each read it from."""
    out = tmp_path / "load"
    run_ranks(_load_report, 4, str(tmp_path), str(out), dict(kw), timeout_s=150)
    reports = _reports(out, 4)
    assert all("error" not in r for r in reports), reports
    assert [r["step"] for r in reports] == [20] * 4
    assert all(r["equal"] for r in reports)
    return [r["source"] for r in reports]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _chunk_path(store_dir: Path, digest: str) -> Path:
    return store_dir / "chunks" / digest[:2] / digest


# -- (a)/(d): a rollback (load of an explicit older step), then saves -------------------------


def test_a_lower_step_saved_after_a_rollback_is_not_retained_away(tmp_path):
    """A job rolls back to step 1 (``load(step=1)``, e.g. after a loss spike) and saves 5 and 6:
    wait() reports both committed; local_keep_last keeps the two highest step numbers of the
    abandoned run (10, 20) and unlists 5 and 6 at once."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=100)) as ckpt:
        for step in (1, 10, 20):
            ckpt.save(step, rank_state(0, step)).wait()
    drain_error = None
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=100)) as ckpt:
        assert ckpt.load(blank_state(), step=1) == 1
        for step in (5, 6):  # 5 is this process's first save: bound for durable storage too
            ckpt.save(step, rank_state(0, step)).wait()  # committed, says wait()
        try:
            ckpt.wait()
        except CheckpointError as exc:
            drain_error = exc
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=100)) as ckpt:
        for step in (5, 6):
            state = blank_state()
            try:
                loaded = ckpt.load(state, step=step)
            except CheckpointNotFoundError as exc:
                pytest.fail(f"step {step}, committed per wait(), is in no tier: {exc}")
            assert loaded == step and torch.equal(state["w"], rank_state(0, step)["w"])
    assert drain_error is None, drain_error


def test_a_step_saved_again_after_a_rollback_is_the_one_loaded(tmp_path):
    """After ``load(step=1)`` the job saves step 20 again (other values): the stale local copy of
    the abandoned run's 20 blocks the local commit, so the save goes to durable storage (wait()
    succeeds); the next ``load()`` must return that save, not the abandoned one."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=100)) as ckpt:
        for step in (1, 10, 20):
            ckpt.save(step, rank_state(0, step)).wait()
    assert list_steps(Store(str(durable))) == [1]
    redone = rank_state(0, 2020)
    redone["step"] = 20
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=100)) as ckpt:
        assert ckpt.load(blank_state(), step=1) == 1
        ckpt.save(20, redone).wait()  # committed (to durable storage, as it turns out)
        ckpt.wait()
    assert list_steps(Store(str(durable))) == [1, 20]
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=100)) as ckpt:
        state = blank_state()
        assert ckpt.load(state) == 20
        assert torch.equal(state["w"], redone["w"]), (
            f"loaded the abandoned run's step 20 from {ckpt.last_load.source}"
        )


# -- (a): a rank's own copy went bad, its holder's copy is good --------------------------------


def test_a_corrupt_own_copy_is_restored_from_the_holders_copy(tmp_path):
    """Step 20 is only on the local tiers (rank 2's own copy on node 1, its peer copy on node 0).
    A chunk of rank 2's own copy went bad: the plan gives rank 2 [local, peer rank 0]; the peer
    source must repair it. It does not: the restore transfer finds the step already 'held' in
    rank 2's store (same attempt), moves nothing, and rank 2 reads the same bad chunk again."""
    kw = {"peer_copies": 1, "durable_every": 100}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    assert list_steps(Store(str(tmp_path / "durable"))) == [10]
    own = copies_dir(tmp_path / "node1", 2)
    fresh = sorted(set(index_doc(own, 20)["chunks"]) - set(index_doc(own, 10)["chunks"]))
    _flip(_chunk_path(own, fresh[0]))
    assert _sources_of_step_20(tmp_path, kw) == [LOCAL, LOCAL, PEER, LOCAL]


# -- (c): SIGTERM reaches one node only ------------------------------------------------------


def _one_node_preempted(rank: int, world: int, root: str, out: str) -> None:
    ckpt = Checkpointer(
        Path(root) / "durable",
        tiers=TierOptions(local_dir=Path(root) / f"node{rank}", durable_every=100),
        preemption=PreemptionOptions(handle_sigterm=True),
        encoding=ENCODING,
        storage=STORAGE,
    )
    ckpt.save(1, rank_state(rank, 1)).wait()
    ckpt.wait()  # step 1 drained
    if rank == 0:
        ckpt._sigterm.signalled.set()  # what the handler does: SIGTERM reached node 0 only
    handle = ckpt.save(2, rank_state(rank, 2))
    try:
        handle.wait(timeout_s=60)
        outcome = "committed"
    except TimeoutError:
        outcome = "still pending after 60s"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        try:
            ckpt.wait()
        except Exception:  # noqa: BLE001 - rank 0's outcome is what the test looks at
            pass
    Path(f"{out}.rank-{rank}").write_text(outcome)
    # Rank 1 stays until rank 0 has its outcome, so that no closed connection ends rank 0's wait.
    deadline = time.monotonic() + 90
    while rank == 1 and not Path(f"{out}.rank-0").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os._exit(0)  # no close(): after SIGTERM it would end the process as SIGTERM does


def test_sigterm_on_one_node_only_does_not_hang_its_save(tmp_path):
    """After SIGTERM a save goes to durable storage and its handle waits for that. The signal
    reached only node 0 (a preempted spot node): rank 0 queues a drain of step 2, rank 1 does
    not (its save is not bound for durable storage), so rank 0's drain waits in a collective
    rank 1 never joins, and its handle, which the SIGTERM grace waits for, never completes."""
    out = tmp_path / "outcome"
    run_ranks(_one_node_preempted, 2, str(tmp_path), str(out), timeout_s=180)
    assert Path(f"{out}.rank-0").read_text() == "committed"
    assert Path(f"{out}.rank-1").read_text() == "committed"
    assert 2 in list_steps(Store(str(tmp_path / "durable")))


# -- (c): one rank's local tier cannot be listed at load -------------------------------------


def _load_one_tier_broken(rank: int, world: int, root: str, out: str) -> None:
    ckpt = Checkpointer(
        Path(root) / "durable",
        tiers=TierOptions(local_dir=Path(root) / f"node{rank}"),
        encoding=ENCODING,
        storage=STORAGE,
    )
    if rank == 1:  # this node's disk errors when listed (EIO; here ELOOP)
        commits = copies_dir(Path(root) / "node1", 1) / "commits"
        shutil.rmtree(commits)
        commits.symlink_to("commits")
    try:
        outcome = f"loaded {ckpt.load(blank_state())}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = f"raised {type(exc).__name__}"
    Path(f"{out}.rank-{rank}").write_text(outcome)
    # Stay until the other rank has its outcome (a rank that leaves ends the other's collective).
    other = Path(f"{out}.rank-{1 - rank}")
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not other.exists():
        Path(f"{out}.rank-{1 - rank}.hung").write_text("no outcome after 60s")
    os._exit(0)


def _save_two_ranks(rank: int, world: int, root: str) -> None:
    ckpt = Checkpointer(
        Path(root) / "durable",
        tiers=TierOptions(local_dir=Path(root) / f"node{rank}"),
        encoding=ENCODING,
        storage=STORAGE,
    )
    ckpt.save(10, rank_state(rank, 10)).wait()
    ckpt.close()


def test_a_rank_whose_local_tier_cannot_be_listed_loads_from_another_tier(tmp_path):
    """``_load_tiered`` lists each rank's copies before the first collective: a rank whose
    listing raises must not leave the load alone (every other rank would wait in the gather
    for the group timeout, at least 600 s); its tier is not offered, and it loads the same
    step from durable storage."""
    run_ranks(_save_two_ranks, 2, str(tmp_path), timeout_s=120)
    out = tmp_path / "outcome"
    run_ranks(_load_one_tier_broken, 2, str(tmp_path), str(out), timeout_s=150)
    assert not Path(f"{out}.rank-0.hung").exists(), (
        "rank 0 still in load() 60s after rank 1 left it"
    )
    assert Path(f"{out}.rank-1").read_text() == "loaded 10"
    assert Path(f"{out}.rank-0").read_text() == "loaded 10"


# -- (b)/(f): the durable store cannot be read at load ---------------------------------------


class _FailingCommitGets:
    """A backend whose gets of one step's manifest fail (the rest works)."""

    def __init__(self, inner, step: int) -> None:
        self._inner, self._suffix = inner, f"commits/{step:020d}.json"

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def get(self, path, start=None, end=None):
        if str(path).endswith(self._suffix):
            raise ConnectionError("injected: service unavailable")
        return self._inner.get(path, start, end)

    def get_view(self, path, start=None, end=None):
        return self.get(path, start, end)

    def reopen(self):
        return _FailingCommitGets(self._inner.reopen(), int(self._suffix[8:28]))


def test_a_durable_manifest_that_cannot_be_read_is_not_silently_skipped(tmp_path):
    """A node replaced (no local copies), the durable store's newest manifest unreadable for
    a moment: ``load()`` without fallback must raise, as it does without tiers; it loads the
    older step 1 instead, and the job then redoes step 2 (whose durable save is refused)."""
    durable = tmp_path / "durable"
    with Checkpointer(durable, tiers=TierOptions(local_dir=tmp_path / "local")) as ckpt:
        for step in (1, 2):
            ckpt.save(step, rank_state(0, step)).wait()
    shutil.rmtree(tmp_path / "local")
    store = open_store(durable, timeout_s=2.0)
    store.backend = _FailingCommitGets(store.backend, 2)
    with Checkpointer(
        durable,
        storage=StorageOptions(store=store, timeout_s=2.0),
        tiers=TierOptions(local_dir=tmp_path / "local"),
    ) as ckpt:
        try:
            step = ckpt.load(blank_state())
        except StorageError:
            return
    pytest.fail(f"load() without fallback silently loaded step {step}, not the newest step 2")


class _Unlistable:
    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def list(self, path):
        raise ConnectionError("injected: durable store unreachable")

    def reopen(self):
        return _Unlistable(self._inner.reopen())


def test_an_unreachable_durable_store_is_not_reported_as_no_checkpoint(tmp_path):
    """No local copy (a new node) and the durable store cannot be listed: the load says
    CheckpointNotFoundError '... (durable steps: none)', the error callers take for a fresh
    start (examples/train_gpt.py resume()), though the store holds step 1."""
    durable = tmp_path / "durable"
    with Checkpointer(durable, tiers=TierOptions(local_dir=tmp_path / "local")) as ckpt:
        ckpt.save(1, rank_state(0, 1)).wait()
    shutil.rmtree(tmp_path / "local")
    store = open_store(durable, timeout_s=2.0)
    store.backend = _Unlistable(store.backend)
    ckpt = Checkpointer(
        durable,
        storage=StorageOptions(store=store, timeout_s=2.0),
        tiers=TierOptions(local_dir=tmp_path / "local"),
    )
    try:
        with pytest.raises(CheckpointError) as info:
            ckpt.load(blank_state(), fallback=True)
        with pytest.raises(CheckpointError) as newest:  # not None: nothing to resume
            ckpt.latest()
    finally:
        ckpt.close()
    assert not isinstance(info.value, CheckpointNotFoundError), info.value
    assert not isinstance(newest.value, CheckpointNotFoundError), newest.value


def test_when_every_step_misses_chunks_the_error_is_not_found(tmp_path):
    """``load(fallback=True)`` documents CheckpointNotFoundError when every step only missed
    objects; the tiered load always raises CheckpointCorruptError."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with Checkpointer(durable, tiers=TierOptions(local_dir=local)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, rank_state(0, step)).wait()
    for root in (durable, copies_dir(local, 0)):
        shutil.rmtree(root / "chunks")
    with Checkpointer(durable, tiers=TierOptions(local_dir=local)) as ckpt:
        with pytest.raises(CheckpointError) as info:
            ckpt.load(blank_state(), fallback=True)
    assert isinstance(info.value, CheckpointNotFoundError), repr(info.value)
    assert "\n" not in str(info.value)


# -- (e): a chunk that went bad in the local tier --------------------------------------------


def test_a_local_chunk_gone_bad_does_not_block_every_later_drain(tmp_path):
    """A tensor that appears at step 2 (a local-only save) and stays unchanged; its chunk goes
    bad on the local tier. Every later local save references it without writing it (a known
    chunk of the newest local step), durable storage does not hold it, so every drain reads it,
    refuses it (it hashes first, rightly) and fails: durable storage stays at step 1 for good
    while wait() reports each save committed, and no local step after 1 loads either."""
    from ckptstore.codec import hash_bytes

    durable, local = tmp_path / "durable", tmp_path / "local"
    extra = torch.arange(16384, dtype=torch.float32) * 3  # one chunk of its own

    def state(step: int) -> dict:
        s = rank_state(0, step)
        if step >= 2:
            s["extra"] = extra
        return s

    with Checkpointer(
        durable,
        tiers=TierOptions(local_dir=local, durable_every=2),
        encoding=ENCODING,
        storage=STORAGE,
    ) as ckpt:
        ckpt.save(1, state(1)).wait()
        ckpt.save(2, state(2)).wait()  # local only
        ckpt.wait()
        copies = copies_dir(local, 0)
        digest = hash_bytes(extra.numpy().tobytes())
        assert digest in index_doc(copies, 2)["chunks"]
        _flip(_chunk_path(copies, digest))
        failures = 0
        for step in range(3, 8):  # 3, 5 and 7 are bound for durable storage
            ckpt.save(step, state(step)).wait()  # committed, says wait()
            try:
                ckpt.wait()
            except CheckpointError:
                failures += 1
    steps = list_steps(Store(str(durable)))
    assert steps[-1] == 7, f"durable steps {steps}: {failures} drains failed"


# -- properties -----------------------------------------------------------------------------


def test_a_drain_records_the_durable_stored_size_of_chunks_encoded_otherwise(tmp_path):
    """Durable storage holds the chunks raw (compression none); the local tier encodes them
    with zstd (another stored size). A chunk the drain knows (in the newest durable step) and
    one it finds stored on put (not in the newest step) are both recorded with their durable
    size: the durable steps verify and load bit for bit."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    g = torch.Generator().manual_seed(3)
    old = torch.randint(0, 50, (32768,), dtype=torch.int32, generator=g)  # compressible
    kept = torch.randint(0, 50, (32768,), dtype=torch.int32, generator=g)
    storage = StorageOptions(timeout_s=20.0)
    raw = EncodingOptions(chunk_bytes=1 << 16, compression="none")
    with Checkpointer(durable, encoding=raw, storage=storage) as ckpt:
        ckpt.save(1, {"a": old, "b": kept}).wait()  # both raw
        ckpt.save(2, {"b": kept}).wait()  # newest: knows only b
    with Checkpointer(
        durable,
        tiers=TierOptions(local_dir=local),
        encoding=EncodingOptions(chunk_bytes=1 << 16, compression="zstd"),
        storage=storage,
    ) as ckpt:
        ckpt.save(3, {"a": old, "b": kept}).wait()  # a: put, exists; b: known
        ckpt.wait()
    local_index = index_doc(copies_dir(local, 0), 3)["chunks"]
    durable_index = index_doc(durable, 3)["chunks"]
    assert local_index.keys() == durable_index.keys()
    assert all(local_index[d][1] != durable_index[d][1] for d in local_index)  # sizes differ
    with Checkpointer(durable) as ckpt:
        ckpt.verify("all")
        state = {"a": torch.zeros_like(old), "b": torch.zeros_like(kept)}
        assert ckpt.load(state, step=3) == 3
    assert torch.equal(state["a"], old) and torch.equal(state["b"], kept)


def test_rounds_smaller_than_a_chunk_and_a_source_failing_mid_transfer(tmp_path):
    """peer_budget_bytes=1 (every round one chunk, whatever its size). Node 1 is wiped; node 0's
    copy of rank 2 misses a chunk, so its sender fails in the middle of the rounds: rank 2
    takes step 20 from durable storage, rank 3 from its peer, every rank the same save, and the
    ranks' point-to-point rounds stay matched (no hang)."""
    kw = {"peer_copies": 1, "durable_every": 1, "peer_budget_bytes": 1}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], dict(kw), timeout_s=150)
    shutil.rmtree(tmp_path / "node1")
    held = copies_dir(tmp_path / "node0", 2)
    chunks = sorted(index_doc(held, 20)["chunks"])
    _chunk_path(held, chunks[len(chunks) // 2]).unlink()
    assert _sources_of_step_20(tmp_path, kw) == [LOCAL, LOCAL, DURABLE, PEER]


def _local_commit_fails_on_rank_1(rank: int, world: int, root: str, out: str) -> None:
    ckpt = tier_checkpointer(Path(root), rank, durable_every=100)  # both ranks on node 0
    ckpt.save(10, rank_state(rank, 10)).wait()  # bound for durable storage: drains meanwhile
    if rank == 1:  # rank 1's manifest put of step 20 fails (after it wrote chunks and index)
        (copies_dir(Path(root) / "node0", 1) / "commits" / f"{20:020d}.json").mkdir()
    handle = ckpt.save(20, rank_state(rank, 20))
    handle.wait()
    report = {"durable": handle.durable is not None and handle.durable.result(timeout=60) is None}
    ckpt.wait()
    ckpt.close()
    Path(f"{out}.rank-{rank}.json").write_text(json.dumps(report))


def test_a_local_commit_failing_on_one_rank_sends_the_save_to_durable_and_loads_unmixed(tmp_path):
    """Rank 0 commits its local copy of step 20, rank 1's manifest put fails: every rank saves
    the step to durable storage instead (same attempt, beside a drain of step 10). A restore
    then takes rank 0's state from its local copy and rank 1's from durable storage: one save."""
    out = tmp_path / "save"
    run_ranks(_local_commit_fails_on_rank_1, 2, str(tmp_path), str(out), timeout_s=150)
    assert all(r["durable"] for r in _reports(out, 2))
    assert list_steps(Store(str(tmp_path / "durable"))) == [10, 20]
    load = tmp_path / "load"
    run_ranks(_load_report, 2, str(tmp_path), str(load), {"durable_every": 100}, timeout_s=150)
    reports = _reports(load, 2)
    assert [r.get("step") for r in reports] == [20, 20], reports
    assert all(r["equal"] for r in reports)
    assert [r["source"] for r in reports] == [LOCAL, DURABLE]


def test_a_load_while_drains_are_pending_keeps_them_and_they_complete(tmp_path):
    """Durable puts are slow: the drains of steps 1 and 2 are still running when the same
    Checkpointer loads; it loads step 2 from its local copy, drops no pending step, and the
    drains then complete."""
    from bench.faults import Faults, with_faults

    durable, local = tmp_path / "durable", tmp_path / "local"
    faults = Faults(hang_rate=1.0, ops=frozenset({"put"}))  # durable puts wait for release()
    store = with_faults(open_store(durable, timeout_s=20.0), faults)
    with Checkpointer(
        durable,
        storage=dataclasses.replace(STORAGE, store=store),
        tiers=TierOptions(local_dir=local),
        encoding=ENCODING,
    ) as ckpt:
        handles = [ckpt.save(step, rank_state(0, step)) for step in (1, 2)]
        for h in handles:
            h.wait()
        assert not any(h.durable.done() for h in handles)  # both drains still to go
        state = blank_state()
        try:
            assert ckpt.load(state) == 2 and ckpt.last_load.source == LOCAL
        finally:
            faults.release()
        assert torch.equal(state["w"], rank_state(0, 2)["w"])
        ckpt.wait()
        assert all(h.durable.result(timeout=60) is None for h in handles)
    assert list_steps(Store(str(durable))) == [1, 2]
    assert list_steps(Store(str(copies_dir(local, 0)))) == [1, 2]


def test_a_chunk_stored_otherwise_is_replaced_in_a_copy_only_where_no_listed_copy_names_it(
    tmp_path,
):
    """A peer copy's chunk that the holder's store holds encoded otherwise: kept, and the copy
    refused, while a copy that store lists names it (its index records that encoding); replaced
    by the verified bytes once no listed copy does (an unlisted copy's chunk, not yet swept)."""
    from ckptstore.catalog import load_manifest, load_rank_index
    from ckptstore.codec import CodecConfig, encode
    from ckptstore.format import ChunkInfo, chunk_key
    from ckptstore.retention import drop_step
    from ckptstore.tiers.transfer import _put_chunk

    raw = torch.arange(4096, dtype=torch.float32) // 7
    ckpt = Checkpointer(tmp_path, encoding=EncodingOptions(compression="none"))
    ckpt.save(1, {"w": raw}).wait()
    ckpt.close()
    store = Store(str(tmp_path))
    [digest] = load_rank_index(store, load_manifest(store, 1), 0).chunks
    stored = store.get(chunk_key(digest))
    packed = encode(raw.numpy().view("uint8"), 4, CodecConfig(level=3))
    info = ChunkInfo(raw=raw.numel() * 4, stored=len(packed))
    assert len(packed) < info.raw < len(stored)  # raw, with its header
    with pytest.raises(CheckpointError, match="encoded otherwise"):
        _put_chunk(store, digest, info, packed, repair=False)
    assert store.get(chunk_key(digest)) == stored
    drop_step(store, 1)
    _put_chunk(store, digest, info, packed, repair=False)
    assert store.get(chunk_key(digest)) == packed


def _latest_on_one_rank(rank: int, world: int, root: str) -> None:
    ckpt = Checkpointer(
        f"{root}/store",
        tiers=TierOptions(local_dir=f"{root}/local{rank}"),
        storage=StorageOptions(lost_rank_timeout_s=8),
    )
    state = {"w": torch.full((4,), float(rank))}
    ckpt.save(1, state).wait()
    with pytest.raises(RanksOutOfStepError) as apart:
        if rank == 0:
            ckpt.latest()  # a script logging the step on rank 0 alone
        else:
            ckpt.save(2, state).wait()
    said = str(apart.value)
    assert "save()" in said and "latest()" in said and "collective" in said, said


@pytest.mark.dist
def test_latest_on_one_rank_while_another_saves_names_both_calls(tmp_path):
    """It was an unpacking ``ValueError`` on both ranks (their exchanges paired)."""
    run_ranks(_latest_on_one_rank, 2, str(tmp_path), timeout_s=120)


def _latest_after_the_others_closed(rank: int, world: int, root: str) -> None:
    ckpt = Checkpointer(
        f"{root}/store",
        tiers=TierOptions(local_dir=f"{root}/local{rank}"),
        storage=StorageOptions(lost_rank_timeout_s=8),
    )
    ckpt.save(1, {"w": torch.full((4,), float(rank))}).wait()
    if rank == 1:
        ckpt.close()
        return
    time.sleep(0.5)  # rank 1 has closed
    t0 = time.monotonic()
    with pytest.raises(RanksOutOfStepError, match=r"rank 1 left in close\(\).*latest\(\)"):
        ckpt.latest()
    assert time.monotonic() - t0 < 8  # not the ~10 minutes a rank alive but stuck gets


@pytest.mark.dist
def test_latest_on_one_rank_after_the_others_closed_fails_at_once(tmp_path):
    """Reviewer P: rank 0 waited ~10 minutes (the bound on a rank alive but stuck) for a rank
    that had closed its Checkpointer."""
    run_ranks(_latest_after_the_others_closed, 2, str(tmp_path), timeout_s=120)
