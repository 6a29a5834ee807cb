"""The Checkpointer's load path: one restore, whichever tiers each rank reads.

``StateLoader.load`` plans the saves it may load (without tiers the committed steps, listed by
rank 0; with tiers ``tiers.plan.plan_restore`` over every rank's held copies and the durable
steps) and tries them newest first (only the first without ``fallback``), each through the same
turns (``_load_candidate``). In a turn every rank that still needs its state:

1. takes part in the peer transfers of the ranks whose source this turn is a peer's copy;
2. opens the step at its source and plans the load (nothing written yet): a step read from
   durable storage has its manifest read once, by rank 0 (which may have read it to plan), and
   broadcast; a local copy (or one just restored from a peer) is this rank's own read;
3. hears every rank's outcome; then reads, its tensors filled in place chunk by verified chunk:
   a chunk two or more ranks read from durable storage is fetched once, by one of them, and
   sent to the others (``shared_read``), while a tier copy is read by its rank alone;
4. hears every rank's outcome again.

A rank whose copy turned out missing or corrupt goes on to its next source in the next turn;
any other failure, or a rank with no source left, ends the attempt on every rank alike
(``fallback`` then tries the next older save where every failure was missing or corrupt data).
Only once every rank holds every tensor are non-tensor values set and ``load_state_dict``
called; a failed load that wrote into tensors raises ``PartialLoadError`` naming them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.catalog import (
    LATEST_REPLANS,
    list_steps,
    load_manifest,
    no_checkpoint,
    resolve_step,
)
from ckptstore.device import host_available_bytes
from ckptstore.device_load import read_into
from ckptstore.errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    PartialLoadError,
    StorageError,
    UnsupportedStateError,
    no_step_loaded,
)
from ckptstore.format import ChunkInfo, Manifest, RankIndex
from ckptstore.health import healthy_steps_to_load, name_passed_over
from ckptstore.peer import PeerReplicas, tensors_from_replica
from ckptstore.pipeline import PipelineConfig, chunks_from_store, parse_dtype
from ckptstore.quarantine import quarantine_skipped
from ckptstore.render import human_bytes
from ckptstore.shared_read import (
    DEFAULT_BUDGET_BYTES,
    ExchangeStats,
    SharedChunks,
    needed_chunks,
    plan_shared_read,
)
from ckptstore.state import finish_load, plan_load
from ckptstore.steps import CHECKPOINTER, StepView
from ckptstore.store import Store
from ckptstore.tiers.ahead import VerifiedAhead, verify_ahead
from ckptstore.tiers.fetch import TierFetch
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.plan import plan_restore
from ckptstore.tiers.policy import Topology
from ckptstore.tiers.restore import (
    DURABLE,
    LOCAL,
    PEER,
    Candidate,
    LoadReport,
    Source,
)
from ckptstore.tiers.transfer import (
    Damage,
    RepairedCopy,
    Transfer,
    restore_copies,
    write_behind,
)
from ckptstore.tree import tensor_indexes, tensor_paths

logger = logging.getLogger(__name__)

Failures = dict[int, tuple[type, str, bool]]  # rank -> (error class, one line, missing or corrupt)
Stop = tuple[BaseException, bool]  # the error this rank raises, whether an older step may load


@dataclass
class _Read:
    """One rank's read of a step from one source: opened, then planned, then read."""

    tier: str
    store: Store
    view: StepView
    started: float
    replica: Any = None  # staging="peer": (buffer, meta) of the replica its guard held
    repaired: RepairedCopy | None = None  # a copy just restored from a peer, in memory
    durable: bool = False  # a tier copy whose bad chunks durable storage holds, this save's
    index: RankIndex | None = None
    tree: Any = None
    loader: Any = None  # state.plan_load's plan
    kinds: dict[int, bool] = field(default_factory=dict)  # saved tensor -> numpy or not
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)

    def paths(self, written: set[int]) -> list[str]:
        return sorted(self.loader.paths[i] for i in written) if self.loader else []


