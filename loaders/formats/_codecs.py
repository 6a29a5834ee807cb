"""Shard decompression and shard hashes, as MosaicML Streaming names them."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import zlib
from collections.abc import Callable

import xxhash
import zstandard

from loaders.errors import ShardCorruptError, UnknownFormatError

_READERS = {
    "zstd": lambda f: zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True),
    "gz": lambda f: gzip.GzipFile(fileobj=f),
    "bz2": bz2.BZ2File,
    "xz": lambda f: lzma.LZMAFile(f, format=lzma.FORMAT_XZ),
}


def decompress(
    algo: str, data: bytes, *, what: str, limit: int, bound: str = "raw bytes its index declares"
) -> bytes:
    """Undo a shard compression such as ``zstd`` or ``zstd:7`` (the level is ignored), decoding
    at most ``limit + 1`` bytes: :class:`ShardCorruptError` if there are more (a shard that may
    be ``limit`` bytes raw, ``bound`` says why, cannot grow the reader past that), or if the
    stream is damaged; :class:`UnknownFormatError` for a compression not read here."""
    name = algo.split(":", 1)[0]
    if name not in _READERS:
        raise UnknownFormatError(
            f"{what}: shard compression {algo!r} is not supported (supported: "
            f"{', '.join(_READERS)})"
        )
    try:
        with _READERS[name](io.BytesIO(data)) as reader:
            out = _read_at_most(reader, limit + 1)
    except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, zstandard.ZstdError) as exc:
        raise ShardCorruptError(f"{what}: cannot decompress {algo}: {exc}") from exc
    if len(out) > limit:
        raise ShardCorruptError(f"{what}: decompresses to more than the {limit} {bound}")
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

# The most raw bytes one compressed byte can stand for, where the format bounds it: a zstd block
# of up to 128 KiB costs at least 4 bytes (an RLE block), a deflate length code of 258 bytes at
# least 2 bits. bz2 (run-length coded before it compresses) and xz reach millions to one.
_MAX_RATIO = {"zstd": 32768, "gz": 1032}


def max_raw_bytes(algo: str, nbytes: int) -> int | None:
    """Most bytes ``nbytes`` compressed with ``algo`` can decompress to, None if unbounded."""
    ratio = _MAX_RATIO.get(algo.split(":", 1)[0])
    return None if ratio is None else nbytes * ratio


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
    # shake_128/shake_256 have no fixed length (digest_size 0): like any unknown hash
    if algo in hashlib.algorithms_available and hashlib.new(algo).digest_size:
        return lambda b: hashlib.new(algo, b).hexdigest()
    return None
