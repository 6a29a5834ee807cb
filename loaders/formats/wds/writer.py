"""WebDataset tar shards as ``WebDataset`` (and the upstream ``webdataset`` package) read them:
each sample's fields stored as consecutive members ``{key}.{field}``."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from typing import Any

from loaders.formats._writing import DatasetSink, ShardWriter, Target
from loaders.formats.manifest import FileHasher, FileHashes, manifest_bytes

_BLOCK = tarfile.BLOCKSIZE
HASH_BLOCK_BYTES = 4 << 20  # a shard is read whole: its blocks' hashes are checked together


def field_bytes(name: str, value: Any) -> bytes:
    """A field's file contents: bytes as they are, text as UTF-8, numbers as their decimal
    text, dicts and lists as JSON (keys in insertion order, as upstream's writer has them)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, int, float)):
        return str(value).encode()
    if isinstance(value, (dict, list)):
        return json.dumps(value).encode("utf-8")
    raise ValueError(
        f"WebDataset field {name!r}: cannot store a {type(value).__name__} "
        "(give bytes, str, a number, a dict or a list)"
    )


class WebDatasetWriter(ShardWriter):
    """Writes samples (``{"__key__": "abc", "txt": ..., "cls": ...}``) into tar shards
    ``{prefix}.00000.tar``, ... of at most ``max_count`` samples and about ``max_bytes`` bytes
    (a larger sample gets a shard of its own), then ``manifest`` listing them with their sizes
    and xxh3_64 hashes (a hashed manifest: docs/FORMAT.md); read them back, verified, with
    ``WebDataset(manifest=...)``."""

    def __init__(
        self,
        uri: Target | Sequence[Target],
        *,
        max_count: int = 10_000,
        max_bytes: int = 1 << 28,
        prefix: str = "shard",
        manifest: str = "manifest.txt",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError(
                f"WebDatasetWriter max_count and max_bytes must be >= 1, got {max_count}, "
                f"{max_bytes}"
            )
        self.max_count, self.max_bytes, self.prefix = max_count, max_bytes, prefix
        self.sink = DatasetSink(uri, index=manifest, storage_options=storage_options)
        self._samples: list[list[tuple[str, bytes]]] = []
        self._bytes = 2 * _BLOCK  # the end-of-archive blocks
        self._last_key: str | None = None
        self._hashes: dict[str, FileHashes] = {}

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample: ``__key__`` (a name without a dot in its last path part) and
        one or more fields (other ``__`` keys are ignored)."""
        self.sink.check_open()
        key = sample.get("__key__")
        if not isinstance(key, str) or not key:
            raise ValueError("WebDataset sample needs a non-empty string '__key__'")
        base = key.rpartition("/")[2]
        if "." in base or not base:
            raise ValueError(f"WebDataset key {key!r}: its last part must be non-empty, no dot")
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"WebDataset key {key!r}: absolute or with '..' (readers refuse it)")
        if key == self._last_key:
            raise ValueError(f"WebDataset key {key!r} repeats the previous sample's")
        members = [
            (f"{key}.{name}", field_bytes(name, value))
            for name, value in sample.items()
            if not name.startswith("__")
        ]
        if not members:
            raise ValueError(f"WebDataset sample {key!r} has no fields")
        size = sum(_BLOCK + -(-len(data) // _BLOCK) * _BLOCK for _, data in members)
        if self._samples and (
            len(self._samples) >= self.max_count or self._bytes + size > self.max_bytes
        ):
            self._flush()
        self._samples.append(members)
        self._bytes += size
        self._last_key = key

    def _flush(self) -> None:
        if not self._samples:
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for members in self._samples:
                for name, data in members:
                    info = tarfile.TarInfo(name)  # mtime 0, no owner: replicas are identical
                    info.size, info.mode = len(data), 0o444
                    tar.addfile(info, io.BytesIO(data))
        name = f"{self.prefix}.{len(self.shards):05d}.tar"
        hasher = FileHasher(HASH_BLOCK_BYTES)
        hasher.update(buf.getbuffer())
        self._hashes[name] = hasher.finish()
        self.sink.put(name, buf.getbuffer())
        self._samples, self._bytes = [], 2 * _BLOCK

    def _index_bytes(self) -> bytes:
        return manifest_bytes(self.shards, self._hashes)
