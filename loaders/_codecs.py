"""Shard decompression and shard hashes, as MosaicML Streaming names them."""

from __future__ import annotations

import bz2
import gzip
import hashlib
from collections.abc import Callable

import xxhash
import zstandard

from loaders.errors import UnknownFormatError


def decompress(algo: str, data: bytes, *, what: str) -> bytes:
    """Undo an MDS shard compression such as ``zstd`` or ``zstd:7`` (the level is ignored)."""
    name = algo.split(":", 1)[0]
    if name == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if name == "gz":
        return gzip.decompress(data)
    if name == "bz2":
        return bz2.decompress(data)
    raise UnknownFormatError(
        f"{what}: shard compression {algo!r} is not supported (supported: zstd, gz, bz2)"
    )


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
