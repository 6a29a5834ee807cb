"""DCP's ``StorageReader`` for one committed DCP step read by this process alone, and a whole
step loaded in one process.

``StepReader`` reads the step of the :class:`~ckptstore.steps.StepView` it is given: its
metadata (stamped with this load), then the stored tensors a plan's items need, each once, in
batches of about ``read_batch_bytes``, every chunk verified by ``pipeline.read_tensors``; shards
narrowed to what each item asks for; values DCP pickled checked by torch's weights-only
unpickler (``load_pickled_value``) unless ``trust_pickled_objects``. ``ckptstore.dcp``'s
``StoreReader`` is a ``StepReader`` that opens the step a load names and adds tiers, reads shared
between ranks and health. ``full_state_dict(view)`` is the whole step as a nested dict, by DCP's
own planner in this process (``StepView.load_plain`` of a DCP step, and
``ckptstore.dcp.load_full_state_dict``).

This module imports torch; it is given the view it reads and imports no ``steps`` (which imports
it when a method needs it: ``ls`` and ``inspect`` run without torch).
"""

from __future__ import annotations

import io
import struct
import uuid
import zipfile
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore._torch_private import (
    EmptyStateDictLoadPlanner,
    load_in_this_process,
    narrow_tensor_by_index,
    set_element,
)
from ckptstore.device import host_available_bytes
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    PickledValueRefusedError,
    UnsupportedStateError,
)
from ckptstore.format import RankIndex, storage_key
from ckptstore.metadata import check_covered
from ckptstore.options import ReadOptions
from ckptstore.pipeline import ChunkSource, PipelineConfig, parse_dtype, read_tensors
from ckptstore.store import Store

if TYPE_CHECKING:
    from ckptstore.steps import StepView

Location = tuple[int, int]  # (stored rank, tensor index in its index)


@dataclass
class Batch:
    """The items of one batch, ready to read: the stored tensors they need (``merged``, each
    once) and where each goes."""

    items: list[ReadItem]
    locs: list[Location]
    uses: Counter[Location]
    slots: dict[Location, int]
    merged: RankIndex
    wanted: dict[int, torch.Tensor | None]
    dests: dict[int, torch.Tensor]


def load_pickled_value(data: bytes, name: str) -> Any:
    """A value DCP pickled (a ``BYTE_IO`` item), loaded by torch's weights-only unpickler:
    tensors, containers and plain scalars, never code. Anything that needs more is refused."""
    check_torch_save_bytes(data, f"DCP item {name}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is a refused value
        raise PickledValueRefusedError(
            f"DCP item {name}: refused (pickled; allow its classes alone with "
            "torch.serialization.add_safe_globals([...]), or everything with "
            "StoreReader(trust_pickled_objects=True) if you trust its writer): torch's "
            f"weights-only unpickler does not load it ({_unpickling_reason(exc)})"
        ) from None


_ZIP_LOCAL = b"PK\x03\x04"  # what torch.load looks for first (else its pre-zip format)


def _zip64_record_where_its_locator_says(data: bytes) -> bool:
    """Where the archive has a zip64 locator (the 20 bytes before its end record): the zip64
    end record it points at is the one right before it, which Python's reader takes (torch's
    follows the pointer: two records, two directories)."""
    locator = bytes(data[-42:-22])
    if locator[:4] != b"PK\x06\x07":
        return True
    (pointed,) = struct.unpack("<Q", locator[8:16])
    before = len(data) - 42 - 56  # a zip64 end record without extensible data, as torch's
    return pointed == before and bytes(data[before : before + 4]) == b"PK\x06\x06"


def check_torch_save_bytes(data: bytes, what: str, *, legacy: bool = False) -> None:
    """``CheckpointCorruptError`` unless ``data`` is a zip archive laid out as ``torch.save``
    writes it: at its start, its central directory where its end record (the archive's last 22
    bytes, no comment) says, every record stored as its local header says too, none compressed.
    Python's reader and torch's then read the same records, and loading takes no more memory
    than the bytes themselves (torch inflates deflated records: 926 bytes stored held 2 GB).
    ``legacy``: bytes not starting as a zip archive pass too (torch's pre-zip format, which a
    pickled storage uses: nothing compressed)."""

    def refuse(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{what}: {why}, which torch.save never writes: refused unread"
        )

    if bytes(data[:4]) != _ZIP_LOCAL:
        if legacy:
            return
        raise refuse("not a zip archive")
    try:
        file = io.BytesIO(data)
        end = zipfile._EndRecData(file)  # as ZipFile finds it: its offset of the directory
        with zipfile.ZipFile(file) as archive:
            records, start, comment = archive.infolist(), archive.start_dir, archive.comment
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error) as exc:
        raise refuse(f"a damaged zip archive ({exc})") from None
    if end is None or comment or end[zipfile._ECD_LOCATION] != len(data) - 22:
        raise refuse("a zip archive with bytes after its end record")
    if not _zip64_record_where_its_locator_says(data):
        raise refuse("a zip archive whose zip64 end record is not where its locator says")
    if start != end[zipfile._ECD_OFFSET]:
        raise refuse("a zip archive whose directory is not where its end record says")
    for record in records:
        local = bytes(data[record.header_offset : record.header_offset + 30])
        if (
            record.compress_type != zipfile.ZIP_STORED
            or record.compress_size != record.file_size
            or record.header_offset + record.file_size > len(data)
            or local[:4] != _ZIP_LOCAL
            or local[8:10] != b"\0\0"  # the local header's method: stored
        ):
            raise refuse(f"its record {record.filename[:80]!r} compressed or misplaced")


