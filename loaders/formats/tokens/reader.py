"""Flat token files (nanoGPT ``train.bin``, Megatron-style pipelines, llm.c): a binary array of
uint16 or uint32 token ids, optionally behind llm.c's 1024-byte header (256 int32: magic,
version, token count), cut into samples of ``sample_tokens`` tokens; a trailing partial sample
is dropped. Each unit is one ranged read of whole samples, about ``read_bytes`` long.

With a hashed manifest (what :class:`~loaders.TokenWriter` writes) every read is checked on
arrival: it is widened to whole hash blocks (``block_bytes``, 256 KiB as written by default), each
block's xxh3_64 compared with the manifest's, and a mismatch is that replica's
:class:`ShardCorruptError`, so the read fails over to another replica like any error. The check
is per read, not per file: a ranged read stays one request of about ``read_bytes`` (plus a block
on average), hedged and failed over on its own, and a flipped byte costs one read of one range
again, not of the whole file."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loaders.errors import ShardCorruptError, ShardTooLargeError, UnknownFormatError
from loaders.formats.layout import Unit, first_time
from loaders.formats.manifest import FileHashes, shards_and_hashes

logger = logging.getLogger(__name__)

# The most reads (units) a dataset of token files is cut into: 32 TiB at the default read_bytes.
MAX_READS = 1 << 23
BIG_BLOCK_BYTES = 64 << 20  # a manifest hash block read whole above this is worth a warning

LLMC_HEADER_BYTES = 1024
# llm.c's dev/data/data_common.py: GPT-2 files hold uint16 tokens, Llama 3 files uint32.
_LLMC_MAGIC = {"uint16": (20240520, 1), "uint32": (20240801, 7)}


def llmc_header(dtype: str, num_tokens: int) -> bytes:
    """llm.c's header of a file of ``num_tokens`` tokens of ``dtype``."""
    if num_tokens >= 2**31:
        raise ValueError(f"an llm.c token file holds < 2**31 tokens, got {num_tokens}")
    magic, version = _LLMC_MAGIC[dtype]
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, num_tokens
    return header.tobytes()


def check_llmc_header(data: bytes, dtype: str, key: str, size: int) -> None:
    """:class:`ShardCorruptError` unless ``data`` is the llm.c header of a ``size``-byte file of
    ``dtype`` tokens."""
    magic, version, tokens = (int(v) for v in np.frombuffer(data[:12], "<i4"))
    want = _LLMC_MAGIC[dtype]
    if (magic, version) != want:
        known = {m: d for d, (m, _) in _LLMC_MAGIC.items()}
        what = f"{known[magic]} tokens" if magic in known else "not an llm.c token file"
        raise ShardCorruptError(
            f"token file {key}: llm.c header magic {magic} version {version} ({what}), "
            f"expected {want[0]} version {want[1]} for {dtype}"
        )
    body = size - LLMC_HEADER_BYTES
    itemsize = np.dtype(dtype).itemsize
    if tokens * itemsize != body:
        raise ShardCorruptError(
            f"token file {key}: its llm.c header says {tokens} tokens, the file holds "
            f"{body // itemsize} ({size} bytes)"
        )


def _head(
    replicas: Any, key: str, nbytes: int, check: Callable[[bytes], None] | None = None
) -> bytes:
    """The first ``nbytes`` of ``key``: a metadata request (not a data read the loader's read
    figures, hedge delay and replica health count). ``check`` raises
    :class:`ShardCorruptError` for a bad header, and the next replica is asked, as for a cut
    answer."""

    def head(store: Any) -> bytes:
        data = store.get(key, 0, nbytes)
        if len(data) != nbytes:  # a cut answer: corrupt, the next replica is asked
            raise ShardCorruptError(
                f"token file {key}: {len(data)} bytes answered for its {nbytes}-byte header"
            )
        if check is not None:
            check(data)
        return data

    return replicas.call(f"header of {key}", head, key=key)


def _refuse_unexpected_llmc_header(head: bytes, key: str, size: int) -> None:
    """:class:`UnknownFormatError` if a file read as headerless starts with an llm.c header
    whose token count fits the file: its header would be read as tokens."""
    magic, version, tokens = (int(v) for v in np.frombuffer(head, "<i4"))
    for dtype, known in _LLMC_MAGIC.items():
        fits = tokens * np.dtype(dtype).itemsize == size - LLMC_HEADER_BYTES
        if (magic, version) == known and fits:
            raise UnknownFormatError(
                f"token file {key} starts with an llm.c header ({tokens} {dtype} tokens): "
                f"read it with TokenFiles(dtype={dtype!r}, header='llmc')"
            )


