"""Chunk encoding: byte-grouping + zstd, and xxh3-128 hashes of the raw bytes.

Byte-grouping splits the bytes of each element into planes (plane k holds byte k of every
element), so the sign/exponent bytes of floats, which repeat, sit together where zstd can find
them, and the near-random low mantissa bytes are stored as they are. Each plane is compressed on
its own and kept raw when zstd does not shrink it.

An encoded chunk is self-describing (see docs/FORMAT.md)::

    header  "CKC1" u8:version u8:itemsize u8:nplanes u8:reserved u64:raw_len
    planes  nplanes x (u8:method u64:stored_len)   method 0 = raw, 1 = zstd
    body    the planes, in order
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash
import zstandard

from ckptstore.errors import CheckpointCorruptError

if TYPE_CHECKING:
    import numpy as np
# Elsewhere numpy is imported by the functions that use it: ``ckptstore ls`` and ``inspect``,
# which only hash, start faster without it.

MAGIC = b"CKC1"
CODEC_VERSION = 1
_HEADER = struct.Struct("<4sBBBxQ")
_PLANE = struct.Struct("<BQ")
RAW, ZSTD = 0, 1
# A plane that zstd cannot shrink below this fraction is stored raw (cheaper to decode).
_WORTH_IT = 0.98


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How chunks are encoded."""

    level: int | None = 1
    """zstd level, or None to store raw. Levels <= 1 use parameters tuned for byte planes
    (fast strategy, 64 KiB window, 7-byte minimum match): on float exponent planes they
    compress better than zstd's level 1 at about twice its speed."""
    byte_grouping: bool = True
    """Split multi-byte elements into byte planes before compressing."""
    adaptive: bool = False
    """Compress a chunk only while that is faster than uploading the bytes it saves
    (see ``pipeline.CompressionGovernor``); the format is the same either way."""

    def __post_init__(self) -> None:
        if self.level is not None and not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be within [-7, 22] or None, got {self.level}")

    @classmethod
    def parse(cls, spec: str | int | None) -> CodecConfig:
        """``"auto"``, ``"none"``, ``"zstd"``, ``"zstd:3"``, an int level, or None (raw)."""
        if isinstance(spec, bool) or not isinstance(spec, str | int | None):
            raise ValueError(
                f"compression takes 'auto', 'none', 'zstd', 'zstd:LEVEL', an int level or None, "
                f"got {type(spec).__name__} {spec!r}"
            )
        if isinstance(spec, str) and spec.lower() == "auto":
            return cls(level=1, adaptive=True)
        if spec is None or (isinstance(spec, str) and spec.lower() in ("none", "raw")):
            return cls(level=None)
        if isinstance(spec, int):
            return cls(level=spec)
        name, _, level = spec.lower().partition(":")
        if name != "zstd":
            raise ValueError(
                f"unknown compression {spec!r}: expected auto, none, zstd or zstd:LEVEL"
            )
        try:
            return cls(level=int(level) if level else 1)
        except ValueError as exc:
            raise ValueError(f"bad zstd level in {spec!r}") from exc


_local = threading.local()


_PLANE_PARAMS = dict(
    window_log=16, hash_log=6, min_match=7, search_log=1, strategy=zstandard.STRATEGY_FAST
)
# A plane bigger than this is first tried on a sample; if zstd can't shrink the sample, the
# whole plane is stored raw without spending a pass of zstd on it.
_SAMPLE_ABOVE = 1 << 20
_SAMPLE = 64 << 10


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        if level <= 1:
            params = zstandard.ZstdCompressionParameters(**_PLANE_PARAMS)
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _compressible(compressor: zstandard.ZstdCompressor, plane: np.ndarray) -> bool:
    if plane.size <= _SAMPLE_ABOVE:
        return True
    middle = plane.size // 2
    sample = plane[middle : middle + _SAMPLE]
    return len(compressor.compress(sample)) < 0.95 * sample.size


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def max_encoded_size(raw_len: int) -> int:
    """The largest object :func:`encode` makes of ``raw_len`` bytes: its header, a plane table
    of at most 255 planes, and the planes stored raw (zstd is kept only when it shrinks one)."""
    return raw_len + _HEADER.size + 255 * _PLANE.size


HASH_PIECE_BYTES = 1024 * 1024  # what ``hash_bytes`` hands ``each`` at once: a core's L2


def possible_encoded_size(size: int, raw_len: int) -> bool:
    """Whether an object of ``size`` bytes can be an encoding of ``raw_len`` bytes."""
    return _HEADER.size <= size <= max_encoded_size(raw_len)


