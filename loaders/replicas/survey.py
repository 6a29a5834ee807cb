"""The shard survey: which shards each replica holds and their sizes, compared across replicas
as a dataset opens (and its index or manifest, which must be the same on every replica)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptstore.errors import (
    CheckpointCorruptError,
    ObjectNotFoundError,
    ObjectOutsideRootError,
    StorageError,
    UnsafeObjectError,
)
from loaders.errors import (
    ReadFailedError,
    ReplicaMismatchError,
    ShardCorruptError,
    ShardNotFoundError,
)
from loaders.replicas.health import Replica, ReplicaHealth

logger = logging.getLogger(__package__)  # "loaders.replicas", as health's

_NAMED = 50  # shards named at most in one warning line


def check_same(health: ReplicaHealth, key: str, first: bytes, max_bytes: int) -> None:
    """:class:`ReplicaMismatchError` unless every replica holds ``first`` as ``key`` (one that
    cannot be reached is skipped with a warning, and benched); no more than a byte past
    ``max_bytes`` is read from any."""
    for r in health.replicas:
        try:
            other = r.store.get(key, 0, max_bytes + 1, small=True)
        except ObjectNotFoundError as exc:
            raise ReplicaMismatchError(f"replica {r.name} lacks {key}") from exc
        except StorageError as exc:
            logger.warning("replica %s not verified, unreachable: %s", r.name, exc)
            health.unreachable(r, exc)
            continue
        if other != first:
            raise ReplicaMismatchError(
                f"replica {r.name} holds a different {key} than the others "
                f"({len(other)} vs {len(first)} bytes)"
            )


def find_shards(
    health: ReplicaHealth,
    keys: Sequence[str] | None,
    suffix: str | tuple[str, ...],
    *,
    verify: bool,
    sizes: Mapping[str, int] | None = None,
    versions: dict[tuple[str, str], str] | None = None,
) -> tuple[dict[str, int | None], dict[str, set[str]]]:
    """The shards as :meth:`ReplicaSet.find_shards` finds them, with their sizes (None where no
    replica was asked: the caller asks one), and the URIs of the replicas not to read each
    shard from: those lacking it, and those holding it at another size (warnings name them).
    Each (replica, shard) asked goes into ``versions`` with the token that changes when the
    shard is written again (``Store.stat``).

    The size a shard must have is the one ``sizes`` (an index's, a hashed manifest's) gives;
    without it, the size most replicas hold, of equals the largest (a copy cut short is the
    common damage). No replica at the size ``sizes`` gives is :class:`ShardCorruptError`.

    A replica that does not answer is benched (:meth:`ReplicaHealth.unreachable`), and one
    already benched as the dataset opens (it did not answer the index or manifest) is not asked,
    as one that does not answer: unless every replica is."""
    sizes = sizes or {}
    if keys is not None and not verify:
        return {key: sizes.get(key) for key in keys}, {}
    replicas = [r for r in health.replicas if not r.benched] or health.replicas
    with ThreadPoolExecutor(len(replicas)) as pool:
        surveyed = list(pool.map(lambda r: _survey(r, keys, suffix, verify), replicas))
    for r, found_there in zip(replicas, surveyed):
        if isinstance(found_there, StorageError):
            health.unreachable(r, found_there, _why_unused(found_there))
    answered: dict[Replica, dict[str, int | None]] = {}
    for r, found_there in zip(replicas, surveyed):
        if isinstance(found_there, dict):
            answered[r] = {key: size for key, (size, _) in found_there.items()}
            if versions is not None:
                versions.update(((r.name, k), v) for k, (_, v) in found_there.items() if v)
    if not answered and all(isinstance(e, UnsafeObjectError) for e in surveyed):
        # a hostile or damaged dataset's link or FIFO, on every replica: no replica is unreachable
        raise ShardCorruptError(f"{surveyed[-1]}") from surveyed[-1]
    if not answered:
        raise ReadFailedError(
            f"no replica answered a listing or size request: {surveyed[-1]}"
        ) from surveyed[-1]
    if keys is None:
        keys = sorted(set().union(*answered.values()))
    tried = ", ".join(r.name for r in answered)
    down = [r.name for r in health.replicas if r not in answered]
    found: dict[str, int | None] = {}
    resized: dict[Replica, list[tuple[str, int, int]]] = {}
    for key in keys:
        have = [(r, f[key]) for r, f in answered.items() if key in f]
        if not have:
            raise ShardNotFoundError(
                f"shard {key} is missing from every replica (tried {tried}"
                + (f"; unreachable: {', '.join(down)})" if down else ")")
            )
        size = _agreed_size(key, have, sizes.get(key))
        for r, got in have:
            if got is not None and size is not None and got != size:
                resized.setdefault(r, []).append((key, got, size))
        found[key] = size
    lacking: dict[str, set[str]] = {}
    for r, wrong in resized.items():
        logger.warning(
            "replica %s holds %d of %d shards at another size, read from the other replicas: %s",
            r.name,
            len(wrong),
            len(keys),
            _named(f"{key} ({got} bytes, not {size})" for key, got, size in wrong),
        )
        for key, _, _ in wrong:
            lacking.setdefault(key, set()).add(r.name)
    for r, f in answered.items():
        absent = [key for key in keys if key not in f]
        if absent:
            logger.warning(
                "replica %s lacks %d of %d shards, read from the other replicas: %s",
                r.name,
                len(absent),
                len(keys),
                _named(absent),
            )
            for key in absent:
                lacking.setdefault(key, set()).add(r.name)
    return found, lacking


def _check_listed(r: Replica, keys: list[str]) -> None:
    """:class:`ObjectOutsideRootError` if ``r``'s listing names a key that leads out of the
    dataset (an S3 key may hold ``..``): a hostile replica, as one holding a link out. The
    store's own rule, no stricter: an odd but inside name (a ``:``, a backslash) is a shard."""
    for key in keys:
        try:
            r.store.path(key)
        except CheckpointCorruptError as exc:
            raise ObjectOutsideRootError(
                f"the listing of replica {r.name} names shard {key!r}, which is not inside the "
                f"dataset ({exc}): not read"
            ) from None


