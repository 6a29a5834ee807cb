"""Several stores holding the same dataset, read as one: replica health (:mod:`.health`), the read
race (:mod:`.race`) and the shard survey (:mod:`.survey`) behind one :class:`ReplicaSet`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

from ckptstore.store import Hedger, RetryPolicy, Store
from loaders.config import ReplicaConfig
from loaders.errors import ShardCorruptError, ShardTooLargeError
from loaders.metrics import Carried, ReadStats, ReplicaStats
from loaders.replicas import survey
from loaders.replicas.health import Replica, ReplicaHealth
from loaders.replicas.race import ReplicaReads

R = TypeVar("R")

Spec = str | os.PathLike | Store


def replica_retry_policy(config: ReplicaConfig) -> RetryPolicy:
    """One attempt per replica request (the replica set fails over itself), under its deadline."""
    return RetryPolicy(attempts=1, timeout_s=config.attempt_timeout_s)


class ReplicaSet:
    """Several stores holding the same objects, read as one.

    ``replicas``: :class:`~ckptstore.Store` objects, used as they are (their own retry
    policy bounds each request, the open's comparison of the replicas included: build them
    with ``retry=replica_retry_policy(config)`` for the config's ``attempt_timeout_s``), or
    URIs, opened with :func:`replica_retry_policy` and ``storage_options``. ``missing`` maps a shard key to the
    URIs of replicas known to lack it (what :meth:`find_shards` found); reads of that key skip
    them."""

    def __init__(
        self,
        replicas: Spec | Sequence[Spec],
        *,
        config: ReplicaConfig | None = None,
        storage_options: dict[str, Any] | None = None,
        missing: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        if isinstance(replicas, (str, os.PathLike, Store)):
            replicas = [replicas]
        if not replicas:
            raise ValueError("a dataset needs at least one replica URI")
        self.config = config or ReplicaConfig()
        policy = replica_retry_policy(self.config)
        # A filesystem (its connection pool) of each replica's own: fsspec hands one instance
        # to equal arguments, and a hung replica's requests, abandoned at their deadline but
        # still holding connections, left none for the replicas beside it on that endpoint.
        own = {**(storage_options or {}), "skip_instance_cache": True}
        stores = [
            r if isinstance(r, Store) else Store(r, storage_options=own, retry=policy)
            for r in replicas
        ]
        names = [s.uri for s in stores]
        # The same directory written two ways (a trailing slash, file://, a link) is one
        # replica: hedges and failovers to it would go to the same disk.
        # The same bucket and prefix behind two endpoints (mirrors on two providers) are two.
        places = [
            os.path.realpath(s.backend.root)
            if s.backend.is_local
            else (s.uri.rstrip("/"), (s.endpoint or "").rstrip("/").lower())
            for s in stores
        ]
        if len(set(places)) != len(places):
            raise ValueError(f"replica URIs repeat (the same place twice): {names}")
        self._health = ReplicaHealth(stores, self.config)
        self._replicas = self._health.replicas
        self.hedger = Hedger(self.config.hedge_policy())
        self.stats = ReadStats()
        self._reads = ReplicaReads(self._health, self.hedger, self.stats, self.config)
        self.missing: dict[str, frozenset[str]] = {
            key: frozenset(uris) for key, uris in (missing or {}).items()
        }
        # (replica URI, shard) -> the token that changes when the shard is written again, for
        # the shards find_shards asked of each replica
        self.versions: dict[tuple[str, str], str] = {}

    def carried(self) -> Carried:
        """What this process saw of the replicas (a dataset's open, in the main process), for
        the workers of a first pass to start from (:meth:`start_as`): the replicas benched or
        on probation, the median read latency of each that answered, the hedge's latencies."""
        states = self._health.states()
        benched = frozenset(uri for uri, state in states.items() if state != "healthy")
        latencies = {r.name: r.stats.median_latency() for r in self._replicas}
        latencies = {uri: p50 for uri, p50 in latencies.items() if p50 is not None}
        return Carried(benched, latencies, self.hedger.samples())

    def start_as(self, carried: Carried) -> None:
        """The replicas' health as the last pass's workers left it (:meth:`ReplicaHealth.start_as`),
        and the hedge delays they had learnt."""
        self._health.start_as(carried.benched, carried.latencies)
        self.hedger.seed(carried.hedge)

    @property
    def uris(self) -> list[str]:
        return [r.name for r in self._replicas]

    def content_version(self) -> str:
        """A digest of every version token :meth:`find_shards` saw: it changes when a shard it
        asked of a replica was written again ("" when it asked none)."""
        if not self.versions:
            return ""
        lines = sorted(f"{uri}\t{key}\t{v}" for (uri, key), v in self.versions.items())
        return xxhash.xxh3_128_hexdigest("\n".join(lines).encode())

    def __len__(self) -> int:
        return len(self._replicas)

    def _lacking(self, key: str) -> list[Replica]:
        uris = self.missing.get(key, frozenset())
        return [r for r in self._replicas if r.name in uris]

    # -- reads ------------------------------------------------------------------------------

    def read(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        *,
        decode: Callable[[bytes, str], Any] | None = None,
        size_hint: int = 0,
        view: bool = False,
        whole: bool = False,
    ) -> Any:
        """The bytes of ``key`` (or ``[start, end)`` of it) from whichever replica answers first,
        passed through ``decode(data, replica)`` when given. A decode error (corrupt bytes) counts
        as that replica's error and fails over to another replica. With ``view`` the data may be
        a read-only buffer instead of bytes: on a local replica, a memory map of the file's pages
        (``Store.get_view``). ``whole``: the range is the whole object (and the byte past it
        that catches a longer copy): errors name the key alone."""
        what = key if start is None or whole else f"{key}[{start}:{end}]"
        nbytes = (end - (start or 0)) if end is not None else size_hint
        get = Store.get_view if view else Store.get
        return self._reads.read(
            what,
            nbytes,
            lambda store: get(store, key, start, end, in_thread=True),
            decode,
            self._lacking(key),
        )

    def read_whole(
        self,
        key: str,
        size: int,
        *,
        decode: Callable[[Any, str], Any] | None = None,
        view: bool = False,
    ) -> Any:
        """All of ``key``, whose size is ``size`` (what the dataset opened with), as :meth:`read`:
        asked for no further than a byte past it, so a copy that grew since (or a replica whose
        listing and body disagree) is refused without being read whole. Any other length is
        that replica's :class:`ShardCorruptError` and the read fails over. A ``size`` of 0
        (not known) reads the object whole."""
        if not size:
            return self.read(key, decode=decode, view=view)

        def sized(data: Any, replica: str) -> Any:
            if len(data) != size:
                got = "more than " if len(data) > size else f"{len(data)}, not "
                raise ShardCorruptError(
                    f"shard {key} on replica {replica} is {got}{size} bytes, the size listed when "
                    "the dataset opened (changed since, or the replica lies about it)"
                )
            return data if decode is None else decode(data, replica)

        return self.read(key, 0, size + 1, decode=sized, size_hint=size, view=view, whole=True)

    def call(self, what: str, fn: Callable[[Store], R], *, key: str | None = None) -> R:
        """``fn(store)`` on the best replica (not one known to lack or to hold another size of
        ``key``), failing over on errors (never hedged)."""
        return self._reads.call(what, fn, [] if key is None else self._lacking(key))

    def size(self, key: str) -> int:
        """The size of ``key`` on the best replica not known to lack it (never hedged)."""
        return self._reads.call(f"size {key}", lambda store: store.size(key), self._lacking(key))

    # -- whole-dataset checks ---------------------------------------------------------------

    def read_same(
        self,
        key: str,
        max_bytes: int,
        *,
        bound: str = "the most a dataset's index or manifest may take",
    ) -> bytes:
        """``key`` from every replica; :class:`ReplicaMismatchError` if any two differ. No more
        than a byte past ``max_bytes`` is read from any replica: a longer copy is
        :class:`ShardCorruptError`, naming the ``bound``."""
        first = self._reads.read(
            key,
            0,
            lambda store: store.get(key, 0, max_bytes + 1, in_thread=True, small=True),
            None,
            self._lacking(key),
        )
        if len(first) > max_bytes:
            raise ShardTooLargeError(f"{key} is more than {max_bytes} bytes, {bound}")
        if len(self) > 1 and self.config.verify_replicas:
            survey.check_same(self._health, key, first, max_bytes)
        return first

    def find_shards(
        self,
        keys: Sequence[str] | None = None,
        *,
        suffix: str | tuple[str, ...] = "",
        sizes: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """The dataset's shards and their sizes, in dataset order, asked of every replica.

        ``keys`` is the declared shard list (the authority): a key no replica holds raises
        :class:`ShardNotFoundError`. Without it every replica is listed and the shard set is
        the union of the keys ending in ``suffix`` (or any of a tuple of them), sorted (a shard
        missing from every replica cannot be seen that way: declare the list). A replica lacking
        shards that others hold gets one WARNING naming them and is not read for them
        (:attr:`missing`); so does a replica holding a shard at another size than ``sizes``
        (what an index or hashed manifest declares) gives or, without it, than most replicas
        hold (the largest of equals). No replica at the declared size is
        :class:`ShardCorruptError`. An unreachable replica is skipped with a warning. With
        ``verify_replicas`` off, declared keys are not asked of every replica (only listings
        are compared) and sizes come from ``sizes`` or one replica each.
        """
        found, lacking = survey.find_shards(
            self._health,
            keys,
            suffix,
            verify=self.config.verify_replicas,
            sizes=sizes,
            versions=self.versions,
        )
        for key, uris in lacking.items():
            self.missing[key] = self.missing.get(key, frozenset()) | uris
        unknown = [key for key, size in found.items() if size is None]
        with ThreadPoolExecutor(8) as pool:
            asked = dict(zip(unknown, pool.map(self.size, unknown)))
        return {key: asked[key] if size is None else size for key, size in found.items()}

    # -- figures ----------------------------------------------------------------------------

    def replica_stats(self) -> dict[str, ReplicaStats]:
        return {r.name: r.stats for r in self._replicas}

    def health(self) -> dict[str, str]:
        """Each replica's state: ``healthy``, ``benched`` (sent no reads) or ``probation`` (a
        share of first attempts)."""
        return self._health.states()

    def metrics(self) -> dict[str, Any]:
        health = self.health()
        return {
            "reads": self.stats.as_dict(),
            "hedge_tokens": self.hedger.tokens,
            "hedge_delay_s": self.hedger.delays(),
            "replicas": {
                r.name: {**r.stats.as_dict(), "health": health[r.name]} for r in self._replicas
            },
        }
