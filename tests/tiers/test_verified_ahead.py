"""A rank's own copy of a step, its chunks mapped and hashed by a thread while the load waits on
another rank's repair (issue 36): what the thread verified is served once, the rest read (and
its errors met) as before."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer
from ckptstore.catalog import load_manifest, read_rank_index
from ckptstore.codec import hash_bytes
from ckptstore.errors import CheckpointCorruptError
from ckptstore.format import chunk_key
from ckptstore.options import EncodingOptions
from ckptstore.store import Store
from ckptstore.tiers.ahead import VerifiedAhead
from ckptstore.tiers.fetch import TierFetch
from ckptstore.tiers.restore import LoadReport

CHUNK = 1 << 16


def _saved(tmp_path: Path, compression: str) -> tuple[Store, int, str, dict]:
    """A one-rank step of random and of compressible tensors; its store, step, attempt and
    chunks."""
    uri = str(tmp_path / "copy")
    ckpt = Checkpointer(uri, encoding=EncodingOptions(compression=compression, chunk_bytes=CHUNK))
    g = torch.Generator().manual_seed(5)
    state = {"noise": torch.rand(40_000, generator=g), "zeros": torch.zeros(40_000)}
    ckpt.save(7, state).wait()
    ckpt.close()
    store = Store(uri)
    manifest = load_manifest(store, 7)
    chunks = read_rank_index(store, manifest.ranks[0]).chunks
    return store, 7, manifest.attempt, chunks


def _finished(ahead: VerifiedAhead) -> None:
    ahead._thread.join(timeout=30)
    assert not ahead._thread.is_alive()


def test_every_chunk_is_verified_and_served_once(tmp_path):
    store, step, attempt, chunks = _saved(tmp_path, "none")
    ahead = VerifiedAhead(store, step, attempt, budget_bytes=1 << 30)
    _finished(ahead)
    assert len(ahead) == len(chunks) > 2
    for digest, info in chunks.items():
        raw = ahead.take(digest)
        assert raw is not None and raw.size == info.raw and hash_bytes(raw) == digest
        assert ahead.take(digest) is None  # handed out once
    assert ahead.held_bytes == 0  # stored as one raw plane: views of the mapped pages


def test_a_corrupt_chunk_is_left_for_the_load_which_meets_its_error(tmp_path):
    store, step, attempt, chunks = _saved(tmp_path, "none")
    bad = sorted(chunks)[0]
    path = Path(store.url(chunk_key(bad)).removeprefix("file://"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    ahead = VerifiedAhead(store, step, attempt, budget_bytes=1 << 30)
    _finished(ahead)
    assert len(ahead) == len(chunks) - 1
    fetch = TierFetch(
        local=store, held=chunks, durable=None, report=LoadReport(), rank=0, ahead=ahead
    )
    with pytest.raises(CheckpointCorruptError, match="xxh3 mismatch"):
        fetch(bad, chunks[bad])
    for digest in sorted(chunks)[1:]:
        assert hash_bytes(fetch(digest, chunks[digest])) == digest


def test_another_save_of_the_step_is_not_read(tmp_path):
    store, step, _, chunks = _saved(tmp_path, "none")
    ahead = VerifiedAhead(store, step, "another-attempt", budget_bytes=1 << 30)
    _finished(ahead)
    assert len(ahead) == 0
    assert all(ahead.take(d) is None for d in chunks)


def test_decoded_chunks_stay_within_the_budget(tmp_path):
    store, step, attempt, chunks = _saved(tmp_path, "zstd")
    compressed = [d for d, info in chunks.items() if info.stored < info.raw]
    assert compressed  # the zeros shrink
    ahead = VerifiedAhead(store, step, attempt, budget_bytes=0)
    _finished(ahead)
    # Only chunks kept as views of the mapped pages, until the first that needed memory.
    assert ahead.held_bytes == 0 and len(ahead) < len(chunks)
    assert all(ahead.take(d) is None for d in compressed)
    roomy = VerifiedAhead(store, step, attempt, budget_bytes=1 << 30)
    _finished(roomy)
    assert len(roomy) == len(chunks)
    assert roomy.held_bytes == sum(chunks[d].raw for d in compressed)
    raw = roomy.take(compressed[0])
    assert raw is not None and hash_bytes(raw) == compressed[0]
    assert roomy.held_bytes == sum(chunks[d].raw for d in compressed[1:])
    roomy.close()
    assert len(roomy) == 0 and roomy.held_bytes == 0


def test_the_first_take_stops_the_thread(tmp_path):
    store, step, attempt, chunks = _saved(tmp_path, "none")
    ahead = VerifiedAhead(store, step, attempt, budget_bytes=1 << 30)
    ahead.take(next(iter(chunks)))
    assert not ahead._thread.is_alive()
    held = len(ahead)
    threading.Event().wait(0.2)
    assert len(ahead) == held  # nothing more verified once the load reads
