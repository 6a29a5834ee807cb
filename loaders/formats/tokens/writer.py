"""Token files as ``TokenFiles`` reads them: flat uint16/uint32 arrays of token ids, optionally
behind llm.c's 1024-byte header (256 int32: magic, version, token count), or with Megatron's
``.idx`` index beside each ``.bin``."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptstore.errors import ObjectNotFoundError
from loaders.errors import ReplicaMismatchError, ShardCorruptError, ShardNotFoundError
from loaders.formats._writing import DatasetSink, ShardWriter, Target
from loaders.formats.layout import check_shard_key
from loaders.formats.manifest import (
    MAX_MANIFEST_BYTES,
    FileHasher,
    FileHashes,
    manifest_bytes,
)
from loaders.formats.tokens.reader import LLMC_HEADER_BYTES, llmc_header

# Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py): "MMIDIDX\0\0",
# version 1 (<Q), a dtype code (<B), then sequence and document counts (<Q each), the sequence
# lengths (int32), their byte offsets in the .bin (int64) and the document boundaries (int64,
# sequence indices starting at 0).
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_DTYPE = {"uint16": 8, "uint32": 4}
"""Megatron's dtype codes: uint16, and int32 for uint32 ids (Megatron's own choice for vocabularies
over 65,500; the bytes are the same for ids below 2**31, which the writer checks)."""


def megatron_index(dtype: str, lengths: Sequence[int]) -> bytes:
    """The ``.idx`` of a ``.bin`` holding ``lengths`` tokens of ``dtype`` in turn, each run one
    sequence and one document (as Megatron's ``preprocess_data.py`` writes whole documents)."""
    itemsize = np.dtype(dtype).itemsize
    n = np.asarray(lengths, dtype=np.int64)
    pointers = np.concatenate(([0], np.cumsum(n[:-1]))) * itemsize if len(n) else n
    return b"".join(
        [
            _MEGATRON_MAGIC,
            struct.pack("<QBQQ", 1, _MEGATRON_DTYPE[dtype], len(n), len(n) + 1),
            n.astype("<i4").tobytes(),
            np.asarray(pointers, dtype="<i8").tobytes(),
            np.arange(len(n) + 1, dtype="<i8").tobytes(),
        ]
    )


class TokenWriter(ShardWriter):
    """Writes token ids into files of at most ``file_tokens`` tokens (``{prefix}.00000.bin``,
    ...) and, last, ``manifest`` listing them; read them back with
    ``TokenFiles(dtype=..., manifest=..., header=writer.header)``.

    Make ``file_tokens`` a multiple of the reader's ``sample_tokens``: the reader drops each
    file's trailing partial sample. ``header="llmc"`` writes llm.c's header, None none (as
    nanoGPT's ``train.bin`` and Megatron's ``.bin``). ``megatron_index`` (no header; uint32
    ids below 2**31, which Megatron reads as int32) also writes Megatron's ``.idx`` beside each ``.bin`` (``{prefix}.00000.idx``, before its
    ``.bin``), each ``write`` one document, so that Megatron's ``IndexedDataset`` reads the
    files too (a document that spans two files is two documents there).

    The manifest records each file's size, xxh3_64 and the xxh3_64 of each ``hash_block_bytes``
    block of it, which the reader checks on every read (docs/FORMAT.md, "Token datasets"):
    smaller blocks widen each ranged read less (by a block on average) and make the manifest
    larger (16 bytes a block)."""

    HEADER_BYTES = {None: 0, "llmc": LLMC_HEADER_BYTES}
    """Bytes each file's header takes, by ``header`` (the reader's ``header_bytes``)."""

    def __init__(
        self,
        uri: Target | Sequence[Target],
        *,
        dtype: str = "uint16",
        header: str | None = None,
        file_tokens: int = 2**26,
        prefix: str = "tokens",
        manifest: str = "manifest.txt",
        storage_options: dict[str, Any] | None = None,
        megatron_index: bool = False,
        hash_block_bytes: int = 256 * 2**10,
    ) -> None:
        if megatron_index and header:
            raise ValueError(
                f"TokenWriter megatron_index takes tokens without a header (Megatron's .bin), "
                f"got header={header!r}"
            )
        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"TokenWriter dtype must be uint16 or uint32, got {dtype!r}")
        if header not in self.HEADER_BYTES:
            raise ValueError(f"TokenWriter header must be None or 'llmc', got {header!r}")
        if file_tokens < 1:
            raise ValueError(f"TokenWriter file_tokens must be >= 1, got {file_tokens}")
        FileHasher(hash_block_bytes)  # checks it
        self.hash_block_bytes = hash_block_bytes
        self._hashes: dict[str, FileHashes] = {}
        self.dtype, self.header, self.file_tokens, self.prefix = dtype, header, file_tokens, prefix
        self.header_bytes = self.HEADER_BYTES[header]
        self.sink = DatasetSink(uri, index=manifest, storage_options=storage_options)
        self.megatron_index = megatron_index
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self.num_tokens = 0

    def write(self, tokens: Any) -> None:
        """Append token ids (any 1-D integer array-like); files are written as they fill."""
        self.sink.check_open()
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"TokenWriter.write takes a 1-D array of integer token ids, got shape "
                f"{arr.shape} of {arr.dtype}"
            )
        # Megatron reads a uint32 .bin as int32 (a uint16 one as uint16).
        limit = np.iinfo("int32" if self.dtype == "uint32" and self.megatron_index else self.dtype)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > limit.max):
            raise ValueError(
                f"token ids must be within [0, {limit.max}] for {self.dtype}"
                f"{' with a Megatron index' if self.megatron_index else ''}, got "
                f"[{int(arr.min())}, {int(arr.max())}]"
            )
        arr = arr.astype(f"<{np.dtype(self.dtype).str[1:]}")  # a copy: the caller may reuse arr
        while arr.size:
            take = min(arr.size, self.file_tokens - self._pending_tokens)
            self._pending.append(arr[:take])
            self._pending_tokens += take
            arr = arr[take:]
            if self._pending_tokens == self.file_tokens:
                self._flush()

    def _flush(self) -> None:
        if not self._pending_tokens:
            return
        stem = f"{self.prefix}.{len(self.shards):05d}"
        parts: list = [np.ascontiguousarray(p).data for p in self._pending]
        if self.header:
            parts.insert(0, llmc_header(self.dtype, self._pending_tokens))
        if self.megatron_index:
            lengths = [len(p) for p in self._pending if len(p)]
            self.sink.put(f"{stem}.idx", megatron_index(self.dtype, lengths))
        hasher = FileHasher(self.hash_block_bytes)
        for part in parts:
            hasher.update(part)
        self.sink.put(f"{stem}.bin", parts)
        self._hashes[f"{stem}.bin"] = hasher.finish()
        self.num_tokens += self._pending_tokens
        self._pending, self._pending_tokens = [], 0

    @property
    def shards(self) -> list[str]:
        """Keys of the ``.bin`` files written so far, in order."""
        return [k for k in super().shards if k.endswith(".bin")]

    def _index_bytes(self) -> bytes:
        return manifest_bytes(self.shards, self._hashes)