def _why_unused(exc: StorageError) -> str:
    if isinstance(exc, UnsafeObjectError):
        return "it holds an object unsafe to read"
    return "unreachable"


def _named(items: Iterable[str]) -> str:
    """At most ``_NAMED`` of ``items``, and how many more."""
    items = list(items)
    more = len(items) - _NAMED
    return ", ".join(items[:_NAMED]) + (f" (+{more} more)" if more > 0 else "")


def _agreed_size(
    key: str, have: list[tuple[Replica, int | None]], declared: int | None
) -> int | None:
    """The size ``key`` must have: ``declared``, else the size most replicas in ``have`` hold
    (the largest of equals); :class:`ShardCorruptError` if none holds the declared size."""
    known = [got for _, got in have if got is not None]
    if declared is not None:
        if known and declared not in known and len(known) == len(have):
            held = ", ".join(f"{r.name}: {got} bytes" for r, got in have)
            raise ShardCorruptError(
                f"shard {key}: no replica holds it at the {declared} bytes its index declares "
                f"({held})"
            )
        return declared
    if not known:
        return None
    counts = Counter(known)
    return max(counts, key=lambda n: (counts[n], n))


def _survey(
    r: Replica, keys: Sequence[str] | None, suffix: str | tuple[str, ...], sizes: bool
) -> dict[str, tuple[int | None, str]] | StorageError:
    """Replica ``r``'s shards (``keys`` it holds, or its listing) with their sizes and version
    tokens (None and "" when not ``sizes``), or the error that made it unreachable."""
    try:
        if keys is None:
            keys = [k for k in r.store.list("") if k.endswith(suffix)]
            _check_listed(r, keys)
            if not sizes:
                return dict.fromkeys(keys, (None, ""))

        def stat(key: str) -> tuple[int, str]:
            try:
                return r.store.stat(key)
            except ObjectNotFoundError:
                return -1, ""

        got = list(r.store.map(stat, keys, max_concurrency=16))
    except StorageError as exc:
        logger.warning("replica %s not checked, %s: %s", r.name, _why_unused(exc), exc)
        return exc
    return {key: (n, version) for key, (n, version) in zip(keys, got) if n >= 0}