def _refuse_llmc_header_of_another_dtype(head: bytes, key: str, dtype: str) -> None:
    """:class:`UnknownFormatError` if a file read past a 1024-byte header starts with llm.c's
    header of another dtype's tokens: every sample would be its tokens glued in pairs (or cut
    in halves), silently."""
    magic, version, tokens = (int(v) for v in np.frombuffer(head, "<i4"))
    theirs = next((d for d, known in _LLMC_MAGIC.items() if known == (magic, version)), None)
    if theirs is not None and theirs != dtype:
        raise UnknownFormatError(
            f"token file {key} starts with an llm.c header of {tokens} {theirs} tokens, read "
            f"as {dtype}: read it with TokenFiles(dtype={theirs!r}, header='llmc')"
        )


def _warn_unhashed(uris: list[str], manifest: str | None) -> None:
    """One WARNING per process for each token dataset whose manifest has no hashes (written
    before they were recorded), however often it is opened; files declared or listed without
    a manifest (raw ``train.bin`` files, which have none to give) are said at INFO."""
    if not first_time(("unhashed tokens", tuple(uris), manifest)):
        return
    if manifest is None:
        logger.info(
            "token files of %s are read unverified: no manifest with hashes was given",
            ", ".join(uris),
        )
        return
    logger.warning(
        "token files of %s carry no hashes: manifest %s lists none (written before token files "
        "were hashed); their bytes are not verified on read (a manifest TokenWriter writes has "
        "them)",
        ", ".join(uris),
        manifest,
    )


