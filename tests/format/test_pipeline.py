"""Layout, adaptive compression and the restore path of the shared pipeline."""

from __future__ import annotations

import torch

from bench.faults import Faults, Fixed, with_faults
from ckptstore import Checkpointer, Store
from ckptstore.catalog import load_manifest
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
    ckpt = Checkpointer(store.uri, store=store, chunk_bytes=64 * 1024, encode_threads=2)
    state = {f"t{i}": torch.randn(16 * 1024) * 0.01 for i in range(n)}
    ckpt.save(1, state).wait()
    ckpt.close()
    return ckpt.engine.governor


def test_governor_stops_compressing_when_storage_outruns_the_encoder():
    governor = _save_chunks(Store("memory://governor-fast"), 64)
    assert governor.raw > governor.compressed  # memory puts are near-free: raw wins


def test_governor_keeps_compressing_when_storage_is_slow():
    store = with_faults(
        Store("memory://governor-slow"), Faults(latency=Fixed(0.02), ops=frozenset({"put"}))
    )
    governor = _save_chunks(store, 24)
    assert governor.compressed == 24 and governor.raw == 0
    manifest = load_manifest(store, 1)
    assert manifest.stored_bytes < manifest.raw_bytes
