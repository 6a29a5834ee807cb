"""One writer per distinct chunk (issue 36): ranks that hold the same chunk agree on which one
puts it. The agreement rule alone, then what a writer that fails or dies leaves behind. The
conformance suite (tests/tiers/test_tier_conformance.py) counts the puts of both front-ends."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from ckptstore import Checkpointer, EncodingOptions, StagingOptions, StorageOptions
from ckptstore.catalog import list_steps
from ckptstore.codec import decode
from ckptstore.errors import CheckpointError, StorageError
from ckptstore.format import chunk_key
from ckptstore.save.once import assign_writers
from ckptstore.store import Store
from tests.helpers.dist import run_ranks, run_ranks_losing

CHUNK = 64 * 1024
ENCODING = EncodingOptions(chunk_bytes=CHUNK, compression="none")
BOUND_S = 60.0


def _digest(i: int) -> str:
    return f"{i:032x}"


def test_each_chunk_gets_one_of_its_holders_and_replicas_share_the_work_by_bytes():
    replicated = [(_digest(i), 100) for i in range(8)]
    holdings = [list(replicated) for _ in range(4)]
    holdings[2].append((_digest(99), 40))  # a chunk of rank 2's own
    writer = assign_writers(holdings)
    assert set(writer) == {_digest(i) for i in range(8)} | {_digest(99)}
    assert writer[_digest(99)] == 2
    assigned = [
        sum(100 for d, r in writer.items() if r == rank and d != _digest(99)) for rank in range(4)
    ]
    assert assigned == [200, 200, 200, 200]


def test_the_same_holdings_in_any_order_give_the_same_writers():
    holdings = [[(_digest(i), 10 * (i + 1)) for i in range(rank, 12)] for rank in range(3)]
    shuffled = [list(reversed(held)) for held in holdings]
    assert assign_writers(holdings) == assign_writers(shuffled)
    for digest, rank in assign_writers(holdings).items():
        assert (digest, int(digest, 16) * 10 + 10) in holdings[rank]


def test_a_chunk_a_rank_holds_twice_is_still_written_once_by_it():
    holdings = [[(_digest(1), 5), (_digest(1), 5)], []]
    assert assign_writers(holdings) == {_digest(1): 0}


def _replicated(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(CHUNK, generator=g), "own": torch.randn(CHUNK // 4, generator=own)}


class _FailingChunkPuts:
    """A store backend whose chunk puts fail while ``failing`` (a disk gone bad on one rank)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failing = True

    def put_once(self, path: str, data: Any) -> None:
        if self.failing and "/chunks/" in f"/{path}":
            raise PermissionError(13, "Permission denied", path)
        return self._inner.put_once(path, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _failing_writer(rank: int, world: int, root: str) -> None:
    store = Store(root)
    backend = _FailingChunkPuts(store.backend)
    backend.failing = rank == 1
    store.backend = backend
    with Checkpointer(root, encoding=ENCODING, storage=StorageOptions(store=store)) as ckpt:
        with pytest.raises(CheckpointError) as raised:
            ckpt.save(1, _replicated(1, rank)).wait(timeout_s=BOUND_S)
        if rank == 1:
            assert isinstance(raised.value, StorageError), raised.value
        else:  # the others name the rank whose chunks did not land
            assert "rank 1 failed writing its chunks" in str(raised.value), raised.value
        assert list_steps(Store(root)) == []
        backend.failing = False
        ckpt.save(2, _replicated(2, rank)).wait(timeout_s=BOUND_S)
    target = {k: torch.zeros_like(v) for k, v in _replicated(2, rank).items()}
    with Checkpointer(root, encoding=ENCODING) as ckpt:
        assert ckpt.load(target) == 2
    assert all(torch.equal(target[k], v) for k, v in _replicated(2, rank).items()), rank


@pytest.mark.dist
def test_a_writer_whose_puts_fail_fails_the_save_on_every_rank_and_the_next_save_commits(
    tmp_path,
):
    """Rank 1 was given a share of the replicated chunks and cannot put any: no rank's save
    commits (no index names a chunk nobody wrote); once its disk is back, the next one does."""
    run_ranks(_failing_writer, 4, str(tmp_path / "store"), timeout_s=240)


LOST = 3
GROUP_S = 10.0


def _killed_writer(rank: int, world: int, root: str, when: str) -> None:
    # Without tiers a lost rank is not bounded by a roll call (StorageOptions.lost_rank_timeout_s):
    # a rank whose ring neighbour died waits out the group's timeout, shortened here from 600 s.
    StorageOptions.group_timeout_s = lambda self, gc_wait_s: GROUP_S  # type: ignore[method-assign]
    ckpt = Checkpointer(root, encoding=ENCODING)
    ckpt.save(1, _replicated(1, rank)).wait(timeout_s=BOUND_S)
    torch.distributed.barrier()
    if rank == LOST:  # killed as it puts its share of step 2, before any put or after one landed
        import ckptstore.pipeline as pipeline
        import ckptstore.save.once as once

        def killed(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        encode_and_put = pipeline._encode_and_put

        def put_then_killed(*args: Any, **kwargs: Any) -> Any:
            encode_and_put(*args, **kwargs)
            killed()

        if when == "before-puts":
            once.write_chunks = killed
        else:
            pipeline._encode_and_put = put_then_killed
        ckpt.save(2, _replicated(2, rank))
        time.sleep(BOUND_S)
        raise AssertionError(f"rank {LOST} was not killed")
    with pytest.raises((CheckpointError, RuntimeError)):  # gloo's error, or a rank's named
        ckpt.save(2, _replicated(2, rank)).wait(timeout_s=BOUND_S)
    assert list_steps(Store(root)) == [1]
    ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("when", ["before-puts", "after-a-put"])
def test_a_writer_killed_mid_save_leaves_no_step_naming_its_chunks(tmp_path, when):
    """Rank 3 dies putting its share of the replicated chunks (before its first put, or once
    one landed): every other rank's save fails, nothing is committed, and the step before
    stays whole."""
    root = tmp_path / "store"
    run_ranks_losing(_killed_writer, 4, str(root), when, lost={LOST}, timeout_s=240)
    from ckptstore.cli import main

    assert list_steps(Store(str(root))) == [1]
    assert main(["verify", str(root), "--step", "1"]) == 0


class _Heard:
    """A group of ``world`` ranks, this one rank 0, whose exchanges answer with ``others``'
    payloads beside this rank's (what the ranks of another save would send)."""

    active = True
    rank = 0

    def __init__(self, others: list[Any]) -> None:
        self.others = others
        self.world_size = 1 + len(others)
        self.sent: list[Any] = []

    def agree(self, error: BaseException | None, payload: Any = None) -> Any:
        from ckptstore.tiers.group import Agreement

        self.sent.append(payload)
        return Agreement(failures=[], payloads=[payload, *self.others.pop(0)])


def test_ranks_that_exchange_the_chunks_of_different_saves_all_fail_before_any_writer():
    from ckptstore.save.once import share_out

    group = _Heard([[("attempt-b", [(_digest(1), (5, None))])]])
    with pytest.raises(CheckpointError, match="different saves"):
        share_out(group, [(_digest(1), 5)], {}, save="attempt-a")


class _Pair:
    """Rank ``rank`` of two ranks exchanging in threads (``share_out`` itself on each)."""

    active = True
    world_size = 2

    def __init__(self, rank: int, box: list, barrier: threading.Barrier) -> None:
        self.rank, self.box, self.barrier = rank, box, barrier

    def agree(self, error: BaseException | None, payload: Any = None) -> Any:
        from ckptstore.tiers.group import Agreement

        self.box[self.rank] = payload
        self.barrier.wait(timeout=BOUND_S)
        heard = Agreement(failures=[], payloads=list(self.box))
        self.barrier.wait(timeout=BOUND_S)
        return heard


def _share_out_on_two_ranks(held: list, known: list, rechecks: list) -> list:
    """Each rank's share of two ranks' ``share_out``, run in two threads."""
    from ckptstore.save.once import share_out

    box: list = [None, None]
    barrier = threading.Barrier(2)
    out: list = [None, None]

    def go(rank: int) -> None:
        group = _Pair(rank, box, barrier)
        out[rank] = share_out(
            group, held[rank], dict(known[rank]), save="a", recheck=rechecks[rank]
        )

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=BOUND_S)
    return out


def test_ranks_that_know_and_suspect_different_chunks_give_each_chunk_one_writer():
    """A reviewer (HIGH): a chunk one rank's load found damaged (a suspect), held or not by it,
    or a rank that knew a chunk stored that the other did not, made the ranks judge the
    save's chunks differently; writers balanced by bytes then differed, some new chunk had
    none, and every save failed with a bare KeyError. Each chunk that needs a writer (stored
    by no rank, or suspect on any rank) gets exactly one, on every trial."""
    from ckptstore.format import ChunkInfo
    from ckptstore.pipeline import Rechecks

    rng = random.Random(7)
    for trial in range(300):
        shared = [(_digest(rng.getrandbits(64)), rng.choice([1, 10, 100])) for _ in range(5)]
        extra = [(_digest(rng.getrandbits(64)), 50) for _ in range(2)]
        held = [list(shared) + extra[:1], list(shared) + extra[1:]]
        known = [{} for _ in range(2)]
        for rank in range(2):  # each rank knows some chunks stored, not the same ones
            for d, raw in rng.sample(held[rank], 2):
                known[rank][d] = ChunkInfo(raw, raw)
        suspects = [set(rng.sample([d for d, _ in shared + extra], rng.randint(0, 2))), set()]
        period = rng.choice([0, 16])
        rechecks = [Rechecks(period, trial, suspects[0]), Rechecks(period, trial, suspects[1])]
        out = _share_out_on_two_ranks(held, known, rechecks)
        reported = {d for r in range(2) for d, _ in held[r] if d in known[r]}
        for d in {d for h in held for d, _ in h}:
            turn = bool(period) and xxhash.xxh3_64_intdigest(f"{d}/{trial}".encode()) % period == 0
            needs = d not in reported or d in suspects[0] or turn
            writers = [r for r in range(2) if d in out[r]]
            assert len(writers) == (1 if needs else 0), (trial, d, writers, needs)
        assert rechecks[1].suspect == suspects[0], trial  # told what rank 0 suspects


def test_a_rank_that_wrote_nothing_joins_its_round_once_and_only_once():
    from ckptstore.save.once import OneRound

    group = _Heard([[("a", [])], [("a", {})]])
    round_ = OneRound(group, "a")
    assert round_.active
    round_.finish()  # no write took part: both exchanges, holding nothing
    assert group.sent == [("a", []), ("a", {})]
    assert not round_.active
    round_.finish()
    assert len(group.sent) == 2


def _rechecking_ranks(rank: int, world: int, root: str) -> None:
    encoding = EncodingOptions(chunk_bytes=CHUNK, compression="none", recheck_every=1)
    with Checkpointer(root, encoding=encoding) as ckpt:
        ckpt.save(1, _replicated(1, rank)).wait(timeout_s=BOUND_S)
        torch.distributed.barrier()
        store = Store(root)
        chunks = sorted(store.list("chunks"))
        if rank == 0:  # every chunk damaged where it lies: the replicated ones and rank 0's own
            for key in chunks:
                data = bytearray(store.get(key))
                data[len(data) // 2] ^= 0xFF
                store.delete(key)
                store.put(key, bytes(data))
        torch.distributed.barrier()
        frozen = _replicated(1, rank)
        ckpt.save(2, frozen).wait(timeout_s=BOUND_S)
    with Checkpointer(root, encoding=ENCODING) as ckpt:
        for step in (1, 2):
            target = {k: torch.zeros_like(v) for k, v in frozen.items()}
            assert ckpt.load(target, step) == step
            assert all(torch.equal(target[k], v) for k, v in frozen.items()), (rank, step)


@pytest.mark.dist
def test_chunks_damaged_since_the_last_save_are_written_again_by_one_holder_each(tmp_path):
    """A reviewer's (HIGH), through the one-writer rule: the next save of the same bytes read
    back its known chunks (``recheck_every=1``), one holder each, and wrote the damaged ones
    again, so both steps load on every rank."""
    run_ranks(_rechecking_ranks, 2, str(tmp_path / "store"), timeout_s=240)


def _chunk_digests(uri: str, step: int) -> set[str]:
    from ckptstore.catalog import load_manifest, load_rank_indexes

    store = Store(uri)
    return {d for i in load_rank_indexes(store, load_manifest(store, step)) for d in i.chunks}


@pytest.mark.parametrize("mode", ["host", "device"])  # device: the cpu stand-in, drained
def test_a_packed_chunks_padding_is_zeros_whatever_the_staging_buffer_held(tmp_path, mode):
    """Reviewer O: the alignment padding after a small tensor in a packed chunk was whatever
    the reused staging buffer held (an earlier save's bytes, or uninitialized memory), so the
    same state hashed apart on two ranks (or in two saves): written twice, and stray memory
    stored in the checkpoint."""
    state = {
        "step": torch.tensor(7, dtype=torch.int32),
        "ids": torch.arange(50),  # int64: packed with the int32 (floats are packed apart)
        "w": torch.arange(100.0),
    }
    fresh = Checkpointer(str(tmp_path / "fresh"), encoding=ENCODING)
    fresh.save(1, state).wait()
    fresh.close()
    reused = Checkpointer(
        str(tmp_path / "reused"), encoding=ENCODING, staging=StagingOptions(mode=mode)
    )
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8).view(torch.float32)
    reused.save(0, {"noise": noise}).wait()  # the staging buffer now holds noise
    reused.save(1, state).wait()
    reused.close()
    digests = _chunk_digests(str(tmp_path / "reused"), 1)
    assert digests == _chunk_digests(str(tmp_path / "fresh"), 1)
    store = Store(str(tmp_path / "reused"))
    chunks = [decode(store.get(chunk_key(d)), expected_hash=d, name=d) for d in digests]
    ids, step = (state[k].reshape(-1).numpy().view(np.uint8) for k in ("ids", "step"))
    # the int32 at 0, 60 bytes of padding, the int64s at 64, 48 bytes of padding
    packed = np.concatenate([step, np.zeros(60, np.uint8), ids, np.zeros(48, np.uint8)])
    assert any(c.size == packed.size and np.array_equal(c, packed) for c in chunks)


def test_a_chunk_already_there_at_a_size_no_encoding_has_is_not_referenced(tmp_path):
    """A storage-fault adversary of stop 80: a save whose chunk put met "already exists" took
    the size the store gave (a gateway's HEAD answering 0, a damaged leftover of 1 byte) into
    the rank index unchecked: wait() said committed, and the step never loaded. The save now
    fails, naming the object; with it gone, the same save commits and loads."""
    state = {"w": torch.arange(1000.0)}
    none = EncodingOptions(compression="none")
    with Checkpointer(tmp_path, encoding=none) as ckpt:
        ckpt.save(1, state).wait()
    chunks = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file()]
    assert len(chunks) == 1
    chunks[0].write_bytes(b"x")  # a damaged leftover, referenced by no step
    for manifest in (tmp_path / "commits").iterdir():
        manifest.unlink()
    with Checkpointer(tmp_path, encoding=none) as ckpt:
        with pytest.raises(StorageError, match="1 bytes, which no encoding of its 4032 bytes"):
            ckpt.save(2, state).wait()
        assert ckpt.steps() == []
        chunks[0].unlink()
        ckpt.save(3, state).wait()
        loaded = {"w": torch.zeros(1000)}
        ckpt.load(loaded)
    assert torch.equal(loaded["w"], state["w"])


def test_a_drain_meeting_a_chunk_at_a_size_no_encoding_has_does_not_commit(tmp_path):
    """The fix's adversary: with tiers, the drain to durable storage took the size of a damaged
    leftover there (0 bytes) unchecked, and committed a durable step that never loaded."""
    from ckptstore import TierOptions

    state = {"w": torch.arange(1000.0)}
    with Checkpointer(tmp_path / "scratch", encoding=EncodingOptions(compression="none")) as c:
        c.save(1, state).wait()
        (key,) = c.store.list("chunks")
    durable = tmp_path / "durable"
    (durable / key).parent.mkdir(parents=True)
    (durable / key).write_bytes(b"")  # a damaged leftover, referenced by no step
    tiers = TierOptions(local_dir=str(tmp_path / "local"))
    with Checkpointer(durable, tiers=tiers, encoding=EncodingOptions(compression="none")) as c:
        c.save(5, state).wait()  # committed to the local tier
        with pytest.raises(CheckpointError, match="0 bytes, which no encoding of its 4032 bytes"):
            c.wait()  # the drain
    assert list_steps(Store(str(durable))) == []
