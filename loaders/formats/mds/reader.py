"""MosaicML Streaming MDS datasets (``index.json`` version 2), read whole shard by whole shard.

A shard is ``uint32 n``, ``uint32 offsets[n + 1]`` (absolute byte offsets of each sample), the
writer's JSON config, then the samples. A sample is the ``uint32`` sizes of its variable-size columns, then every column's
bytes in index order. Compressed shards (``zip_data``) are decompressed after the read; the hashes
the index lists (sha1, xxh64, ...) are checked on the compressed and on the raw bytes.
"""

from __future__ import annotations

import json
import logging
import pickle
import posixpath
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from loaders.errors import (
    ShardCorruptError,
    ShardNotFoundError,
    ShardTooLargeError,
    UnknownFormatError,
)
from loaders.formats._codecs import decompress, hasher, max_raw_bytes
from loaders.formats.layout import Unit, check_shard_key, first_time

logger = logging.getLogger(__name__)

_SCALARS = {
    n: np.dtype(n)
    for n in (
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
# Array element types and shape widths as MDS ``ndarray`` encodes them in a sample.
_NDARRAY_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
_IMAGE_ENCODINGS = {"pil", "jpeg", "png", "jpeg_array", "jpegarray", "jpeg_array_hwc"}


def _ndarray_decoder(spec: str) -> Callable[[bytes], np.ndarray]:
    parts = spec.split(":")[1:]
    try:
        dtype = np.dtype(parts[0]) if parts and parts[0] else None
        shape = tuple(int(x) for x in parts[1].split(",")) if len(parts) > 1 else None
    except (TypeError, ValueError) as exc:
        raise ShardCorruptError(f"MDS column encoding {spec!r} is malformed: {exc}") from None
    if dtype is not None and (dtype.hasobject or dtype.itemsize == 0):
        raise ShardCorruptError(f"MDS column encoding {spec!r}: {dtype} is not an array dtype")

    def decode(b: bytes) -> np.ndarray:
        i = 0
        dt = dtype
        if dt is None:
            dt = np.dtype(_NDARRAY_DTYPES[b[0]])
            i = 1
        shp = shape
        if shp is None:
            ndim, width = b[i] >> 2, np.dtype(_SHAPE_DTYPES[b[i] & 3])
            i += 1
            shp = tuple(int(x) for x in np.frombuffer(b, width, ndim, i))
            i += ndim * width.itemsize
        # A copy: writable (torch warns on read-only arrays), and not a view of the shard.
        return np.frombuffer(b, dt, offset=i).reshape(shp).copy()

    return decode


def column_decoder(encoding: str, *, allow_pickle: bool = False) -> Callable[[bytes], Any]:
    """Bytes -> value for one MDS column encoding; :class:`UnknownFormatError` if unsupported."""
    if encoding == "bytes":
        return bytes
    if encoding == "str":
        return lambda b: b.decode("utf-8")
    if encoding == "int":
        return lambda b: int(np.frombuffer(b, np.int64)[0])
    if encoding in _SCALARS:
        dt = _SCALARS[encoding]
        return lambda b: np.frombuffer(b, dt)[0]
    if encoding == "str_int":
        return lambda b: int(b.decode())
    if encoding == "str_float":
        return lambda b: float(b.decode())
    if encoding == "str_decimal":
        return lambda b: Decimal(b.decode())
    if encoding == "json":
        return _json_value
    if encoding == "pkl":
        if not allow_pickle:
            raise UnknownFormatError(
                "MDS column encoding 'pkl' runs code when read: pass "
                "MDS(allow_pickle=True) if the dataset is trusted"
            )
        return pickle.loads
    if encoding == "ndarray" or encoding.startswith("ndarray:"):
        return _ndarray_decoder(encoding)
    if encoding in _IMAGE_ENCODINGS:
        raise UnknownFormatError(f"MDS image column encoding {encoding!r} is not decoded here")
    raise UnknownFormatError(f"unknown MDS column encoding {encoding!r}")


def _json_value(b: bytes) -> Any:
    return json.loads(b.decode("utf-8"))


# At most what a JSON text's decoded objects take per byte of it, measured on CPython 3.11
# (``json_size``): lists nested 50 deep in a list take 43-44 times their text, a dict of one key
# nested in another 37 (``{"":{"":...}}``), an empty one in a list 24; text and numbers 2 to 13.
JSON_WORST_BYTES_PER_BYTE = 48


_CONTAINERS = frozenset((list, dict))


def json_size(value: Any) -> int:
    """Bytes the Python objects of a decoded JSON value take (``sys.getsizeof`` of each)."""
    getsizeof = sys.getsizeof
    size, stack = 0, [value]
    while stack:
        v = stack.pop()
        size += getsizeof(v)
        if type(v) is dict:
            stack.extend(v)
            stack.extend(v.values())
        elif type(v) is not list:
            continue
        elif len(v) > 8 and type(v[0]) is not list and type(v[0]) is not dict:
            size += sum(map(getsizeof, v))  # a list of numbers or strings: measured at C speed
            if not _CONTAINERS.isdisjoint(map(type, v)):
                nested = [x for x in v if type(x) is list or type(x) is dict]
                size -= sum(map(getsizeof, nested))  # measured again as they are walked
                stack += nested
        else:
            stack.extend(v)
    return size


def _named_decoder(name: str, encoding: str, allow_pickle: bool) -> Callable[[bytes], Any]:
    """:func:`column_decoder` for column ``name``, whose errors say how to read it raw."""
    try:
        return column_decoder(encoding, allow_pickle=allow_pickle)
    except UnknownFormatError as exc:
        raise UnknownFormatError(
            f"MDS column {name!r}: {exc}; MDS(raw_columns=({name!r},)) reads its stored bytes "
            "for a transform to decode"
        ) from exc


@dataclass(kw_only=True)
class MDS:
    """A MosaicML MDS dataset: ``index.json`` (version 2) and its shards."""

    index: str = "index.json"
    """Key of the index, relative to each replica's root; shards are named relative to it."""
    allow_pickle: bool = False
    """Decode ``pkl`` columns (runs code from the dataset: only for trusted data)."""
    verify_hashes: bool = True
    """Check the hashes the index lists for each shard, on every read."""
    raw_columns: tuple[str, ...] = ()
    """Columns handed out as the bytes stored for them, whatever their encoding: image columns
    (``jpeg``, ``png``: the image file; ``pil``: ``uint32`` width, height, mode length, the
    mode, then ``Image.tobytes()``), ``pkl`` without unpickling, or encodings not read here.
    Decoding them is left to the dataset's ``transform``."""
    max_shard_bytes: int = 1 << 32
    """Most raw bytes a shard may declare (and a compressed one decompress to), and most bytes
    its samples may take decoded (its raw bytes plus ``SAMPLE_BYTES`` a sample and
    ``VALUE_BYTES`` a column value: Python objects): an index declaring more is
    :class:`ShardTooLargeError` at open, so that no shard grows the reader past it (upstream's
    shards are 64 MiB by default)."""
    max_index_bytes: int = 64 << 20
    """Most bytes ``index.json`` may take: a JSON text decodes to up to
    ``JSON_WORST_BYTES_PER_BYTE`` times its size (3 GiB at this default, about 3.5 GiB of the
    process at its peak) before a single entry is checked. An index of upstream's entries
    takes about 450 bytes a shard: 64 MiB lists about 150,000 shards."""
    name: str = field(default="mds", init=False)

    def __post_init__(self) -> None:
        for bound in ("max_shard_bytes", "max_index_bytes"):
            if getattr(self, bound) < 1:
                raise ValueError(f"MDS.{bound} must be >= 1, got {getattr(self, bound)}")
        if isinstance(self.raw_columns, str):
            raise ValueError(
                f"MDS raw_columns takes a tuple of column names, got the string {self.raw_columns!r}"
            )
        self.raw_columns = tuple(self.raw_columns)

    def open(self, replicas: Any) -> MDSLayout:
        raw = replicas.read_same(
            self.index,
            self.max_index_bytes,
            bound="MDS.max_index_bytes: raise it for an index this large",
        )
        try:
            index = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ShardCorruptError(f"{self.index} is not JSON: {exc}") from None
        if not isinstance(index, dict) or index.get("version") != 2:
            raise UnknownFormatError(
                f"{self.index}: MDS index version "
                f"{index.get('version') if isinstance(index, dict) else '?'}"
                " is not supported (only version 2)"
            )
        base = posixpath.dirname(self.index)
        units, shards, keys = [], [], {}
        first = 0
        listed = index.get("shards", [])
        if not isinstance(listed, list):
            raise ShardCorruptError(f"{self.index}: shards is {type(listed).__name__}, not a list")
        for i, info in enumerate(listed):
            if not isinstance(info, dict):
                raise ShardCorruptError(
                    f"{self.index}: shard {i} is {type(info).__name__}, not an object"
                )
            if info.get("format") != "mds":
                raise UnknownFormatError(
                    f"{self.index}: shard {i} has format "
                    f"{info.get('format')!r}, only 'mds' is supported"
                )
            where = f"{self.index} (shard {i})"
            try:
                shard = _Shard.from_index(
                    info,
                    base,
                    index=where,
                    allow_pickle=self.allow_pickle,
                    verify=self.verify_hashes,
                    raw=frozenset(self.raw_columns),
                    max_bytes=self.max_shard_bytes,
                )
                bound = f"MDS.max_shard_bytes ({self.max_shard_bytes}): raise it to read it"
                if shard.raw_bytes > self.max_shard_bytes:
                    raise ShardTooLargeError(
                        f"{where}: {shard.raw_bytes} raw bytes, more than {bound}"
                    )
                if shard.nbytes > self.max_shard_bytes:  # read whole before it is decompressed
                    raise ShardTooLargeError(
                        f"{where}: {shard.nbytes} bytes stored, more than {bound}"
                    )
                shard.check_ratio(where)
                if shard.decoded_bytes() > self.max_shard_bytes:
                    raise ShardTooLargeError(
                        f"{where}: {shard.samples} samples of {len(shard.names)} column(s) "
                        f"decode to about {shard.decoded_bytes()} bytes, more than {bound}"
                    )
            except (KeyError, TypeError, AttributeError) as exc:
                what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ShardCorruptError(f"{where}: malformed entry ({what})") from None
            if shard.key in keys:
                raise ShardCorruptError(
                    f"{where}: names shard {shard.key!r} again (shard {keys[shard.key]} names it "
                    "too): its samples would be read twice"
                )
            keys[shard.key] = i
            units.append(
                Unit(
                    key=shard.key,
                    start=None,
                    end=None,
                    nbytes=shard.nbytes,
                    mem_bytes=shard.decoded_bytes(),
                    num_samples=shard.samples,
                    first_id=first,
                )
            )
            shards.append(shard)
            first += shard.samples
        if not shards:
            raise ShardNotFoundError(f"{self.index} lists no shards")
        unhashed = not any(s.zip_hashes or s.raw_hashes for s in shards)
        if unhashed and first_time(("unhashed mds", tuple(replicas.uris), self.index)):
            logger.log(
                logging.WARNING if self.verify_hashes else logging.INFO,
                "MDS shards of %s are read unverified: %s (a byte flipped on a replica "
                "is not found; MDSWriter's default hashes=('sha1', 'xxh64') are checked)",
                ", ".join(replicas.uris),
                f"{self.index} lists no hashes" if self.verify_hashes else "verify_hashes=False",
            )
        if replicas.config.verify_replicas:
            # The index is the shard list: each shard on some replica, at the index's size (a
            # replica holding another size is not read for it).
            replicas.find_shards([s.key for s in shards], sizes={s.key: s.nbytes for s in shards})
        return MDSLayout(units=units, shards=shards)


# A decoded sample's Python objects beyond its raw bytes (a dict, its ``__index__``, a list
# slot, its offsets as Python ints while the shard is parsed; each column's value object),
# measured on CPython 3.11 (tracemalloc after a parse: 256 bytes a sample of one int column,
# 358 of three (int, str, bytes), 567 of eight ints; peak RSS of a shard of empty samples: 326).
SAMPLE_BYTES = 264
VALUE_BYTES = 48


@dataclass
class _Shard:
    key: str
    raw_name: str
    samples: int
    nbytes: int
    raw_bytes: int
    compression: str | None
    zip_hashes: dict[str, str]
    raw_hashes: dict[str, str]
    names: list[str]
    sizes: list[int | None]
    encodings: list[str]
    allow_pickle: bool
    raw_columns: frozenset[str]
    max_bytes: int
    """``MDS.max_shard_bytes``: what its samples may take decoded, JSON values measured."""

    @classmethod
    def from_index(
        cls,
        info: dict,
        base: str,
        *,
        index: str,
        allow_pickle: bool,
        verify: bool,
        raw: frozenset[str],
        max_bytes: int,
    ) -> _Shard:
        raw_data, zipped = info["raw_data"], info.get("zip_data")
        compression = info.get("compression")
        if compression and not isinstance(zipped, dict):
            raise ShardCorruptError(
                f"a shard compressed with {compression!r} has no zip_data in {index}"
            )
        data = zipped if compression else raw_data
        for column in ("column_names", "column_encodings", "column_sizes"):
            if not isinstance(info[column], list):
                raise ShardCorruptError(f"{column} of a shard in {index} is not a list")
        names, encodings = list(info["column_names"]), list(info["column_encodings"])
        if not all(isinstance(n, str) for n in names):
            raise ShardCorruptError(f"column_names of a shard in {index} are not all names")
        unknown = sorted(raw.difference(names))
        if unknown:
            raise ValueError(
                f"MDS raw_columns names {', '.join(map(repr, unknown))}, which {index} does not "
                f"have (columns: {', '.join(names)})"
            )
        listed = set(info.get("hashes") or [])
        recorded = data.get("hashes") if isinstance(data.get("hashes"), dict) else {}
        if verify and listed and not listed & set(recorded):
            raise ShardCorruptError(
                f"{index} lists hashes {', '.join(sorted(listed))} but shard "
                f"{data['basename']!r} records none of them: it cannot be verified"
            )
        shard = cls(
            key=posixpath.join(base, check_shard_key(data["basename"], index)),
            raw_name=check_shard_key(raw_data["basename"], index),
            samples=_count(info["samples"], "samples", index),
            nbytes=_count(data["bytes"], "bytes", index),
            raw_bytes=_count(raw_data["bytes"], "raw bytes", index),
            compression=compression,
            zip_hashes={
                k: v for k, v in (zipped or {}).get("hashes", {}).items() if verify and k in listed
            }
            if compression
            else {},
            raw_hashes={
                k: v for k, v in raw_data.get("hashes", {}).items() if verify and k in listed
            },
            names=names,
            sizes=list(info["column_sizes"]),
            encodings=encodings,
            allow_pickle=allow_pickle,
            raw_columns=raw,
            max_bytes=max_bytes,
        )
        if any(
            size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0)
            for size in shard.sizes
        ):
            raise ShardCorruptError(f"{index}: column_sizes {shard.sizes!r} are not sizes or null")
        columns = {len(shard.names), len(shard.encodings), len(shard.sizes)}
        if len(columns) != 1:
            raise ShardCorruptError(
                f"{index}: {len(shard.names)} column names, {len(shard.encodings)} encodings and "
                f"{len(shard.sizes)} sizes (each column needs one of each)"
            )
        repeated = sorted(n for n, count in Counter(shard.names).items() if count > 1)
        if repeated:  # a sample's later column would replace the earlier one's value
            raise ShardCorruptError(f"{index}: column names repeat: {', '.join(repeated)}")
        # A raw shard holds a 4-byte count and an offset table of samples + 1 entries.
        if 4 + 4 * (shard.samples + 1) > shard.raw_bytes:
            raise ShardCorruptError(
                f"{index}: {shard.samples} samples cannot fit in a shard of {shard.raw_bytes} raw "
                "bytes"
            )
        shard.decoders()  # an encoding not read here fails at open
        return shard

    def decoded_bytes(self) -> int:
        """About what the shard's samples take decoded: its raw bytes and the Python objects
        (``parse_shard``'s dicts and values), what the prefetch window accounts until the
        shard is decoded (JSON values are measured then: :class:`Samples`)."""
        return self.raw_bytes + self.samples * (SAMPLE_BYTES + VALUE_BYTES * len(self.names))

    def check_ratio(self, index: str) -> None:
        """A compressed shard declaring more raw bytes (so room for more samples) than its
        compression can make of its size is corrupt; so is one declaring more samples than
        its stored bytes can number (the epoch's order, held in memory, is sized by them)."""
        most = max_raw_bytes(self.compression, self.nbytes) if self.compression else None
        if most is not None and self.raw_bytes > most:
            raise ShardCorruptError(
                f"{index}: {self.raw_bytes} raw bytes cannot come from {self.nbytes} bytes of "
                f"{self.compression} (at most {most})"
            )
        if self.compression and self.samples > SAMPLES_PER_STORED_BYTE * max(self.nbytes, 1):
            raise ShardCorruptError(
                f"{index}: {self.samples} samples cannot be numbered in {self.nbytes} bytes of "
                f"{self.compression} (at most {SAMPLES_PER_STORED_BYTE} a byte: each needs "
                "its own 4-byte offset)"
            )

    def decoders(self) -> list[Callable[[bytes], Any]]:
        """Bytes -> value for each column, in order (``bytes`` for the raw columns)."""
        images = [
            name
            for name, enc in zip(self.names, self.encodings)
            if enc in _IMAGE_ENCODINGS and name not in self.raw_columns
        ]
        if len(images) > 1:  # name them all at once, not one per try
            raise UnknownFormatError(
                f"MDS image columns {', '.join(map(repr, images))} are not decoded here; "
                f"MDS(raw_columns={tuple(images)!r}) reads their stored bytes for a transform "
                "to decode"
            )
        return [
            bytes if name in self.raw_columns else _named_decoder(name, enc, self.allow_pickle)
            for name, enc in zip(self.names, self.encodings)
        ]


# Each sample has its own 4-byte entry in the shard's offset table; distinct offsets do not
# compress below about a byte each, so a compressed shard claiming more samples than this per
# stored byte made them up.
SAMPLES_PER_STORED_BYTE = 4


def _count(value: object, what: str, index: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShardCorruptError(f"{index}: {what} {value!r} is not a non-negative int")
    return value


def _check_hashes(data: bytes, expected: dict[str, str], what: str, replica: str) -> None:
    for algo, digest in expected.items():
        fn = hasher(algo)
        if fn is None:
            logger.warning("%s: hash %r is unknown, not checked", what, algo)
            continue
        got = fn(data)
        if got != digest:
            raise ShardCorruptError(
                f"shard {what} on replica {replica}: {algo} is {got}, the index says {digest}"
            )


@dataclass
class MDSLayout:
    units: list[Unit]
    shards: list[_Shard]
    reads_views: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._by_key = {s.key: s for s in self.shards}
        # json values decode larger than their text: the window learns by how much
        self.may_grow = any(
            enc == "json" and name not in s.raw_columns
            for s in self.shards
            for name, enc in zip(s.names, s.encodings)
        )

    def decode(self, unit: Unit, data: bytes, replica: str) -> list[dict[str, Any]]:
        return self.decode_shard(self._by_key[unit.key], data, replica, unit.first_id)

    def decode_shard(self, shard: _Shard, data: bytes, replica: str, first_id: int) -> list:
        what = shard.key
        if len(data) != shard.nbytes:
            raise ShardCorruptError(
                f"shard {what} on replica {replica} is {len(data)} bytes, "
                f"the index says {shard.nbytes}"
            )
        if shard.compression:
            _check_hashes(data, shard.zip_hashes, what, replica)
            data = decompress(
                shard.compression,
                data,
                what=f"shard {what} on replica {replica}",
                limit=shard.raw_bytes,
            )
        _check_hashes(data, shard.raw_hashes, shard.raw_name, replica)
        return parse_shard(data, shard, replica, first_id)


class Samples(list):
    """A decoded shard's samples, with ``mem_bytes``: about what they take (the prefetch
    window's account of the shard once read)."""

    mem_bytes: int


def parse_shard(data: bytes, shard: _Shard, replica: str, first_id: int) -> Samples:
    """Every sample of one raw MDS shard; :class:`ShardCorruptError` names shard and offset.

    A JSON value may take up to ``JSON_WORST_BYTES_PER_BYTE`` times its text decoded (2 to 13
    for text and numbers): each is measured, and a shard whose values would take more than
    ``MDS.max_shard_bytes`` is refused before the value that would pass it is decoded."""
    what = f"shard {shard.raw_name} on replica {replica}"
    n = len(data)
    if n < 4:
        raise ShardCorruptError(f"{what}: {n} bytes, shorter than its 4-byte header (offset 0)")
    count = int(np.frombuffer(data, np.uint32, 1)[0])
    if count != shard.samples:
        raise ShardCorruptError(
            f"{what}: header at offset 0 says {count} samples, the index says {shard.samples}"
        )
    table_end = 4 + 4 * (count + 1)
    if n < table_end:
        raise ShardCorruptError(
            f"{what}: offset table runs to byte {table_end}, past the end of the shard ({n} bytes)"
        )
    offsets = np.frombuffer(data, np.uint32, count + 1, 4).astype(np.int64)
    bad = np.flatnonzero((np.diff(offsets) < 0) | (offsets[1:] > n))
    if offsets[0] < table_end or len(bad):
        i = 0 if offsets[0] < table_end else int(bad[0]) + 1
        raise ShardCorruptError(
            f"{what}: offset table entry {i} (at byte {4 + 4 * i}) is "
            f"{int(offsets[i])}, outside [{table_end}, {n}] or out of order"
        )
    decoders = shard.decoders()
    variable = [i for i, s in enumerate(shard.sizes) if s is None]
    head = 4 * len(variable)
    bounds = offsets.tolist()
    out = Samples()
    out.mem_bytes = shard.decoded_bytes()
    measured = [
        enc == "json" and name not in shard.raw_columns
        for name, enc in zip(shard.names, shard.encodings)
    ]
    view = memoryview(data)
    for j in range(count):
        begin, end = bounds[j], bounds[j + 1]
        sample_id = first_id + j
        try:
            sizes = list(shard.sizes)
            if head:
                if end - begin < head:
                    raise ValueError("shorter than its column sizes")
                for i, size in zip(variable, np.frombuffer(data, np.uint32, len(variable), begin)):
                    sizes[i] = int(size)
            pos = begin + head
            if pos + sum(sizes) != end:
                raise ValueError(
                    f"columns take {head + sum(sizes)} bytes, the sample has {end - begin}"
                )
            sample: dict[str, Any] = {}
            for name, size, dec, measure in zip(shard.names, sizes, decoders, measured):
                value = bytes(view[pos : pos + size])
                if measure:
                    sample[name], grown = _measured_json(shard, out.mem_bytes, value, what, j)
                    out.mem_bytes += grown
                else:
                    sample[name] = dec(value)
                pos += size
        except (ShardCorruptError, ShardTooLargeError):
            raise
        except (ValueError, KeyError, IndexError, ArithmeticError, RecursionError) as exc:
            # ArithmeticError: decimal's InvalidOperation; RecursionError: deep json columns
            raise ShardCorruptError(
                f"{what}: sample {j} at offset {begin} cannot be decoded: {_why(exc)}"
            ) from exc
        sample["__index__"] = sample_id
        out.append(sample)
    return out


def _measured_json(shard: _Shard, used: int, text: bytes, what: str, j: int) -> tuple[Any, int]:
    """The JSON value ``text`` and the bytes it takes decoded beyond what the shard's account
    holds for it (its text and ``VALUE_BYTES``). ``ShardTooLargeError`` before it is decoded if
    its worst case could take the shard's samples past ``max_bytes`` (``used`` so far), or
    after if it does: the shard's bound, where its hashes vouch for its bytes; else
    ``ShardCorruptError``, another replica tried (a replica's damage can resize its values)."""
    bound = f"MDS.max_shard_bytes ({shard.max_bytes})"
    verified = bool(shard.raw_hashes or shard.zip_hashes)
    error = ShardTooLargeError if verified else ShardCorruptError
    if used + JSON_WORST_BYTES_PER_BYTE * len(text) > shard.max_bytes:
        raise error(
            f"{what}: sample {j} has a json value of {len(text)} bytes, which may decode to "
            f"{JSON_WORST_BYTES_PER_BYTE}x that, past {bound} with the samples before it: not "
            "decoded (raise the bound to read it)"
        )
    value = _json_value(text)
    grown = max(0, json_size(value) - len(text) - VALUE_BYTES)
    if used + grown > shard.max_bytes:
        raise error(
            f"{what}: its json values decode to more than {bound} by sample {j}: not read "
            "further (raise the bound to read it)"
        )
    return value, grown


def _why(exc: BaseException) -> str:
    """A decode error in words (decimal's says only ``[<class 'decimal.ConversionSyntax'>]``)."""
    if isinstance(exc, InvalidOperation):
        return "a str_decimal value that is no decimal number"
    return f"{type(exc).__name__}: {str(exc)[:200]}"