def _refuse_beyond_memory(step: int, read: _Read, available: int) -> None:
    """Refuse, before a byte is read, a load whose new tensors (values the state holds no
    tensor for, allocated at the size the index declares) exceed this host's available
    memory: a step whose tiny chunks declare huge zero tensors would otherwise run the job
    out of memory."""
    assert read.index is not None
    new = [i for i in read.kinds if i not in read.loader.dests]
    need = sum(read.index.tensors[i].nbytes for i in new)
    if need <= available:
        return
    paths = tensor_paths(read.tree)
    named = ", ".join(paths.get(i, f"tensor {i}") for i in new[:3])
    more = f" and {len(new) - 3} more" if len(new) > 3 else ""
    raise UnsupportedStateError(
        f"step {step} has {human_bytes(need)} of values the state holds no tensor for "
        f"({named}{more}), more than the {human_bytes(available)} this host has available: "
        "load into a state that holds them, or with strict=False to leave them out"
    )


class StateLoader:
    """What a Checkpointer's ``load`` and ``verify`` need: the durable ``store``, the ranks'
    ``group``, the pipeline ``config``, and where it has them the guard replicas of
    ``staging="peer"`` (``peers``), or the ``local`` tier and the peer ``topology``. After each
    load, ``last_load`` (its step, source and time; bytes per tier with tiers),
    ``last_load_source``, ``last_load_left_out`` and ``last_load_exchange`` say what it read."""

    def __init__(
        self,
        store: Store,
        group: RankGroup,
        config: PipelineConfig,
        *,
        shared_read_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        peers: PeerReplicas | None = None,
        local: LocalTier | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.store = store
        self.group = group
        self.config = config
        self.shared_read_budget_bytes = shared_read_budget_bytes
        self.peers = peers
        self.local = local
        self.topology = topology
        self.rank = group.rank
        self.last_load = LoadReport()
        self.last_load_source: str | None = None
        self.last_load_left_out: list[str] = []
        self.last_load_exchange: ExchangeStats | None = None
        self._report = LoadReport()  # the attempt in progress (last_load with tiers)
        self._manifests: dict[int, Manifest] = {}  # rank 0: durable manifests this load read
        self._repaired: dict[int, RepairedCopy] = {}  # copies restored, written after the read
        self._ahead: VerifiedAhead | None = None  # this rank's copy, verified during a repair

    # -- one load, newest save first ----------------------------------------------------------

    def load(
        self,
        state: Any,
        step: int | str = "latest",
        *,
        fallback: bool = False,
        strict: bool = True,
        healthy: bool = False,
    ) -> int:
        """``Checkpointer.load``: load ``step`` into ``state``; returns the step loaded."""
        if fallback and step not in (None, "latest"):
            raise ValueError(f"fallback=True starts from the latest step, got step={step!r}")
        self._refuse_loads_apart(step, fallback, healthy)
        t0 = time.perf_counter()
        try:
            dirty: dict[str, int] = {}  # tensor path -> the failed step whose bytes it received
            candidates, not_healthy = self._candidates(step, fallback, healthy)
            for replans in range(LATEST_REPLANS + 1):
                loaded = self._load_first(
                    state, candidates, not_healthy, dirty, fallback, strict, t0
                )
                if isinstance(loaded, int):
                    return loaded
                gone = step in (None, "latest") and isinstance(loaded, CheckpointNotFoundError)
                if not gone or replans == LATEST_REPLANS:
                    raise self._load_failed(loaded, dirty)
                # Gone while it loaded: another process's keep_last or gc removed it after a
                # newer save. Plan again (collective: every rank agreed on the error).
                tried = candidates[0].step
                try:
                    candidates, not_healthy = self._candidates(step, fallback, healthy)
                except CheckpointNotFoundError:  # the failed loads unlisted their bad copies
                    raise self._load_failed(loaded, dirty) from None
                if candidates[0].step <= tried:
                    raise self._load_failed(loaded, dirty)
                logger.warning(
                    "rank %d: step %d was removed while it loaded (keep_last or gc of another "
                    "process): loading step %d, the newest now",
                    self.rank,
                    tried,
                    candidates[0].step,
                )
            raise AssertionError("unreachable: the last plan's error is raised above")
        finally:
            self._manifests.clear()
            self._drop_ahead()
            self._write_repaired()

    def _refuse_loads_apart(self, step: int | str, fallback: bool, healthy: bool) -> None:
        """Every rank must ask for the same load (collective): a rank whose ``step`` differs
        from rank 0's would silently get rank 0's step."""
        asked = ("latest" if step is None else step, fallback, healthy)
        every = self.group.gather(asked)
        apart = [(r, a) for r, a in enumerate(every) if a != every[0]]
        if apart:
            shown = "; ".join(
                f"rank {r} step={a[0]!r} fallback={a[1]} healthy={a[2]}"
                for r, a in [(0, every[0]), *apart[:3]]
            )
            raise ValueError(
                f"the ranks asked for different loads ({shown}"
                f"{f'; and {len(apart) - 3} more' if len(apart) > 3 else ''}): every rank must "
                "call load() with the same step, fallback and healthy"
            )

    def _load_first(
        self,
        state: Any,
        candidates: list[Candidate],
        not_healthy: dict[int, str],
        dirty: dict[str, int],
        fallback: bool,
        strict: bool,
        t0: float,
    ) -> int | BaseException:
        """The first of ``candidates`` that loads (with ``fallback``; else only the first), or
        the error (agreed by every rank) to raise."""
        skipped: list[tuple[int, BaseException]] = []
        for candidate in candidates:
            where = "" if self.local is not None else f" in {self.store.uri}"
            skipped += name_passed_over(
                not_healthy, candidate.step, where=where, say=self.rank == 0
            )
            self._report = report = LoadReport(step=candidate.step)
            self.last_load = report
            error, skippable, written = self._load_candidate(state, candidate, dirty, strict)
            report.seconds = time.perf_counter() - t0
            self._write_repaired(background=error is None)
            if error is None:
                if self.local is not None:  # newer copies go at the next save
                    self.local.resumed_from = candidate.step
                self._quarantine(skipped)
                return candidate.step
            dirty.update(dict.fromkeys(written, candidate.step))
            if not (fallback and skippable):
                return error
            skipped.append((candidate.step, error))
            self._warn_skipped(candidate.step, error)
        return self._none_loaded(skipped, not_healthy)

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def _write_repaired(self, background: bool = True) -> None:
        """The copies a repair held in memory, written to the local tier and committed now
        that the load has read them: in the background (``transfer.write_behind``), or before
        an older save is tried (whose copies the write's retention may judge)."""
        repaired, self._repaired = list(self._repaired.values()), {}
        if background:
            write_behind(repaired)
            return
        for copy in repaired:
            copy.write_local()

    def _quarantine(self, skipped: list[tuple[int, BaseException]]) -> None:
        """Rank 0, after a load with fallback skipped steps as corrupt: each is quarantined
        in the durable store (``ckptstore.quarantine``: only if its durable copy re-checks
        damaged or missing objects) so that it never blocks a save of its step number again."""
        if self.rank == 0:
            quarantine_skipped(self.store, skipped)

    def _candidates(
        self, step: int | str, fallback: bool, healthy: bool = False
    ) -> tuple[list[Candidate], dict[int, str]]:
        """The saves to try, newest first, the same on every rank (collective); with
        ``healthy`` only healthy steps, and by step why each newer one passed over is not."""
        if self.local is not None:
            plan = plan_restore(
                self.store,
                self.local,
                self.group,
                step=step,
                limit=None if fallback else 1,
                healthy=healthy,
            )
            self._manifests.update(plan.manifests)
            return plan.candidates, plan.not_healthy
        found: Any = None
        if self.rank == 0:
            try:
                found = self._durable_steps(step, fallback, healthy)
            except (CheckpointError, ValueError) as exc:
                found = exc
        found = self.group.broadcast(found)
        if isinstance(found, BaseException):
            raise found
        steps, not_healthy = found
        durable = [[Source(DURABLE)] for _ in range(self.group.world_size)]
        return [Candidate(s, None, durable) for s in steps], not_healthy

    def _durable_steps(
        self, step: int | str, fallback: bool, healthy: bool
    ) -> tuple[list[int], dict[int, str]]:
        """(rank 0) The committed steps to try, newest first, and why the newer ones a
        ``healthy`` load passes over are not healthy. A bucket that does not exist holds no
        checkpoint (``CheckpointNotFoundError`` naming it), as ``latest()`` says None there."""
        try:
            if not healthy:
                if fallback:
                    steps = list_steps(self.store)[::-1]
                    if not steps:
                        raise no_checkpoint(self.store)
                    return steps, {}
                return [resolve_step(self.store, step)], {}
            return healthy_steps_to_load(self.store, step, limit=None if fallback else 1)
        except BucketNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"no committed checkpoint in {self.store.uri}: {exc}"
            ) from exc

    # -- one save, in turns -------------------------------------------------------------------

    def _load_candidate(
        self, state: Any, candidate: Candidate, dirty: dict[str, int], strict: bool
    ) -> tuple[BaseException | None, bool, list[str]]:
        """Load ``candidate`` into ``state``: in each turn every rank still without its state
        opens, plans and reads its next source, the ranks agreeing after planning and after
        reading. Returns the error this rank raises (None: loaded), whether every rank's
        failure was missing or corrupt data, and the paths of the tensors it wrote."""
        step, turn = candidate.step, [0] * self.group.world_size
        pending = set(range(self.group.world_size))
        written: set[int] = set()
        done: _Read | None = None
        paths: list[str] = []
        while pending:
            current = {r: candidate.sources[r][turn[r]] for r in pending}
            read, error, stop = self._open_and_plan(state, candidate, current, dirty, strict)
            if stop is None:
                stop, failed = self._settle(candidate, error, turn)
            if stop is not None:
                return (*stop, paths)
            ready = pending - failed
            error = self._read_turn(read if self.rank in ready else None, current, ready, written)
            paths = read.paths(written) if read is not None else paths
            stop, again = self._settle(candidate, error, turn)
            if stop is not None:
                return (*stop, paths)
            if read is not None and self.rank in ready and self.rank not in again:
                done = read
            pending = failed | again
        assert done is not None
        self._finish(state, done, step)
        return None, True, paths

    def _open_and_plan(
        self,
        state: Any,
        candidate: Candidate,
        current: dict[int, Source],
        dirty: dict[str, int],
        strict: bool,
    ) -> tuple[_Read | None, BaseException | None, Stop | None]:
        """Steps 1 and 2 of a turn (collective): this rank's read of ``candidate`` from its
        source in ``current`` (None where it has no source this turn), opened and planned, and
        its error; with peer replicas, where the ranks agreed to stop before fetching them."""
        outcomes = self._transfers(candidate, current)
        durable = any(src.tier == DURABLE for src in current.values())
        shared = self._shared_manifest(candidate.step) if durable else None
        read: _Read | None = None
        error: BaseException | None = None
        if self.rank in current:
            try:
                read = self._open(candidate, current[self.rank], outcomes, shared)
            except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement
                error = exc
        if self.peers is not None:
            stop = self._agree(candidate.step, error)  # fetching a replica is collective
            if stop is not None:
                return None, error, stop
            replica = self.peers.fetch(candidate.step)
            if read is not None:
                read.replica = replica
        if read is not None:
            try:
                self._plan(state, read, candidate.step, dirty, strict)
            except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement
                error = exc
        return read, error, None

    def _transfers(
        self, candidate: Candidate, current: dict[int, Source]
    ) -> dict[Transfer, str | None]:
        """The peer transfers of the ranks whose source this turn is a peer's copy, every
        rank taking part (collective where there are any); their outcomes."""
        sources = {r: src.holder for r, src in current.items() if src.tier == PEER}
        if not sources:
            return {}
        assert self.local is not None and candidate.attempt is not None
        mine = current.get(self.rank)
        self._drop_ahead()
        self._ahead = verify_ahead(
            self.local,
            self.group,
            candidate.step,
            candidate.attempt,
            intact=mine is not None and mine.tier == LOCAL,
        )
        outcomes, kept = restore_copies(
            self.local, self.group, candidate.step, candidate.attempt, sources, self._report
        )
        self._repaired.update(kept)
        return outcomes

    def _open(
        self,
        candidate: Candidate,
        source: Source,
        outcomes: dict[Transfer, str | None],
        shared: Manifest | BaseException | None,
    ) -> _Read:
        """This rank's copy of ``candidate`` at ``source``, its manifest checked: for durable
        storage ``shared``, the manifest rank 0 read (or the error it met)."""
        step = candidate.step
        if source.tier == PEER:
            outcome = outcomes.get(
                Transfer(source.holder, self.rank, self.rank, step, candidate.attempt, repair=True)
            )
            if outcome is not None:  # damaged data, or storage that failed (the next tier)
                kind = CheckpointCorruptError if isinstance(outcome, Damage) else StorageError
                raise kind(f"peer copy from rank {source.holder}: {outcome}")
        started = time.perf_counter()
        repaired: RepairedCopy | None = None
        if source.tier == DURABLE:
            if isinstance(shared, BaseException):
                raise shared
            assert shared is not None
            store, manifest = self.store, shared
        else:
            assert self.local is not None
            store = self.local.store(self.rank)
            repaired = self._repaired.get(self.rank) if source.tier == PEER else None
            if repaired is not None and repaired.step == step:
                manifest = repaired.manifest  # as received and checked: not read back
            else:
                repaired, manifest = None, load_manifest(store, step)
        view = StepView(store, manifest)
        if repaired is not None:
            view.adopt_index(repaired.index)
        view.require(CHECKPOINTER)
        if source.tier != DURABLE:
            assert self.local is not None
            self.local.check_copy(manifest, self.rank, candidate.attempt)
        elif candidate.attempt is not None and manifest.attempt != candidate.attempt:
            raise CheckpointNotFoundError(
                f"{store.uri} holds another save of step {step} ({manifest.attempt})"
            )
        elif manifest.world_size != self.group.world_size:
            raise UnsupportedStateError(
                f"step {step} was saved by {manifest.world_size} rank(s), loading with "
                f"{self.group.world_size}: resharding is done through ckptstore.dcp"
            )
        # A tier copy's chunk that fails its check is read from durable storage where the
        # step is there as this very save (it is the last source the plan gave this rank).
        durable = source.tier != DURABLE and candidate.sources[self.rank][-1].tier == DURABLE
        return _Read(source.tier, store, view, started, repaired=repaired, durable=durable)

    def _plan(
        self, state: Any, read: _Read, step: int, dirty: dict[str, int], strict: bool
    ) -> None:
        """Which saved tensor lands in which tensor of ``state``. Nothing is written yet."""
        if read.replica is not None:
            buffer, meta = read.replica
            tensors = tensors_from_replica(buffer, meta)
            read.tree, read.tensors = meta["tree"], tensors

            def describe(i: int):
                return tensors[i].dtype, list(tensors[i].shape)
        else:
            index = read.view.index(self.rank if read.tier == DURABLE else 0)
            read.index, read.tree = index, index.tree

            def describe(i: int):
                entry = index.tensors[i]
                return parse_dtype(entry.dtype), entry.shape

        loader = plan_load(state, read.tree, describe, strict=strict)
        read.loader = loader
        read.kinds = {i: k for i, k in tensor_indexes(read.tree).items() if i in loader.needed}
        if read.replica is None:
            _refuse_beyond_memory(step, read, host_available_bytes())
        stale = sorted(set(dirty) - set(loader.paths.values()))
        if stale:
            failed = ", ".join(map(str, sorted(set(dirty.values()), reverse=True)))
            raise UnsupportedStateError(
                f"step {step} has no tensor for {self._some(stale)}, which the failed load "
                f"of step {failed} wrote into: loading it cannot make the state whole"
            )

    def _read_turn(
        self, read: _Read | None, current: dict[int, Source], ready: set[int], written: set[int]
    ) -> BaseException | None:
        """Step 3 of a turn: this rank's ``read``, if it is ready; collective where ranks read
        durable storage (each rank names the durable chunks it needs, none if it reads
        elsewhere): a chunk several of them need is fetched once. Its error, if any."""
        source: SharedChunks | None = None
        try:
            if any(current[r].tier == DURABLE for r in ready):
                durable = read is not None and read.tier == DURABLE and read.replica is None
                needs = needed_chunks(read.index, read.kinds) if durable else {}
                source = self._shared_source(needs)
            if read is not None:
                self._read(read, written, source)
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement
            if source is not None:
                source.finish(exc)  # the ranks waiting for its chunks hear it failed
            return exc
        return None

    def _read(self, read: _Read, written: set[int], source: SharedChunks | None) -> None:
        """Fill the state's tensors in place, chunk by verified chunk (``written``: those
        that received bytes), from the replica, the copy or ``source`` over durable storage."""
        if read.replica is not None:
            for i, dest in read.loader.dests.items():
                written.add(i)
                dest.copy_(read.tensors[i])
                read.tensors[i] = dest
            return
        index = read.index
        assert index is not None
        wanted = {i: read.loader.dests.get(i) for i in read.kinds}
        ahead = self._ahead if read.tier == LOCAL else None
        tiered = read.tier != DURABLE
        if tiered:
            assert source is None and self.local is not None  # no shared read of a tier copy
            # Each chunk from the nearest holder that verifies: the repair's verified bytes in
            # memory (not hashed again), the copy, durable storage (for a step not there, a bad
            # local chunk by its digest); counted where it came from.
            fetch = TierFetch(
                local=read.store,
                held=index.chunks,
                durable=self.store,
                durable_step=read.durable,
                durable_sized=False,  # the sizes are the copy's: durable may encode otherwise
                report=self._report,
                rank=self.rank,
                local_tier=read.tier,
                repaired=read.repaired,
                ahead=ahead,
                forget=self.local.forget_bad_chunk,
            )
            source = chunks_from_store(read.store, index.chunks, self.config, fetch)
        try:
            read.tensors = read_into(
                read.store, index, wanted, self.config, written=written, source=source
            )
        finally:
            self._drop_ahead()
        if not tiered:
            digests = {seg.chunk for i in read.kinds for seg in index.tensors[i].segments}
            nbytes = sum(index.chunks[d].stored for d in digests if d in index.chunks)
            self._report.add(read.tier, nbytes, time.perf_counter() - read.started, len(digests))
        self._report.source = read.tier

    def _finish(self, state: Any, read: _Read, step: int) -> None:
        """Every rank has every tensor: only now are values set and load_state_dict called."""
        kinds = read.kinds
        values = {i: (t.numpy() if kinds[i] else t) for i, t in read.tensors.items() if i in kinds}
        try:
            finish_load(read.loader, state, read.tree, values)
        except Exception as exc:  # a load_state_dict() of the caller's own, as it raised it
            exc.add_note(
                f"ckptstore: raised while step {step} was set into the state: every tensor holds "
                f"step {step} and the values and load_state_dict() calls before this one were "
                "made, the rest not; load again or rebuild the state before going on"
            )
            raise
        self.last_load_left_out = [f"{p} (not in the state)" for p in read.loader.left_out]
        self.last_load_left_out += [f"{p} (not in step {step})" for p in read.loader.not_saved]
        if self.last_load_left_out:
            logger.info(
                "rank %d: step %d loaded with strict=False; left out: %s",
                self.rank,
                step,
                self._some(self.last_load_left_out),
            )
        if self.local is not None:
            self._report.count()
            self.last_load_source = where = self._report.source
        elif read.replica is not None:
            self.last_load_source, where = "peer", "its guard's memory"
        else:
            self.last_load_source, where = "storage", self.store.uri
        self._report.source = self.last_load_source
        logger.info("rank %d: loaded step %d from %s", self.rank, step, where)

    # -- read once, share ---------------------------------------------------------------------

    def _shared_manifest(self, step: int) -> Manifest | BaseException:
        """The durable manifest of ``step``, read by rank 0 (unless it read it to plan this
        load) and broadcast: one GET of ``commits/`` per load however many ranks (it is one
        prefix). Collective; the error rank 0 met instead, for each rank to raise if it reads
        durable storage."""
        found: Any = None
        if self.rank == 0:
            try:
                found = self._manifests.get(step) or load_manifest(self.store, step)
                self._manifests[step] = found
            except Exception as exc:  # noqa: BLE001 - every rank must reach the broadcast
                found = exc
        found = self.group.broadcast(found)
        if not isinstance(found, BaseException) or self.rank == 0:
            return found
        message = f"rank 0 could not read the manifest: {self._one_line(found)}"
        try:
            return type(found)(message)
        except Exception:  # noqa: BLE001 - an error class with another signature
            return CheckpointError(message)

    def _shared_source(self, needs: dict[str, ChunkInfo]) -> SharedChunks | None:
        """Where this rank's chunks come from when other ranks need some of them too (None:
        from storage alone). Collective: every rank calls it in a turn's read from durable
        storage (with no ``needs`` if it reads none)."""
        self.last_load_exchange = None
        if not self.group.active:
            return None
        source = plan_shared_read(
            self.store,
            needs,
            self.config,
            group=self.group.group,
            budget_bytes=self.shared_read_budget_bytes,
        )
        if source is not None:
            self.last_load_exchange = source.stats
        return source

    # -- agreement ----------------------------------------------------------------------------

    def _settle(
        self, candidate: Candidate, error: BaseException | None, turn: list[int]
    ) -> tuple[Stop | None, set[int]]:
        """Every rank's outcome of a phase of this turn (collective), and the ranks that
        failed. Where each failed on missing or corrupt data and has a source left, each moves
        on to it (``turn``); else the attempt stops, on every rank: the error to raise."""
        sources = candidate.sources
        mine = sources[self.rank][min(turn[self.rank], len(sources[self.rank]) - 1)]
        failed = self._outcomes(error, mine.tier)
        if not failed:
            return None, set()
        if not all(skippable for *_, skippable in failed.values()) or any(
            turn[r] + 1 >= len(sources[r]) for r in failed
        ):
            return self._agreed(candidate.step, error, failed), set(failed)
        for r, (_, why, _) in failed.items():
            if r == self.rank:
                logger.warning(
                    "rank %d: step %d from %s failed, trying the next tier: %s",
                    r,
                    candidate.step,
                    sources[r][turn[r]],
                    why,
                )
            turn[r] += 1
        return None, set(failed)

    def _agree(self, step: int, error: BaseException | None) -> Stop | None:
        """Every rank's outcome of a phase of loading ``step``: None if it went well on every
        rank, else the error this rank raises and whether every failure was corrupt or missing
        data (both the same on every rank)."""
        failed = self._outcomes(error)
        return self._agreed(step, error, failed) if failed else None

    def _outcomes(self, error: BaseException | None, tier: str = DURABLE) -> Failures:
        """Every rank's failure (collective), by rank: those that went well left out; each
        says whether the rank may try its next source: after missing or corrupt data, and after
        a local or peer copy's storage error (a hung or failing local disk: the durable tier
        may well answer)."""
        mine = None
        if error is not None:
            kind = next(
                (c for c in type(error).__mro__ if c.__module__ == CheckpointError.__module__),
                CheckpointError,
            )
            skippable = isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError)) or (
                tier != DURABLE and isinstance(error, StorageError)
            )
            mine = (kind, self._one_line(error), skippable)
        everyone = self.group.gather(mine) if self.group.active else [mine]
        return {r: o for r, o in enumerate(everyone) if o is not None}

    def _agreed(self, step: int, error: BaseException | None, failed: Failures) -> Stop:
        """The error each rank raises for the ``failed`` ranks of a phase of ``step``, and
        whether an older step may load instead: only where every rank's failure was missing or
        corrupt data (a tier's storage that failed sent its rank to its next source, but is no
        reason to leave the step, as DCP's resume does not)."""
        named_by_object = (CheckpointCorruptError, CheckpointNotFoundError)
        skippable = all(issubclass(o[0], named_by_object) for o in failed.values())
        if error is not None and not self.group.active and type(error) in named_by_object:
            if f"step {step}" not in str(error):  # a chunk's error names its object, not the step
                named = type(error)(f"step {step}: {error}")
                named.__cause__ = error
                return named, skippable
        if error is not None and (not self.group.active or not isinstance(error, Exception)):
            return error, skippable  # alone, or KeyboardInterrupt and the like: as they are
        shown = list(failed.items())
        by_why: dict[str, list[int]] = {}  # the same reason on many ranks: said once
        for r, o in shown:
            by_why.setdefault(o[1], []).append(r)
        why = "; ".join(f"{_ranks(ranks)}: {said}" for said, ranks in list(by_why.items())[:4])
        if len(by_why) > 4:
            why += f"; and {len(by_why) - 4} more reason(s)"
        message = (
            f"step {step} failed to load on {len(shown)} of {self.group.world_size} rank(s): {why}"
        )
        try:
            agreed = shown[0][1][0](message)
        except Exception:  # noqa: BLE001 - an error class with another signature
            agreed = CheckpointError(message)
        agreed.__cause__ = error
        return agreed, skippable

    # -- errors -------------------------------------------------------------------------------

    def _warn_skipped(self, step: int, error: BaseException) -> None:
        why = self._one_line(error).removeprefix(f"step {step}: ")
        level = logging.WARNING if self.rank == 0 else logging.INFO  # every rank heard it
        if self.local is None:
            logger.log(
                level,
                "rank %d: step %d in %s cannot be loaded, trying an older step: %s",
                self.rank,
                step,
                self.store.uri,
                why,
            )
        else:
            logger.log(
                level,
                "rank %d: step %d cannot be loaded from any tier, trying an older step: %s",
                self.rank,
                step,
                why,
            )

    def _none_loaded(
        self, skipped: list[tuple[int, BaseException]], not_healthy: dict[int, str] | None = None
    ) -> CheckpointError:
        """The error of a load with fallback that loaded no step."""
        where = f"committed step in {self.store.uri}"
        if self.local is not None:
            where = f"step in the tiers ({self.local.policy.local_dir}, peers) or {self.store.uri}"
        return no_step_loaded(where, skipped, not_healthy)

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

    # -- verify -------------------------------------------------------------------------------

    def verify(self, step: int | str = "latest") -> None:
        """``Checkpointer.verify``: re-check ``step`` (``"all"``: every committed step) in
        full; raises naming each problem, returns quietly when all is intact (a step removed
        meanwhile, by keep_last or a gc, is passed over by ``"all"``)."""
        from ckptstore._inspect import problems_error, removed_while_checked, verify_steps

        steps = list_steps(self.store) if step == "all" else [resolve_step(self.store, step)]
        if not steps:
            raise no_checkpoint(self.store)
        checks = verify_steps(self.store, steps)
        removed = removed_while_checked(self.store, checks)
        if removed and step != "all":
            raise CheckpointNotFoundError(
                f"step {removed[0]} of {self.store.uri} was removed while it was verified "
                "(keep_last or gc of another process)"
            )
        problems = [p for c in checks if c.step not in removed for p in c.problems]
        if problems:
            raise problems_error(self.store.uri, problems)


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 1``, ``ranks 0, 1, 2, 3 and 12 more``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    return f"ranks {', '.join(map(str, ranks[:4]))}{more}"