_HASH_READ_BYTES = 16 << 20  # a converter's ranged read: memory stays bounded by it


def hash_token_files(
    uri: Target | Sequence[Target],
    *,
    files: Sequence[str] | None = None,
    manifest: str | None = None,
    out: str = "manifest.hashed.txt",
    hash_block_bytes: int = 256 * 2**10,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Give token files written without hashes (an older ``TokenWriter``'s, nanoGPT's
    ``train.bin``) a hashed manifest, ``out``, without rewriting them; read them with
    ``TokenFiles(manifest=out, ...)``. The files are ``files``, else those ``manifest`` lists,
    else every ``*.bin`` (sorted). Each is read and hashed on every replica given (ranged reads of
    16 MiB): a file missing from one, or held there with other bytes, is an error naming the file
    and the replicas (which copy is right is for a person to say; leave the bad one out of
    ``uri``). ``out`` is written once to every replica, last. Returns the keys, in order."""
    sink = DatasetSink(uri, index=out, storage_options=storage_options)
    stores = sink.stores
    if files is None and manifest is not None:
        if stores[0].size(manifest) > MAX_MANIFEST_BYTES:
            raise ShardCorruptError(f"manifest {manifest} is over {MAX_MANIFEST_BYTES} bytes")
        text = stores[0].get(manifest).decode("utf-8")
        files = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        if any("\t" in name for name in files):  # a hashed manifest's lines: name, size, hashes
            raise ValueError(
                f"manifest {manifest} already holds hashes (tab-separated sizes and digests): "
                f"read it with TokenFiles(manifest={manifest!r}), nothing to hash"
            )
    if files is None:
        files = sorted(k for k in stores[0].list("") if k.endswith(".bin"))
    keys = [check_shard_key(k, "hash_token_files") for k in files]
    if not keys:
        raise ValueError(f"no token files to hash in {stores[0].uri}")
    hashes: dict[str, FileHashes] = {}
    for key in keys:
        found = [(store.uri, _hash_file(store, key, hash_block_bytes)) for store in stores]
        (_, first), *others = found
        differ = [name for name, h in others if (h.size, h.digest) != (first.size, first.digest)]
        if differ:
            held = ", ".join(
                f"{name}: {h.size} bytes, xxh3_64 {h.digest:016x}" for name, h in found
            )
            raise ReplicaMismatchError(f"token file {key} differs between replicas ({held})")
        hashes[key] = first
    sink.finish(manifest_bytes(keys, hashes))
    return keys


def _hash_file(store: Any, key: str, block_bytes: int) -> FileHashes:
    try:
        size = store.size(key)
    except ObjectNotFoundError as exc:
        raise ShardNotFoundError(f"token file {key} is missing from replica {store.uri}") from exc
    hasher = FileHasher(block_bytes)
    for start in range(0, size, _HASH_READ_BYTES):
        end = min(size, start + _HASH_READ_BYTES)
        data = store.get(key, start, end)
        if len(data) != end - start:
            raise ShardCorruptError(
                f"token file {key} on replica {store.uri}: read [{start}:{end}] returned "
                f"{len(data)} bytes"
            )
        hasher.update(data)
    return hasher.finish()
