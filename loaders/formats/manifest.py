"""The shard list of formats without an index of their own (token files, WebDataset tars): the
list the user declares, a manifest listing one key a line, or every replica's listing; and the
manifest as the writers write it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from loaders.errors import ShardCorruptError, ShardNotFoundError
from loaders.formats.layout import check_shard_key


def shard_sizes(
    replicas: Any, declared: list[str] | None, manifest: str | None, suffix: str | tuple[str, ...]
) -> tuple[list[str], list[int]]:
    """The dataset's shards, in order, and their sizes: the ``declared`` list, else the
    ``manifest``'s, else every replica's listing of keys ending in ``suffix`` (one, or any of
    several: ``ReplicaSet.find_shards``)."""
    if declared is None and manifest is not None:
        declared = read_manifest(replicas, manifest)
    found = replicas.find_shards(declared, suffix=suffix)
    if not found:
        names = " / ".join((suffix,) if isinstance(suffix, str) else suffix)
        raise ShardNotFoundError(f"no {names} shards found in {', '.join(replicas.uris)}")
    keys = list(found) if declared is None else list(declared)
    return keys, [found[k] for k in keys]


def read_manifest(replicas: Any, key: str) -> list[str]:
    """The shard keys a manifest lists, one per line (blank lines and ``#`` comments skipped);
    the manifest must be the same on every replica (:meth:`ReplicaSet.read_same`)."""
    raw = replicas.read_same(key)
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ShardCorruptError(f"manifest {key} is not UTF-8 text: {exc}") from exc
    keys = [line.strip() for line in text.splitlines()]
    keys = [check_shard_key(k, f"manifest {key}") for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"manifest {key} lists no shards")
    repeated = sorted(k for k, n in Counter(keys).items() if n > 1)
    if repeated:
        raise ValueError(f"manifest {key} lists shards more than once: {', '.join(repeated)}")
    return keys


def manifest_bytes(keys: list[str]) -> bytes:
    """A manifest as ``TokenFiles(manifest=...)`` and ``WebDataset(manifest=...)`` read it."""
    return "".join(f"{k}\n" for k in keys).encode("utf-8")
