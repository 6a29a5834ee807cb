"""The DCP ``StorageReader``: loads steps committed by ``StoreWriter``, every chunk verified,
resharded by DCP's planner."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from collections import Counter
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore.catalog import parse_step
from ckptstore.dcp._torch_private import narrow_tensor_by_index
from ckptstore.dcp.ids import checkpoint_step, storage_key, store_opener, valid_checkpoint_id
from ckptstore.errors import CheckpointCorruptError, CheckpointError, UnsupportedStateError
from ckptstore.format import RankIndex
from ckptstore.pipeline import PipelineConfig, parse_dtype, read_tensors
from ckptstore.steps import DCP, StepView
from ckptstore.store import Store

logger = logging.getLogger(__name__)


def load_pickled_value(data: bytes, name: str) -> Any:
    """A value DCP pickled (a ``BYTE_IO`` item), loaded by torch's weights-only unpickler:
    tensors, containers and plain scalars, never code. Anything that needs more is refused."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is a refused value
        raise CheckpointCorruptError(
            f"DCP item {name}: refused, its pickled value needs more than torch's weights-only "
            f"unpickler ({_unpickling_reason(exc)})"
        ) from None


def _unpickling_reason(exc: Exception) -> str:
    text = str(exc)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
        return text.split(". ", 1)[0].splitlines()[0]
    return (text.splitlines() or [type(exc).__name__])[0][:200]


