"""Shard decompression and shard hashes, as MosaicML Streaming names them."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
from collections.abc import Callable

import xxhash
import zstandard

from loaders.errors import ShardCorruptError, UnknownFormatError


def decompress(algo: str, data: bytes, *, what: str, limit: int) -> bytes:
    """Undo an MDS shard compression such as ``zstd`` or ``zstd:7`` (the level is ignored),
    decoding at most ``limit + 1`` bytes: :class:`ShardCorruptError` if there are more (a
    shard that the index says is ``limit`` bytes raw cannot grow the reader past that)."""
    name = algo.split(":", 1)[0]
    source = io.BytesIO(data)
    if name == "zstd":
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)
    elif name == "gz":
        reader = gzip.GzipFile(fileobj=source)
    elif name == "bz2":
        reader = bz2.BZ2File(source)
    else:
        raise UnknownFormatError(
            f"{what}: shard compression {algo!r} is not supported (supported: zstd, gz, bz2)"
        )
    with reader:
        out = _read_at_most(reader, limit + 1)
    if len(out) > limit:
        raise ShardCorruptError(
            f"{what}: decompresses to more than the {limit} raw bytes its index declares"
        )
    return bytes(out)


def _read_at_most(reader, nbytes: int) -> bytearray:
    """Up to ``nbytes`` from ``reader``, fewer only at its end."""
    out = bytearray()
    while len(out) < nbytes:
        piece = reader.read(min(nbytes - len(out), _READ_PIECE))
        if not piece:
            break
        out += piece
    return out


_READ_PIECE = 4 << 20

_XXH: dict[str, Callable[[bytes], str]] = {
    "xxh32": lambda b: xxhash.xxh32(b).hexdigest(),
    "xxh64": lambda b: xxhash.xxh64(b).hexdigest(),
    "xxh128": lambda b: xxhash.xxh128(b).hexdigest(),
    "xxh3_64": lambda b: xxhash.xxh3_64(b).hexdigest(),
    "xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest(),
}


def hasher(algo: str) -> Callable[[bytes], str] | None:
    """Hex digest function of a hash named in an MDS index, or None if unknown."""
    if algo in _XXH:
        return _XXH[algo]
    if algo in hashlib.algorithms_available:
        return lambda b: hashlib.new(algo, b).hexdigest()
    return None