def hash_bytes(raw, each: Callable[[int, int], None] | None = None) -> str:
    """xxh3-128 of ``raw`` as 32 lowercase hex digits. With ``each``, ``raw`` is hashed in
    pieces of ``HASH_PIECE_BYTES`` and ``each(start, end)`` is called on each piece's bounds
    right before it is hashed, so another pass over it (``health.ChunkScan``) reads it from
    cache; the digest is the same."""
    if each is None:
        return xxhash.xxh3_128_hexdigest(raw)
    data = _as_u8(raw)
    hasher = xxhash.xxh3_128()
    for start in range(0, data.size, HASH_PIECE_BYTES):
        end = min(start + HASH_PIECE_BYTES, data.size)
        each(start, end)
        hasher.update(data[start:end])
    return hasher.hexdigest()


def _as_u8(raw) -> np.ndarray:
    import numpy as np

    return (
        np.frombuffer(raw, dtype=np.uint8)
        if not isinstance(raw, np.ndarray)
        else raw.view(np.uint8).reshape(-1)
    )


def encode(raw, itemsize: int, config: CodecConfig) -> bytes:
    """Encode ``raw`` (a buffer of elements ``itemsize`` bytes wide) into a chunk object."""
    return b"".join(encode_parts(raw, itemsize, config))


def encode_parts(raw, itemsize: int, config: CodecConfig) -> list:
    """:func:`encode` as a list of buffers (header first) whose concatenation is the object,
    so a local write can skip joining them."""
    import numpy as np

    data = _as_u8(raw)
    n = data.size
    if config.level is None:
        planes = [data]
        itemsize = 1
    elif config.byte_grouping and itemsize > 1 and n % itemsize == 0 and n:
        grid = data.reshape(-1, itemsize)
        planes = [np.ascontiguousarray(grid[:, k]) for k in range(itemsize)]
    else:
        planes = [data]
        itemsize = 1
    parts: list = [b""]  # header placeholder
    table = []
    compressor = _compressor(config.level) if config.level is not None else None
    for plane in planes:
        method, body = RAW, plane
        if compressor is not None and plane.size and _compressible(compressor, plane):
            packed = compressor.compress(plane)
            if len(packed) < _WORTH_IT * plane.size:
                method, body = ZSTD, packed
        table.append(_PLANE.pack(method, len(body) if method == ZSTD else plane.size))
        parts.append(body)
    parts[0] = _HEADER.pack(MAGIC, CODEC_VERSION, itemsize, len(planes), n) + b"".join(table)
    return parts


def decode(
    obj,
    *,
    expected_hash: str,
    name: str,
    out: np.ndarray | None = None,
    raw_len: int | None = None,
    verify: bool = True,
) -> np.ndarray:
    """Decode a chunk object into raw bytes (into ``out`` if given; a chunk stored as one raw
    plane comes back as a read-only view of ``obj`` instead) and verify its hash.

    ``verify=False``: the hash is not checked again, for bytes this process already decoded
    and verified against ``expected_hash`` (a repair's chunks, held in memory for the load);
    the object's structure still is.

    ``raw_len`` (or ``out``'s size) is the raw size the rank index declares: a header that
    says otherwise is refused before anything is decompressed, and no plane decompresses to
    more than its share of it, so decoding never takes more memory than the index declares.

    Raises :class:`CheckpointCorruptError` naming ``name`` when the object is truncated,
    malformed, or its bytes do not hash to ``expected_hash``.
    """
    import numpy as np

    view = memoryview(obj)
    nplanes, declared, table, offset = _read_header(view, name)
    expected = out.nbytes if out is not None else raw_len
    if expected is not None:
        _same_raw_size(declared, expected, name)
    if nplanes == 1 and table[0] == (RAW, declared) and len(view) == offset + declared:
        # One raw plane: verify the object's own bytes and hand out a view of them, no copy.
        raw = np.frombuffer(view[offset:], dtype=np.uint8)
        return _verified(raw, expected_hash, name) if verify else raw
    if out is None:
        out = np.empty(declared, dtype=np.uint8)
    out = out.view(np.uint8).reshape(-1)
    plane_len = declared // nplanes
    grid = out.reshape(-1, nplanes) if nplanes > 1 else None
    for k, (method, stored) in enumerate(table):
        body = view[offset : offset + stored]
        offset += stored
        if grid is None and method == ZSTD:
            _decompress_into(body, out, name)  # no second buffer of the chunk's size
            continue
        plane = _decode_plane(body, method, plane_len, name, k)
        if grid is None:
            out[:] = plane
        else:
            grid[:, k] = plane
    return _verified(out, expected_hash, name) if verify else out