class StoreReader(StorageReader):
    """DCP ``StorageReader`` for steps committed by :class:`StoreWriter`.

    Use as ``dcp.load(state, storage_reader=StoreReader("s3://bucket/run", step=7))``. Every
    chunk is hash-verified before its bytes reach a tensor; DCP's planner reshards (a step saved
    by N ranks loads into M ranks, or into one process with ``no_dist=True``).

    Args:
        uri: the store. A ``checkpoint_id`` passed to ``dcp.load`` is a store URI too.
        step: the step to load, or ``"latest"``. The step is resolved once per load (at the
            first ``read_metadata``); if ranks resolve different steps (one was committed while
            they started) the load fails clearly: pass an explicit step to avoid that.
        read_concurrency: chunks fetched and decoded at once.
        read_batch_bytes: stored items are read in batches of about this many bytes, which
            bounds the temporary memory of a load.
        store: an already open ``Store``.
        trust_pickled_objects: values DCP pickled (``BYTE_IO`` items, such as a step counter
            or a dataclass) reach the load planner only after torch's weights-only unpickler
            accepted them; a value that needs more (a class of yours, or code) is refused with
            ``CheckpointCorruptError``. ``True`` hands every value to the planner unchecked: DCP's
            default planner then unpickles it with ``weights_only=False``, which runs whatever
            code the stored bytes name. Pass it only for stores whose writers you trust.

    Steps saved by ``ckptstore.Checkpointer`` (kind ``state``) are refused with
    ``UnsupportedStateError``: load them with ``Checkpointer.load``.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        step: int | str = "latest",
        storage_options: dict[str, Any] | None = None,
        read_concurrency: int = 8,
        read_batch_bytes: int = 1 << 30,
        max_concurrency: int = 16,
        timeout_s: float = 30.0,
        store: Store | None = None,
        trust_pickled_objects: bool = False,
    ) -> None:
        super().__init__()
        self.trust_pickled_objects = trust_pickled_objects
        if read_batch_bytes < 1:
            raise ValueError(f"read_batch_bytes must be >= 1, got {read_batch_bytes}")
        parse_step(step)  # refuses a step that is neither a number nor "latest"
        self.step = step
        self.storage_options = storage_options
        self._open_store = store_opener(
            storage_options, timeout_s=timeout_s, max_concurrency=max_concurrency
        )
        self.store = store or self._open_store(uri)
        self.config = PipelineConfig(read_concurrency=read_concurrency)
        self.read_batch_bytes = read_batch_bytes
        self.rank = 0
        self.load_id = uuid.uuid4().hex
        self.view: StepView | None = None

    # -- StorageReader ----------------------------------------------------------------------

    def reset(self, checkpoint_id: int | str | os.PathLike | None = None) -> None:
        """Start a new load. A ``checkpoint_id`` that is an ``int`` or a ``str`` of digits is the
        step to load (same store); any other is a store URI that replaces the current one."""
        step = None if checkpoint_id is None else checkpoint_step(checkpoint_id)
        if step is not None:
            self.step = step
        elif checkpoint_id is not None and os.fspath(checkpoint_id) != self.store.uri:
            self.store = self._open_store(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.view = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: int | str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is a step or a URI fsspec can resolve to a filesystem."""
        return valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return self.store.uri

    def read_metadata(self) -> Metadata:
        # No **kwargs: DCP then never tries a rank-local fallback (there is none), whose
        # refusal would stand beside the real error in what dcp.load raises.
        self.view = None  # each load resolves "latest" afresh
        metadata = self._view().dcp_metadata()
        meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self.store.uri, save_id=meta.save_id, load_id=self.load_id
        )
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointCorruptError(
                f"DCP metadata in {self.store.uri} has no storage_data (not written by StoreWriter)"
            )
        self._view().adopt_metadata(metadata)  # the coordinator's, read once
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        manifest = self._view().manifest
        chosen = (manifest.step, manifest.attempt)
        return [dataclasses.replace(p, storage_data=chosen) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self._view().manifest
        if plan.storage_data is not None and tuple(plan.storage_data) != (
            manifest.step,
            manifest.attempt,
        ):
            raise CheckpointError(
                f"rank {self.rank} resolved step {manifest.step} of {self.store.uri} but the "
                f"coordinator resolved step {plan.storage_data[0]} (a step was committed during "
                "the load); pass StoreReader(step=N) explicitly"
            )
        batch: list[ReadItem] = []
        batch_bytes = 0
        seen: set[tuple[int, int]] = set()
        for item in plan.items:
            loc = self._locate(item.storage_index)
            if loc not in seen:
                nbytes = self._index(loc[0]).tensors[loc[1]].nbytes
                if batch and batch_bytes + nbytes > self.read_batch_bytes:
                    self._read_batch(batch, planner)
                    batch, batch_bytes, seen = [], 0, set()
                seen.add(loc)
                batch_bytes += nbytes
            batch.append(item)
        if batch:
            self._read_batch(batch, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # -- internals --------------------------------------------------------------------------

    def _view(self) -> StepView:
        if self.view is None:
            view = StepView.open(self.store, self.step)
            view.require(DCP)
            self.view = view
            logger.debug(
                "rank %d: DCP load of step %d from %s", self.rank, view.step, self.store.uri
            )
        return self.view

    def _index(self, rank: int) -> RankIndex:
        return self._view().index(rank)

    def _locate(self, storage_index: MetadataIndex) -> tuple[int, int]:
        return self._view().locate(storage_index)

    def _item_name(self, item: ReadItem) -> str:
        return (
            f"{storage_key(item.storage_index)!r} of step {self._view().step} in {self.store.uri}"
        )

    def _read_batch(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Read the stored items ``items`` need (each chunk once) and hand them to DCP."""
        locs = [self._locate(item.storage_index) for item in items]
        uses = Counter(locs)
        slots: dict[tuple[int, int], int] = {}
        merged = RankIndex(rank=-1, tensors=[], chunks={})
        for loc in uses:
            index = self._index(loc[0])
            entry = index.tensors[loc[1]]
            slots[loc] = len(merged.tensors)
            merged.tensors.append(entry)
            for seg in entry.segments:
                if seg.chunk in index.chunks:
                    merged.chunks.setdefault(seg.chunk, index.chunks[seg.chunk])
        # A stored tensor read whole, once, into a destination of its dtype and shape is
        # decoded straight into it; every other one goes through a temporary and is narrowed.
        wanted: dict[int, torch.Tensor | None] = {slot: None for slot in slots.values()}
        dests: dict[int, torch.Tensor] = {}
        for pos, item in enumerate(items):
            if item.type == LoadItemType.BYTE_IO:
                continue
            dest = planner.resolve_tensor(item).detach()
            dests[pos] = dest
            entry = merged.tensors[slots[locs[pos]]]
            if (
                uses[locs[pos]] == 1
                and not any(item.storage_offsets)
                and list(item.lengths) == entry.shape
                and list(dest.shape) == entry.shape
                and dest.dtype == parse_dtype(entry.dtype)
            ):
                wanted[slots[locs[pos]]] = dest
        loaded = read_tensors(self.store, merged, wanted, self.config)
        for pos, item in enumerate(items):
            slot = slots[locs[pos]]
            if item.type == LoadItemType.BYTE_IO:
                data = loaded[slot].numpy().tobytes()
                if not self.trust_pickled_objects:
                    load_pickled_value(data, self._item_name(item))
                planner.load_bytes(item, io.BytesIO(data))
                continue
            dest = dests[pos]
            if wanted[slot] is not dest:
                source = narrow_tensor_by_index(loaded[slot], item.storage_offsets, item.lengths)
                if dest.size() != source.size():
                    raise UnsupportedStateError(
                        f"DCP item {storage_key(item.storage_index)!r}: destination shape "
                        f"{tuple(dest.size())} does not match the stored {tuple(source.size())}"
                    )
                dest.copy_(source)
            planner.commit_tensor(item, dest)