@dataclass(kw_only=True)
class TokenFiles:
    """Token files (keys relative to each replica's root)."""

    files: list[str] | None = None
    """File keys in dataset order; None: ``manifest``'s, or else every ``*.bin`` below the root
    of any replica, sorted (a file missing from every replica goes unnoticed that way: declare
    the files to have that checked)."""
    manifest: str | None = None
    """Key of a text file on the replicas listing the file keys in dataset order, one a line
    (``#`` comments and blank lines skipped); it must be the same on every replica."""
    dtype: str = "uint16"
    """Token id type: ``uint16`` or ``uint32``."""
    sample_tokens: int = 2048
    """Tokens per sample (use block size + 1 for shifted inputs and targets)."""
    header: str | None = None
    """``"llmc"``: each file starts with llm.c's 1024-byte header, checked at open (its magic
    and version must match ``dtype``, its token count the file's size); None: no header, or an
    unchecked one of ``header_bytes``."""
    header_bytes: int = 0
    """Bytes to skip at the start of each file (1024 with ``header="llmc"``)."""
    read_bytes: int = 4 * 2**20
    """Bytes per read, rounded down to whole samples (at least one)."""
    name: str = field(default="tokens", init=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("uint16", "uint32"):
            raise ValueError(f"TokenFiles.dtype must be uint16 or uint32, got {self.dtype!r}")
        if self.sample_tokens < 1:
            raise ValueError(f"TokenFiles.sample_tokens must be >= 1, got {self.sample_tokens}")
        if self.header not in (None, "llmc"):
            raise ValueError(f"TokenFiles.header must be None or 'llmc', got {self.header!r}")
        if self.header == "llmc":
            if self.header_bytes not in (0, LLMC_HEADER_BYTES):
                raise ValueError(
                    f"TokenFiles.header_bytes is {LLMC_HEADER_BYTES} with header='llmc', "
                    f"got {self.header_bytes}"
                )
            self.header_bytes = LLMC_HEADER_BYTES
        if self.header_bytes < 0:
            raise ValueError(f"TokenFiles.header_bytes must be >= 0, got {self.header_bytes}")
        if self.read_bytes < 1:
            raise ValueError(f"TokenFiles.read_bytes must be >= 1, got {self.read_bytes}")
        if self.files is not None and self.manifest is not None:
            raise ValueError("TokenFiles takes files or a manifest, not both")

    def open(self, replicas: Any) -> TokenLayout:
        files, sizes, hashes = shards_and_hashes(replicas, self.files, self.manifest, ".bin")
        if hashes is None:
            _warn_unhashed(replicas.uris, self.manifest)
        itemsize = np.dtype(self.dtype).itemsize
        sample_bytes = self.sample_tokens * itemsize
        per_unit = max(1, self.read_bytes // sample_bytes)
        block = max((h.block_bytes for h in hashes.values()), default=0) if hashes else 0
        if block > self.read_bytes:
            # Each read takes the whole hash blocks its samples lie in: reads of read_bytes
            # would each read a block (block / read_bytes times the data). A read spans a block.
            per_unit = max(per_unit, block // sample_bytes)
            # Said at INFO: nothing to fix (the example's own corpus reads so); a block past
            # BIG_BLOCK_BYTES held per read in flight is memory a user should hear of.
            logger.log(
                logging.WARNING if block > BIG_BLOCK_BYTES else logging.INFO,
                "token manifest's hash blocks of %d bytes are larger than TokenFiles.read_bytes"
                "=%d: each read takes about a block (%d bytes, in memory while it is checked)",
                block,
                self.read_bytes,
                block,
            )
        reads = sum(
            -(-max(0, size - self.header_bytes) // sample_bytes // per_unit) for size in sizes
        )
        if reads > MAX_READS:  # each a Unit held for the dataset's life, about 256 bytes
            raise ShardTooLargeError(
                f"token files of {sum(sizes)} bytes in all make {reads} reads of "
                f"TokenFiles.read_bytes={self.read_bytes}, more than {MAX_READS}: raise "
                "read_bytes (a file listed larger than it is, sparse, is counted at its size)"
            )
        units, first = [], 0
        for key, size in zip(files, sizes):
            body = size - self.header_bytes
            if body < 0 or body % itemsize:
                raise ShardCorruptError(
                    f"token file {key}: {size} bytes is not a {self.header_bytes}-byte header plus "
                    f"whole {self.dtype} tokens (partial token at offset {size - body % itemsize})"
                    if body >= 0
                    else f"token file {key}: {size} bytes, shorter than its header"
                )
            if self.header == "llmc":
                check = functools.partial(check_llmc_header, dtype=self.dtype, key=key, size=size)
                _head(replicas, key, LLMC_HEADER_BYTES, check)
            elif not self.header_bytes and not units and size >= 12:  # the first file's head
                _refuse_unexpected_llmc_header(_head(replicas, key, 12), key, size)
            elif self.header_bytes == LLMC_HEADER_BYTES and not units and size >= 12:
                _refuse_llmc_header_of_another_dtype(_head(replicas, key, 12), key, self.dtype)
            samples = body // sample_bytes
            block = hashes[key].block_bytes if hashes is not None else 0
            for j in range(0, samples, per_unit):
                n = min(per_unit, samples - j)
                start = self.header_bytes + j * sample_bytes
                end = start + n * sample_bytes
                # With hashes, the read takes the whole hash blocks the samples lie in.
                lo, hi = (
                    (start // block * block, min(size, -(-end // block) * block))
                    if block
                    else (start, end)
                )
                units.append(
                    Unit(
                        key=key,
                        start=start,
                        end=end,
                        nbytes=hi - lo,
                        mem_bytes=hi - lo,
                        num_samples=n,
                        first_id=first + j,
                        read_start=lo if block else None,
                        read_end=hi if block else None,
                    )
                )
            first += samples
        if files and not first:
            longest = (max(sizes) - self.header_bytes) // itemsize
            raise ValueError(
                f"TokenFiles: no sample in {len(files)} token file(s): the longest holds "
                f"{longest} tokens, fewer than sample_tokens={self.sample_tokens} (a trailing "
                "partial sample is dropped)"
            )
        return TokenLayout(
            units=units, dtype=self.dtype, sample_tokens=self.sample_tokens, hashes=hashes
        )


@dataclass
class TokenLayout:
    units: list[Unit]
    dtype: str
    sample_tokens: int
    hashes: dict[str, FileHashes] | None = None
    """Each file's hashes (a hashed manifest's), checked on every read; None: not checked."""
    reads_views: bool = field(default=True, init=False)

    def decode(self, unit: Unit, data, replica: str) -> np.ndarray:
        start, end = unit.span()
        if len(data) != unit.nbytes:
            raise ShardCorruptError(
                f"token file {unit.key} on replica {replica}: read [{start}:{end}] returned "
                f"{len(data)} bytes, not {unit.nbytes}"
                + (f" (truncated at offset {start + len(data)})" if len(data) < unit.nbytes else "")
            )
        if self.hashes is not None:
            self.hashes[unit.key].check(
                data, start, what=f"token file {unit.key} on replica {replica}"
            )
        return np.frombuffer(
            data,
            self.dtype,
            count=unit.num_samples * self.sample_tokens,
            offset=unit.start - start,
        ).reshape(unit.num_samples, self.sample_tokens)
