"""Requests per chunk (issue 23): a save puts each new chunk with one request and asks nothing
of a chunk the previous step holds; a restore GETs each chunk once.

Counted where they leave the process: on S3 (the moto server) each API call the S3 client
sends, so that a HEAD s3fs makes on its own counts too; on a local store each call into the
backend. Hedged uploads are off: a hedge adds a duplicate put only when a put is slow.

``python -m tests.store.test_requests`` prints the figures recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, StorageOptions
from ckptstore.errors import CheckpointError, CheckpointNotFoundError
from ckptstore.save import SaveEngine, SaveSession
from ckptstore.store import RetryPolicy, Store
from tests.helpers.counting import (
    CHUNK_BYTES,
    CountingBackend,
    Tally,
    counted_checkpointer,
    moto_server,
)

N_CHUNKS = 64
SAVE_FIXED = 12
"""Requests of a save besides its chunks, 10 on S3 today: the lease's put and delete; the
gc-lease listing (on S3 a LIST, then s3fs's HEAD and LIST of the empty prefix); the listing of
committed steps, the latest manifest and this rank's index in it; this step's index and
manifest (8 on a local store). 2 spare for lease bookkeeping."""
RESTORE_FIXED = 3
"""Requests of a restore besides its chunks: the listing of committed steps, the manifest, the
rank's index."""


def state(seed: int, n_chunks: int = N_CHUNKS) -> dict[str, torch.Tensor]:
    """One tensor of ``n_chunks`` chunks of fresh bytes for each seed."""
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(n_chunks * CHUNK_BYTES // 4, generator=generator)}


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_uri")
    return str(tmp_path / "ckpt")


def test_a_save_of_fresh_chunks_puts_each_once(uri):
    tally = Tally()
    with counted_checkpointer(uri, tally) as ckpt:
        for step in (1, 2):  # with no earlier step, then with one whose index it reads
            tally.clear()
            ckpt.save(step, state(step)).wait()
            assert tally.chunks == {"put": N_CHUNKS}, f"step {step}"
            assert tally.total <= 1.05 * N_CHUNKS + SAVE_FIXED, (step, tally.others)


def test_a_save_of_an_unchanged_state_sends_no_chunk_request(uri):
    tally = Tally()
    with counted_checkpointer(uri, tally, recheck_every=0) as ckpt:
        ckpt.save(1, state(1)).wait()
        tally.clear()
        ckpt.save(2, state(1)).wait()
        assert tally.chunks == {}
        assert tally.total <= SAVE_FIXED, tally.others
        ckpt.verify(2)


def test_a_save_of_an_unchanged_state_reads_back_a_share_of_its_chunks(uri):
    """By default (``recheck_every=16``) a save reads back about one in 16 of the chunks it
    references without writing them: GETs only, each once, never a put."""
    tally = Tally()
    with counted_checkpointer(uri, tally) as ckpt:
        ckpt.save(1, state(1)).wait()
        read = 0
        for step in range(2, 6):
            tally.clear()
            ckpt.save(step, state(1)).wait()
            assert set(tally.chunks) <= {"get"}, tally.chunks
            read += tally.chunks.get("get", 0)
        assert 0 < read < 4 * N_CHUNKS / 4, read  # about 4 * 64 / 16 = 16


def test_a_restore_gets_each_chunk_once(uri):
    tally = Tally()
    with counted_checkpointer(uri, tally) as ckpt:
        ckpt.save(1, state(1)).wait()
        tally.clear()
        into = state(0)
        assert ckpt.load(into) == 1
        assert torch.equal(into["w"], state(1)["w"])
        assert tally.chunks == {"get": N_CHUNKS}
        assert tally.total <= N_CHUNKS + RESTORE_FIXED, tally.others


def test_requests_per_chunk_beyond_a_fixed_overhead(s3_uri):
    """Marginal requests per chunk, on S3: (requests at 2N chunks - at N chunks) / N."""
    n_chunks = N_CHUNKS // 2
    for what, (at_n, at_2n) in request_totals(s3_uri, n_chunks).items():
        assert (at_2n - at_n) / n_chunks <= 1.05, what


def request_totals(uri: str, n_chunks: int) -> dict[str, tuple[int, int]]:
    """Requests of a save and of a restore of ``n_chunks`` and of ``2 * n_chunks`` chunks
    (fresh bytes in every save; each save follows a committed one)."""
    tally = Tally()
    totals: dict[str, list[int]] = {"save": [], "restore": []}
    with counted_checkpointer(uri, tally) as ckpt:
        ckpt.save(1, state(1, n_chunks)).wait()
        for step, n in ((2, n_chunks), (3, 2 * n_chunks)):
            tally.clear()
            ckpt.save(step, state(step, n)).wait()
            totals["save"].append(tally.total)
            tally.clear()
            ckpt.load(state(0, n), step)
            totals["restore"].append(tally.total)
    return {what: (at_n, at_2n) for what, (at_n, at_2n) in totals.items()}


def test_a_gc_between_saves_makes_the_next_save_write_the_chunks_again(tmp_path):
    """The chunks a save knows come from the latest step, read under its lease, never from an
    earlier save of this process: those of a step retained away are swept between saves."""
    tally = Tally()
    with counted_checkpointer(str(tmp_path), tally, keep_last=1) as ckpt:
        ckpt.save(1, state(1)).wait()
        ckpt.save(2, state(2)).wait()  # retention drops step 1 and sweeps its chunks
        assert len(ckpt.store.list("chunks")) == N_CHUNKS
        tally.clear()
        ckpt.save(3, state(1)).wait()  # its own retention then sweeps step 2's
        assert tally.chunks["put"] == N_CHUNKS
        ckpt.verify(3)


def _delete_behind_the_stores_back(uri: str, key: str) -> None:
    if uri.startswith("s3://"):
        import boto3

        bucket, prefix = uri.removeprefix("s3://").split("/", 1)
        boto3.client("s3").delete_object(Bucket=bucket, Key=f"{prefix}/{key}")
    else:
        os.remove(os.path.join(uri, key))


def test_a_chunk_deleted_behind_the_stores_back_is_referenced_and_verify_reports_it(uri):
    """Deleting objects outside ckptstore breaks the format's contract: a save that does not
    read the chunk back (``recheck_every=0``, or not its turn) trusts the latest step's index,
    references the chunk without writing it, and ``verify`` (and a restore) name it missing."""
    with counted_checkpointer(uri, Tally(), recheck_every=0) as ckpt:
        ckpt.save(1, state(1)).wait()
        victim = next(iter(ckpt.store.list("chunks")))
        _delete_behind_the_stores_back(uri, victim)
        ckpt.save(2, state(1)).wait()
        assert not ckpt.store.exists(victim)
        digest = victim.rsplit("/", 1)[-1]
        with pytest.raises(CheckpointNotFoundError, match=digest):
            ckpt.verify(2)
        with pytest.raises(CheckpointError, match=f"{digest} is missing"):
            ckpt.load(state(0), 2)


def _damage(uri: str, store: Store, victim: str, damage: str) -> None:
    """Chunk ``victim`` deleted, a bit flipped in it, or cut short, behind the store's back."""
    if damage == "deleted":
        _delete_behind_the_stores_back(uri, victim)
        return
    data = bytearray(store.get(victim))
    if damage == "flipped":
        data[len(data) // 2] ^= 0x10
    store.delete(victim)
    store.put(victim, bytes(data if damage == "flipped" else data[: len(data) // 2]))


@pytest.mark.parametrize("damage", ["deleted", "flipped", "truncated"])
def test_a_damaged_chunk_a_save_reads_back_is_written_again_for_every_step(uri, damage):
    """A reviewer's (HIGH): a chunk damaged after an earlier save was referenced by every later
    save of the same bytes (frozen weights): each wait() returned, none of those steps loaded.
    A save that reads it back (``recheck_every=1``: every save) writes it again from its own
    bytes, and every step sharing it loads again."""
    with counted_checkpointer(uri, Tally(), recheck_every=1) as ckpt:
        ckpt.save(1, state(1)).wait()
        victim = next(iter(ckpt.store.list("chunks")))
        _damage(uri, ckpt.store, victim, damage)
        ckpt.save(2, state(1)).wait()
        assert ckpt.store.exists(victim)
        for step in (1, 2):
            ckpt.verify(step)
            into = state(0)
            assert ckpt.load(into, step) == step
            assert torch.equal(into["w"], state(1)["w"])


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_chunk_a_load_found_damaged_is_written_again_by_the_next_save(uri, damage):
    """A reviewer's (HIGH): with the chunk of a frozen tensor damaged, a restarted job's load
    named it on every step, and the saves after it still referenced it (not their turn to
    read it back): each committed, none loadable. A chunk a load found damaged or missing is
    read back by the next save that holds it, and written again."""
    with counted_checkpointer(uri, Tally(), recheck_every=0) as ckpt:
        ckpt.save(1, state(1)).wait()
        victim = next(iter(ckpt.store.list("chunks")))
        _damage(uri, ckpt.store, victim, damage)
    with counted_checkpointer(uri, Tally(), recheck_every=0) as ckpt:  # the restarted job
        with pytest.raises(CheckpointError, match=victim.rsplit("/", 1)[-1]):
            ckpt.load(state(0), fallback=True)
        ckpt.save(2, state(1)).wait()
        for step in (1, 2):
            ckpt.verify(step)
            into = state(0)
            assert ckpt.load(into, step) == step and torch.equal(into["w"], state(1)["w"])
        ckpt.save(3, state(1)).wait()  # the chunk is no longer suspect: referenced unread
        ckpt.verify(3)


def _leaseless_write(store: Store, tensor: torch.Tensor, step: int) -> None:
    engine = SaveEngine(chunk_bytes=CHUNK_BYTES, compression="none")
    session = SaveSession(engine, store, step=step, attempt=f"a{step}", kind="state")
    staged = engine.stage_somewhere([tensor], wait_s=0.0, rank=0)
    staged.copy.wait()
    try:
        session.write(staged.buffer, staged.layout, [tensor])
    finally:
        engine.release(staged)


def test_a_session_without_a_lease_asks_for_each_chunk_first(tmp_path):
    """A session on which neither ``begin`` nor ``learn`` is called read no index under a
    lease, so it knows no chunk, asks for each one's size, and writes one that is missing."""
    tally = Tally()
    store = Store(str(tmp_path))
    store.backend = CountingBackend(store.backend, tally)
    tensor = state(1)["w"]
    _leaseless_write(store, tensor, 1)
    assert tally.chunks == {"head": N_CHUNKS, "put": N_CHUNKS}
    victim = store.list("chunks")[0]
    store.delete(victim)
    tally.clear()
    _leaseless_write(store, tensor, 2)
    assert tally.chunks == {"head": N_CHUNKS, "put": 1}
    assert store.exists(victim)


def test_a_backend_without_exclusive_create_is_asked_before_each_new_chunk(tmp_path):
    """Where a put could overwrite, a new chunk is looked for first (an overwrite could change
    the stored size another step's index records); known chunks still cost nothing."""
    tally = Tally()
    store = Store(str(tmp_path))
    store.backend = CountingBackend(store.backend, tally, enforces_create=False)
    encoding = EncodingOptions(
        chunk_bytes=CHUNK_BYTES, compression="none", hedge_uploads=False, recheck_every=0
    )
    with Checkpointer(
        str(tmp_path), storage=StorageOptions(store=store), encoding=encoding
    ) as ckpt:
        ckpt.save(1, state(1)).wait()
        # The size first, then the put's own existence check and its read-back.
        assert tally.chunks == {"head": 2 * N_CHUNKS, "put": N_CHUNKS, "get": N_CHUNKS}
        tally.clear()
        ckpt.save(2, state(1)).wait()
        assert tally.chunks == {}


def _print_figures() -> None:
    """Requests per chunk on a moto server, for docs/BENCHMARKS.md."""
    with moto_server() as new_bucket:
        for n_chunks in (32, 128):
            uri = f"s3://{new_bucket()}/ckpt"
            for what, (at_n, at_2n) in request_totals(uri, n_chunks).items():
                per_chunk = (at_2n - at_n) / n_chunks
                print(
                    f"{what} of {n_chunks} / {2 * n_chunks} chunks: {at_n} / {at_2n} requests, "
                    f"{per_chunk:.2f} per chunk + {at_n - per_chunk * n_chunks:.0f}"
                )


if __name__ == "__main__":
    _print_figures()


class _ChunkFaults:
    """A local backend whose chunk requests misbehave as ``faults`` says, each once:
    ``slow-delete`` (a delete that outlives its deadline, then lands), ``missed-read`` (a
    read answering "not found" for a chunk that is there), ``full`` (puts fail: no space)."""

    def __init__(self, inner, *faults: str) -> None:
        self._inner, self.faults = inner, set(faults)

    def delete(self, path: str) -> None:
        if "/chunks/" in f"/{path}" and "slow-delete" in self.faults:
            self.faults.discard("slow-delete")
            time.sleep(2.0)
        return self._inner.delete(path)

    def get_view(self, path: str, *args, **kwargs):
        if "/chunks/" in f"/{path}" and "missed-read" in self.faults:
            self.faults.discard("missed-read")
            raise FileNotFoundError(errno.ENOENT, "No such file", path)
        return self._inner.get_view(path, *args, **kwargs)

    def put_once(self, path: str, data) -> None:
        if "/chunks/" in f"/{path}" and "full" in self.faults:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return self._inner.put_once(path, data)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _damage_every_chunk(root: str) -> None:
    store = Store(root)
    for key in store.list("chunks"):
        data = bytearray(store.get(key))
        data[len(data) // 2] ^= 0x01
        store.delete(key)
        store.put(key, bytes(data))


def _loads(root: str, step: int, want: dict) -> bool:
    into = {k: torch.zeros_like(v) for k, v in want.items()}
    with Checkpointer(root) as ckpt:
        ckpt.load(into, step)
    return all(torch.equal(into[k], v) for k, v in want.items())


RECHECK_ALL = EncodingOptions(chunk_bytes=CHUNK_BYTES, compression="zstd", recheck_every=1)


def test_a_rewrite_waits_for_its_delete_given_up_at_its_deadline(tmp_path):
    """The recheck's reviewer: the delete of a damaged chunk outlived its deadline, the chunk
    was put again, the save committed, and the abandoned delete then landed: both steps
    missed the chunk the log called repaired."""
    root, want = str(tmp_path / "s"), state(1, 1)
    with Checkpointer(root, encoding=RECHECK_ALL) as ckpt:
        ckpt.save(1, want).wait()
    _damage_every_chunk(root)
    store = Store(root, retry=RetryPolicy(timeout_s=0.5, total_s=10.0))
    store.backend = _ChunkFaults(store.backend, "slow-delete")
    with Checkpointer(root, encoding=RECHECK_ALL, storage=StorageOptions(store=store)) as ckpt:
        ckpt.save(2, want).wait()
    time.sleep(2.5)  # past the slow delete's end, had it been left running
    assert _loads(root, 1, want) and _loads(root, 2, want)


def test_a_read_that_misses_a_good_chunk_never_removes_it(tmp_path):
    """The recheck's reviewer: a read answering "not found" for a good chunk had it deleted
    before its rewrite, whose put then failed (a full disk): the committed step before lost
    it. A chunk found missing is not deleted; the save fails, nothing committed is lost."""
    root, want = str(tmp_path / "s"), state(1, 1)
    with Checkpointer(root, encoding=RECHECK_ALL) as ckpt:
        ckpt.save(1, want).wait()
    store = Store(root, retry=RetryPolicy(attempts=1))
    store.backend = _ChunkFaults(store.backend, "missed-read", "full")
    with Checkpointer(root, encoding=RECHECK_ALL, storage=StorageOptions(store=store)) as ckpt:
        ckpt.save(2, want).wait()  # the second read finds it: nothing to rewrite
    assert _loads(root, 1, want) and _loads(root, 2, want)


def test_a_damaged_chunk_a_save_holds_many_times_is_rechecked_once(tmp_path):
    """The recheck's reviewer: 16 tensors of the same bytes, their one chunk damaged: encode
    threads rechecked it at once, deleting each other's rewrites (3 saves in 30 failed)."""
    root = str(tmp_path / "s")
    same = torch.arange(CHUNK_BYTES // 4, dtype=torch.float32) % 13
    want = {f"t{i}": same.clone() for i in range(16)}
    encoding = EncodingOptions(
        chunk_bytes=CHUNK_BYTES, compression="zstd", recheck_every=1, encode_threads=4
    )
    with Checkpointer(root, encoding=encoding) as ckpt:
        ckpt.save(1, want).wait()
        for step in range(2, 10):
            _damage_every_chunk(root)
            ckpt.save(step, want).wait()
    assert all(_loads(root, step, want) for step in range(1, 10))
