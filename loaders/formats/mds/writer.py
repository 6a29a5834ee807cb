"""MosaicML Streaming MDS datasets (``index.json`` version 2), as ``MDS`` reads them.

A shard is ``uint32 n``, ``uint32 offsets[n + 1]`` (absolute), the shard's JSON config, then the
samples (the ``uint32`` sizes of the variable-size columns, then every column's bytes); columns
are kept in name order, shards named ``shard.00000.mds`` (``.zstd`` etc. when compressed, in
which case only the compressed file is stored). The index lists each shard's sizes and hashes.
"""

from __future__ import annotations

import bz2
import gzip
import json
import pickle
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zstandard

from loaders.formats._codecs import hasher
from loaders.formats._writing import DatasetSink, ShardWriter, Target
from loaders.formats.mds.reader import _NDARRAY_DTYPES, _SCALARS, _SHAPE_DTYPES

_DTYPE_CODES = {np.dtype(v): k for k, v in _NDARRAY_DTYPES.items()}
_SHAPE_CODES = [(k, np.dtype(v)) for k, v in sorted(_SHAPE_DTYPES.items())]


def _compressor(algo: str) -> Callable[[bytes], bytes]:
    name, _, level = algo.partition(":")
    if name == "zstd":
        return zstandard.ZstdCompressor(level=int(level or 3)).compress
    if name == "gz":
        return lambda b: gzip.compress(b, int(level or 9), mtime=0)
    if name == "bz2":
        return lambda b: bz2.compress(b, int(level or 9))
    raise ValueError(f"MDS compression {algo!r} is not supported (zstd[:level], gz, bz2 or None)")


def _ndarray_encoder(encoding: str) -> tuple[Callable[[Any], bytes], int | None]:
    parts = encoding.split(":")[1:]
    dtype = np.dtype(parts[0]) if parts and parts[0] else None
    shape = tuple(int(x) for x in parts[1].split(",")) if len(parts) > 1 else None
    if dtype is not None and dtype not in _DTYPE_CODES:
        raise ValueError(f"MDS ndarray element type {dtype} is not supported")
    if shape is not None and min(shape, default=0) < 1:
        raise ValueError(f"MDS column {encoding!r}: every dimension must be >= 1 (as Streaming's)")

    def encode(value: Any) -> bytes:
        arr = np.asarray(value)
        if dtype is not None and arr.dtype != dtype:
            raise ValueError(f"column {encoding!r} takes {dtype} arrays, got {arr.dtype}")
        if shape is not None and arr.shape != shape:
            raise ValueError(f"column {encoding!r} takes shape {shape}, got {arr.shape}")
        # Streaming's writer refuses both: its reader would need a shape of zeros or none.
        if arr.ndim == 0:
            raise ValueError("a 0-d array: give it a scalar column such as 'float32' or 'int'")
        if arr.size == 0:
            raise ValueError(f"an array of shape {arr.shape} has no elements")
        head = b""
        if dtype is None:
            if arr.dtype not in _DTYPE_CODES:
                raise ValueError(f"MDS ndarray element type {arr.dtype} is not supported")
            head += bytes([_DTYPE_CODES[arr.dtype]])
        if shape is None:
            if arr.ndim >= 64:
                raise ValueError(f"MDS ndarray takes at most 63 dimensions, got {arr.ndim}")
            top = max(arr.shape, default=0)
            code, width = next((c, w) for c, w in _SHAPE_CODES if top <= np.iinfo(w).max)
            head += bytes([arr.ndim << 2 | code]) + np.asarray(arr.shape, width).tobytes()
        return head + arr.astype(arr.dtype.newbyteorder("<")).tobytes()

    fixed = None
    if dtype is not None and shape is not None:
        fixed = int(np.prod(shape)) * dtype.itemsize
    return encode, fixed


