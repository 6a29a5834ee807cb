"""Export a committed step as Hugging Face safetensors, streamed.

The output is the layout ``transformers`` loads: ``model.safetensors`` when everything fits in
one shard of ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` ... plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). Tensors are named by
their dotted state paths (``model.layers.0.weight``): a Checkpointer step's tree paths joined
with ``.``, a DCP step's fqns as DCP flattened them.

Memory is bounded: tensors are read in batches of at most ``min(read_batch_bytes,
max_shard_size)`` bytes (a larger tensor is a batch of its own), each batch assembled from its
chunks (fetched, decoded and hash-verified by ``pipeline.read_tensors``; the shards of a DCP
tensor from every rank's index), written to the shard file, and dropped. Every shard's header is
known up front, so it is written first and the tensors streamed after it.

Each file is written under a temporary name; only when every shard is complete are they moved
into place, the index last. A failed export leaves no final file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.catalog import LATEST_TRIES
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    UnsupportedStateError,
)
from ckptstore.format import ChunkInfo, RankIndex, TensorEntry, shape_text
from ckptstore.pipeline import (
    PipelineConfig,
    new_tensor,
    parse_dtype,
    read_tensors,
    release_free_memory,
)
from ckptstore.steps import Piece, StepView, WholeTensor
from ckptstore.store import open_store

logger = logging.getLogger(__name__)

__all__ = ["ExportResult", "export_safetensors", "parse_size"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# torch dtype -> safetensors dtype code
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",  # a rotary embedding's freqs_cis, say
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_CAST_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote."""

    out_dir: str
    step: int
    kind: str  # "state" (Checkpointer) or "dcp"
    files: list[str]  # shard file names, in order
    index_file: str | None  # model.safetensors.index.json, or None for a single file
    tensors: int
    total_bytes: int  # tensor bytes written (the index's metadata.total_size)
    skipped: list[str] = field(default_factory=list)  # non-tensor values left out, by name
    notes: list[str] = field(default_factory=list)
    ranks: int | None = None  # a step each rank saved its own state of: how many ranks

    def as_dict(self) -> dict[str, Any]:
        return {
            "out_dir": self.out_dir,
            "step": self.step,
            "kind": self.kind,
            "files": self.files,
            "index_file": self.index_file,
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "skipped": self.skipped,
            "notes": self.notes,
            "ranks": self.ranks,
        }


