"""The shard survey: which shards each replica holds and their sizes, compared across replicas
as a dataset opens (and its index or manifest, which must be the same on every replica)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptstore.errors import ObjectNotFoundError, StorageError
from loaders.errors import ReadFailedError, ReplicaMismatchError, ShardNotFoundError
from loaders.replicas.health import Replica

logger = logging.getLogger(__package__)  # "loaders.replicas", as health's

_NAMED = 50  # shards named at most in one warning line


def check_same(replicas: Sequence[Replica], key: str, first: bytes) -> None:
    """:class:`ReplicaMismatchError` unless every replica holds ``first`` as ``key`` (one that
    cannot be reached is skipped with a warning)."""
    for r in replicas:
        try:
            other = r.store.get(key)
        except ObjectNotFoundError as exc:
            raise ReplicaMismatchError(f"replica {r.name} lacks {key}") from exc
        except StorageError as exc:
            logger.warning("replica %s not verified, unreachable: %s", r.name, exc)
            continue
        if other != first:
            raise ReplicaMismatchError(
                f"replica {r.name} holds a different {key} than the others "
                f"({len(other)} vs {len(first)} bytes)"
            )


def find_shards(
    replicas: Sequence[Replica],
    keys: Sequence[str] | None,
    suffix: str | tuple[str, ...],
    *,
    verify: bool,
) -> tuple[dict[str, int | None], dict[str, set[str]]]:
    """The shards as :meth:`ReplicaSet.find_shards` finds them, with their sizes (None where no
    replica was asked: the caller asks one), and the URIs of the replicas lacking each shard
    that some lack (a warning names them)."""
    if keys is not None and not verify:
        return dict.fromkeys(keys), {}
    with ThreadPoolExecutor(len(replicas)) as pool:
        found = list(pool.map(lambda r: _survey(r, keys, suffix, verify), replicas))
    answered = {r: f for r, f in zip(replicas, found) if isinstance(f, dict)}
    if not answered:
        raise ReadFailedError(
            f"no replica answered a listing or size request: {found[-1]}"
        ) from found[-1]
    if keys is None:
        keys = sorted(set().union(*answered.values()))
    tried = ", ".join(r.name for r in answered)
    down = [r.name for r in replicas if r not in answered]
    sizes: dict[str, int | None] = {}
    for key in keys:
        have = [(r, f[key]) for r, f in answered.items() if key in f]
        if not have:
            raise ShardNotFoundError(
                f"shard {key} is missing from every replica (tried {tried}"
                + (f"; unreachable: {', '.join(down)})" if down else ")")
            )
        (first, size), *others = have
        for r, got in others:
            if got is not None and size is not None and got != size:
                raise ReplicaMismatchError(
                    f"shard {key} is {got} bytes on replica {r.name}, {size} on replica "
                    f"{first.name}: replicas differ"
                )
        sizes[key] = size
    lacking: dict[str, set[str]] = {}
    for r, f in answered.items():
        absent = [key for key in keys if key not in f]
        if absent:
            shown = ", ".join(absent[:_NAMED]) + (
                f" (+{len(absent) - _NAMED} more)" if len(absent) > _NAMED else ""
            )
            logger.warning(
                "replica %s lacks %d of %d shards, read from the other replicas: %s",
                r.name,
                len(absent),
                len(keys),
                shown,
            )
            for key in absent:
                lacking.setdefault(key, set()).add(r.name)
    return sizes, lacking


def _survey(
    r: Replica, keys: Sequence[str] | None, suffix: str | tuple[str, ...], sizes: bool
) -> dict[str, int | None] | StorageError:
    """Replica ``r``'s shards (``keys`` it holds, or its listing) with their sizes (None
    when not ``sizes``), or the error that made it unreachable."""
    try:
        if keys is None:
            keys = [k for k in r.store.list("") if k.endswith(suffix)]
            if not sizes:
                return dict.fromkeys(keys)

        def size(key: str) -> int:
            try:
                return r.store.size(key)
            except ObjectNotFoundError:
                return -1

        got = list(r.store.map(size, keys, max_concurrency=16))
    except StorageError as exc:
        logger.warning("replica %s not checked, unreachable: %s", r.name, exc)
        return exc
    return {key: n for key, n in zip(keys, got) if n >= 0}