def check_raw_size(obj, raw_len: int, name: str) -> None:
    """:class:`CheckpointCorruptError` unless chunk object ``obj``'s header is well formed and
    declares ``raw_len`` raw bytes (what decoding it with ``raw_len`` checks first)."""
    _same_raw_size(_read_header(memoryview(obj), name)[1], raw_len, name)


def _same_raw_size(declared: int, expected: int, name: str) -> None:
    if declared != expected:
        raise CheckpointCorruptError(
            f"chunk {name}: header says {declared} raw bytes, the index says {expected}"
        )


def _decompress_into(body: memoryview, out: np.ndarray, name: str) -> None:
    """Decompress the zstd frame ``body`` into ``out``, which it must fill exactly."""
    _check_frame_size(body, out.nbytes, name, 0)
    target = memoryview(out).cast("B")
    filled = 0
    try:
        with _decompressor().stream_reader(body, read_across_frames=True) as reader:
            while filled < len(target):
                n = reader.readinto(target[filled:])
                if not n:
                    break
                filled += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CheckpointCorruptError(f"chunk {name}: zstd cannot decode it ({exc})") from exc
    if filled != len(target) or extra:
        raise CheckpointCorruptError(
            f"chunk {name}: decodes to {'more than ' if extra else ''}{filled} bytes, "
            f"expected {len(target)}"
        )


def _check_frame_size(body: memoryview, plane_len: int, name: str, k: int) -> None:
    """With a content size in the frame zstd allocates that size whatever limit it is given: a
    frame must declare exactly the plane's length, or none (then the limit holds)."""
    try:
        claimed = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise CheckpointCorruptError(f"chunk {name}: zstd cannot decode it ({exc})") from exc
    if claimed not in (-1, plane_len):
        raise CheckpointCorruptError(
            f"chunk {name}: plane {k} claims {claimed} bytes, expected {plane_len}"
        )


def _read_header(view: memoryview, name: str) -> tuple[int, int, list, int]:
    """``(nplanes, raw_len, plane table, body offset)`` of a chunk object, checked
    against the object's length before any plane is touched."""
    try:
        magic, version, itemsize, nplanes, raw_len = _HEADER.unpack_from(view, 0)
    except struct.error as exc:
        raise CheckpointCorruptError(f"chunk {name}: truncated header ({len(view)} bytes)") from exc
    if magic != MAGIC:
        raise CheckpointCorruptError(f"chunk {name}: bad magic {bytes(magic)!r}")
    if version != CODEC_VERSION:
        raise CheckpointCorruptError(f"chunk {name}: unknown codec version {version}")
    if nplanes < 1 or itemsize < 1 or (nplanes > 1 and nplanes != itemsize):
        raise CheckpointCorruptError(f"chunk {name}: bad plane layout {nplanes}x{itemsize}")
    if raw_len % nplanes:
        raise CheckpointCorruptError(
            f"chunk {name}: {raw_len} raw bytes do not split into {nplanes} planes"
        )
    offset = _HEADER.size + nplanes * _PLANE.size
    if offset > len(view):
        raise CheckpointCorruptError(f"chunk {name}: truncated plane table")
    table = [_PLANE.unpack_from(view, _HEADER.size + i * _PLANE.size) for i in range(nplanes)]
    body = sum(stored for _, stored in table)
    if offset + body != len(view):
        raise CheckpointCorruptError(
            f"chunk {name}: its planes take {body} bytes, the object holds {len(view) - offset}"
        )
    return nplanes, raw_len, table, offset


def _decode_plane(body: memoryview, method: int, plane_len: int, name: str, k: int) -> np.ndarray:
    """Plane ``k``'s bytes, never more than ``plane_len`` of them."""
    import numpy as np

    if method == RAW:
        plane = np.frombuffer(body, dtype=np.uint8)
    elif method == ZSTD:
        _check_frame_size(body, plane_len, name, k)
        try:
            decoded = _decompressor().decompress(body, max_output_size=plane_len)
        except zstandard.ZstdError as exc:
            raise CheckpointCorruptError(f"chunk {name}: zstd cannot decode it ({exc})") from exc
        plane = np.frombuffer(decoded, dtype=np.uint8)
    else:
        raise CheckpointCorruptError(f"chunk {name}: unknown plane method {method}")
    if plane.size != plane_len:
        raise CheckpointCorruptError(
            f"chunk {name}: plane {k} has {plane.size} bytes, expected {plane_len}"
        )
    return plane


def _verified(raw: np.ndarray, expected_hash: str, name: str) -> np.ndarray:
    actual = hash_bytes(raw)
    if actual != expected_hash:
        raise CheckpointCorruptError(
            f"chunk {name}: xxh3 mismatch (the bytes read hash to {actual}, expected {expected_hash})"
        )
    return raw