@dataclass
class _Item:
    """One output tensor and the stored pieces it is assembled from."""

    name: str
    dtype: torch.dtype  # as stored
    out_dtype: torch.dtype  # as written
    shape: list[int]
    pieces: list[Piece]

    @property
    def out_bytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize

    @property
    def read_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """``5GB`` (10^9, as Hugging Face), ``500MiB`` (2^20), or a number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"bad max_shard_size {size!r}: expected e.g. 5GB, 500MiB or 1048576")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"bad max_shard_size {size!r}: must be at least 1 byte")
    return value


def _cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in _CAST_DTYPES.values():
            raise ValueError(f"bad dtype {dtype}: expected one of {', '.join(_CAST_DTYPES)}")
        return dtype
    cast = _CAST_DTYPES.get(str(dtype).removeprefix("torch.").lower())
    if cast is None:
        raise ValueError(f"bad dtype {dtype!r}: expected one of {', '.join(_CAST_DTYPES)}")
    return cast


def export_safetensors(
    uri: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | str = "latest",
    max_shard_size: int | str = "5GB",
    only: str | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    rank: int = 0,
    overwrite: bool = False,
    read_batch_bytes: int = 64 * 2**20,
    read_concurrency: int = 4,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> ExportResult:
    """Write a committed step to OUT_DIR as Hugging Face safetensors (sharded like
    ``save_pretrained``), reading and hash-verifying every chunk on the way.

    Args:
        uri: the store (``path``, ``file://``, ``memory://``, ``s3://bucket/prefix``).
        out_dir: a local directory; created if missing, refused if not empty (see
            ``overwrite``).
        step: the step to export, or ``"latest"`` (a latest step removed while it is read,
            by another process's keep_last or gc, gives way to the newest, one warning).
        max_shard_size: the largest shard, e.g. ``5GB`` (the default, 10^9 bytes as Hugging
            Face counts) or ``500MiB``; a tensor larger than it gets a shard of its own. All
            in one shard: a single ``model.safetensors`` and no index.
        only: export only the tensors named this or under it (``model`` covers ``model.*``,
            not ``model_ema.*``; a prefix ending in ``.`` covers what starts with it).
        strip_prefix: removed from the front of every exported name with the ``.`` after it.
            Default: ``only`` (so ``only="model"`` writes ``layers.0.weight``); ``""`` keeps
            the names whole.
        dtype: cast floating-point tensors to this dtype (``bfloat16``, ``float16``,
            ``float32``, ``float64``); integer and bool tensors keep theirs.
        rank: which rank's state to export from a Checkpointer step saved by several ranks
            (DCP steps are always assembled from every rank).
        overwrite: allow a non-empty OUT_DIR; model shards and an index of an earlier export
            there that this one does not rewrite are removed once it has succeeded.
        read_batch_bytes: tensors are assembled in memory at most this many bytes at a time
            (never more than ``max_shard_size``, except for one larger tensor).
        read_concurrency: chunks fetched and decoded at once.
        storage_options: fsspec options of the store.
        timeout_s: the deadline of each storage request.

    Values that are not tensors (step counters, strings, pickled DCP objects) are skipped and
    listed in ``ExportResult.skipped``.
    """
    max_bytes = parse_size(max_shard_size)
    cast = _cast_dtype(dtype)
    if read_batch_bytes < 1 or read_concurrency < 1:
        raise ValueError("read_batch_bytes and read_concurrency must be >= 1")
    store = open_store(
        uri, storage_options=storage_options, timeout_s=timeout_s, max_concurrency=read_concurrency
    )
    out = _out_dir(out_dir, overwrite)
    cfg = PipelineConfig(read_concurrency=read_concurrency)
    batch_bytes = min(read_batch_bytes, max_bytes)

    def export_one(view: StepView) -> ExportResult:
        return _export_step(view, out, rank, only, strip_prefix, cast, max_bytes, cfg, batch_bytes)

    result = _export_kept_step(store, step, export_one)
    if overwrite:
        _remove_stale(
            out, keep={*result.files, *([result.index_file] if result.index_file else [])}
        )
    return result


def _export_step(
    view: StepView,
    out: str,
    rank: int,
    only: str | None,
    strip_prefix: str | None,
    cast: torch.dtype | None,
    max_bytes: int,
    cfg: PipelineConfig,
    batch_bytes: int,
) -> ExportResult:
    """The step of ``view`` written to ``out`` (see ``export_safetensors``)."""
    _check_rank(view, rank)
    items, skipped = _items_to_export(view, rank, only, strip_prefix, cast)
    shards = _split(items, max_bytes)
    names = _shard_names(len(shards))
    os.makedirs(out, exist_ok=True)
    return ExportResult(
        out_dir=out,
        step=view.step,
        kind=view.kind,
        files=names,
        index_file=_write_files(out, names, shards, view, cfg, batch_bytes),
        tensors=len(items),
        total_bytes=sum(i.out_bytes for i in items),
        skipped=skipped,
        notes=_notes(view, rank, skipped),
        ranks=view.manifest.world_size if view.per_rank else None,
    )


def _export_kept_step(
    store: Any, step: int | str, export_one: Callable[[StepView], ExportResult]
) -> ExportResult:
    """``export_one`` of the step. A step removed while it was read (another process's
    keep_last or gc) is no damage: "latest" exports the newest step instead (``LATEST_TRIES``
    times at most), a step named fails saying it was removed."""
    for tries_left in range(LATEST_TRIES - 1, -1, -1):
        view = StepView.open(store, step)
        try:
            return export_one(view)
        except CheckpointError as exc:
            if view.still_committed():
                raise
            if step not in (None, "latest") or not tries_left:
                raise CheckpointNotFoundError(
                    f"step {view.step} of {store.uri} was removed while it was exported "
                    "(keep_last or gc of another process): export a step still kept "
                    "(ckptstore ls)"
                ) from exc
            logger.warning(
                "step %d of %s was removed while it was exported (keep_last or gc of another "
                "process); exporting the newest step",
                view.step,
                store.uri,
            )
    raise AssertionError("unreachable: the last try returns or raises")


def _out_dir(out_dir: str | os.PathLike, overwrite: bool) -> str:
    """``out_dir`` as an absolute path, refused if it is a file or, without ``overwrite``, a
    directory that is not empty. It may lie inside the store (torchtitan's ``hf/step-N``):
    an export writes, and with ``overwrite`` removes, only its own model files."""
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out} exists and is not a directory")
    if not overwrite and os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out} is not empty (pass overwrite=True to export into it anyway)")
    return out


def _items_to_export(
    view: StepView,
    rank: int,
    only: str | None,
    strip_prefix: str | None,
    cast: torch.dtype | None,
) -> tuple[list[_Item], list[str]]:
    """The tensors of ``rank``'s state that ``only`` selects, and the names of the non-tensor
    values it would have selected; a step or a selection without a tensor is refused."""
    manifest = view.manifest
    named, skipped = view.whole_tensors(rank)
    items = _select(named, only, only if strip_prefix is None else strip_prefix, cast)
    skipped = [name for name in skipped if only is None or name_under(name, only)]
    if not items and not named:
        raise CheckpointNotFoundError(
            f"step {manifest.step} in {view.store.uri} holds no tensor to export as safetensors"
        )
    if not items:
        available = ", ".join(sorted(t.name for t in named)[:5]) or "none"
        raise ValueError(
            f"no tensor of step {manifest.step} in {view.store.uri} matches only={only!r} "
            f"(names start like: {available})"
        )
    return items, skipped


def _check_rank(view: StepView, rank: int) -> None:
    """``ValueError`` for a ``rank`` a per-rank step has none of."""
    size = view.manifest.world_size
    if view.per_rank and not 0 <= rank < size:
        raise ValueError(
            f"rank {rank}: step {view.manifest.step} was saved by {size} rank(s), 0-{size - 1}"
        )


def _notes(view: StepView, rank: int, skipped: list[str]) -> list[str]:
    notes = []
    if view.per_rank:
        notes.append(
            f"step saved by {view.manifest.world_size} ranks: exported rank {rank}'s state"
        )
    if skipped:
        notes.append(f"{len(skipped)} non-tensor value(s) skipped")
    return notes


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# -- what to export ------------------------------------------------------------------------------


def name_under(name: str, prefix: str, separators: str = ".") -> bool:
    """Whether ``name`` is ``prefix`` or under it: ``model`` covers ``model`` and ``model.w``
    (or ``model/w`` with ``/`` a separator), not ``model_ema.w``; a prefix that ends with a
    separator (``model.``) covers what starts with it."""
    if not prefix or prefix[-1] in separators:
        return name.startswith(prefix)
    return name == prefix or any(name.startswith(prefix + sep) for sep in separators)


def _strip(name: str, prefix: str) -> str:
    """``name`` without ``prefix`` and the separator after it (``model.w`` -> ``w``)."""
    if not prefix or not name_under(name, prefix):
        return name
    rest = name[len(prefix) :]
    return rest[1:] if rest[:1] == "." and prefix[-1] != "." else rest


def _select(
    named: list[WholeTensor], only: str | None, strip: str | None, cast: torch.dtype | None
) -> list[_Item]:
    items = []
    seen: dict[str, str] = {}
    for tensor in named:
        name, dtype, shape, pieces = (
            tensor.name,
            parse_dtype(tensor.dtype),
            tensor.shape,
            tensor.pieces,
        )
        if only is not None and not name_under(name, only):
            continue
        out_name = _strip(name, strip) if strip else name
        if out_name == "__metadata__":  # the header's own entry: a file no reader opens
            raise UnsupportedStateError(
                f"tensor {name!r} would export as '__metadata__', the name safetensors keeps "
                "for its header's metadata (leave it out with only=, or strip= a prefix)"
            )
        if out_name in seen:
            if seen[out_name] == name:  # the step's own names, not a flag's doing
                raise UnsupportedStateError(
                    f"two tensors of the step are named {name!r} (a key holding a dot beside a "
                    "nested one?); safetensors needs distinct names: export one with only="
                )
            raise ValueError(f"tensors {seen[out_name]!r} and {name!r} both export as {out_name!r}")
        seen[out_name] = name
        out_dtype = cast if cast is not None and dtype.is_floating_point else dtype
        if out_dtype not in _ST_DTYPES:
            raise UnsupportedStateError(
                f"tensor {name!r} has dtype {str(dtype).removeprefix('torch.')}, which "
                "safetensors cannot store (leave it out with only=, or cast it with dtype=)"
            )
        items.append(_Item(out_name, dtype, out_dtype, shape, pieces))
    return items


def _split(items: list[_Item], max_bytes: int) -> list[list[_Item]]:
    """Consecutive items in shards of at most ``max_bytes`` (a larger item alone), as
    Hugging Face shards a state dict."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.out_bytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.out_bytes
    return shards


# -- writing -------------------------------------------------------------------------------------


def _write_files(
    out: str,
    names: list[str],
    shards: list[list[_Item]],
    view: StepView,
    cfg: PipelineConfig,
    batch_bytes: int,
) -> str | None:
    """Every shard, and the index of several, written under temporary names in ``out`` and
    moved into place once all are complete, the index last; returns the index's name, or
    None for a single file. A failure removes the temporary files."""
    temporaries: list[str] = []
    writing = out
    try:
        for name, shard in zip(names, shards):
            temporaries.append(_temporary(out, name))
            writing = os.path.join(out, name)
            _write_shard(temporaries[-1], shard, view, cfg, batch_bytes)
            logger.info("export of step %d: %s written", view.manifest.step, name)
        index_doc = None
        writing = os.path.join(out, INDEX_FILE)
        if len(shards) > 1:
            weight_map = {item.name: name for name, shard in zip(names, shards) for item in shard}
            index_doc = {
                "metadata": {"total_size": sum(i.out_bytes for s in shards for i in s)},
                "weight_map": weight_map,
            }
            temporaries.append(_temporary(out, INDEX_FILE))
            _write_file(temporaries[-1], json.dumps(index_doc, indent=2).encode() + b"\n")
        # Every file is complete: move them into place, the index last.
        finals = [*names, INDEX_FILE] if index_doc is not None else names
        for temporary, name in zip(temporaries, finals):
            os.replace(temporary, os.path.join(out, name))
        temporaries = []
        _fsync_dir(out)
    except OSError as exc:
        if isinstance(exc, CheckpointError):  # the store's, named already
            raise
        error = OSError(f"cannot write {writing}: {exc.strerror or exc}")  # no "[Errno N]"
        error.errno = exc.errno
        raise error from exc
    finally:
        for temporary in temporaries:
            _remove(temporary)
    return INDEX_FILE if index_doc is not None else None


def _header(shard: list[_Item]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in shard:
        doc[item.name] = {
            "dtype": _ST_DTYPES[item.out_dtype],
            "shape": item.shape,
            "data_offsets": [offset, offset + item.out_bytes],
        }
        offset += item.out_bytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # tensor data starts 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(body)) + body


def _batches(shard: list[_Item], budget: int) -> Iterator[list[_Item]]:
    batch: list[_Item] = []
    size = 0
    for item in shard:
        if batch and size + item.read_bytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.read_bytes
    if batch:
        yield batch


def _write_shard(
    path: str, shard: list[_Item], view: StepView, cfg: PipelineConfig, batch_bytes: int
) -> None:
    header = _header(shard)
    with open(path, "xb") as f:
        f.write(header)
        for batch in _batches(shard, batch_bytes):
            for item, tensor in zip(batch, _assemble(batch, view, cfg)):
                out = tensor if tensor.dtype == item.out_dtype else tensor.to(item.out_dtype)
                if out.numel():
                    f.write(out.reshape(-1).view(torch.uint8).numpy().data)
                del out, tensor
            release_free_memory()
        expected = len(header) + sum(item.out_bytes for item in shard)
        assert f.tell() == expected, f"{path}: wrote {f.tell()} bytes, expected {expected}"
        f.flush()
        os.fsync(f.fileno())


def _assemble(batch: list[_Item], view: StepView, cfg: PipelineConfig) -> list[torch.Tensor]:
    """The whole tensors of ``batch``, each piece read into its block (chunks verified)."""
    merged = RankIndex(rank=-1, tensors=[], chunks={})
    wanted: dict[int, torch.Tensor | None] = {}
    fulls = []
    for item in batch:
        full = new_tensor(item.shape, item.dtype, f"tensor {item.name!r}")
        fulls.append(full)
        covered = 0
        # Pieces adding up to the size may still overlap and leave a hole of never-written
        # memory: with more than one, each element is marked once.
        mask = torch.zeros(item.shape, dtype=torch.bool) if len(item.pieces) > 1 else None
        for piece in item.pieces:
            index = view.index(piece.rank)
            entry = _entry(index, piece, item)
            block, marks = full, mask
            for dim, (start, length) in enumerate(zip(piece.offsets, piece.shape)):
                block = block.narrow(dim, start, length)
                marks = marks.narrow(dim, start, length) if marks is not None else None
            if marks is not None:
                if marks.any():
                    raise CheckpointCorruptError(
                        f"tensor {item.name!r}: two of its stored pieces overlap"
                    )
                marks.fill_(True)
            wanted[len(merged.tensors)] = block
            merged.tensors.append(entry)
            for seg in entry.segments:
                info = index.chunks.get(seg.chunk)
                if info is not None:
                    merged.chunks.setdefault(seg.chunk, ChunkInfo(info.raw, info.stored))
            covered += math.prod(piece.shape)
        if covered != full.numel():
            raise CheckpointCorruptError(
                f"tensor {item.name!r}: its stored pieces hold {covered} of {full.numel()} elements"
            )
    read_tensors(view.store, merged, wanted, cfg)
    return fulls


def _entry(index: RankIndex, piece: Piece, item: _Item) -> TensorEntry:
    if not 0 <= piece.tensor < len(index.tensors):
        raise CheckpointCorruptError(f"rank {piece.rank} has no tensor {piece.tensor}")
    entry = index.tensors[piece.tensor]
    if parse_dtype(entry.dtype) != item.dtype or list(entry.shape) != piece.shape:
        raise CheckpointCorruptError(
            f"tensor {item.name!r}: rank {piece.rank} stores {entry.dtype} "
            f"{shape_text(entry.shape)}, expected {str(item.dtype).removeprefix('torch.')} "
            f"{shape_text(piece.shape)}"
        )
    return entry


def _temporary(out: str, name: str) -> str:
    return os.path.join(out, f".{name}.tmp-{uuid.uuid4().hex[:12]}")


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _remove_stale(out: str, *, keep: set[str]) -> None:
    """Model files of an earlier export in ``out`` that this one did not rewrite."""
    for name in os.listdir(out):
        if name in keep:
            continue
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(name):
            _remove(os.path.join(out, name))