def _unpickling_reason(exc: Exception) -> str:
    """What a weights-only unpickler refused, in one line: torch's own line naming the global
    (``Unsupported global: ...``, ``Trying to load unsupported GLOBAL posix.system ...``),
    never its advice to turn the check off."""
    text = str(exc)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
        return text.split(". ", 1)[0].splitlines()[0]
    for line in text.splitlines():
        line = line.strip()
        if "GLOBAL" in line or line.startswith("Unsupported"):
            return line.rstrip(".")[:200]
    return f"{type(exc).__name__}: the weights-only unpickler refused it"


class StepReader(StorageReader):
    """DCP ``StorageReader`` for DCP step ``view`` (opened on ``store``, the store its errors and
    metadata name), read by this process alone with ``config``, in batches of about
    ``read_batch_bytes``. A subclass that opens the step when a load starts passes no view and
    overrides ``_view``."""

    def __init__(
        self,
        store: Store,
        view: StepView | None = None,
        *,
        config: PipelineConfig,
        read_batch_bytes: int,
        trust_pickled_objects: bool = False,
    ) -> None:
        super().__init__()
        self.store = store
        self.view = view
        self.config = config
        self.read_batch_bytes = read_batch_bytes
        self.trust_pickled_objects = trust_pickled_objects
        self.rank = 0
        self.load_id = uuid.uuid4().hex

    # -- StorageReader ----------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new load of the same step (a ``StepReader`` reads the step it was given)."""
        if checkpoint_id is not None:
            raise ValueError(f"a StepReader reads the step it was given, not {checkpoint_id!r}")
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """False: a ``StepReader`` names no checkpoint ids (it reads the step it was given)."""
        return False

    @property
    def checkpoint_id(self) -> str:
        return self.store.uri

    def read_metadata(self) -> Metadata:
        return self._stamped(self._view().dcp_metadata())

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
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._read_plan(plan, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # -- internals --------------------------------------------------------------------------

    def _stamped(self, metadata: Metadata) -> Metadata:
        """``metadata`` naming this load: the store's URI and ``load_id``, the save's id kept."""
        meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self.store.uri, save_id=meta.save_id, load_id=self.load_id
        )
        return metadata

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Every item of ``plan`` read and handed to ``planner``."""
        self._read_alone(plan, planner)

    def _view(self) -> StepView:
        if self.view is None:
            raise CheckpointError(f"{type(self).__name__} of {self.store.uri} has no step open")
        return self.view

    def _index(self, rank: int) -> RankIndex:
        return self._view().index(rank)

    def _locate(self, storage_index: MetadataIndex) -> tuple[int, int]:
        return self._view().locate(storage_index)

    def _item_name(self, item: ReadItem) -> str:
        return (
            f"{storage_key(item.storage_index)!r} of step {self._view().step} in {self.store.uri}"
        )

    def _read_alone(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """This rank's items from storage, in batches of about ``read_batch_bytes``."""
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

    def _read_batch(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Read the stored items ``items`` need (each chunk once) and hand them to DCP."""
        batch = self._prepare_batch(items, planner)
        self._finish_batch(batch, planner, self._read(batch, None))

    def _read(self, batch: Batch, source: ChunkSource | None) -> dict[int, torch.Tensor]:
        """The stored tensors of ``batch``, from ``source`` (None: from the step's store)."""
        return read_tensors(
            self._view().store, batch.merged, batch.wanted, self.config, source=source
        )

    def _prepare_batch(self, items: list[ReadItem], planner: LoadPlanner) -> Batch:
        """The stored tensors ``items`` need, each once, and where each one goes."""
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
        return Batch(items, locs, uses, slots, merged, wanted, dests)

    def _finish_batch(
        self, batch: Batch, planner: LoadPlanner, loaded: dict[int, torch.Tensor]
    ) -> None:
        """Hand what ``batch``'s items read to DCP: values checked, tensors narrowed."""
        wanted, dests = batch.wanted, batch.dests
        for pos, item in enumerate(batch.items):
            slot = batch.slots[batch.locs[pos]]
            if item.type == LoadItemType.BYTE_IO:
                stream = io.BytesIO(loaded[slot].numpy().tobytes())
                if not self.trust_pickled_objects:
                    # The planner unpickles what it is given with weights_only=False: it gets
                    # our own pickle of the value the weights-only unpickler built, never the
                    # stored bytes (which two unpicklers might read two ways).
                    value = load_pickled_value(stream.getvalue(), self._item_name(item))
                    stream = io.BytesIO()
                    torch.save(value, stream)
                    del value  # the planner builds its own: one copy held, not two
                    stream.seek(0)
                planner.load_bytes(item, stream)
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


# -- a whole step in one process ---------------------------------------------------------------


class _WeightsOnlyPlanner(EmptyStateDictLoadPlanner):
    """DCP's planner for loading into an empty state dict, whose pickled values are loaded by
    torch's weights-only unpickler instead of ``torch.load(weights_only=False)``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_pickled_value(value.getvalue(), f"{fqn!r} of {self.where}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def full_state_dict(view: StepView) -> dict[str, Any]:
    """The whole state of DCP step ``view`` (its loader checked by the caller:
    ``view.require(DCP)``) as a nested dict of full tensors and objects.

    Runs in this process alone (no process group needed): sharded tensors are assembled from
    every rank's pieces, like torch's ``dcp_to_torch_save``. Values DCP pickled are loaded by
    torch's weights-only unpickler; one that needs more is refused (``PickledValueRefusedError``).
    """
    store, step = view.store, view.step
    reads = ReadOptions()
    reader = StepReader(
        store,
        view,
        config=PipelineConfig(read_concurrency=reads.read_concurrency),
        read_batch_bytes=reads.read_batch_bytes,
    )
    metadata = reader.read_metadata()  # raises missing or corrupt metadata errors unwrapped
    where = f"step {step} in {store.uri}"
    tensors = [md for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks")]
    need = sum(md.size.numel() * md.properties.dtype.itemsize for md in tensors)
    available = host_available_bytes()
    if need > available:
        raise UnsupportedStateError(  # not corrupt: a healthy step too large for this host
            f"{where}: restoring it whole takes {need} bytes, more than the {available} this "
            "host has available"
        )
    check_covered(metadata, where)
    planner = _WeightsOnlyPlanner(f"step {step} in {store.uri}")
    state: dict[str, Any] = {}
    try:
        load_in_this_process(state, reader=reader, planner=planner)
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
        if len(errors) == 1 and isinstance(errors[0], CheckpointError):
            raise errors[0] from None
        # DCP's own text holds every rank's traceback: one line, the cause chained.
        first = errors[0] if errors else exc
        raise CheckpointError(
            f"step {step} in {store.uri} did not load: {type(first).__name__}: "
            f"{' '.join(str(first).split())[:300] or 'no message'}"
        ) from exc
    return state
