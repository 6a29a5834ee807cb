"""WebDataset tar shards: files grouped into samples by key, each shard read whole.

A member ``dir/abc.cls.txt`` belongs to sample ``dir/abc`` under field ``cls.txt`` (lower case);
consecutive members with one key form one sample. Samples carry ``__key__`` and ``__url__``.
"""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loaders.errors import ShardCorruptError
from loaders.layout import Unit, shard_sizes


def parse_tar(data: bytes, key: str, replica: str) -> list[dict[str, Any]]:
    """The samples of one tar shard; :class:`ShardCorruptError` names shard and byte offset."""
    what = f"shard {key} on replica {replica}"
    samples: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    view = memoryview(data)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as exc:
        raise ShardCorruptError(f"{what}: not a tar file (offset 0): {exc}") from exc
    offset = 0
    try:
        for member in tar:
            offset = member.offset
            if not member.isfile():
                continue
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
    except tarfile.TarError as exc:
        raise ShardCorruptError(f"{what}: bad tar header after offset {offset}: {exc}") from exc
    return samples


@dataclass(kw_only=True)
class WebDataset:
    """WebDataset ``.tar`` shards (keys relative to each replica's root)."""

    shards: list[str] | None = None
    """Shard keys in dataset order; None: ``manifest``'s, or else every ``*.tar`` below the root
    of any replica, sorted (a shard missing from every replica goes unnoticed that way: declare
    the shards to have that checked)."""
    manifest: str | None = None
    """Key of a text file on the replicas listing the shard keys in dataset order, one a line
    (``#`` comments and blank lines skipped); it must be the same on every replica."""
    sample_counts: list[int] | None = None
    """Samples per shard, if known; otherwise every shard is read once at open to count them."""
    name: str = field(default="webdataset", init=False)

    def __post_init__(self) -> None:
        if self.shards is not None and self.manifest is not None:
            raise ValueError("WebDataset takes shards or a manifest, not both")
        if self.sample_counts is not None:
            if self.shards is None or len(self.sample_counts) != len(self.shards):
                raise ValueError("WebDataset.sample_counts needs shards, one count per shard")
            if any(c < 0 for c in self.sample_counts):
                raise ValueError("WebDataset.sample_counts must be >= 0")

    def open(self, replicas: Any) -> WdsLayout:
        shards, nbytes = shard_sizes(replicas, self.shards, self.manifest, ".tar")
        sizes = dict(zip(shards, nbytes))
        with ThreadPoolExecutor(8) as pool:
            counts = self.sample_counts
            if counts is None:
                counts = list(
                    pool.map(
                        lambda k: len(
                            replicas.read(k, decode=lambda d, r, k=k: parse_tar(d, k, r))
                        ),
                        shards,
                    )
                )
        units, first = [], 0
        for key, count in zip(shards, counts):
            units.append(
                Unit(
                    key=key,
                    start=None,
                    end=None,
                    nbytes=sizes[key],
                    mem_bytes=sizes[key],
                    num_samples=count,
                    first_id=first,
                )
            )
            first += count
        return WdsLayout(units=units)


@dataclass
class WdsLayout:
    units: list[Unit]
    reads_views: bool = field(default=False, init=False)

    def decode(self, unit: Unit, data: bytes, replica: str) -> list[dict[str, Any]]:
        samples = parse_tar(data, unit.key, replica)
        if len(samples) != unit.num_samples:
            raise ShardCorruptError(
                f"shard {unit.key} on replica {replica} holds "
                f"{len(samples)} samples, {unit.num_samples} expected"
            )
        for i, s in enumerate(samples):
            s["__index__"] = unit.first_id + i
        return samples
