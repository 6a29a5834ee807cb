"""DCP items as the tensors a save writes: ``item_tensor`` (what DCP wants written for an
item) and ``write_tensors`` (their chunks written through a ``SaveSession``, from the staging an
async save took, else copied into a staging buffer)."""

from __future__ import annotations

import io
import logging

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ckptstore.dcp.stager import HeldStaging
from ckptstore.errors import CheckpointError, UnsupportedStateError, one_line
from ckptstore.pipeline import chunks_holding
from ckptstore.save import SaveEngine, SaveSession
from ckptstore.save.once import OneRound
from ckptstore.step_reader import load_pickled_value

logger = logging.getLogger(__name__)


def item_tensor(item: WriteItem, planner: SavePlanner) -> torch.Tensor:
    """The bytes DCP wants written for ``item``, as a tensor (uint8 ``[n]`` for BYTE_IO)."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if isinstance(data, io.BytesIO):
            raw = data.getvalue()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            raise UnsupportedStateError(
                f"DCP item {item.index.fqn!r}: BYTE_IO data is {type(data).__name__}, "
                "expected io.BytesIO"
            )
        _warn_unless_loadable(item.index.fqn, raw)
        if not raw:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if not isinstance(data, torch.Tensor):
        raise UnsupportedStateError(
            f"DCP item {item.index.fqn!r}: expected a tensor, got {type(data).__name__}"
        )
    return data.detach()


_CHECKED: set[str] = set()  # the pickled items this process's saves checked a load takes


def _warn_unless_loadable(fqn: str, raw: bytes) -> None:
    """Once per item and process: a WARNING where a ``StoreReader`` would refuse the value
    DCP pickled (a numpy value, a class of the user's), so that a job hears of it at its
    first save, not at the restart that cannot resume."""
    if fqn in _CHECKED:
        return
    _CHECKED.add(fqn)
    try:
        load_pickled_value(raw, repr(fqn))
    except CheckpointError as exc:
        logger.warning(
            "saved, but a StoreReader refuses it at load as things stand (in the process "
            "that checked it): %s",
            one_line(exc),
        )


def write_tensors(
    engine: SaveEngine,
    rank: int,
    session: SaveSession,
    staged: HeldStaging | None,
    tensors: list[torch.Tensor],
    *,
    keep: bool = False,
    group: OneRound | None = None,
):
    """(entries, chunks) of ``tensors`` written through ``session``: from ``staged`` where
    they lie in it (released afterwards unless ``keep``), else copied into a staging buffer.
    ``group``: the round of one writer per chunk they take part in."""
    if staged is None:
        return _write_copied(engine, rank, session, tensors, group=group)
    # The staged chunks take part in ``group``; a tensor not in the staging (DCP's pickled
    # values) is written alone, through a buffer of its own.
    copied = staged.copied
    base, size = copied.buffer.data_ptr(), copied.buffer.numel()
    inside, outside = [], []
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        offset = t.data_ptr() - base
        in_buffer = (
            n > 0
            and t.is_contiguous()
            and 0 <= offset
            and offset + n <= size
            and t.untyped_storage().data_ptr() == copied.buffer.untyped_storage().data_ptr()
        )
        (inside if in_buffer else outside).append((i, offset))
    mine = [tensors[i] for i, _ in inside]
    try:
        copied.copy.wait()
        layout = chunks_holding(
            copied.layout,
            [(offset, t.numel() * t.element_size()) for (_, offset), t in zip(inside, mine)],
        )
        found, chunks = session.write(copied.buffer, layout, mine, group=group)
    finally:
        if not keep:
            staged.release()
    entries: list = [None] * len(tensors)
    for (i, _), entry in zip(inside, found):
        entries[i] = entry
    if outside:
        rest = [tensors[i] for i, _ in outside]
        rest_entries, rest_chunks = _write_copied(engine, rank, session, rest, pooled=False)
        for (i, _), entry in zip(outside, rest_entries):
            entries[i] = entry
        chunks = {**chunks, **rest_chunks}
    return entries, chunks


def _write_copied(
    engine: SaveEngine,
    rank: int,
    session: SaveSession,
    tensors: list[torch.Tensor],
    *,
    pooled: bool = True,
    group: OneRound | None = None,
):
    """Copy ``tensors`` into a staging buffer (the pool's, if ``pooled`` and one is free)
    and write its chunks (``group``: its round of one writer per chunk); (entries,
    chunks)."""
    copied = engine.stage_somewhere(tensors, wait_s=0.0, rank=rank, pooled=pooled)
    try:
        copied.copy.wait()
        return session.write(copied.buffer, copied.layout, tensors, group=group)
    finally:
        engine.release(copied)
