"""The dataset a training loop iterates: formats + replicas + order + prefetch + exact resume.

:class:`ShardDataset` is a ``torch.utils.data.IterableDataset``; iterated directly (or by a
DataLoader with ``num_workers=0``) it counts what it hands out. Under ``num_workers=N`` wrap it
in :class:`StatefulLoader`, which counts the samples the consumer received. Either one's
``state_dict()`` holds the global sample position of the epoch, so a resumed run reads exactly
the samples not yet seen, in the same order, also with another ``num_workers`` or world size.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
import xxhash
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ckptstore.store import Store
from loaders.cache import ShardCache, open_cache, read_unit
from loaders.config import LoaderConfig, ReplicaConfig
from loaders.errors import LoaderError, ShardNotFoundError
from loaders.formats.layout import Format, Unit, unit_samples
from loaders.formats.tokens.reader import TokenFiles
from loaders.metrics import CacheStats, Carried, ConsumerStats, ReaderReport, ReaderReports
from loaders.order import BlockPlan, EpochOrder, Reader
from loaders.prefetch import Growth, Window
from loaders.replicas import ReplicaSet

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_REPORT_S = 1.0  # a worker leaves a report of its figures this often, and at its end


class ShardDataset(IterableDataset):
    """A sharded dataset on one or more replicas, read with prefetch, hedging and exact resume.

    ``replicas``: URIs (or :class:`ckptstore.Store` objects) holding the same dataset.
    ``format``: :class:`~loaders.MDS`, :class:`~loaders.WebDataset` or
    :class:`~loaders.TokenFiles`. ``rank``/``world_size`` default to torch.distributed's.
    ``transform`` runs on each sample in the process that reads it.
    """

    def __init__(
        self,
        replicas: str | os.PathLike | Store | Sequence[str | os.PathLike | Store],
        format: Format,
        *,
        config: LoaderConfig | None = None,
        replica_config: ReplicaConfig | None = None,
        storage_options: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(format, type) and hasattr(format, "open"):
            raise TypeError(
                f"the dataset format is the class {format.__name__}: pass an instance, "
                f"{format.__name__}(...)"
            )
        if not hasattr(format, "open"):
            raise ValueError(
                f"unknown dataset format {format!r}: expected MDS(), WebDataset() or TokenFiles()"
            )
        if isinstance(replicas, (str, os.PathLike, Store)):
            replicas = [replicas]
        for r in replicas:
            if isinstance(r, (str, os.PathLike)):
                path = os.fspath(r).removeprefix("file://")
                if "://" not in path and not os.path.isdir(path):
                    raise ShardNotFoundError(f"replica {os.fspath(r)}: no such directory")
        self.config = config or LoaderConfig()
        self.replica_config = replica_config or ReplicaConfig()
        self._storage_options = storage_options
        # What reopens each replica in another process: a Store reopens itself (its settings
        # and backend, wrappers included); a URI opens with the replica retry policy.
        self._specs = [r if isinstance(r, Store) else os.fspath(r) for r in replicas]
        self._replicas: ReplicaSet | None = ReplicaSet(
            list(replicas), config=self.replica_config, storage_options=storage_options
        )
        self._pid = os.getpid()
        self.format = format
        self.layout = format.open(self._replicas)
        self._missing = dict(self._replicas.missing)  # shards some replicas lack, found at open
        self._cache = open_cache(
            self.config.cache_dir,
            self.config.cache_bytes,
            self._replicas.uris,
            version=self._replicas.content_version(),
        )
        self.units: Sequence[Unit] = self.layout.units
        self._unit_samples = unit_samples(self.units)
        self.num_samples = int(self._unit_samples.sum())
        # What a saved position means depends on which samples are where: the units, in order.
        self.fingerprint = xxhash.xxh3_64_hexdigest(
            "\n".join(f"{u.describe()}:{u.num_samples}" for u in self.units).encode()
        )
        if world_size is None:
            world_size = (
                dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            )
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        Reader(rank=rank, world_size=world_size)  # checks them
        self.rank, self.world_size = rank, world_size
        self.transform = transform
        self._check_window()
        self._epoch = 0
        self._resumed = False  # load_state_dict ran and no pass started since
        self._position = 0  # global position the current pass started at
        self._consumed = 0  # samples this rank's consumer received since _position
        self.stats = ConsumerStats()
        self._orders: dict[int, EpochOrder] = {}
        # what units grew to once decoded, which every pass's window starts from
        self._growth = Growth(may_grow=getattr(self.layout, "may_grow", False))
        # what the last pass's workers saw of the replicas, which the next pass's workers start
        # from (StatefulLoader sets it)
        self.carried: Carried | None = None

    def _check_window(self) -> None:
        """All of a shuffle block's units are held at once: ``ValueError`` if the largest
        block's reads do not fit the window; one WARNING if only their decoded samples may not
        (MDS's Python objects), and the window then grows past ``window_bytes`` to hold one."""
        k = self.config.shuffle_block_units if self.config.shuffle else 1
        if k < 2 or len(self.units) < 2:
            return
        read = sum(sorted((u.nbytes for u in self.units), reverse=True)[:k])
        decoded = sum(sorted((u.mem_bytes for u in self.units), reverse=True)[:k])
        window = self.config.window_bytes
        if read > window:
            raise ValueError(
                f"a shuffle block of {k} units may take {read} bytes, more than "
                f"window_bytes={window}: lower shuffle_block_units or raise window_bytes"
            )
        if decoded > window:
            logger.warning(
                "a shuffle block of %d units may take %d bytes decoded, more than "
                "window_bytes=%d: the loader holds a whole block anyway (lower "
                "shuffle_block_units or raise window_bytes to stay within it)",
                k,
                decoded,
                window,
            )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_replicas"] = None
        state["stats"] = None
        state["_orders"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.stats = ConsumerStats()

    @property
    def replicas(self) -> ReplicaSet:
        if self._replicas is None or self._pid != os.getpid():
            self._replicas = ReplicaSet(
                [spec.reopen() if isinstance(spec, Store) else spec for spec in self._specs],
                config=_worker_share(self.replica_config),
                storage_options=self._storage_options,
                missing=self._missing,
            )
            if self.carried is not None:  # a new worker process of a StatefulLoader
                self._replicas.start_as(self.carried)
            self._pid = os.getpid()
        return self._replicas

    @property
    def cache(self) -> ShardCache | None:
        """The local cache of units read from remote replicas (``LoaderConfig.cache_dir``)."""
        return self._cache

    def feed(self, *, batch_size: int, reports_dir: str | None = None) -> LoaderFeed:
        """What one DataLoader of ``batch_size`` iterates for a :class:`StatefulLoader`: this
        dataset's samples, its workers taking ``batch_size`` of them in turn, not counted
        here (the StatefulLoader counts what its consumer receives). With ``reports_dir``
        each worker leaves its figures there (:class:`ReaderReports`)."""
        return LoaderFeed(self, batch_size=batch_size, reports_dir=reports_dir)

    # -- order and state ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration; after
        :meth:`load_state_dict`, the epoch it resumes keeps its position until a pass starts
        (the ``for epoch in ...: set_epoch(epoch)`` habit of DistributedSampler loops)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._resumed and epoch == self._epoch:
            logger.info(
                "rank %d: set_epoch(%d) keeps the position %d it resumes at",
                self.rank,
                epoch,
                self.position,
            )
            return
        self._epoch, self._position, self._consumed = epoch, 0, 0
        self._resumed = False

    def order(self, epoch: int | None = None) -> EpochOrder:
        epoch = self._epoch if epoch is None else epoch
        if epoch not in self._orders:
            self._orders = {
                epoch: EpochOrder(
                    self._unit_samples,
                    seed=self.config.seed,
                    epoch=epoch,
                    shuffle=self.config.shuffle,
                    block_units=self.config.shuffle_block_units,
                )
            }
        return self._orders[epoch]

    @property
    def position(self) -> int:
        """Global position of the next sample this rank's consumer will receive, in the epoch
        order (every rank has received the samples before it, in lock step)."""
        return self._position + self._consumed * self.world_size

    def begin_pass(self) -> None:
        """Start a pass over the epoch at the consumer's :attr:`position`."""
        self._position, self._consumed = self.position, 0
        self._resumed = False

    def received(self, n: int) -> None:
        """The consumer received ``n`` more samples of this pass."""
        self._consumed += n

    def end_pass(self) -> None:
        """The pass read the epoch to its end: the next pass starts the next epoch."""
        self._epoch, self._position, self._consumed = self._epoch + 1, 0, 0

    def rank_length(self) -> int:
        """Samples this rank still reads in the current epoch."""
        return self.order().rank_length(self.position, self.world_size)

    def __len__(self) -> int:
        return self.rank_length()

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the epoch and the global position of the next unseen sample."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self.position,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "shuffle_block_units": self.config.shuffle_block_units,
            "num_samples": self.num_samples,
            "dataset": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, possibly saved with another world size or worker count."""
        version = state.get("version") if isinstance(state, dict) else None
        if type(version) is not int or version != STATE_VERSION:  # True == 1, 1.0 == 1 too
            raise ValueError(
                f"loader state version {state.get('version') if isinstance(state, dict) else state!r}"
                f" is not {STATE_VERSION}"
            )
        for key, mine in (
            ("num_samples", self.num_samples),
            ("seed", self.config.seed),
            ("shuffle", self.config.shuffle),
            ("shuffle_block_units", self.config.shuffle_block_units),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r} but this dataset "
                    f"has {mine!r}: it was saved for another dataset or order"
                )
        saved_for = state.get("dataset")  # absent in states saved before it was recorded
        if saved_for is not None and saved_for != self.fingerprint:
            raise ValueError(
                f"loader state was saved for another dataset (its shards and their sample "
                f"counts differ: fingerprint {saved_for}, this dataset's {self.fingerprint})"
            )
        try:
            # index(), not int(): a float or a string is a damaged state, not one to truncate
            epoch, position = operator.index(state["epoch"]), operator.index(state["position"])
            if isinstance(state["epoch"], bool) or isinstance(state["position"], bool):
                raise TypeError("a bool")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"loader state has no integer epoch and position ({type(exc).__name__}: {exc})"
            ) from None
        if not 0 <= epoch < 2**63:  # an int64, as a checkpoint's JSON or tensor holds it
            raise ValueError(f"loader state epoch {str(epoch)[:40]} is not in [0, 2**63)")
        if not 0 <= position <= self.num_samples:
            raise ValueError(
                f"loader state position {position} is outside the dataset (0..{self.num_samples})"
            )
        self._epoch, self._position, self._consumed = epoch, position, 0
        self._resumed = True
        if state.get("world_size") != self.world_size:
            logger.info(
                "rank %d: resuming at global position %d saved with world size %s, now %d",
                self.rank,
                position,
                state.get("world_size"),
                self.world_size,
            )

    # -- reading -----------------------------------------------------------------------------

    def _reader(self, batch_size: int) -> tuple[Reader, bool]:
        info = get_worker_info()
        if info is None:
            return Reader(rank=self.rank, world_size=self.world_size), True
        return Reader(
            rank=self.rank,
            world_size=self.world_size,
            worker=info.id,
            num_workers=info.num_workers,
            batch_size=batch_size,
        ), False

    def _fetch(self, unit_id: int) -> Any:
        unit = self.units[unit_id]
        decode = self.layout.decode

        start, end = unit.span()

        def fetch(post: Callable[[Any, str], Any]) -> Any:
            view = self.layout.reads_views
            if start is None:
                return self.replicas.read_whole(unit.key, unit.nbytes, decode=post, view=view)
            return self.replicas.read(
                unit.key, start, end, size_hint=unit.nbytes, decode=post, view=view
            )

        if self._cache is None:
            data = fetch(lambda raw, replica: decode(unit, raw, replica))
        else:
            data = read_unit(self._cache, unit, fetch, decode)
        self.stats.bytes_read += unit.nbytes
        return data

    def _blocks(
        self, reader: Reader, reports: tuple[str, int] | None = None
    ) -> Iterator[tuple[BlockPlan, Window]]:
        """Each block of this reader's plan with the window that fetches its units. In a
        DataLoader worker, ``reports`` (a directory and the pass number) is where it leaves its
        figures (:class:`ReaderReports`)."""
        order = self.order()
        plans = order.plan(reader, self._position)
        queued: deque[BlockPlan] = deque()
        # Opened here, before the window's threads start: in a new process each of them
        # would otherwise open a replica set of its own, and all but one would be dropped
        # (their health and figures with them).
        self.replicas  # noqa: B018
        worker = get_worker_info()
        if worker is None:
            reports = None
        if reports is not None:  # a worker reports this pass only, whatever it inherited
            self.stats = ConsumerStats()
            if self._cache is not None:
                self._cache.stats = CacheStats()

        def schedule() -> Iterator[tuple[int, int]]:
            for plan in plans:
                queued.append(plan)
                for u in plan.needed:
                    yield u, self.units[u].mem_bytes

        window = Window(
            schedule(),
            self._fetch,
            window_reads=self.config.window_reads,
            window_bytes=self.config.window_bytes,
            stats=self.stats,
            growth=self._growth,
        )
        last_log = last_report = time.monotonic()
        try:
            while True:
                if not queued:
                    window.top_up()
                    if not queued:
                        return
                now = time.monotonic()
                if reports is not None and now - last_report >= _REPORT_S:
                    last_report = now  # before the yield, which may suspend this worker
                    ReaderReports.write(*reports, worker.id, self.report())
                yield queued.popleft(), window
                interval = self.config.log_interval_s
                if interval and time.monotonic() - last_log >= interval:
                    last_log = time.monotonic()
                    logger.info(
                        "loader rank %d worker %d: %s", reader.rank, reader.worker, self.metrics()
                    )
        finally:
            if reports is None:
                window.close()
            else:
                # Reads still in flight (the pass broken off) count in the final report, written
                # when the last one ends; until then (or if this worker is killed first) the
                # figures so far stand.
                directory, n = reports
                w = worker.id
                ReaderReports.write(directory, n, w, self.report())
                window.close(
                    then=lambda: ReaderReports.write(directory, n, w, self.report(final=True))
                )

    def __iter__(self) -> Iterator[Any]:
        return self._samples(self.config.batch_size, counted=True)

    def _samples(
        self, batch_size: int, *, counted: bool, reports: tuple[str, int] | None = None
    ) -> Iterator[Any]:
        """The samples of this pass for this process: the rank's, or a DataLoader worker's
        share of them (in turns of ``batch_size``). In the process itself (not in a worker) and
        ``counted``, each sample counts as received by the consumer."""
        reader, in_process = self._reader(batch_size)
        count = counted and in_process
        if counted and not in_process:
            warnings.warn(
                "a ShardDataset iterated by DataLoader workers cannot count what the consumer "
                "receives: its state_dict() stays at the pass's start; use "
                "loaders.StatefulLoader(dataset, batch_size=..., num_workers=...) to resume "
                "exactly",
                stacklevel=2,
            )
        if count:
            self.begin_pass()
        transform = self.transform
        for plan, window in self._blocks(reader, reports):
            units, local = plan.units.tolist(), plan.local.tolist()
            last = {u: j for j, u in enumerate(units)}
            for j, (u, k) in enumerate(zip(units, local)):
                data = window.get(u)
                if isinstance(data, np.ndarray):
                    sample: Any = {
                        "tokens": data[k].copy(),
                        "__index__": self.units[u].first_id + k,
                    }
                else:
                    sample = data[k]
                if last[u] == j:
                    window.release(u)
                if transform is not None:
                    sample = transform(sample)
                self.stats.samples += 1
                if count:
                    self.received(1)
                yield sample
        if count:
            self.end_pass()

    def iter_batches(self, batch_size: int) -> Iterator[Any]:
        """Batches of ``batch_size`` samples in this rank's order, in this process.

        Token files give ``{"tokens": uint array (B, sample_tokens), "__index__": (B,)}`` cut
        from the read buffers with one copy (none for consecutive rows); other formats give
        lists of samples, ``transform`` run on each. The consumer count advances by each
        batch's length. A token dataset with a ``transform`` is refused (``ValueError``): its
        batches are arrays, cut with no sample of its own to transform.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.transform is not None and isinstance(self.format, TokenFiles):
            raise ValueError(
                "iter_batches() gives token batches as arrays, where a per-sample transform "
                "cannot run: iterate the dataset (or StatefulLoader) to transform each sample, "
                "or transform each batch"
            )
        return self._batches(batch_size)

    def _batches(self, batch_size: int) -> Iterator[Any]:
        reader = Reader(rank=self.rank, world_size=self.world_size)
        self.begin_pass()
        first_ids = np.fromiter((u.first_id for u in self.units), np.int64, len(self.units))
        pending: list[tuple[np.ndarray, np.ndarray]] = []
        pending_n = 0
        # Batches that mix units are gathered (copied) out of the block's units laid end to end
        # in this buffer, reused from block to block: no fresh pages to fault in per block.
        joined: np.ndarray | None = None
        carried: list[Any] = []  # other formats' samples of a batch not yet full
        for plan, window in self._blocks(reader):
            arrays = [window.get(u) for u in plan.needed]
            if not isinstance(arrays[0], np.ndarray):
                samples = [
                    arrays[plan.needed.index(u)][k]
                    for u, k in zip(plan.units.tolist(), plan.local.tolist())
                ]
                for u in plan.needed:
                    window.release(u)
                if self.transform is not None:
                    samples = [self.transform(sample) for sample in samples]
                carried.extend(samples)
                while len(carried) >= batch_size:
                    yield self._emit_samples(carried[:batch_size])
                    del carried[:batch_size]
                continue
            needed = np.asarray(plan.needed, dtype=np.int64)
            by_id = np.argsort(needed)
            unit_slots = by_id[np.searchsorted(needed[by_id], plan.units)]
            local = plan.local
            ids = first_ids[plan.units] + local
            n = len(local)
            # Samples k-1 and k share a run when they are consecutive rows of one unit; a batch
            # within one run is a view of that unit's rows.
            breaks = np.ones(n, dtype=np.int64)
            breaks[1:] = (unit_slots[1:] != unit_slots[:-1]) | (local[1:] != local[:-1] + 1)
            run_of = np.cumsum(breaks).tolist()
            slots, rows_in_unit = unit_slots.tolist(), local.tolist()
            block = rows = None  # the block's units end to end, made only when a batch mixes
            i = 0
            while i < n:
                take = min(batch_size - pending_n, n - i)
                j = i + take
                if run_of[i] == run_of[j - 1]:
                    row = rows_in_unit[i]
                    piece = arrays[slots[i]][row : row + take]  # a view, no copy
                else:
                    if block is None:
                        lengths = [len(a) for a in arrays]
                        total = sum(lengths)
                        if len(arrays) == 1:
                            block = arrays[0]
                        else:
                            if (
                                joined is None
                                or len(joined) < total
                                or joined.dtype != arrays[0].dtype
                            ):
                                joined = np.empty((total, *arrays[0].shape[1:]), arrays[0].dtype)
                            block = np.concatenate(arrays, out=joined[:total])
                        rows = np.cumsum([0] + lengths[:-1])[unit_slots] + local
                    piece = block[rows[i:j]]
                pending.append((piece, ids[i:j]))
                pending_n += take
                i = j
                if pending_n == batch_size:
                    yield self._emit_tokens(pending)
                    pending, pending_n = [], 0
            for u in plan.needed:
                window.release(u)
        if pending:
            yield self._emit_tokens(pending)
        if carried:
            yield self._emit_samples(carried)
        self.end_pass()

    def _emit_samples(self, batch: list[Any]) -> list[Any]:
        self.received(len(batch))
        self.stats.samples += len(batch)
        return batch

    def _emit_tokens(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        if len(pieces) == 1:
            tokens, ids = pieces[0]
        else:
            tokens = np.concatenate([p for p, _ in pieces])
            ids = np.concatenate([i for _, i in pieces])
        self.received(len(ids))
        self.stats.samples += len(ids)
        return {"tokens": tokens, "__index__": ids}

    def metrics(self) -> dict[str, Any]:
        """Consumer wait and window figures, and per-replica request figures, of this process."""
        cache = {} if self._cache is None else {"cache": self._cache.metrics()}
        return {"consumer": self.stats.as_dict(), **self.replicas.metrics(), **cache}

    def report(self, *, final: bool = False) -> ReaderReport:
        """This process's figures (live objects: pickle to keep them as they are now)."""
        replicas = self.replicas
        return ReaderReport(
            consumer=self.stats,
            reads=replicas.stats,
            replicas=replicas.replica_stats(),
            health=replicas.health(),
            cache=None if self._cache is None else self._cache.stats,
            final=final,
            hedge=replicas.hedger.samples(),
        )


def _worker_share(config: ReplicaConfig) -> ReplicaConfig:
    """``config`` for this process: in one of a DataLoader's ``n`` workers, each a reader of
    its own, the hedge bucket holds ``hedge_burst / n`` (at least one hedge), so that a pass's
    workers together hedge no more back to back than one reader would."""
    info = get_worker_info()
    if info is None or info.num_workers < 2:
        return config
    return dataclasses.replace(config, hedge_burst=max(1.0, config.hedge_burst / info.num_workers))


def _one_line_worker_error(exc: LoaderError) -> LoaderError | None:
    """The loader's own one-line error a DataLoader worker raised, naming the worker, where torch
    re-raised it with the worker's whole traceback as its message; None for any other."""
    first, _, rest = str(exc).partition("\n")
    lines = [line for line in rest.splitlines() if line.strip()]
    prefix = f"{type(exc).__module__}.{type(exc).__qualname__}: "
    caught = f"Caught {type(exc).__name__} "
    if not first.startswith(caught) or not lines or not lines[-1].startswith(prefix):
        return None
    return type(exc)(f"{lines[-1][len(prefix) :]} ({first[len(caught) :].rstrip('.')})")


class LoaderFeed(IterableDataset):
    """A :class:`ShardDataset` as one DataLoader iterates it (:meth:`ShardDataset.feed`); the
    workers take it, dataset included, as each pass starts them."""

    def __init__(self, dataset: ShardDataset, *, batch_size: int, reports_dir: str | None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.reports_dir = reports_dir
        self.report_pass = 0
        """The pass the workers report for: set before each pass starts them."""

    def __iter__(self) -> Iterator[Any]:
        reports = None if self.reports_dir is None else (self.reports_dir, self.report_pass)
        return self.dataset._samples(self.batch_size, counted=False, reports=reports)


class StatefulLoader:
    """A ``torch.utils.data.DataLoader`` over a :class:`ShardDataset` that counts the samples its
    consumer received, so ``state_dict()`` is exact under any ``num_workers``."""

    def __init__(
        self,
        dataset: ShardDataset,
        *,
        batch_size: int = 1,
        num_workers: int = 0,
        **dataloader_kwargs: Any,
    ) -> None:
        for bad in ("sampler", "batch_sampler", "shuffle"):
            if dataloader_kwargs.get(bad):
                raise ValueError(f"StatefulLoader orders samples itself: do not pass {bad}")
        if dataloader_kwargs.get("in_order", True) is not True:
            raise ValueError(
                "StatefulLoader counts batches in the order they are read: do not pass "
                "in_order=False (a resumed run would repeat some samples and skip others)"
            )
        if dataloader_kwargs.get("persistent_workers"):
            raise ValueError(
                "StatefulLoader needs fresh workers each pass "
                "(persistent_workers=False) to hand them the resume position"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        # Only this loader's workers report here (not a DataLoader of the user's over the same
        # dataset, nor another StatefulLoader's).
        self._reports = ReaderReports() if num_workers else None
        self._feed = dataset.feed(
            batch_size=batch_size, reports_dir=self._reports.directory if self._reports else None
        )
        self._loader = DataLoader(
            self._feed, batch_size=batch_size, num_workers=num_workers, **dataloader_kwargs
        )
        self.stats = ConsumerStats()

    def __len__(self) -> int:
        """Batches left in this pass (the last, short one too unless ``drop_last``)."""
        whole, short = divmod(self.dataset.rank_length(), self.batch_size)
        return whole + (1 if short and not self._loader.drop_last else 0)

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        ds.begin_pass()
        left = ds.rank_length()
        whole_epoch = ds.position == 0
        batches = 0
        if self._reports is not None:
            ds.carried = self._reports.carried()
            if not ds.carried and ds._replicas is not None:
                ds.carried = ds._replicas.carried()  # no pass yet: what the open saw
        self._feed.report_pass += 1
        it = iter(self._loader)  # starts the workers, which take the dataset as it is now
        while True:
            t0 = time.monotonic()
            try:
                batch = next(it)
            except StopIteration:
                break
            except LoaderError as exc:
                _stop_workers(it)  # not left to the garbage collector, with the error's frames
                one = _one_line_worker_error(exc)
                if one is None:
                    raise
                raise one from None
            except BaseException:
                _stop_workers(it)
                raise
            waited = time.monotonic() - t0
            self.stats.wait.record(waited)
            self.stats.wait_s += waited
            self.stats.waits += 1
            n = min(self.batch_size, left)
            left -= n
            ds.received(n)
            self.stats.samples += n
            batches += 1
            yield batch
        if whole_epoch and batches == 0:
            raise ValueError(
                f"epoch {ds.epoch} gave rank {ds.rank} no batch ({ds.num_samples} samples over "
                f"{ds.world_size} ranks, batch_size={self.batch_size}"
                f"{', drop_last=True' if self._loader.drop_last else ''}): a loop over epochs "
                "would never get one"
            )
        ds.end_pass()

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def metrics(self) -> dict[str, Any]:
        """The consumer's wait for batches (``consumer``: this process's), and the figures of
        the processes that read, summed over every worker of every pass so far (the latest
        report of each, about a second old at most while it runs): ``readers`` (their wait for
        reads and their window), ``reads``, ``replicas`` (with ``health``: how many workers of
        the newest pass last saw the replica in each state) and ``cache``. Without workers,
        this process's figures. See docs/loaders.md, "Metrics"."""
        # This process's figures count too: its requests at open, its reads without workers.
        here = self.dataset.report()
        if self._reports is None:
            report = ReaderReports.merged(None, here)
            health = {uri: {state: 1} for uri, state in here.health.items()}
        else:
            workers, health = self._reports.collect()
            report = ReaderReports.merged(workers, here)
        waited = self.stats.as_dict()
        out: dict[str, Any] = {
            "consumer": {
                "samples": waited["samples"],
                "batches": waited["waits"],
                "wait_s": waited["wait_s"],
                "wait_p99_s": waited["wait_p99_s"],
            },
            "workers": self._loader.num_workers,
            "readers": report.consumer.as_dict(),
            "reads": report.reads.as_dict(),
            "replicas": {
                uri: {**stats.as_dict(), "health": health.get(uri, {})}
                for uri, stats in report.replicas.items()
            },
        }
        cache = self.dataset.cache
        if cache is not None:
            out["cache"] = {
                **(report.cache or CacheStats()).as_dict(),
                "cached_bytes": cache.cached_bytes(),
                "budget_bytes": cache.budget_bytes,
            }
        return out


def _stop_workers(it: Any) -> None:
    """Shut the worker processes of DataLoader iterator ``it`` down now (a failed pass's: its
    exception's traceback keeps ``it`` alive until a garbage collection, and a process forked
    meanwhile, as the next pass's workers, would run its finalizer)."""
    shutdown = getattr(it, "_shutdown_workers", None)  # torch's, private; absent: no workers
    if shutdown is not None:
        shutdown()


__all__ = ["LoaderFeed", "ShardDataset", "StatefulLoader"]
