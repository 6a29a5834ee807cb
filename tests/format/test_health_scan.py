"""The health scan fused into the hashing pass (``health.ChunkScan``, issue 33): each chunk's
pieces are scanned as they are hashed, and the partial results add up, per tensor, to the same
``[nan, inf, sumsq]`` as ``health.scan`` over whole tensors, wherever the chunks and the
pieces cut them."""

from __future__ import annotations

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, HealthPolicy, Store, codec
from ckptstore.catalog import load_manifest, read_rank_index
from ckptstore.codec import hash_bytes
from ckptstore.health import ChunkScan, scan
from ckptstore.pipeline import PipelineConfig, plan_layout, write_chunks

CHUNK = 64 * 1024


def _small_ints(n: int, dtype: torch.dtype, shift: int = 0) -> torch.Tensor:
    """Values 0..6: every partial sum of squares is exact in float32, so a wrong partial (an
    element counted twice or missed) shows as an inexact total."""
    return ((torch.arange(n) + shift) % 7).to(dtype)


def _expected(t: torch.Tensor) -> list | None:
    if not t.dtype.is_floating_point:
        return None
    x = t.reshape(-1).double()
    finite = torch.isfinite(x)
    return [
        int(torch.isnan(x).sum()),
        int(torch.isinf(x).sum()),
        float(torch.where(finite, x, 0).square().sum()),
    ]


def _state() -> list[torch.Tensor]:
    big = _small_ints(3 * CHUNK // 4 + 1000, torch.float32)  # over 3 chunks, a partial last
    for boundary in (CHUNK // 4 - 1, CHUNK // 4, 2 * CHUNK // 4):  # around chunk boundaries
        big[boundary] = float("nan")
    big[CHUNK // 4 + 1] = float("inf")
    bf = _small_ints(CHUNK + 500, torch.bfloat16, shift=3)  # a bf16 tensor across 2 chunks
    bf[CHUNK // 2 - 1] = -float("inf")  # the last element of its first chunk
    bf[CHUNK // 2] = float("nan")  # the first of its second
    return [
        big,
        bf,
        _small_ints(700, torch.float32, shift=1),  # packed small tensors share a chunk
        torch.empty(0),  # empty
        torch.arange(9),  # not floating
        _small_ints(300, torch.bfloat16, shift=2),
        _small_ints(CHUNK // 8 + 3, torch.float64, shift=5),  # a float64 over 2 chunks
        _small_ints(40, torch.float16, shift=4),
    ]


def _staged(tensors: list[torch.Tensor]):
    layout = plan_layout(tensors, PipelineConfig(chunk_bytes=CHUNK, pack_below_bytes=8192))
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for t, offset in zip(tensors, layout.offsets):
        n = t.numel() * t.element_size()
        buffer[offset : offset + n] = t.reshape(-1).view(torch.uint8)
    return layout, buffer.numpy()


@pytest.mark.parametrize("piece_bytes", [codec.HASH_PIECE_BYTES, 8192, 1000, 24])
def test_partial_results_add_up_to_each_tensors_health(monkeypatch, piece_bytes):
    """Pieces smaller than a chunk, and pieces that cut elements (1000, 24 bytes: a float64
    or a pair of bf16 straddles their bounds) give the exact totals and the same digests."""
    monkeypatch.setattr(codec, "HASH_PIECE_BYTES", piece_bytes)
    tensors = _state()
    layout, buffer = _staged(tensors)
    assert sum(1 for c in layout.chunks if c.start < layout.offsets[0] + tensors[0].nbytes) > 3
    fused = ChunkScan(tensors, layout.offsets, layout.chunks)
    for span in layout.chunks:
        raw = buffer[span.start : span.end]
        assert fused.hash(span.start, raw) == hash_bytes(raw)
    expected = [_expected(t) for t in tensors]
    assert fused.result() == expected
    assert expected[0][:2] == [3, 1] and expected[1][:2] == [1, 1]
    assert expected[3] == [0, 0, 0.0] and expected[4] is None
    whole = scan(tensors)  # the whole-tensor scan (a device's) means the same
    assert [h if h is None else h[:2] for h in whole] == [
        h if h is None else h[:2] for h in expected
    ]


def test_a_chunk_left_unscanned_is_an_error_not_a_silent_zero():
    tensors = _state()
    layout, buffer = _staged(tensors)
    fused = ChunkScan(tensors, layout.offsets, layout.chunks)
    for span in layout.chunks[1:]:
        fused.hash(span.start, buffer[span.start : span.end])
    with pytest.raises(AssertionError, match="not scanned"):
        fused.result()


def test_overflowing_sums_take_the_slow_path_per_piece_quietly(recwarn):
    """A float32 sum of squares past float32 (finite values) is recounted in float64; one past
    float64 is None; neither warns."""
    tensors = [torch.full((5000,), 1e30), torch.full((3,), 1e200, dtype=torch.float64)]
    layout, buffer = _staged(tensors)
    fused = ChunkScan(tensors, layout.offsets, layout.chunks)
    for span in layout.chunks:
        fused.hash(span.start, buffer[span.start : span.end])
    (nan, inf, sq), big = fused.result()
    assert (nan, inf) == (0, 0) and sq == pytest.approx(5000 * 1e60, rel=1e-6)
    assert big == [0, 0, None]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_write_chunks_scans_every_chunk_it_hashes(tmp_path):
    tensors = _state()
    layout, buffer = _staged(tensors)
    fused = ChunkScan(tensors, layout.offsets, layout.chunks)
    cfg = PipelineConfig(chunk_bytes=CHUNK, pack_below_bytes=8192, encode_threads=3)
    digests, _ = write_chunks(Store(tmp_path), buffer, layout, cfg, scan=fused)
    plain, _ = write_chunks(Store(tmp_path / "plain"), buffer, layout, cfg)
    assert digests == plain
    assert fused.result() == [_expected(t) for t in tensors]


def _index_health(root, step: int) -> dict[str, list | None]:
    """Tensor name -> its recorded health."""
    from ckptstore.save.session import tensor_names

    store = Store(root)
    index = read_rank_index(store, load_manifest(store, step).ranks[0])
    names = tensor_names(index)
    return {names[i]: e.health for i, e in enumerate(index.tensors)}


def test_a_save_records_the_fused_scan_and_scan_off_records_none(tmp_path):
    """Through a Checkpointer save whose chunks cut the tensors: the index holds the exact
    health of each; with the scan off (``HealthPolicy(scan=False)``) it holds none."""
    tensors = _state()
    state = {f"t{i}": t for i, t in enumerate(tensors)}
    encoding = EncodingOptions(chunk_bytes=CHUNK, encode_threads=2)
    with Checkpointer(tmp_path / "on", encoding=encoding) as ck:
        handle = ck.save(1, state)
        handle.wait()
    assert _index_health(tmp_path / "on", 1) == {k: _expected(t) for k, t in state.items()}
    assert (handle.health.nan, handle.health.inf) == (3 + 1, 1 + 1)
    with Checkpointer(tmp_path / "off", encoding=encoding, health=HealthPolicy(scan=False)) as ck:
        handle = ck.save(1, state)
        handle.wait()
    assert handle.health.status == "unknown"
    assert _index_health(tmp_path / "off", 1) == dict.fromkeys(state)