def _json_bytes(value: Any) -> bytes:
    """JSON as Streaming writes it: keys in insertion order, arrays as lists."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return json.dumps(value).encode("utf-8")


def column_encoder(encoding: str) -> tuple[Callable[[Any], bytes], int | None]:
    """Value -> bytes for one MDS column encoding, and the column's fixed size (None if it
    varies); ``ValueError`` if the encoding is not one the reader decodes."""
    if encoding == "bytes":
        return bytes, None
    if encoding == "str":
        return lambda v: v.encode("utf-8"), None
    if encoding == "int":
        return lambda v: np.int64(v).tobytes(), 8
    if encoding in _SCALARS:
        dt = _SCALARS[encoding].newbyteorder("<")
        return lambda v: np.asarray(v, dt).tobytes(), dt.itemsize
    if encoding in ("str_int", "str_float", "str_decimal"):
        return lambda v: str(v).encode(), None
    if encoding == "json":
        return _json_bytes, None
    if encoding == "pkl":
        return pickle.dumps, None
    if encoding == "ndarray" or encoding.startswith("ndarray:"):
        return _ndarray_encoder(encoding)
    raise ValueError(f"MDS column encoding {encoding!r} is not supported by the writer")


class MDSWriter(ShardWriter):
    """Writes samples (dicts with every column) into MDS shards of at most ``size_limit`` raw
    bytes (a larger sample gets a shard of its own), then ``index.json``."""

    def __init__(
        self,
        uri: Target | Sequence[Target],
        *,
        columns: dict[str, str],
        compression: str | None = "zstd",
        hashes: Sequence[str] = ("sha1", "xxh64"),
        size_limit: int = 1 << 26,
        index: str = "index.json",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not columns:
            raise ValueError("MDSWriter needs at least one column")
        if size_limit < 1:
            raise ValueError(f"MDSWriter size_limit must be >= 1, got {size_limit}")
        self.names = sorted(columns)
        self.encodings = [columns[n] for n in self.names]
        coders = [column_encoder(e) for e in self.encodings]
        self._encoders = [c for c, _ in coders]
        self.sizes = [s for _, s in coders]
        self._variable = [i for i, s in enumerate(self.sizes) if s is None]
        self.compression = compression
        self._compress = _compressor(compression) if compression else None
        for algo in hashes:
            if hasher(algo) is None:
                raise ValueError(f"MDS hash {algo!r} is unknown")
        self.hashes = list(hashes)
        self.size_limit = size_limit
        self._config = json.dumps(self._shard_info(), sort_keys=True).encode("utf-8")
        self.sink = DatasetSink(uri, index=index, storage_options=storage_options)
        self._base = posixpath.dirname(index)  # shards are named relative to the index
        self._samples: list[bytes] = []
        self._bytes = 0
        self._index: list[dict[str, Any]] = []

    def _shard_info(self) -> dict[str, Any]:
        return {
            "column_encodings": self.encodings,
            "column_names": self.names,
            "column_sizes": self.sizes,
            "compression": self.compression,
            "format": "mds",
            "hashes": self.hashes,
            "size_limit": self.size_limit,
            "version": 2,
        }

    def _shard_bytes(self, samples: int, data_bytes: int) -> int:
        return 4 + 4 * (samples + 1) + len(self._config) + data_bytes

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample; it must have every column (other keys are ignored)."""
        self.sink.check_open()
        missing = [n for n in self.names if n not in sample]
        if missing:
            raise ValueError(f"MDS sample lacks columns {missing}")
        values = []
        for name, encode, size in zip(self.names, self._encoders, self.sizes):
            try:
                data = encode(sample[name])
            except (TypeError, ValueError, AttributeError, OverflowError) as exc:
                raise ValueError(
                    f"MDS column {name!r}: cannot encode {sample[name]!r}: {exc}"
                ) from exc
            if size is not None and len(data) != size:
                raise ValueError(f"MDS column {name!r} takes {size} bytes, got {len(data)}")
            values.append(data)
        head = np.asarray([len(values[i]) for i in self._variable], "<u4").tobytes()
        raw = head + b"".join(values)
        n = len(self._samples)
        if n and self._shard_bytes(n + 1, self._bytes + len(raw)) > self.size_limit:
            self._flush()
        self._samples.append(raw)
        self._bytes += len(raw)

    def _flush(self) -> None:
        n = len(self._samples)
        if not n:
            return
        first = self._shard_bytes(n, 0)
        offsets = np.cumsum([first] + [len(s) for s in self._samples], dtype=np.int64)
        if offsets[-1] >= 2**32:
            raise ValueError(f"MDS shard of {offsets[-1]} bytes: shards must stay below 4 GiB")
        head = np.uint32(n).tobytes() + offsets.astype("<u4").tobytes() + self._config
        raw = b"".join([head, *self._samples])
        basename = f"shard.{len(self._index):05d}.mds"
        info = {
            **self._shard_info(),
            "raw_data": {"basename": basename, "bytes": len(raw), "hashes": self._digests(raw)},
            "samples": n,
            "zip_data": None,
        }
        data = raw
        if self._compress is not None:
            data = self._compress(raw)
            zipped = f"{basename}.{self.compression.split(':', 1)[0]}"
            info["zip_data"] = {
                "basename": zipped,
                "bytes": len(data),
                "hashes": self._digests(data),
            }
            basename = zipped
        self.sink.put(posixpath.join(self._base, basename), data)
        self._index.append(info)
        self._samples, self._bytes = [], 0

    def _digests(self, data: bytes) -> dict[str, str]:
        return {algo: hasher(algo)(data) for algo in self.hashes}

    def _index_bytes(self) -> bytes:
        return json.dumps({"shards": self._index, "version": 2}, sort_keys=True).encode("utf-8")
