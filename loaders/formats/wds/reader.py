"""WebDataset tar shards: files grouped into samples by key, each shard read whole.

A member ``dir/abc.cls.txt`` belongs to sample ``dir/abc`` under field ``cls.txt`` (lower case);
consecutive members with one key form one sample. Samples carry ``__key__`` and ``__url__``.
A shard is a plain tar or one compressed with gzip, bzip2, xz or zstd (told by its first bytes,
as upstream's ``tarfile`` mode ``r|*`` does), decompressed up to ``max_shard_bytes``.
"""

from __future__ import annotations

import io
import logging
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loaders.errors import ShardCorruptError, ShardTooLargeError, UnknownFormatError
from loaders.formats._codecs import decompress
from loaders.formats.layout import Unit, first_time
from loaders.formats.manifest import FileHashes, shards_and_hashes

logger = logging.getLogger(__name__)

# What ``webdataset.TarWriter`` writes: a name ending in "gz" is gzip-compressed.
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_COMPRESSIONS = {  # leading bytes -> loaders.formats._codecs name
    b"\x1f\x8b": "gz",
    b"BZh": "bz2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}
_NOT_TARS = {  # leading bytes of files that are valid, and not tar shards
    b"PK\x03\x04": "a zip archive",
    b"PK\x05\x06": "an empty zip archive",
    b"7z\xbc\xaf\x27\x1c": "a 7z archive",
    b"Rar!\x1a\x07": "a RAR archive",
    b"PAR1": "a Parquet file",
    b"\x93NUMPY": "a NumPy .npy file",
}


def shard_tar(data: bytes, key: str, replica: str, max_bytes: int) -> bytes:
    """The tar archive a shard holds: the shard itself, or decompressed (at most ``max_bytes``).
    :class:`UnknownFormatError` for a file of another kind; :class:`ShardCorruptError` for a
    damaged compressed stream or one that decompresses to more than ``max_bytes``."""
    what = f"shard {key} on replica {replica}"
    head = bytes(data[:8])
    if _starts_tar(data):
        return data
    for magic, kind in _NOT_TARS.items():
        if head.startswith(magic):
            raise UnknownFormatError(
                f"{what} is {kind}, not a tar: WebDataset reads tar shards, plain or "
                "compressed with gzip, bzip2, xz or zstd"
            )
    algo = next((a for magic, a in _COMPRESSIONS.items() if head.startswith(magic)), None)
    if algo is None:
        return data  # no tar header: parse_tar says where it is damaged
    tar = decompress(
        algo, data, what=what, limit=max_bytes, bound="bytes WebDataset.max_shard_bytes allows"
    )
    if not _starts_tar(tar):
        raise UnknownFormatError(f"{what} is {algo}-compressed but holds no tar archive")
    return tar


def _starts_tar(data: bytes) -> bool:
    """Whether ``data`` begins with a tar header (or the zero block of an empty archive)."""
    block = bytes(data[: tarfile.BLOCKSIZE])
    if len(block) < tarfile.BLOCKSIZE:
        return False
    if block == bytes(tarfile.BLOCKSIZE):
        return True
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


# Python before 3.11.10 / 3.12.6 parses a pax header in time quadratic in its length
# (CVE-2024-6232: 160 KB took 80 s); a real one names a path and a few attributes.
MAX_PAX_HEADER_BYTES = 8192


class _Refused(Exception):
    """A tar header refused as ``tarfile`` reaches it (carried out of its iteration)."""


class _CheckedTarInfo(tarfile.TarInfo):
    """The members ``tarfile`` reads, each checked as it reaches its header (no walk of our own
    that could read the archive otherwise): a pax header over ``MAX_PAX_HEADER_BYTES`` is
    refused before it is parsed, global ones once they add up to more (each member's header
    walks every global key: 193 KiB of them took 1,000 s), and a negative size, base-256 or a
    pax record's, before ``tarfile`` steps back to an earlier header and reads the same ones
    for ever."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size < 0:
            raise _Refused(f"a member of {self.size} bytes at offset {self.offset}")
        return super()._proc_member(tarfile_)

    def _proc_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_PAX_HEADER_BYTES:
            raise _Refused(
                f"a pax header of {self.size} bytes at offset {self.offset} (more than "
                f"{MAX_PAX_HEADER_BYTES}: not read)"
            )
        if self.type == tarfile.XGLTYPE:
            seen = getattr(tarfile_, "_global_pax_bytes", 0) + self.size
            tarfile_._global_pax_bytes = seen  # type: ignore[attr-defined]
            if seen > MAX_PAX_HEADER_BYTES:
                raise _Refused(
                    f"global pax headers of {seen} bytes by offset {self.offset} (more than "
                    f"{MAX_PAX_HEADER_BYTES}: not read)"
                )
        return super()._proc_pax(tarfile_)

    def _apply_pax_info(self, pax_headers: dict, encoding: str, errors: str) -> None:
        super()._apply_pax_info(pax_headers, encoding, errors)
        if self.size < 0:
            raise _Refused(f"a member whose pax header says {self.size} bytes")


def parse_tar(data: bytes, key: str, replica: str) -> list[dict[str, Any]]:
    """The samples of one tar archive; :class:`ShardCorruptError` names shard and byte offset
    (of the decompressed archive, for a compressed shard)."""
    what = f"shard {key} on replica {replica}"
    samples: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    view = memoryview(data)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=_CheckedTarInfo)
    except tarfile.TarError as exc:
        raise ShardCorruptError(f"{what}: not a tar file (offset 0): {exc}") from exc
    except _Refused as exc:
        raise ShardCorruptError(f"{what}: {exc}") from exc
    except (ValueError, OverflowError, RecursionError) as exc:  # a pax number; pax chains
        raise ShardCorruptError(f"{what}: bad tar header at offset 0: {_short(exc)}") from exc
    offset = 0
    links: list[str] = []  # never followed: upstream's reader skips them too
    try:
        for member in tar:
            offset = member.offset
            if not member.isfile():
                if member.issym() or member.islnk():
                    links.append(member.name)
                continue
            # Its size is the expanded one: its bytes are not a slice (a pax GNU.sparse record
            # sets the size without the map that makes tarfile call it sparse)
            if member.issparse() or any(k.startswith("GNU.sparse.") for k in member.pax_headers):
                raise ShardCorruptError(
                    f"{what}: member {member.name!r} at offset {member.offset} is a sparse file "
                    "(tar -S), which WebDataset shards cannot hold: write it without -S"
                )
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts:
                raise ShardCorruptError(
                    f"{what}: member {member.name!r} at offset {member.offset} names a path "
                    "outside the shard (absolute, or with '..'): not a sample key"
                )
            dirname, _, base = member.name.rpartition("/")
            if "." not in base or base.startswith("."):
                continue
            stem, ext = base.split(".", 1)
            sample_key = f"{dirname}/{stem}" if dirname else stem
            end = member.offset_data + member.size
            if end > len(data):
                raise ShardCorruptError(
                    f"{what}: member {member.name!r} at offset "
                    f"{member.offset} runs past the end ({end} > {len(data)})"
                )
            if current is None or current["__key__"] != sample_key:
                current = {"__key__": sample_key, "__url__": key}
                samples.append(current)
            ext = ext.lower()
            if ext in current:
                raise ShardCorruptError(
                    f"{what}: sample {sample_key!r} has two {ext!r} files "
                    f"(second at offset {member.offset})"
                )
            current[ext] = bytes(view[member.offset_data : end])
    except ShardCorruptError:
        raise
    except _Refused as exc:
        raise ShardCorruptError(f"{what}: {exc}") from exc
    except (tarfile.TarError, ValueError, OverflowError, RecursionError) as exc:
        raise ShardCorruptError(
            f"{what}: bad tar header after offset {offset}: {_short(exc)}"
        ) from exc
    # ``tarfile`` ends its walk quietly at a damaged header or at the end of the bytes, as it
    # does at the end-of-archive zero blocks every tar writer puts last: only those end it here.
    end = tar.offset
    if bytes(view[end : end + tarfile.BLOCKSIZE]) != bytes(tarfile.BLOCKSIZE):
        why = "the bytes end" if end + tarfile.BLOCKSIZE > len(data) else "a damaged header"
        raise ShardCorruptError(
            f"{what}: {why} at offset {end}, before the end-of-archive blocks (samples after "
            "it would be lost)"
        )
    if links and first_time(("wds links", key, replica)):
        logger.warning(
            "%s: %d link member(s) skipped, never followed (%s%s): their samples are not read",
            what,
            len(links),
            ", ".join(map(repr, links[:3])),
            ", ..." if len(links) > 3 else "",
        )
    return samples


def _short(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "extended headers chained deeper than a tar writer makes them"
    return str(exc)


@dataclass(kw_only=True)
class WebDataset:
    """WebDataset tar shards (keys relative to each replica's root), plain or compressed."""

    shards: list[str] | None = None
    """Shard keys in dataset order; None: ``manifest``'s, or else every ``*.tar``,
    ``*.tar.gz``, ``*.tgz``, ``*.tar.bz2`` and ``*.tar.xz`` below the root of any replica,
    sorted (a shard missing from every replica goes unnoticed that way: declare the shards to
    have that checked)."""
    manifest: str | None = None
    """Key of a text file on the replicas listing the shard keys in dataset order, one a line
    (``#`` comments and blank lines skipped); it must be the same on every replica. A hashed
    manifest (``WebDatasetWriter``'s) also gives each shard's size and xxh3_64 hashes, checked on
    every read: a shard whose bytes differ is read from another replica."""
    sample_counts: list[int] | None = None
    """Samples per shard, if known; otherwise every shard is read once at open to count them
    (and a compressed shard's decompressed size is learnt for the prefetch window, which
    otherwise counts its compressed size)."""
    max_shard_bytes: int = 1 << 32
    """Most bytes a shard may hold, as stored or decompressed: a larger one is
    :class:`ShardCorruptError`, refused unread where its listed size says so, else found in
    that much memory (a gzip bomb stops here). The default holds upstream ``ShardWriter``'s
    largest shards (3 GB)."""
    name: str = field(default="webdataset", init=False)

    def __post_init__(self) -> None:
        if self.shards is not None and self.manifest is not None:
            raise ValueError("WebDataset takes shards or a manifest, not both")
        if self.sample_counts is not None:
            if self.shards is None or len(self.sample_counts) != len(self.shards):
                raise ValueError("WebDataset.sample_counts needs shards, one count per shard")
            if any(c < 0 for c in self.sample_counts):
                raise ValueError("WebDataset.sample_counts must be >= 0")
        if self.max_shard_bytes < 1:
            raise ValueError(f"WebDataset.max_shard_bytes must be >= 1, got {self.max_shard_bytes}")

    def open(self, replicas: Any) -> WdsLayout:
        shards, nbytes, hashes = shards_and_hashes(
            replicas, self.shards, self.manifest, SHARD_SUFFIXES
        )
        for key, size in zip(shards, nbytes):  # each is read whole into memory: refused unread
            if size > self.max_shard_bytes:
                raise ShardTooLargeError(
                    f"shard {key} is {size} bytes, more than WebDataset.max_shard_bytes "
                    f"({self.max_shard_bytes}): raise it to read it"
                )
        if self.sample_counts is None:
            with ThreadPoolExecutor(8) as pool:
                surveyed = list(
                    pool.map(lambda k, n: self._survey(replicas, k, n, hashes), shards, nbytes)
                )
            counts, mem_bytes = [c for c, _ in surveyed], [m for _, m in surveyed]
        else:
            counts, mem_bytes = self.sample_counts, nbytes
        units, first = [], 0
        for key, size, count, mem in zip(shards, nbytes, counts, mem_bytes):
            units.append(
                Unit(
                    key=key,
                    start=None,
                    end=None,
                    nbytes=size,
                    mem_bytes=mem,
                    num_samples=count,
                    first_id=first,
                )
            )
            first += count
        return WdsLayout(units=units, max_shard_bytes=self.max_shard_bytes, hashes=hashes)

    def _survey(
        self, replicas: Any, key: str, size: int, hashes: dict[str, FileHashes] | None
    ) -> tuple[int, int]:
        """Shard ``key``'s sample count and the size of its tar archive (read no further than a
        byte past ``size``, its listed size: a longer copy is refused unread)."""

        def count(data: bytes, replica: str) -> tuple[int, int]:
            if hashes is not None:
                hashes[key].check(data, 0, what=f"shard {key} on replica {replica}")
            tar = shard_tar(data, key, replica, self.max_shard_bytes)
            return len(parse_tar(tar, key, replica)), len(tar)

        return replicas.read_whole(key, size, decode=count)


@dataclass
class WdsLayout:
    units: list[Unit]
    max_shard_bytes: int
    hashes: dict[str, FileHashes] | None = None
    """Each shard's hashes (a hashed manifest's, ``WebDatasetWriter``'s), checked on every
    read; None: not checked."""
    reads_views: bool = field(default=False, init=False)

    def decode(self, unit: Unit, data: bytes, replica: str) -> list[dict[str, Any]]:
        if self.hashes is not None:
            self.hashes[unit.key].check(data, 0, what=f"shard {unit.key} on replica {replica}")
        tar = shard_tar(data, unit.key, replica, self.max_shard_bytes)
        samples = parse_tar(tar, unit.key, replica)
        if len(samples) != unit.num_samples:
            raise ShardCorruptError(
                f"shard {unit.key} on replica {replica} holds "
                f"{len(samples)} samples, {unit.num_samples} expected"
            )
        for i, s in enumerate(samples):
            s["__index__"] = unit.first_id + i
        return samples
