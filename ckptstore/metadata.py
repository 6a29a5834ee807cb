"""DCP's ``Metadata`` as plain JSON, which ckptstore encodes and decodes itself, and the reading
of the pickled ``Metadata`` that steps written before it hold, through an allowlist of DCP's own
metadata classes. Nothing here runs code from storage.

Every decoded value is checked before it becomes a ``Metadata``: dtypes come from a fixed list,
sizes and offsets are non-negative ints, every chunk lies inside its tensor, and every item's
location names a tensor chunk or an object the metadata describes. Anything else is a one-line
``CheckpointCorruptError`` naming the object.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.errors import CheckpointCorruptError, FormatVersionError, UnsupportedStateError

FORMAT = "ckptstore"
FORMAT_VERSION = 1
DOC_TYPE = "dcp_metadata"

MAX_NDIM = 64
MAX_DEPTH = 32  # nesting of planner_data
# List slots planner_data may open beyond one per item: DCP's unflattening extends a list to any
# index a path names, and a list element holding no item (an empty dict) still takes a slot.
LIST_SLACK = 4096
MAX_TENSOR_BYTES = (1 << 63) - 1

_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex128 complex64 complex32 "
    "int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool "
    "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2"
).split()
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)
}

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PICKLED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        (_METADATA_MODULE, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [("torch", "Size"), ("torch", "strided"), ("torch.serialization", "_get_layout")]
    + [("torch", name) for name in DTYPES]
)


# -- writing -----------------------------------------------------------------------------------


def encode_metadata(metadata: Metadata) -> bytes:
    """``metadata`` as the JSON document ``decode_metadata`` reads. ``storage_data`` must map
    each ``MetadataIndex`` to a ``(rank, tensor index)`` pair, as ``StoreWriter`` sets it.

    Every field's type is checked as it is walked (a ``TypeError`` otherwise), so an unpickled
    old ``Metadata`` is walked in time linear in its size."""
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "type": DOC_TYPE,
        "version": _optional_str(metadata.version, "version"),
        "state_dict_metadata": {
            _str(fqn, "an item name"): _storage_doc(meta)
            for fqn, meta in _typed(metadata.state_dict_metadata, dict, "items").items()
        },
        "storage_data": [
            [_str(index.fqn, "an item name"), _ints(index.offset), *_ints(location)]
            for index, location in _typed(metadata.storage_data, dict, "storage_data").items()
            if _typed(index, MetadataIndex, "a storage_data key")
        ],
        "planner_data": _plain(metadata.planner_data, "planner_data", 0),
        "storage_meta": _storage_meta_doc(metadata.storage_meta),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _storage_doc(meta: Any) -> dict[str, Any]:
    if type(meta) is BytesStorageMetadata:
        return {"type": "bytes"}
    _typed(meta, TensorStorageMetadata, "an item's metadata")
    dtype = _typed(
        _typed(meta.properties, TensorProperties, "properties").dtype, torch.dtype, "dtype"
    )
    return {
        "type": "tensor",
        "dtype": str(dtype).removeprefix("torch."),
        "size": _ints(meta.size),
        "chunks": [
            [_ints(c.offsets), _ints(c.sizes)]
            for c in _typed(meta.chunks, list, "chunks")
            if _typed(c, ChunkStorageMetadata, "a chunk")
        ],
    }


def _storage_meta_doc(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    _typed(meta, StorageMeta, "storage_meta")
    checkpoint_id = None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id)
    return {
        "checkpoint_id": _optional_str(checkpoint_id, "checkpoint_id"),
        "save_id": _optional_str(meta.save_id, "save_id"),
        "load_id": _optional_str(meta.load_id, "load_id"),
        "modules": [_str(m, "a module name") for m in _typed(meta.modules, list, "modules")],
    }


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{what} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _str(value: Any, what: str) -> str:
    return _typed(value, str, what)


def _optional_str(value: Any, what: str) -> str | None:
    return None if value is None else _str(value, what)


def _ints(values: Any) -> list[int] | None:
    if values is None:
        return None
    out = list(_typed(values, tuple, "sizes, offsets or a location"))
    if not all(type(v) is int for v in out):
        raise TypeError(f"{out!r:.80} are not ints")
    return out


def _plain(value: Any, path: str, depth: int) -> Any:
    """``value`` as JSON: tuples as ``{"$tuple": [...]}``, dicts with str keys not starting
    with ``$``, lists, str, int, finite float, bool, None."""
    if depth > MAX_DEPTH:
        raise UnsupportedStateError(f"DCP {path} nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, tuple):
        return {"$tuple": [_plain(v, path, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_plain(v, path, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {k: _plain(v, path, depth + 1) for k, v in value.items()}
    raise UnsupportedStateError(
        f"DCP {path} holds a {type(value).__name__} ({value!r:.60}); StoreWriter stores only "
        "plain data (dicts with str keys, lists, tuples, str, numbers, bool, None)"
    )


# -- reading -----------------------------------------------------------------------------------


def decode_metadata(blob: bytes, name: str) -> Metadata:
    """The ``Metadata`` in ``blob`` (the object ``name``): the JSON document of current
    steps (it starts with ``{``), else the pickle of older ones, read through the allowlist."""
    if blob[:1] == b"{":
        return _Decoder(name).metadata(_json_doc(blob, name))
    return _Decoder(name).metadata(_legacy_doc(blob, name))


def _json_doc(blob: bytes, name: str) -> dict[str, Any]:
    try:
        doc = json.loads(blob)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"DCP metadata {name} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"DCP metadata {name} is not a JSON object")
    if (doc.get("format"), doc.get("type")) != (FORMAT, DOC_TYPE):
        raise CheckpointCorruptError(
            f"DCP metadata {name} is not a ckptstore dcp_metadata document"
        )
    version = doc.get("format_version")
    if type(version) is int and version > FORMAT_VERSION:  # bytes the manifest's hash vouched for
        raise FormatVersionError(
            f"DCP metadata {name}: format version {version}; this ckptstore reads version "
            f"{FORMAT_VERSION} only (upgrade ckptstore to read it)"
        )
    if version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"DCP metadata {name}: format_version {doc.get('format_version')!r} is not "
            f"{FORMAT_VERSION}"
        )
    return doc


class _AllowlistUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled DCP ``Metadata`` needs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return super().find_class(module, name)


def _legacy_doc(blob: bytes, name: str) -> dict[str, Any]:
    """The pickled ``Metadata`` of a step written before the JSON encoding, as the document
    ``encode_metadata`` would have written, for the same checks."""
    try:
        metadata = _AllowlistUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # noqa: BLE001 - any failure is a refused object
        raise CheckpointCorruptError(
            f"DCP metadata {name} (pickled) is refused: {exc}".splitlines()[0]
        ) from None
    if type(metadata) is not Metadata:
        raise CheckpointCorruptError(
            f"DCP metadata {name} (pickled) holds a {type(metadata).__name__}, not a Metadata"
        )
    try:
        _check_flat_mapping(metadata.planner_data)
        _check_expansion(metadata, len(blob))
        return json.loads(encode_metadata(metadata))
    except Exception as exc:  # noqa: BLE001 - a malformed Metadata, whatever it trips on
        raise CheckpointCorruptError(
            f"DCP metadata {name} (pickled) is malformed: {exc}".splitlines()[0]
        ) from None


def _check_expansion(metadata: Metadata, blob_bytes: int) -> None:
    """A pickle stores a shared object once and names it again in two bytes, so a blob of a few
    KiB can name a million chunks (every tensor sharing one list): the values a walk of
    ``metadata`` would visit, counted without walking them, may be at most a few per byte."""
    values = len(metadata.planner_data or {}) + len(metadata.storage_data or {})
    for meta in metadata.state_dict_metadata.values():
        chunks = getattr(meta, "chunks", ())
        values += 1 + len(getattr(meta, "size", ())) + len(chunks)
        if values > 4 * blob_bytes + 1024:
            break
        values += sum(len(chunk.offsets) + len(chunk.sizes) for chunk in chunks)
    if values > 4 * blob_bytes + 1024:
        raise ValueError(f"it names more values than its {blob_bytes} bytes can hold")


def _check_flat_mapping(planner_data: Any) -> None:
    """Pickles share objects, so a nested value could expand exponentially when walked: an old
    step's planner_data must be DCP's flat ``{fqn: (key, ...)}`` mapping (or None)."""
    if planner_data is None:
        return
    if not isinstance(planner_data, dict) or not all(
        isinstance(path, (tuple, list)) and all(isinstance(k, (str, int)) for k in path)
        for path in planner_data.values()
    ):
        raise ValueError("planner_data is not DCP's {fqn: path} mapping")


class _Decoder:
    """Checks a metadata document while building its ``Metadata``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"DCP metadata {self.name}: {what}")

    def metadata(self, doc: dict[str, Any]) -> Metadata:
        items = self.mapping(doc.get("state_dict_metadata"), "state_dict_metadata")
        state = {fqn: self.storage(fqn, meta) for fqn, meta in items.items()}
        planner_data = self.plain(doc.get("planner_data"), "planner_data", 0)
        self.places(planner_data, state)
        return Metadata(
            state_dict_metadata=state,
            planner_data=planner_data,
            storage_data=self.storage_data(doc.get("storage_data"), state),
            storage_meta=self.storage_meta(doc.get("storage_meta")),
            version=self.optional_str(doc.get("version"), "version"),
        )

    def mapping(self, value: Any, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} is {type(value).__name__}, not an object")
        return value

    def places(self, planner_data: Any, state: dict[str, Any]) -> None:
        """Where DCP's planner puts each item when it loads a step into an empty state
        (``set_element``): each item at a place of its own, none inside another, and list
        indexes the step's items can fill (it appends ``None`` up to any index it is given)."""
        if planner_data is None:
            return
        planner_data = self.mapping(planner_data, "planner_data")
        kinds: dict[tuple, str] = {}  # a path -> "item", "list" or "dict"
        lengths: dict[tuple, int] = {}  # a list's path -> the length its indexes make it
        for fqn in state:
            path = planner_data.get(fqn, (fqn,))
            if not (
                isinstance(path, (tuple, list))
                and path
                and type(path[0]) is str
                and all(type(k) is str or (type(k) is int and k >= 0) for k in path)
            ):
                raise self.fail(f"item {fqn!r} has the place {path!r:.80}, not a path of keys")
            path = tuple(path)
            for i in range(1, len(path)):
                kind = "list" if type(path[i]) is int else "dict"
                if kinds.setdefault(path[:i], kind) != kind:
                    raise self.fail(f"item {fqn!r} is placed inside another item at {path!r:.80}")
                if kind == "list":
                    lengths[path[:i]] = max(lengths.get(path[:i], 0), path[i] + 1)
            if path in kinds:
                raise self.fail(f"item {fqn!r} is placed where another item is, {path!r:.80}")
            kinds[path] = "item"
        if sum(lengths.values()) > len(state) + LIST_SLACK:
            raise self.fail(
                f"planner_data opens {sum(lengths.values())} list slots for {len(state)} items"
            )
        for fqn in state:  # DCP names each item by its place's keys
            path = tuple(planner_data.get(fqn, (fqn,)))
            if ".".join(map(str, path)) != fqn:
                raise self.fail(f"item {fqn!r} is placed at {path!r:.80}, a place of another name")

    def storage(self, fqn: str, meta: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        meta = self.mapping(meta, f"item {fqn!r}")
        if meta.get("type") == "bytes":
            return BytesStorageMetadata()
        if meta.get("type") != "tensor":
            raise self.fail(f"item {fqn!r} has type {meta.get('type')!r}")
        dtype = meta.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self.fail(f"item {fqn!r} has dtype {dtype!r}, not one of torch's dtypes")
        size = self.sizes(meta.get("size"), f"item {fqn!r} size", None)
        if math.prod(size) * DTYPES[dtype].itemsize > MAX_TENSOR_BYTES:
            raise self.fail(f"item {fqn!r} of size {size} holds more than 2**63 bytes")
        chunks = meta.get("chunks")
        if not isinstance(chunks, list):
            raise self.fail(f"item {fqn!r} chunks are not a list")
        return TensorStorageMetadata(
            properties=TensorProperties(dtype=DTYPES[dtype]),
            size=torch.Size(size),
            chunks=[self.chunk(fqn, chunk, size) for chunk in chunks],
        )

    def chunk(self, fqn: str, chunk: Any, size: list[int]) -> ChunkStorageMetadata:
        if not isinstance(chunk, list) or len(chunk) != 2:
            raise self.fail(f"item {fqn!r}: a chunk is not [offsets, sizes]")
        offsets = self.sizes(chunk[0], f"item {fqn!r} chunk offsets", len(size))
        sizes = self.sizes(chunk[1], f"item {fqn!r} chunk sizes", len(size))
        if any(o + n > dim for o, n, dim in zip(offsets, sizes, size)):
            raise self.fail(f"item {fqn!r}: chunk at {offsets} of {sizes} exceeds size {size}")
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def sizes(self, value: Any, what: str, ndim: int | None) -> list[int]:
        """A list of non-negative ints (of length ``ndim`` when given)."""
        if not isinstance(value, list) or len(value) > MAX_NDIM:
            raise self.fail(f"{what} is not a list of at most {MAX_NDIM} ints")
        if ndim is not None and len(value) != ndim:
            raise self.fail(f"{what} has {len(value)} dimensions, the tensor {ndim}")
        if not all(type(v) is int and v >= 0 for v in value):
            raise self.fail(f"{what} {value!r:.80} are not non-negative ints")
        return value

    def storage_data(self, value: Any, state: dict[str, Any]) -> dict[MetadataIndex, Any]:
        if not isinstance(value, list):
            raise self.fail("storage_data is not a list")
        out: dict[MetadataIndex, tuple[int, int]] = {}
        for entry in value:
            if not isinstance(entry, list) or len(entry) != 4:
                raise self.fail(f"storage_data entry {entry!r:.80} is not [fqn, offset, rank, i]")
            fqn, offset, rank, tensor = entry
            index = self.item_index(fqn, offset, state)
            if not all(type(v) is int and v >= 0 for v in (rank, tensor)):
                raise self.fail(f"item {fqn!r}: location {rank!r}, {tensor!r} is not two ints >= 0")
            if index in out:
                raise self.fail(f"item {fqn!r} at {offset} is located twice")
            out[index] = (rank, tensor)
        return out

    def item_index(self, fqn: Any, offset: Any, state: dict[str, Any]) -> MetadataIndex:
        """The ``MetadataIndex`` of a stored item that ``state`` describes."""
        meta = state.get(fqn) if isinstance(fqn, str) else None
        if meta is None:
            raise self.fail(f"storage_data locates {fqn!r:.80}, which the metadata does not hold")
        if isinstance(meta, BytesStorageMetadata):
            if offset is not None:
                raise self.fail(f"object item {fqn!r} has an offset")
            return MetadataIndex(fqn)
        offsets = self.sizes(offset, f"item {fqn!r} offset", len(meta.size))
        if not any(list(chunk.offsets) == offsets for chunk in meta.chunks):
            raise self.fail(f"item {fqn!r} has no chunk at {offsets}")
        return MetadataIndex(fqn, offsets)

    def storage_meta(self, value: Any) -> StorageMeta | None:
        if value is None:
            return None
        value = self.mapping(value, "storage_meta")
        modules = value.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise self.fail("storage_meta modules are not a list of strings")
        return StorageMeta(
            checkpoint_id=self.optional_str(value.get("checkpoint_id"), "checkpoint_id"),
            save_id=self.optional_str(value.get("save_id"), "save_id"),
            load_id=self.optional_str(value.get("load_id"), "load_id"),
            modules=modules,
        )

    def optional_str(self, value: Any, what: str) -> str | None:
        if value is not None and not isinstance(value, str):
            raise self.fail(f"{what} is {type(value).__name__}, not a string")
        return value

    def plain(self, value: Any, what: str, depth: int) -> Any:
        """``_plain``'s inverse: ``{"$tuple": [...]}`` becomes a tuple."""
        if depth > MAX_DEPTH:
            raise self.fail(f"{what} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            return [self.plain(v, what, depth + 1) for v in value]
        if isinstance(value, dict):
            if list(value) == ["$tuple"] and isinstance(value["$tuple"], list):
                return tuple(self.plain(v, what, depth + 1) for v in value["$tuple"])
            if any(k.startswith("$") for k in value):
                raise self.fail(f"{what} holds an unknown tag {sorted(value)[0]!r:.40}")
            return {k: self.plain(v, what, depth + 1) for k, v in value.items()}
        return value


def check_covered(metadata: Metadata, where: str) -> None:
    """``CheckpointCorruptError`` unless the chunks of each tensor of ``metadata`` cover it
    exactly once: their sizes add up to its size and no two overlap (a tensor loaded whole
    would hold bytes never stored where they fall short). ``verify`` and restore run the same
    check, without a buffer of the tensor's size."""
    for key, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "chunks"):
            continue
        size = tuple(md.size)
        total = sum(math.prod(chunk.sizes) for chunk in md.chunks)
        if total != math.prod(size) or _overlap(md.chunks, f"{where}: {key!r}"):
            raise CheckpointCorruptError(
                f"{where}: the chunks of {key!r} do not cover its size {list(size)} exactly once"
            )


def _grid_cells(offsets: Any, ends: Any) -> Any:
    """Each chunk's cell in the grid the chunks' boundaries make along every dimension, or None
    where a chunk spans more than one cell (then the sweep decides)."""
    import numpy as np

    cells = []
    for d in range(offsets.shape[1]):
        bounds = np.unique(np.concatenate([offsets[:, d], ends[:, d]]))
        at = np.searchsorted(bounds, offsets[:, d])
        if not np.array_equal(bounds[np.minimum(at + 1, len(bounds) - 1)], ends[:, d]):
            return None
        cells.append(at)
    return np.stack(cells, axis=1)


MAX_OVERLAP_TESTS = 1 << 26
"""Most chunk pairs :func:`_overlap` compares for one tensor (a sharded layout needs about as
many as it has chunks; ~1 s of numpy at the bound)."""


def _overlap(chunks: Sequence[Any], what: str) -> bool:
    """Whether two of ``chunks`` (each inside the tensor) overlap: a sweep along the dimension
    whose offsets vary most, each chunk tested against those still open there."""
    import numpy as np

    if len(chunks) < 2:
        return False
    if not len(chunks[0].offsets):
        return True  # two chunks of a 0-d tensor
    offsets = np.array([list(c.offsets) for c in chunks], dtype=np.int64)
    ends = offsets + np.array([list(c.sizes) for c in chunks], dtype=np.int64)
    solid = np.all(ends > offsets, axis=1)  # a chunk of no elements overlaps nothing
    offsets, ends = offsets[solid], ends[solid]
    if len(offsets) < 2:
        return False
    cells = _grid_cells(offsets, ends)
    if cells is not None:  # each chunk one cell of the grid of every boundary: a sharded layout
        return len(np.unique(cells, axis=0)) < len(cells)
    dim = max(range(offsets.shape[1]), key=lambda d: len(np.unique(offsets[:, d])))
    active = np.empty(0, dtype=np.int64)
    tests = 0
    for i in np.argsort(offsets[:, dim], kind="stable"):
        active = active[ends[active, dim] > offsets[i, dim]]
        tests += len(active)
        if tests > MAX_OVERLAP_TESTS:
            raise CheckpointCorruptError(
                f"{what}: its {len(chunks)} chunks overlap too widely to check (more than "
                f"{MAX_OVERLAP_TESTS} pairs)"
            )
        low = np.maximum(offsets[active], offsets[i])
        if np.any(np.all(low < np.minimum(ends[active], ends[i]), axis=1)):
            return True
        active = np.append(active, i)
    return False
