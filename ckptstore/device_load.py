"""Restore into tensors on an accelerator at host speed: chunks are fetched, verified and
decoded into pinned host buffers (``pipeline.read_tensors``) a batch of tensors at a time, and
each batch is copied to the device on a side stream while the next batch decodes into the other
of two buffers. No pageable host-to-device copy. On the cpu (``Device("cpu")``) the same steps
run, each copy finished when it is made."""

from __future__ import annotations

import math

import torch

from ckptstore.device import Device
from ckptstore.format import RankIndex
from ckptstore.pipeline import ChunkSource, PipelineConfig, parse_dtype, read_tensors
from ckptstore.staging import align
from ckptstore.store import Store

LOAD_BATCH_BYTES = 256 * 2**20


def read_into(
    store: Store,
    index: RankIndex,
    wanted: dict[int, torch.Tensor | None],
    cfg: PipelineConfig,
    *,
    written: set[int] | None = None,
    source: ChunkSource | None = None,
) -> dict[int, torch.Tensor]:
    """``pipeline.read_tensors``, with the destinations that live on one accelerator filled
    through ``read_to_device``; same contract (``written`` included). With a ``source`` (one
    pass over every chunk, e.g. ranks that share them) every destination is filled by one
    ``read_tensors``: those on an accelerator through a host temporary each."""
    on_device = {i: d for i, d in wanted.items() if d is not None and d.device.type != "cpu"}
    device = Device.of(list(on_device.values()))
    if not on_device or device is None or source is not None:
        return read_tensors(store, index, wanted, cfg, written=written, source=source)
    rest = {i: d for i, d in wanted.items() if i not in on_device}
    out = read_tensors(store, index, rest, cfg, written=written) if rest else {}
    out.update(read_to_device(store, index, on_device, cfg, device=device, written=written))
    return out


def read_to_device(
    store: Store,
    index: RankIndex,
    dests: dict[int, torch.Tensor],
    cfg: PipelineConfig,
    *,
    device: Device,
    written: set[int] | None = None,
    batch_bytes: int = LOAD_BATCH_BYTES,
) -> dict[int, torch.Tensor]:
    """Fill ``dests`` (tensors on ``device``) with the tensors of ``index``, through two
    pinned host buffers used in turn; returns ``dests``. A tensor is in ``written`` once its
    copy to the device was enqueued (its bytes all verified). Returns, or raises, once every
    copy enqueued has run."""
    touched = written if written is not None else set()
    batches = _batches(index, list(dests), batch_bytes)
    if not batches:
        return dict(dests)
    size = max(total for _, total in batches)
    buffers: list[torch.Tensor] = []
    events: list[object] = []
    stream = device.new_stream()
    # The copies start after the loop's work on the destinations enqueued so far.
    device.wait(device.record(), stream)
    try:
        for k, (batch, _) in enumerate(batches):
            slot = k % 2
            if slot == len(buffers):
                buffers.append(
                    torch.empty(size, dtype=torch.uint8, pin_memory=device.is_accelerator)
                )
                events.append(None)
            elif events[slot] is not None:
                events[slot].synchronize()  # the batch before in this buffer has been copied out
            host = _place(buffers[slot], index, batch)
            read_tensors(store, index, host, cfg)
            with device.on(stream):
                for i in batch:
                    dests[i].copy_(host[i], non_blocking=device.is_accelerator)
                    touched.add(i)
            events[slot] = device.record(stream)
    finally:
        for event in events:
            if event is not None:
                event.synchronize()  # the buffers are freed (or reused) once this returns
    return dict(dests)


def _saved_as(index: RankIndex, i: int) -> tuple[torch.dtype, list[int], int]:
    """The dtype, shape and bytes tensor ``i`` was saved with (``read_tensors`` checks that
    its chunks hold that many)."""
    entry = index.tensors[i]
    dtype = parse_dtype(entry.dtype)
    return dtype, entry.shape, math.prod(entry.shape) * dtype.itemsize


def _batches(index: RankIndex, order: list[int], batch_bytes: int) -> list[tuple[list[int], int]]:
    """``order`` cut into runs of at most ``batch_bytes`` (a larger tensor alone), with each
    run's bytes in a buffer (each tensor aligned)."""
    out: list[tuple[list[int], int]] = []
    batch: list[int] = []
    total = 0
    for i in sorted(order):
        n = align(_saved_as(index, i)[2])
        if batch and total + n > batch_bytes:
            out.append((batch, total))
            batch, total = [], 0
        batch.append(i)
        total += n
    if batch:
        out.append((batch, total))
    return out


def _place(buffer: torch.Tensor, index: RankIndex, batch: list[int]) -> dict[int, torch.Tensor]:
    """Views of ``buffer``, one per tensor of ``batch``, with the dtype and shape it was saved
    with."""
    views, offset = {}, 0
    for i in batch:
        dtype, shape, n = _saved_as(index, i)
        views[i] = buffer[offset : offset + n].view(dtype).view(shape)
        offset = align(offset + n)
    return views
