"""Layout, adaptive compression and the restore path of the shared pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.faults import Faults, Fixed, with_faults
from ckptstore import Checkpointer, EncodingOptions, StorageOptions, Store
from ckptstore.catalog import load_manifest, read_rank_index
from ckptstore.codec import CodecConfig, decode, encode, hash_bytes
from ckptstore.errors import CheckpointCorruptError
from ckptstore.pipeline import CompressionGovernor, PipelineConfig, plan_layout


def test_layout_packs_small_tensors_by_width_and_splits_large_ones():
    cfg = PipelineConfig(chunk_bytes=4096, pack_below_bytes=1024)
    tensors = [
        torch.zeros(10),
        torch.zeros(10, dtype=torch.int64),
        torch.zeros(5000),
        torch.zeros(3, dtype=torch.bfloat16),
    ]
    layout = plan_layout(tensors, cfg)
    widths = sorted(c.itemsize for c in layout.chunks)
    # float32 pack, int64 pack (grouping width 1), bf16 pack, and 20000 bytes in 4096 pieces
    assert widths.count(4) == 1 + 5 and widths.count(1) == 1 and widths.count(2) == 1
    assert all(c.end - c.start <= 4096 for c in layout.chunks)
    assert all(o % 64 == 0 for o in layout.offsets)


def _save_chunks(store: Store, n: int) -> CompressionGovernor:
    ckpt = Checkpointer(
        store.uri,
        storage=StorageOptions(store=store),
        encoding=EncodingOptions(chunk_bytes=64 * 1024, encode_threads=2),
    )
    state = {f"t{i}": torch.randn(16 * 1024) * 0.01 for i in range(n)}
    ckpt.save(1, state).wait()
    ckpt.close()
    return ckpt.engine.governor


def _chunk_timed(governor: CompressionGovernor, *, encode_s: float, put_s: float) -> bool:
    """One 1 MiB chunk through ``governor`` (compressing to 80%), with the given timings;
    whether it was stored compressed."""
    raw = 1 << 20
    compress = governor.should_compress()
    if compress:
        compress = governor.keeps(raw=raw, encoded=raw * 8 // 10, encode_s=encode_s)
    stored = raw * 8 // 10 if compress else raw
    governor.observe_put(stored=stored, put_s=put_s * stored / raw, compressed=compress)
    return compress


def test_governor_stops_compressing_when_storage_outruns_the_encoder():
    """A store that takes 1 ms per MiB, an encoder 5 ms: compression never pays. The first
    chunk is compressed (the store's speed is not known yet); every probe after is encoded,
    found not to pay, and stored raw, so no restore decodes it."""
    governor = CompressionGovernor(probe_every=8)
    stored = [_chunk_timed(governor, encode_s=0.005, put_s=0.001) for _ in range(64)]
    assert stored[0] and not any(stored[1:])
    assert governor.probes_kept_raw == 64 // 8
    assert (governor.compressed, governor.raw) == (1, 63)


def test_governor_follows_a_store_that_slows_down():
    governor = CompressionGovernor(probe_every=4, smoothing=1.0)
    assert [_chunk_timed(governor, encode_s=0.005, put_s=0.001) for _ in range(8)][1:] == [
        False
    ] * 7
    # the store now takes 100 ms per MiB: the first raw put to see it turns compression on
    slow = [_chunk_timed(governor, encode_s=0.005, put_s=0.1) for _ in range(8)]
    assert slow == [False] + [True] * 7


def test_a_chunk_whose_compression_does_not_pay_is_stored_raw_and_loads(tmp_path):
    """The codec path of a probe kept raw: encoded compressed, then put as one raw plane."""

    class NeverPays(CompressionGovernor):
        def keeps(self, **kwargs) -> bool:
            self.probes_kept_raw += 1
            return False

    store = Store(str(tmp_path))
    ckpt = Checkpointer(
        store.uri,
        storage=StorageOptions(store=store),
        encoding=EncodingOptions(chunk_bytes=64 * 1024),
    )
    ckpt.engine.governor = NeverPays()
    state = {f"t{i}": torch.randn(16 * 1024) * 0.01 for i in range(8)}
    ckpt.save(1, state).wait()
    assert ckpt.engine.governor.probes_kept_raw == 8  # every chunk was encoded compressed
    assert len(list(store.list("chunks/"))) == 8 and _compressed_chunks(store) == 0
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ckpt.load(into) == 1
    assert all(torch.equal(into[k], v) for k, v in state.items())
    ckpt.close()


def _compressed_chunks(store: Store) -> int:
    """Chunk objects with a zstd plane (their plane table read from each header)."""
    from ckptstore.codec import _HEADER, _PLANE

    count = 0
    for key in store.list("chunks/"):
        data = store.get(key)
        nplanes = _HEADER.unpack_from(data)[3]
        methods = [
            _PLANE.unpack_from(data, _HEADER.size + i * _PLANE.size)[0] for i in range(nplanes)
        ]
        count += any(m == 1 for m in methods)
    return count


def test_governor_keeps_compressing_when_storage_is_slow():
    store = with_faults(
        Store("memory://governor-slow"), Faults(latency=Fixed(0.1), ops=frozenset({"put"}))
    )
    governor = _save_chunks(store, 24)
    assert governor.compressed == 24 and governor.raw == 0
    manifest = load_manifest(store, 1)
    assert manifest.stored_bytes < manifest.raw_bytes


def test_a_local_store_keeps_a_chunk_compressed_only_where_that_saves_a_quarter():
    """On a store on this machine's disk a restore reads raw chunks at page-cache speed, several
    times what zstd decodes: a chunk compression shrinks by a few percent is stored raw, the
    first ones of a save (encoded before any put is timed) included; one it shrinks by a third
    is kept, chunk by chunk. A store that is not local keeps the first ones compressed (its speed unknown)."""
    local = CompressionGovernor(probe_every=8)
    remote = CompressionGovernor(probe_every=8)
    raw = 1 << 20
    # Four threads encode at once, before any put: 2 ms per MiB, to 90% of the size.
    assert [local.should_compress() for _ in range(4)] == [True] * 4
    kept = [local.keeps(raw=raw, encoded=raw * 9 // 10, encode_s=0.002, local=True) for _ in "abcd"]
    assert kept == [False] * 4 and local.probes_kept_raw == 4
    assert local.keeps(raw=raw, encoded=raw * 2 // 3, encode_s=0.002, local=True)
    assert all(remote.keeps(raw=raw, encoded=raw * 9 // 10, encode_s=0.002) for _ in range(4))


def test_a_save_to_a_local_directory_keeps_only_chunks_that_shrink_by_a_quarter(tmp_path):
    """compression="auto" on a local directory: every chunk of a state of float noise (which
    zstd shrinks by a few percent) is stored raw, the first ones included; of a bf16 state
    (whose exponent bytes shrink by far more) the chunks encoded before any put was timed are
    kept compressed, and no chunk is kept compressed for less than a quarter."""
    state = {f"t{i}": torch.randn(16 * 1024) for i in range(12)}
    for step, saved in ((1, state), (2, {k: v.bfloat16() for k, v in state.items()})):
        encoding = EncodingOptions(chunk_bytes=64 * 1024, encode_threads=4)
        with Checkpointer(tmp_path / "s", encoding=encoding) as ckpt:
            ckpt.save(step, saved).wait()
    store = Store(str(tmp_path / "s"))
    chunks = {
        step: read_rank_index(store, load_manifest(store, step).ranks[0]).chunks.values()
        for step in (1, 2)
    }
    assert all(c.stored >= c.raw for c in chunks[1])  # noise: raw
    compressed = [c for c in chunks[2] if c.stored < c.raw]
    assert compressed and all(c.stored <= 0.75 * c.raw for c in compressed)
    target = {f"t{i}": torch.zeros(16 * 1024) for i in range(12)}
    with Checkpointer(tmp_path / "s") as again:
        assert again.load(target, step=1) == 1
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_decode_without_verify_skips_only_the_hash():
    """Issue 36: a repair's chunks, hashed once on arrival, are decoded for the load with
    ``verify=False``: the same bytes, no second hash; a malformed object still fails."""
    raw = np.arange(4096, dtype=np.float32).view(np.uint8)
    for level in (None, 1):
        obj = encode(raw, 4, CodecConfig(level=level))
        digest = hash_bytes(raw)
        wrong = "0" * len(digest)
        assert bytes(decode(obj, expected_hash=digest, name="c")) == raw.tobytes()
        with pytest.raises(CheckpointCorruptError):
            decode(obj, expected_hash=wrong, name="c")
        out = decode(obj, expected_hash=wrong, name="c", raw_len=raw.size, verify=False)
        assert bytes(out) == raw.tobytes()
        with pytest.raises(CheckpointCorruptError):
            decode(obj[:-1], expected_hash=digest, name="c", verify=False)
