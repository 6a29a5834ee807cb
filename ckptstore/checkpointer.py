"""The high-level API for training loops: ``Checkpointer(uri).save(step, state)``.

One save goes through these stages; only the first runs on the caller's thread::

    stage    flatten the state, lay tensors out, copy them into a pooled host buffer
    ---- save() returns here; the rest runs on the checkpointer's background thread ----
    encode   hash each chunk, skip it if stored, byte-group + zstd it   (encode_threads)
    put      write-once upload of new chunks, then the rank's index     (store concurrency)
    commit   ranks exchange index refs; rank 0 writes the manifest last, then applies retention

Rank 0 holds the save's one lease from before any rank looks for stored chunks until the step's
commit is decided, so garbage collection never deletes a chunk the save reuses; it alone lists
the committed steps, and hands each rank where its own index of the latest one is
(``ckptstore.save``).

A failed save's error is reported once: by its ``handle.wait()``; if nobody waited for it, by the
next ``wait()``, ``save()`` (that step is then not saved) or ``close()``. After that the
Checkpointer saves again. With ``torch.distributed`` initialised, every rank calls ``save`` with the same step;
each writes its own chunks and index and rank 0 commits once all have succeeded.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import json
import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any

import torch

from ckptstore import telemetry
from ckptstore.catalog import list_steps, load_manifest, resolve_step
from ckptstore.device_load import read_into
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    FormatVersionError,
    PartialLoadError,
    UnsupportedStateError,
)
from ckptstore.format import ChunkInfo, Manifest, check_step
from ckptstore.options import (
    EncodingOptions,
    PreemptionOptions,
    ReadOptions,
    RetentionOptions,
    StagingOptions,
    StorageOptions,
    TierOptions,
    resolve,
)
from ckptstore.peer import PeerReplicas, tensors_from_replica
from ckptstore.pipeline import parse_dtype
from ckptstore.preemption import SigtermGuard
from ckptstore.save import (
    SaveEngine,
)
from ckptstore.saver import SaveHandle, SaveJob, SaveWorker, TensorMeta
from ckptstore.shared_read import (
    ExchangeStats,
    SharedChunks,
    needed_chunks,
    plan_shared_read,
)
from ckptstore.state import finish_load, flatten, plan_load
from ckptstore.steps import CHECKPOINTER, StepView
from ckptstore.store import niced, open_store
from ckptstore.tiers.drain import DrainQueue
from ckptstore.tiers.group import RankGroup as _Group
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import (
    Topology,
    node_identity,
    store_identity,
)
from ckptstore.tiers.restore import DURABLE, PEER, Candidate, LoadReport, plan_sources
from ckptstore.tiers.saving import TierSaver
from ckptstore.tiers.transfer import Transfer, TransferStats, transfer
from ckptstore.tree import tensor_indexes

logger = logging.getLogger(__name__)


class Checkpointer:
    """Asynchronous, verified, deduplicated checkpoints of a training state in ``uri``.

    Args:
        uri: where the checkpoints live: a path, ``file://``, ``memory://``, ``s3://b/prefix``.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        keep_last: after each commit keep only the newest this many steps (None: keep all).
        storage, encoding, staging, retention, tiers, reads, preemption: option objects of
            ``ckptstore.options`` (each field documented there), the same ones
            ``ckptstore.dcp.StoreWriter``/``StoreReader`` take; ``staging="device"`` is short
            for ``StagingOptions(mode="device")``. With ``tiers=TierOptions(local_dir=...)``
            every save is committed to node-local storage first (``wait()`` returns once
            every rank's copy is there; a rank that cannot write it sends the save to ``uri``,
            one warning), copied to peers (``peer_copies``) and drained to ``uri`` every
            ``durable_every`` saves (``handle.durable``); ``load`` takes the newest save every
            rank can get, each rank from its own copy, a peer's, or ``uri``, whichever verifies
            first (docs/FORMAT.md, "Tiers"). ``steps()``/``latest()`` list ``uri``.
        process_group: the ranks that save together (default: the whole world, if any).
        no_dist: this process saves and loads alone, as rank 0 of 1, even under
            ``torch.distributed`` (as DCP's ``no_dist``): for a state every rank holds whole,
            saved by one rank (Lightning's DDP) and loaded by each rank on its own.
        **deprecated: the flat keywords of earlier releases (``compression=``,
            ``local_dir=``, ...), folded into their option object with a
            ``DeprecationWarning``.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        storage: StorageOptions | None = None,
        encoding: EncodingOptions | None = None,
        staging: StagingOptions | str | None = None,
        retention: RetentionOptions | None = None,
        tiers: TierOptions | None = None,
        reads: ReadOptions | None = None,
        preemption: PreemptionOptions | None = None,
        process_group: Any = None,
        no_dist: bool = False,
        **deprecated: Any,
    ) -> None:
        given = dict(
            storage=storage,
            encoding=encoding,
            staging=staging,
            retention=retention,
            tiers=tiers,
            reads=reads,
            preemption=preemption,
        )
        o = resolve("Checkpointer", given, deprecated)
        self.options = o
        store = o["storage"].store
        timeout_s, background_nice = o["storage"].timeout_s, o["storage"].background_nice
        staging_mode, when_busy = o["staging"].mode, o["staging"].when_busy
        self.shared_read_budget_bytes = o["reads"].shared_read_budget_bytes
        if o["preemption"].handle_sigterm:
            SigtermGuard.check_installable(o["preemption"].sigterm_grace_s)
        self._policy = o["tiers"].policy()
        if self._policy is not None and staging_mode == "peer":
            raise ValueError("staging='peer' and local_dir are two ways of peer copies: pick one")
        self.store = store or open_store(
            uri,
            storage_options=storage_options,
            timeout_s=timeout_s,
            max_concurrency=o["storage"].max_concurrency,
            thread_nice=background_nice,
        )
        self._save_thread_nice = niced(background_nice)
        self.when_busy = when_busy
        self.engine = SaveEngine.build(o, keep_last=keep_last, store=self.store)
        group_timeout_s = o["storage"].group_timeout_s(o["retention"].gc_wait_s)
        self._group = _Group(process_group, timeout_s=group_timeout_s, no_dist=no_dist)
        self.rank = self._group.rank
        if self._group.active and when_busy == "skip":
            raise ValueError(
                "when_busy='skip' is single-process only: ranks could disagree "
                "on which saves to skip"
            )
        self._peers = None
        if staging_mode == "peer":
            if not self._group.active:
                raise ValueError("staging='peer' needs torch.distributed with 2 or more ranks")
            ranks_per_node = o["staging"].ranks_per_node
            if ranks_per_node is None:
                ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if ranks_per_node >= self._group.world_size:
                ranks_per_node = 1  # one node: the next rank guards
            self._peers = PeerReplicas(self._group.group, ranks_per_node=ranks_per_node)
        self._local: LocalTier | None = None
        self._topology: Topology | None = None
        self._drains: DrainQueue | None = None
        self._tiers: TierSaver | None = None
        self.last_load = LoadReport()
        if self._policy is not None:
            self._local = LocalTier(
                self._policy,
                self.engine,
                rank=self.rank,
                world_size=self._group.world_size,
                durable_uri=store_identity(self.store),
                timeout_s=timeout_s,
                thread_nice=background_nice,
            )
            if self._policy.peer_copies:
                if not self._group.active:
                    raise ValueError("peer_copies needs torch.distributed with 2 or more nodes")
                nodes = self._group.gather(node_identity(o["tiers"].node_rank, self.rank))
                self._topology = Topology.build(nodes, self._policy.peer_copies)
            self._tiers = TierSaver(
                self._policy,
                self._local,
                self._group,
                self._topology,
                durable_uri=self.store.uri,
            )
            # Drains run collectives of their own while the save thread runs the next save's.
            self._drains = DrainQueue(
                local=self._local,
                group=_Group(process_group, timeout_s=group_timeout_s, no_dist=no_dist),
                store=self.store,
                thread_nice=self._save_thread_nice,
            )
        self.last_load_source: str | None = None
        self.last_load_left_out: list[str] = []
        self.last_load_exchange: ExchangeStats | None = None  # chunks shared with other ranks
        self._session = self._group.broadcast(uuid.uuid4().hex[:12])
        self._saves = 0
        self.skipped_saves = 0
        self._closed_event = threading.Event()
        self._sigterm = (
            SigtermGuard(
                grace_s=o["preemption"].sigterm_grace_s,
                ckpt=f"rank {self.rank} checkpointer of {self.store.uri}",
                closed=self._closed_event,
            )
            if o["preemption"].handle_sigterm
            else None
        )
        self._saver = SaveWorker(
            engine=self.engine,
            store=self.store,
            group=self._group,
            tiers=self._tiers,
            drains=self._drains,
            peers=self._peers,
            thread_nice=self._save_thread_nice,
        )
        self._closed = False
        # A script that ends right after save() must not lose that save. Threading's exit hooks
        # run before atexit's, last registered first: this one runs while concurrent.futures
        # still accepts work (s3fs resolves hosts through an executor).
        this = weakref.ref(self)
        threading._register_atexit(lambda: (c := this()) is not None and c._close_at_exit())

    @property
    def last_peer_copy(self) -> TransferStats | None:
        """What this rank moved in the last save's peer copies (tiers with ``peer_copies``)."""
        return self._saver.last_peer_copy

    # -- public API ---------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: dict | None = None) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        check_step(step)
        self._saver.raise_failure(f"step {step} was not saved")
        t0 = time.perf_counter()
        tree, tensors, numpy = flatten(state)
        user = json.loads(json.dumps(metadata or {}))
        staged = self.engine.stage(tensors, block=self.when_busy == "wait", rank=self.rank)
        self._saves += 1
        if staged is None:
            self.skipped_saves += 1
            telemetry.saves_total.inc(frontend="checkpointer", outcome="skipped")
            telemetry.save_blocked_seconds.observe(
                time.perf_counter() - t0, frontend="checkpointer"
            )
            logger.warning(
                "rank %d: skipping save of step %d: the previous save is still persisting",
                self.rank,
                step,
            )
            return SaveHandle(step, skipped=True)
        handle = SaveHandle(step)
        attempt = f"{self._session}-{self._saves:06d}"
        meta = [TensorMeta(t.dtype, t.shape, t.numel() * t.element_size()) for t in tensors]
        # After SIGTERM a node may not come back: a save then goes to durable storage too, and
        # its handle (which the SIGTERM grace waits for) is done once it is there.
        preempted = self._sigterm is not None and self._sigterm.signalled.is_set()
        durable = (
            self._policy is None
            or self._policy.is_durable(self._saves - self.skipped_saves)
            or preempted
        )
        if self._policy is not None and durable:
            handle.durable = Future()
        self._saver.put(
            SaveJob(step, attempt, tree, meta, numpy, staged, user, handle, durable, preempted)
        )
        if self._sigterm is not None:
            self._sigterm.watch(handle)
        blocked = time.perf_counter() - t0
        telemetry.save_blocked_seconds.observe(blocked, frontend="checkpointer")
        logger.debug("rank %d: step %d staged in %.3fs", self.rank, step, blocked)
        return handle

    def reserve(self, state_or_nbytes: Any) -> Future[None]:
        """Allocate the host staging memory for saves of ``state_or_nbytes`` (a state as
        ``save`` takes it, or a byte count) ahead, on a background thread, a bounded slab at
        a time (pinned with an accelerator), so that the first save does not allocate it on
        the loop's thread. Returns a future, done once the memory is reserved (its error
        re-raised by ``result()``); a save started before waits for it instead of allocating
        a second buffer."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if isinstance(state_or_nbytes, int) and not isinstance(state_or_nbytes, bool):
            nbytes = state_or_nbytes
        else:
            nbytes = self.engine.staged_bytes(flatten(state_or_nbytes)[1])
        return self.engine.reserve(nbytes)

    def wait(self) -> None:
        """Block until every save so far is committed; raise the error of the first failed
        save that no ``wait()`` raised yet."""
        self._saver.wait()
        if self._drains is not None:
            self._drains.wait()  # and its drain to durable storage
        self._saver.raise_failure()
        if self._drains is not None:
            self._drains.raise_failures()

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (``handle_sigterm=True``): save the current step and
        leave the loop; the process then exits as SIGTERM would have once the Checkpointer
        closes (at the latest ``sigterm_grace_s`` after the signal)."""
        if self._sigterm is None:
            return False
        if not self._sigterm.signalled.is_set():
            self._sigterm.aware = True
        return self._sigterm.signalled.is_set()

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list_steps(self.store)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(
        self, state: Any, step: int | str = "latest", *, fallback: bool = False, strict: bool = True
    ) -> int:
        """Load ``step`` into ``state`` in place (tensors copied into, stateful objects
        given ``load_state_dict``); returns the step loaded.

        With ``fallback=True`` (``step`` must be ``"latest"``) a committed step that cannot be
        loaded because it is corrupt or misses objects (``CheckpointCorruptError`` or
        ``CheckpointNotFoundError``, also when raised as ``PartialLoadError``) is skipped, with
        one warning naming it and why, and the next older committed step is tried. If none
        loads, the error names every step and why (``CheckpointNotFoundError`` when each missed
        objects, else ``CheckpointCorruptError``). Any other error (a state that does not match
        the checkpoint, storage that cannot be reached) is raised at once, as without fallback.

        With ``torch.distributed`` initialised every rank calls ``load`` and the ranks agree on
        the outcome: a step is loaded only if it loads on every rank; otherwise every rank
        raises (naming the ranks that failed and why) or, with fallback, every rank goes on to
        the same older step.

        A failed load: tensors are filled in place as their chunks arrive, each chunk once its
        hash checked out; non-tensor values are set and ``load_state_dict`` called only after
        every tensor of the step loaded, on every rank. A load that fails before any byte
        reached the state raises its error and leaves the state untouched; one that fails after
        raises ``PartialLoadError``, whose ``written`` names the tensors that received bytes
        (each may hold a mix of two steps) while nothing else was changed: load again (with
        ``fallback=True`` an older step overwrites them) or rebuild the state before going on.
        (Verifying every chunk before writing any would take a second state-sized buffer or a
        second read of every chunk.)

        ``strict=False`` loads the part of the step the state asks for: saved keys that the
        state's dicts do not have are left out and not read, and keys of the state that the
        step lacks are left alone; a module loads the parameters both have (with ``strict``, a
        module whose keys differ from the step's is refused before any I/O); ``last_load_left_out`` lists both
        (``load({"model": model}, strict=False)`` from a step that also holds the optimizer).
        """

        if fallback and step not in (None, "latest"):
            raise ValueError(f"fallback=True starts from the latest step, got step={step!r}")
        if self._local is not None:
            return self._load_tiered(state, step, fallback, strict)
        candidates: Any = None
        if self.rank == 0:
            try:
                if fallback:
                    candidates = list_steps(self.store)[::-1]
                    if not candidates:
                        raise CheckpointNotFoundError(
                            f"no committed checkpoint in {self.store.uri}"
                        )
                else:
                    candidates = [resolve_step(self.store, step)]
            except (CheckpointError, ValueError) as exc:
                candidates = exc
        candidates = self._group.broadcast(candidates)
        if isinstance(candidates, BaseException):
            raise candidates
        dirty: dict[str, int] = {}  # tensor path -> the failed step whose bytes it last received
        skipped: list[tuple[int, BaseException]] = []
        for chosen in candidates:
            error, skippable, written = self._load_step(state, chosen, dirty, strict)
            if error is None:
                return chosen
            dirty.update(dict.fromkeys(written, chosen))
            if not (fallback and skippable):
                raise self._load_failed(error, dirty)
            skipped.append((chosen, error))
            logger.warning(
                "rank %d: step %d in %s cannot be loaded, trying an older step: %s",
                self.rank,
                chosen,
                self.store.uri,
                self._one_line(error),
            )
        every = "; ".join(f"step {s}: {self._one_line(e)}" for s, e in skipped)
        missing = all(isinstance(e, CheckpointNotFoundError) for _, e in skipped)
        error = (CheckpointNotFoundError if missing else CheckpointCorruptError)(
            f"no committed step in {self.store.uri} could be loaded, every one failed: {every}"
        )
        raise self._load_failed(error, dirty)

    def _load_step(
        self, state: Any, step: int, dirty: dict[str, int], strict: bool = True
    ) -> tuple[BaseException | None, bool, list[str]]:
        """One attempt at loading ``step`` into ``state``, its outcome agreed by every rank:
        the error this rank raises (None: loaded), whether every rank's failure was corrupt or
        missing data (then an older step may load), and the paths of the tensors it wrote."""
        error: BaseException | None = None
        try:
            view = StepView(self.store, self._shared_manifest(step))
            view.require(CHECKPOINTER)
            manifest = view.manifest
            if manifest.world_size != self._group.world_size:
                raise UnsupportedStateError(
                    f"step {step} was saved by {manifest.world_size} rank(s), loading with "
                    f"{self._group.world_size}: resharding is done through ckptstore.dcp"
                )
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement
            error = exc
        replica = None
        if self._peers is not None:
            agreed = self._agree(step, error)  # fetching a replica is collective
            if agreed is not None:
                return (*agreed, [])
            replica = self._peers.fetch(step)
        # Plan: which saved tensor lands in which tensor of the state. Nothing is written yet.
        if error is None:
            try:
                if replica is not None:
                    buffer, meta = replica
                    tensors = tensors_from_replica(buffer, meta)
                    tree = meta["tree"]

                    def describe(i: int):
                        return tensors[i].dtype, list(tensors[i].shape)
                else:
                    index = view.index(self.rank)
                    tree = index.tree

                    def describe(i: int):
                        entry = index.tensors[i]
                        return parse_dtype(entry.dtype), entry.shape

                loader = plan_load(state, tree, describe, strict=strict)
                kinds = {i: k for i, k in tensor_indexes(tree).items() if i in loader.needed}
                stale = sorted(set(dirty) - set(loader.paths.values()))
                if stale:
                    failed = ", ".join(map(str, sorted(set(dirty.values()), reverse=True)))
                    raise UnsupportedStateError(
                        f"step {step} has no tensor for {self._some(stale)}, which the failed load "
                        f"of step {failed} wrote into: loading it cannot make the state whole"
                    )
            except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement
                error = exc
        agreed = self._agree(step, error)
        if agreed is not None:
            return (*agreed, [])
        # Read: the state's tensors are filled in place, chunk by verified chunk; a chunk other
        # ranks also need is fetched by one of them and sent to the others.
        written: set[int] = set()
        try:
            source = self._shared_source({} if replica is not None else needed_chunks(index, kinds))
            if replica is not None:
                for i, dest in loader.dests.items():
                    written.add(i)
                    dest.copy_(tensors[i])
                    tensors[i] = dest
            else:
                wanted = {i: loader.dests.get(i) for i in kinds}
                tensors = read_into(
                    self.store, index, wanted, self.engine.config, written=written, source=source
                )
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement
            error = exc
        paths = sorted(loader.paths[i] for i in written)
        agreed = self._agree(step, error)
        if agreed is not None:
            return (*agreed, paths)
        # Every rank has every tensor: only now are values set and load_state_dict called.
        values = {i: (t.numpy() if kinds[i] else t) for i, t in tensors.items() if i in kinds}
        finish_load(loader, state, tree, values)
        self.last_load_left_out = [f"{p} (not in the state)" for p in loader.left_out]
        self.last_load_left_out += [f"{p} (not in step {step})" for p in loader.not_saved]
        if self.last_load_left_out:
            logger.info(
                "rank %d: step %d loaded with strict=False; left out: %s",
                self.rank,
                step,
                self._some(self.last_load_left_out),
            )
        if replica is not None:
            self.last_load_source = "peer"
            logger.info("rank %d: loaded step %d from its guard's memory", self.rank, step)
        else:
            self.last_load_source = "storage"
            logger.info("rank %d: loaded step %d from %s", self.rank, step, self.store.uri)
        return None, True, paths

    def _load_tiered(self, state: Any, step: int | str, fallback: bool, strict: bool) -> int:
        """``load`` with tiers: the newest save every rank can get from some tier (or ``step``),
        each rank's state from the first of its sources that verifies."""
        assert self._local is not None
        t0 = time.perf_counter()
        wanted = None if step in (None, "latest") else int(step)
        wards = [self.rank] + (self._topology.wards(self.rank) if self._topology else [])
        held: dict[int, dict[int, str]] = {}
        for ward in wards:
            try:
                held[ward] = self._local.copies(ward)
            except Exception as exc:  # noqa: BLE001 - peers or durable storage may serve it
                logger.warning(
                    "rank %d: the local tier of rank %d cannot be read, not offered: %s",
                    self.rank,
                    ward,
                    self._one_line(exc),
                )
        durable: Any = None
        if self.rank == 0:
            try:
                durable = list_steps(self.store)
            except CheckpointError as exc:
                durable = exc
        everything = self._group.gather((held, durable))
        plan: Any = None
        if self.rank == 0:
            try:
                plan = self._plan_tiered(
                    [h for h, _ in everything], durable, wanted, None if fallback else 1
                )
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                plan = exc
        plan = self._group.broadcast(plan)
        if isinstance(plan, BaseException):
            raise plan
        if not fallback:
            plan = plan[:1]
        dirty: dict[str, int] = {}
        skipped: list[tuple[int, BaseException]] = []
        for candidate in plan:
            self.last_load = LoadReport(step=candidate.step)
            error, skippable, written = self._load_candidate(state, candidate, strict)
            self.last_load.seconds = time.perf_counter() - t0
            if error is None:
                self._local.resumed_from = candidate.step  # newer copies go at the next save
                return candidate.step
            dirty.update(dict.fromkeys(written, candidate.step))
            if not (fallback and skippable):
                raise self._load_failed(error, dirty)
            skipped.append((candidate.step, error))
            logger.warning(
                "rank %d: step %d cannot be loaded from any tier, trying an older step: %s",
                self.rank,
                candidate.step,
                self._one_line(error),
            )
        every = "; ".join(f"step {s}: {self._one_line(e)}" for s, e in skipped)
        missing = all(isinstance(e, CheckpointNotFoundError) for _, e in skipped)
        error = (CheckpointNotFoundError if missing else CheckpointCorruptError)(
            f"no step in the tiers ({self._local.policy.local_dir}, peers) or {self.store.uri} "
            f"could be loaded, every one failed: {every}"
        )
        raise self._load_failed(error, dirty)

    def _plan_tiered(
        self,
        held: list[dict[int, dict[int, str]]],
        durable: Any,
        step: int | None,
        limit: int | None,
    ) -> list[Candidate]:
        unlisted = durable if isinstance(durable, BaseException) else None
        if unlisted is not None:
            logger.warning(
                "durable store %s cannot be listed, only local and peer copies are considered: %s",
                self.store.uri,
                self._one_line(unlisted),
            )
            durable = []

        def attempt(s: int) -> str | None:
            try:
                return load_manifest(self.store, s).attempt
            except (CheckpointCorruptError, CheckpointNotFoundError, FormatVersionError) as exc:
                logger.warning("durable step %d in %s unreadable: %s", s, self.store.uri, exc)
                return None  # a storage error is raised: the step may be fine

        plan = plan_sources(held, durable, attempt, step=step, limit=limit)
        if not plan and unlisted is not None:
            raise unlisted
        if not plan:
            where = f"step {step}" if step is not None else "any step"
            raise CheckpointNotFoundError(
                f"no tier holds {where} for every rank: local {self._local.policy.local_dir}"
                f", peers, durable {self.store.uri} (durable steps: "
                f"{', '.join(map(str, durable[-5:])) or 'none'})"
            )
        return plan

    def _load_candidate(
        self, state: Any, candidate: Candidate, strict: bool
    ) -> tuple[BaseException | None, bool, list[str]]:
        """Load ``candidate`` into ``state``: each rank tries its sources in turn, every rank
        taking part in the peer transfers of each turn; the outcome agreed by every rank."""
        assert self._local is not None and self._policy is not None
        world = self._group.world_size
        pending = set(range(world))
        turn = dict.fromkeys(range(world), 0)
        mine = candidate.sources[self.rank]
        written: set[int] = set()
        paths: list[str] = []
        error: BaseException | None = None
        loaded = None
        for _ in range(max(len(s) for s in candidate.sources)):
            transfers = [
                Transfer(src.holder, r, r, candidate.step, candidate.attempt, repair=True)
                for r in sorted(pending)
                if turn[r] < len(candidate.sources[r])
                and (src := candidate.sources[r][turn[r]]).tier == PEER
            ]
            outcomes: dict[Transfer, str | None] = {}
            if transfers:
                t0 = time.perf_counter()
                outcomes, stats = transfer(
                    transfers,
                    group=self._group.group,
                    local=self._local,
                    budget_bytes=self._policy.peer_budget_bytes,
                )
                self.last_load.peer_buffer_bytes = max(
                    self.last_load.peer_buffer_bytes, stats.buffer_bytes
                )
                if any(t.dst == self.rank for t in transfers):
                    self.last_load.add(
                        PEER, stats.received_bytes, time.perf_counter() - t0, stats.chunks_received
                    )
            error = None
            if self.rank in pending:
                source = mine[turn[self.rank]] if turn[self.rank] < len(mine) else None
                try:
                    loaded = self._read_from(state, candidate, source, outcomes, strict, written)
                except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather
                    error = exc
            paths = sorted(loaded[0].paths[i] for i in written) if loaded else paths
            results = self._group.gather(
                None
                if error is None
                else (
                    isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError)),
                    self._one_line(error),
                )
            )
            failed = {r: o for r, o in enumerate(results) if o is not None}
            if not failed:
                break
            if not all(skippable for skippable, _ in failed.values()):
                break  # a state that does not match, not a bad copy: no tier helps
            for r, (_, why) in failed.items():
                source = (
                    candidate.sources[r][turn[r]] if turn[r] < len(candidate.sources[r]) else None
                )
                if r == self.rank:
                    logger.warning(
                        "rank %d: step %d from %s failed, trying the next tier: %s",
                        r,
                        candidate.step,
                        source,
                        why,
                    )
                turn[r] += 1
            pending = set(failed)
            if all(turn[r] >= len(candidate.sources[r]) for r in pending):
                break
        agreed = self._agree(candidate.step, error)
        if agreed is not None:
            return (*agreed, paths)
        loader, tree, kinds, tensors = loaded
        values = {i: (t.numpy() if kinds[i] else t) for i, t in tensors.items() if i in kinds}
        finish_load(loader, state, tree, values)
        self.last_load_left_out = [f"{p} (not in the state)" for p in loader.left_out]
        self.last_load_left_out += [f"{p} (not in step {candidate.step})" for p in loader.not_saved]
        self.last_load_source = self.last_load.source
        self.last_load.count()
        logger.info(
            "rank %d: loaded step %d from %s", self.rank, candidate.step, self.last_load.source
        )
        return None, True, paths

    def _read_from(
        self,
        state: Any,
        candidate: Candidate,
        source: Any,
        outcomes: dict[Transfer, str | None],
        strict: bool,
        written: set[int],
    ) -> tuple[Any, Any, dict[int, bool], dict[int, torch.Tensor]]:
        """This rank's tensors of ``candidate`` from ``source``, verified chunk by chunk."""
        assert self._local is not None
        step = candidate.step
        if source is None:
            raise CheckpointNotFoundError(f"rank {self.rank}: no tier holds a copy of step {step}")
        if source.tier == PEER:
            outcome = outcomes.get(
                Transfer(source.holder, self.rank, self.rank, step, candidate.attempt, repair=True)
            )
            if outcome is not None:
                raise CheckpointCorruptError(f"peer copy from rank {source.holder}: {outcome}")
        t0 = time.perf_counter()
        store = self.store if source.tier == DURABLE else self._local.store(self.rank)
        view = StepView(store, load_manifest(store, step))
        view.require(CHECKPOINTER)
        manifest = view.manifest
        if manifest.attempt != candidate.attempt:
            raise CheckpointNotFoundError(
                f"{store.uri} holds another save of step {step} ({manifest.attempt})"
            )
        if source.tier == DURABLE:
            if manifest.world_size != self._group.world_size:
                raise UnsupportedStateError(
                    f"step {step} was saved by {manifest.world_size} rank(s), loading with "
                    f"{self._group.world_size}: resharding is done through ckptstore.dcp"
                )
            index = view.index(self.rank)
        else:
            if not self._local.belongs(manifest, self.rank):
                raise CheckpointNotFoundError(f"{store.uri}: step {step} is not this job's copy")
            index = view.index(0)

        def describe(i: int):
            entry = index.tensors[i]
            return parse_dtype(entry.dtype), entry.shape

        loader = plan_load(state, index.tree, describe, strict=strict)
        kinds = {i: k for i, k in tensor_indexes(index.tree).items() if i in loader.needed}
        wanted = {i: loader.dests.get(i) for i in kinds}
        tensors = read_into(store, index, wanted, self.engine.config, written=written)
        digests = {seg.chunk for i in kinds for seg in index.tensors[i].segments}
        nbytes = sum(index.chunks[d].stored for d in digests if d in index.chunks)
        if source.tier == PEER:  # its bytes were counted as the transfer received them
            nbytes, digests = 0, set()
        self.last_load.add(source.tier, nbytes, time.perf_counter() - t0, len(digests))
        self.last_load.source = source.tier
        return loader, index.tree, kinds, tensors

    def _shared_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, read by rank 0 and broadcast: one GET of ``commits/`` per
        load however many ranks (it is one prefix). Collective; raises on every rank if rank 0
        could not read it."""
        found: Any = None
        if self.rank == 0:
            try:
                found = load_manifest(self.store, step)
            except CheckpointError as exc:
                found = exc
        found = self._group.broadcast(found)
        if isinstance(found, BaseException):
            if self.rank == 0:
                raise found
            message = f"rank 0 could not read the manifest: {self._one_line(found)}"
            try:
                raised = type(found)(message)
            except Exception:  # noqa: BLE001 - an error class with another signature
                raised = CheckpointError(message)
            raise raised
        return found

    def _shared_source(self, needs: dict[str, ChunkInfo]) -> SharedChunks | None:
        """Where this rank's chunks come from when other ranks need some of them too (None:
        from storage alone). Collective: every rank calls it in each load's read."""
        self.last_load_exchange = None
        if not self._group.active:
            return None
        source = plan_shared_read(
            self.store,
            needs,
            self.engine.config,
            group=self._group.group,
            budget_bytes=self.shared_read_budget_bytes,
        )
        if source is not None:
            self.last_load_exchange = source.stats
        return source

    def _agree(self, step: int, error: BaseException | None) -> tuple[BaseException, bool] | None:
        """Every rank's outcome of a phase of loading ``step``: None if it went well on every
        rank, else the error this rank raises and whether every failure was corrupt or missing
        data (both the same on every rank)."""

        def missing_or_corrupt(exc: BaseException) -> bool:
            return isinstance(exc, (CheckpointCorruptError, CheckpointNotFoundError))

        if not self._group.active:
            return None if error is None else (error, missing_or_corrupt(error))
        mine = None
        if error is not None:
            kind = next(
                (c for c in type(error).__mro__ if c.__module__ == CheckpointError.__module__),
                CheckpointError,
            )
            mine = (kind, self._one_line(error), missing_or_corrupt(error))
        failed = [(r, o) for r, o in enumerate(self._group.gather(mine)) if o is not None]
        if not failed:
            return None
        skippable = all(o[2] for _, o in failed)
        if error is not None and not isinstance(error, Exception):
            return error, skippable  # KeyboardInterrupt and the like stay what they are
        why = "; ".join(f"rank {r}: {o[1]}" for r, o in failed[:4])
        if len(failed) > 4:
            why += f"; and {len(failed) - 4} more rank(s)"
        message = (
            f"step {step} failed to load on {len(failed)} of {self._group.world_size} "
            f"rank(s): {why}"
        )
        try:
            agreed = failed[0][1][0](message)
        except Exception:  # noqa: BLE001 - an error class with another signature
            agreed = CheckpointError(message)
        agreed.__cause__ = error
        return agreed, skippable

    def _load_failed(self, error: BaseException, dirty: dict[str, int]) -> BaseException:
        """``error``, or, if a failed load wrote into tensors of the state, a PartialLoadError
        naming them."""
        if not dirty or not isinstance(error, Exception):
            return error
        steps = ", ".join(map(str, sorted(set(dirty.values()), reverse=True)))
        partial = PartialLoadError(
            f"{error} -- the state is partly overwritten: {self._some(sorted(dirty))} received bytes "
            f"of step {steps} before the load failed (no non-tensor value was set and no "
            "load_state_dict() called); load again or rebuild the state before going on",
            written=sorted(dirty),
        )
        partial.__cause__ = error
        return partial

    @staticmethod
    def _one_line(error: BaseException) -> str:
        return " ".join(str(error).split()) or type(error).__name__

    @staticmethod
    def _some(paths: list[str], shown: int = 8) -> str:
        more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
        return ", ".join(paths[:shown]) + more

    def verify(self, step: int | str = "latest") -> None:
        """Re-check ``step`` (``"all"``: every committed step) in full, as ``ckptstore verify``
        does: every object read back and every chunk re-hashed. Raises
        :class:`CheckpointCorruptError` (or :class:`CheckpointNotFoundError` when objects are
        only missing) naming each problem; returns quietly when all is intact."""
        from ckptstore._inspect import verify_steps

        steps = list_steps(self.store) if step == "all" else [resolve_step(self.store, step)]
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.store.uri}")
        problems = [p for c in verify_steps(self.store, steps) for p in c.problems]
        if not problems:
            return
        shown = "; ".join(
            f"step {p.step}: {p.object} {p.problem} ({p.error})" for p in problems[:5]
        )
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        kind = (
            CheckpointNotFoundError
            if all(p.problem == "missing" for p in problems)
            else CheckpointCorruptError
        )
        raise kind(f"{len(problems)} problem(s) in {self.store.uri}: {shown}{more}")

    def close(self) -> None:
        """Wait for pending saves and stop the background thread."""
        if self._closed:
            return
        self._closed = True
        self._saver.close()
        if self._drains is not None:
            self._drains.close()
        self.engine.close()
        self._closed_event.set()
        try:
            if self._drains is not None:
                self._drains.raise_failures()
        except CheckpointError as exc:
            drain_error: CheckpointError | None = exc
        else:
            drain_error = None
        if self._sigterm is not None:
            if self._sigterm.signalled.is_set():
                self._sigterm.report()  # the process ends at exit, as SIGTERM would have
            else:
                self._sigterm.uninstall()
        self._saver.raise_failure()
        if drain_error is not None:
            raise drain_error

    def _close_at_exit(self) -> None:
        if self._closed:
            return
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nothing is left to raise to at exit
            logger.error("rank %d: a save to %s failed at exit: %s", self.rank, self.store.uri, exc)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
