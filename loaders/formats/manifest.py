"""The shard list of formats without an index of their own (token files, WebDataset tars): the
list the user declares, a manifest listing one key a line, or every replica's listing; and the
manifest as the writers write it.

A manifest is UTF-8 text, one shard key a line (blank lines and ``#`` comments skipped). A
*hashed* manifest (version 1, what :class:`~loaders.TokenWriter` writes) starts with the line
``#loaders-manifest 1 xxh3_64 block_bytes=B`` and gives each shard as four tab-separated fields:
key, size in bytes, the xxh3_64 of the whole file, and the xxh3_64 of each ``B``-byte block of
it in turn (the last one shorter), 16 hex digits each, concatenated. See docs/FORMAT.md.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from loaders.errors import ShardCorruptError, ShardNotFoundError, UnknownFormatError
from loaders.formats.layout import check_shard_key

MANIFEST_MAGIC = "#loaders-manifest"
MANIFEST_VERSION = 1
HASH = "xxh3_64"
MAX_MANIFEST_BYTES = 1 << 30
"""A manifest larger than this is refused before it is read (a hashed manifest takes 16 bytes
per hash block: 1 GiB lists 16 TiB of 256 KiB blocks)."""
_MAX_BLOCK_BYTES = 1 << 30
MAX_MANIFEST_LINES = 1 << 24
"""Lines (not blank) a manifest may hold: each becomes a few Python objects (a manifest of
64 MiB of newlines took 5.5 GB as a list of empty lines)."""
_HEX = re.compile(r"[0-9a-f]*")
_DIGITS = re.compile(r"[0-9]{1,19}")


@dataclass(frozen=True)
class FileHashes:
    """What a hashed manifest says of one file: its size, the xxh3_64 of the whole file and of
    each ``block_bytes`` block (the last one shorter), as integers."""

    size: int
    digest: int
    block_bytes: int
    blocks: np.ndarray
    """``uint64``, one per block."""

    def check(self, data: Any, start: int, *, what: str) -> None:
        """:class:`ShardCorruptError` (naming ``what``, the file and replica) unless ``data``,
        the bytes ``[start, start + len(data))`` of the file, match their blocks' hashes;
        ``start`` on a block boundary, the end on one or at the end of the file."""
        view = memoryview(data).cast("B")
        if start + len(view) > self.size:
            raise ShardCorruptError(
                f"{what}: bytes [{start}:{start + len(view)}] run past the {self.size} bytes the "
                "manifest gives the file"
            )
        b = self.block_bytes
        first = start // b
        for i in range(first, first + -(-len(view) // b)):
            piece = view[(i - first) * b : (i - first + 1) * b]
            if xxhash.xxh3_64_intdigest(piece) != int(self.blocks[i]):
                lo = i * b
                raise ShardCorruptError(
                    f"{what}: bytes [{lo}:{lo + len(piece)}] do not match their xxh3_64 in "
                    f"the manifest (hash block {i})"
                )


@dataclass(frozen=True)
class Manifest:
    """A manifest as read: the shard keys in order and, for a hashed one, their hashes."""

    keys: list[str]
    hashes: dict[str, FileHashes] | None


def shard_sizes(
    replicas: Any,
    declared: list[str] | None,
    manifest: str | None,
    suffix: str | tuple[str, ...],
    *,
    sizes: dict[str, int] | None = None,
) -> tuple[list[str], list[int]]:
    """The dataset's shards, in order, and their sizes: the ``declared`` list, else the
    ``manifest``'s, else every replica's listing of keys ending in ``suffix`` (one, or any of
    several: ``ReplicaSet.find_shards``). ``sizes`` (a hashed manifest's) are the sizes the
    shards must have: a replica holding one at another size is not read for it."""
    if declared is None and manifest is not None:
        declared = read_manifest(replicas, manifest).keys
    found = replicas.find_shards(declared, suffix=suffix, sizes=sizes)
    if not found:
        names = " / ".join((suffix,) if isinstance(suffix, str) else suffix)
        raise ShardNotFoundError(f"no {names} shards found in {', '.join(replicas.uris)}")
    keys = list(found) if declared is None else list(declared)
    return keys, [found[k] for k in keys]


def shards_and_hashes(
    replicas: Any, declared: list[str] | None, manifest: str | None, suffix: str | tuple[str, ...]
) -> tuple[list[str], list[int], dict[str, FileHashes] | None]:
    """``shard_sizes`` of a dataset whose shards are ``declared``, else listed by ``manifest``,
    else found by listing, and their hashes where a hashed manifest gives them (None
    otherwise): its sizes are the sizes the shards must have."""
    hashes: dict[str, FileHashes] | None = None
    if declared is not None:
        declared = [check_shard_key(k, "the dataset's declared list") for k in declared]
    elif manifest is not None:
        read = read_manifest(replicas, manifest)
        declared, hashes = read.keys, read.hashes
    sizes = None if hashes is None else {k: h.size for k, h in hashes.items()}
    keys, nbytes = shard_sizes(replicas, declared, None, suffix, sizes=sizes)
    return keys, nbytes, hashes


def read_manifest(replicas: Any, key: str) -> Manifest:
    """The shards a manifest lists, one per line (blank lines and ``#`` comments skipped), with
    their hashes if it is a hashed one; the manifest must be the same on every replica
    (:meth:`ReplicaSet.read_same`)."""
    raw = replicas.read_same(key, MAX_MANIFEST_BYTES)
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ShardCorruptError(f"manifest {key} is not UTF-8 text: {exc}") from exc
    lines = _lines(text, key)
    first = lines[0][0] if lines else ""
    block_bytes = _header(first, key) if first.startswith(MANIFEST_MAGIC) else 0
    rows = [row for bare, row in lines if not bare.startswith("#")]
    hashes: dict[str, FileHashes] | None = None
    if block_bytes:
        hashes = {}
        keys = []
        for n, row in enumerate(rows):
            shard, entry = _row(row, key, n, block_bytes)
            keys.append(shard)
            hashes[shard] = entry
    else:
        keys = [check_shard_key(k.strip(), f"manifest {key}") for k in rows]
    if not keys:
        raise ShardCorruptError(f"manifest {key} lists no shards")
    repeated = sorted(k for k, n in Counter(keys).items() if n > 1)
    if repeated:
        raise ShardCorruptError(
            f"manifest {key} lists shards more than once: {', '.join(repeated)}"
        )
    return Manifest(keys=keys, hashes=hashes)


_LINE = re.compile("[^\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]+")  # str.splitlines()'s


def _lines(text: str, key: str) -> list[tuple[str, str]]:
    """The lines of ``text`` that are not blank, each (stripped, as written less its spaces at
    either end: a hashed row's tab may end an empty last field, a 0-byte file has no block
    hashes); at most ``MAX_MANIFEST_LINES``, blank ones never held."""
    lines = []
    for match in _LINE.finditer(text):
        line = match.group()
        if line.isspace():
            continue
        if len(lines) == MAX_MANIFEST_LINES:
            raise ShardCorruptError(f"manifest {key} holds more than {MAX_MANIFEST_LINES} lines")
        lines.append((line.strip(), line.strip(" \r")))
    return lines


def _header(line: str, key: str) -> int:
    """The block size a hashed manifest's first line declares."""
    fields = line.split()
    if fields[0] != MANIFEST_MAGIC or len(fields) < 2:
        raise ShardCorruptError(f"manifest {key}: bad first line {line[:80]!r}")
    if fields[1] != str(MANIFEST_VERSION):
        raise UnknownFormatError(
            f"manifest {key} is version {fields[1][:20]!r}; this reader knows version "
            f"{MANIFEST_VERSION}"
        )
    if len(fields) != 4 or fields[2] != HASH or not fields[3].startswith("block_bytes="):
        raise ShardCorruptError(
            f"manifest {key}: first line {line[:80]!r} is not "
            f"'{MANIFEST_MAGIC} {MANIFEST_VERSION} {HASH} block_bytes=N'"
        )
    value = fields[3].removeprefix("block_bytes=")
    if not _DIGITS.fullmatch(value) or not 1 <= int(value) <= _MAX_BLOCK_BYTES:
        raise ShardCorruptError(
            f"manifest {key}: block_bytes must be 1..{_MAX_BLOCK_BYTES}, got {value[:20]!r}"
        )
    return int(value)


def _row(row: str, key: str, n: int, block_bytes: int) -> tuple[str, FileHashes]:
    """One shard of a hashed manifest: key, size, file digest, block digests (tab-separated),
    each checked before it is believed."""
    fields = row.split("\t")
    where = f"manifest {key}, shard line {n + 1}"
    if len(fields) != 4:
        raise ShardCorruptError(
            f"{where}: {len(fields)} tab-separated fields, expected 4 (key, size, {HASH}, "
            "block hashes)"
        )
    shard, size, digest, blocks = fields
    check_shard_key(shard, f"manifest {key}")
    if not _DIGITS.fullmatch(size):
        raise ShardCorruptError(f"{where}: size {size[:24]!r} is not a byte count")
    nbytes = int(size)
    if len(digest) != 16 or not _HEX.fullmatch(digest):
        raise ShardCorruptError(f"{where}: {HASH} {digest[:24]!r} is not 16 hex digits")
    count = -(-nbytes // block_bytes)
    if len(blocks) != 16 * count or not _HEX.fullmatch(blocks):
        raise ShardCorruptError(
            f"{where}: {shard} of {nbytes} bytes has {count} blocks of {block_bytes}, so "
            f"{16 * count} hex digits of block hashes, got {len(blocks)}"
            + (" (not all hex)" if len(blocks) == 16 * count else "")
        )
    table = np.frombuffer(bytes.fromhex(blocks), dtype=">u8").astype(np.uint64)
    return shard, FileHashes(
        size=nbytes, digest=int(digest, 16), block_bytes=block_bytes, blocks=table
    )


def manifest_bytes(keys: Sequence[str], hashes: dict[str, FileHashes] | None = None) -> bytes:
    """A manifest as ``TokenFiles(manifest=...)`` and ``WebDataset(manifest=...)`` read it:
    hashed (version 1) when ``hashes`` gives every key's, one key a line otherwise."""
    if hashes is None:
        return "".join(f"{k}\n" for k in keys).encode("utf-8")
    (block_bytes,) = {h.block_bytes for h in hashes.values()} or {1}
    lines = [f"{MANIFEST_MAGIC} {MANIFEST_VERSION} {HASH} block_bytes={block_bytes}\n"]
    for k in keys:
        h = hashes[k]
        table = np.asarray(h.blocks, dtype=">u8").tobytes().hex()
        lines.append(f"{k}\t{h.size}\t{h.digest:016x}\t{table}\n")
    return "".join(lines).encode("utf-8")


class FileHasher:
    """The hashes of one file as it is written in pieces: the whole file's xxh3_64 and each
    ``block_bytes`` block's."""

    def __init__(self, block_bytes: int) -> None:
        if not 1 <= block_bytes <= _MAX_BLOCK_BYTES:
            raise ValueError(f"hash block_bytes must be 1..{_MAX_BLOCK_BYTES}, got {block_bytes}")
        self.block_bytes = block_bytes
        self._file = xxhash.xxh3_64()
        self._block = xxhash.xxh3_64()
        self._in_block = 0
        self._blocks: list[int] = []
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._file.update(view)
        self.size += len(view)
        while len(view):
            take = min(len(view), self.block_bytes - self._in_block)
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == self.block_bytes:
                self._blocks.append(self._block.intdigest())
                self._block, self._in_block = xxhash.xxh3_64(), 0

    def finish(self) -> FileHashes:
        if self._in_block:
            self._blocks.append(self._block.intdigest())
        return FileHashes(
            size=self.size,
            digest=self._file.intdigest(),
            block_bytes=self.block_bytes,
            blocks=np.asarray(self._blocks, dtype=np.uint64),
        )
