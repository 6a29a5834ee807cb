"""The DCP ``StorageReader``: loads steps committed by ``StoreWriter``, every chunk verified,
resharded by DCP's planner. With several ranks, a chunk that two or more of them need is read
from storage once and sent to the others (``ckptstore.shared_read``, batch by batch).

``StoreReader`` extends the core's ``ckptstore.step_reader.StepReader`` (a step read by one
process: batches, pickled values checked, shards narrowed) with what a load names (a checkpoint
id, ``latest``, ``healthy``), tiers and the shared read."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptstore.catalog import LATEST_REPLANS, parse_step, store_nearby
from ckptstore.dcp.ids import checkpoint_step, store_opener, valid_checkpoint_id
from ckptstore.errors import CheckpointError, CheckpointNotFoundError, one_line
from ckptstore.health import healthy_steps_to_load, name_passed_over, resumable_steps
from ckptstore.options import ReadOptions, StorageOptions, TierOptions, resolve
from ckptstore.pipeline import ChunkSource, PipelineConfig, chunks_from_store
from ckptstore.shared_read import (
    DEFAULT_BUDGET_BYTES,
    ExchangeStats,
    needed_chunks,
    shared_source,
)
from ckptstore.step_reader import Batch, Location, StepReader
from ckptstore.steps import DCP, StepView
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.open_step import TierLoad, load_group, newest_step, open_tiered_step
from ckptstore.tiers.restore import LoadReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LoadTarget:
    """What the coordinator decided for one load; travels to every rank in
    ``LoadPlan.storage_data``."""

    step: int
    attempt: str
    world: int
    """Ranks of DCP's load (the plans the coordinator saw)."""
    shared_budget: int
    """Bytes per round of the shared read, the least any rank asked for (0: off)."""
    latest: bool = False
    """The load names ``"latest"``: a step removed while it loads gives way to a newer one."""


class _OtherRanksFailed(CheckpointError):
    """This rank stopped because another rank of the load failed."""


class StoreReader(StepReader):
    """DCP ``StorageReader`` for steps committed by :class:`StoreWriter`.

    Use as ``dcp.load(state, storage_reader=StoreReader("s3://bucket/run", step=7))``. Every
    chunk is hash-verified before its bytes reach a tensor; DCP's planner reshards (a step saved
    by N ranks loads into M ranks, or into one process with ``no_dist=True``).

    Args:
        uri: the store. A ``checkpoint_id`` passed to ``dcp.load`` is a step of it (an ``int``
            or a string of digits: that load's only, as a writer's is that save's), or a store
            URI that replaces it.
        step: the step to load, or ``"latest"``. The step is resolved once per load (at the
            first ``read_metadata``); if ranks resolve different steps (one was committed while
            they started) the load fails clearly: pass an explicit step to avoid that. A
            ``"latest"`` step removed while it is read (another process's ``keep_last`` or gc
            after a newer save) gives way to the newest step, read with the same plan when its
            state layout is the same (else one line: load again), at most 3 times; the ranks
            agree first, over the shared read's group or the tiered load's (which plans the
            tiers again) or in a load by one process.
        storage, reads: the option objects of ``ckptstore.options``, the same ones
            ``Checkpointer`` and ``StoreWriter`` take (``StorageOptions.store``: an already
            open ``Store``; ``ReadOptions``: ``read_concurrency``, ``read_batch_bytes``,
            ``shared_read_budget_bytes``, whose sharing is described below).
        trust_pickled_objects: values DCP pickled (``BYTE_IO`` items, such as a step counter
            or a dataclass) reach the load planner only after torch's weights-only unpickler
            accepted them; a value that needs more (a class of yours, or code) is refused with
            ``PickledValueRefusedError`` (its bytes are intact). ``True`` hands every value to the planner unchecked: DCP's
            default planner then unpickles it with ``weights_only=False``, which runs whatever
            code the stored bytes name. Pass it only for stores whose writers you trust.
        With several ranks (over all ranks of the default process group), a chunk that two or
        more need (replicated state) is fetched and verified by one of them and sent to the
        others, who verify it again (``ckptstore.shared_read``), in rounds of at most
        ``shared_read_budget_bytes``; ranks agree on the batches, so each distinct chunk is
        read from storage once per load (over the default group when it is gloo, else over a
        gloo group of all ranks made once). 0 on any rank: every rank reads its own items, as
        a load by one rank, over a subgroup, or with ``no_dist=True`` always does.
        ``last_load_exchange`` tells what this rank's last load shared (None: nothing).

        tiers: the ``TierOptions`` of the writer (``local_dir``; ``peer_budget_bytes`` bounds a
            repair's rounds, ``local_keep_last`` the retention after it): the ranks agree on the
            newest step (or ``step``) every rank holds in its local tier as the same save, else
            one committed in ``uri``, and read each chunk from a rank's local copy where one
            holds it (sent over the process group to the ranks that need it), else from ``uri``
            (docs/FORMAT.md, "Tiers"). Runs over every rank of the default process group.
            ``last_load`` says per tier what this rank read.

        healthy: load the newest *healthy* step (docs/FORMAT.md, "Health") for ``"latest"``,
            each newer step passed over named once in a warning with why; an explicit step
            that is not healthy raises ``UnhealthyStepError``; none healthy is
            ``CheckpointNotFoundError``. With ``tiers``: a durable step as its manifest says,
            a step only the tiers hold when every rank's own copy is healthy.

    Steps saved by ``ckptstore.Checkpointer`` (kind ``state``) are refused with
    ``UnsupportedStateError``: load them with ``Checkpointer.load``.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        step: int | str = "latest",
        storage_options: dict[str, Any] | None = None,
        storage: StorageOptions | None = None,
        reads: ReadOptions | None = None,
        tiers: TierOptions | None = None,
        trust_pickled_objects: bool = False,
        healthy: bool = False,
        **deprecated: Any,
    ) -> None:
        o = resolve("StoreReader", dict(storage=storage, reads=reads, tiers=tiers), deprecated)
        policy = o["tiers"].policy()
        parse_step(step)  # refuses a step that is neither a number nor "latest"
        open_store = store_opener(
            storage_options,
            timeout_s=o["storage"].timeout_s,
            max_concurrency=o["storage"].max_concurrency,
        )
        super().__init__(  # the step is opened when a load starts (read_metadata)
            o["storage"].store or open_store(uri),
            config=PipelineConfig(read_concurrency=o["reads"].read_concurrency),
            read_batch_bytes=o["reads"].read_batch_bytes,
            trust_pickled_objects=trust_pickled_objects,
        )
        self.options = o
        self._policy = policy
        self._tier: TierLoad | None = None
        self._planned: Metadata | None = None  # what this load's plan was made from
        self.last_load: LoadReport | None = None
        self.metadata_error: Exception | None = None
        """Why this rank's last ``read_metadata`` failed (DCP's ``CheckpointException`` keeps
        its text alone), or None."""
        self.healthy = healthy
        self.shared_read_budget_bytes = o["reads"].shared_read_budget_bytes
        self.last_load_exchange: ExchangeStats | None = None
        self.step = step
        self._own_step = step
        self._pinned: str | None = None  # a checkpoint_id's step: "next" load's, then "this"
        self._nearby_looked = False  # nothing to resume: a store near a mistyped path, once
        self.storage_options = storage_options
        self._open_store = open_store

    def latest(self) -> int | None:
        """The step a load of ``"latest"`` would take, or None when there is none: nothing to
        resume (``dcp.load`` wraps that case in a ``CheckpointException`` whose cause is lost).
        ``healthy``: steps of which none is healthy raise ``NoHealthyStepError``, not None. With
        ``local_dir`` it is collective, as a load: every rank of the job calls it."""
        if self._policy is None:
            steps, _ = resumable_steps(self.store, healthy=self.healthy, limit=1)
            step = steps[0] if steps else None
        else:
            group = load_group(self.options["storage"], tiered=True)
            step = newest_step(self.store, self._policy, group, healthy=self.healthy)
        if step is None:
            self.say_if_mistyped(not dist.is_initialized() or dist.get_rank() == 0)
        return step

    def say_if_mistyped(self, say: bool) -> None:
        """Nothing to resume: where a store lies just above or inside this local path, one
        warning naming it (a mistyped path), once per reader, as ``Checkpointer.latest()``."""
        if self._nearby_looked or not say:
            return
        self._nearby_looked = True
        if nearby := store_nearby(self.store):
            logger.warning("no committed checkpoint in %s%s", self.store.uri, nearby)

    # -- StorageReader ----------------------------------------------------------------------

    def reset(self, checkpoint_id: int | str | os.PathLike | None = None) -> None:
        """Start a new load. A ``checkpoint_id`` that is an ``int`` or a ``str`` of digits is the
        step this load takes (same store; the next load without one takes the reader's own
        ``step`` again: an eval loop's ``dcp.load`` of latest after one of step 0 did not see
        new steps); any other is a store URI that replaces the current one."""
        step = None if checkpoint_id is None else checkpoint_step(checkpoint_id)
        if step is not None:
            self.step, self._pinned = step, "next"
        elif checkpoint_id is not None and os.fspath(checkpoint_id) != self.store.uri:
            self.store = self._open_store(checkpoint_id)
        super().reset()
        self.view = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: int | str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is a step or a URI fsspec can resolve to a filesystem."""
        return valid_checkpoint_id(checkpoint_id)

    @property
    def stored_keys(self) -> frozenset[str] | None:
        """The keys (DCP's flattened names) the step of this reader's last load holds; None
        before a load has read a step's metadata."""
        planned = self._planned
        return None if planned is None else frozenset(planned.state_dict_metadata)

    def read_metadata(self) -> Metadata:
        # No **kwargs: DCP then never tries a rank-local fallback (there is none), whose
        # refusal would stand beside the real error in what dcp.load raises.
        self.view = None  # each load resolves "latest" afresh
        if self._pinned == "this":  # the last load's checkpoint_id step: that load's only
            self.step, self._pinned = self._own_step, None
        elif self._pinned == "next":
            self._pinned = "this"
        self._tier = None
        self.metadata_error = None
        try:
            if self._policy is not None:
                group = load_group(self.options["storage"], tiered=True)
                self._tier = open_tiered_step(
                    self.store, self._policy, self.step, group, DCP, healthy=self.healthy
                )
                self.view = self._tier.view
                self.last_load = self._tier.report
            self._planned = self._stamped(self._view().dcp_metadata())
        except Exception as exc:
            self.metadata_error = exc  # dcp.load keeps only its text
            raise
        return self._planned

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The coordinator agrees the shared read's budget from every rank's.
        return dataclasses.replace(plan, storage_data=self.shared_read_budget_bytes)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        manifest = self._view().manifest
        budgets = [p.storage_data for p in plans if type(p.storage_data) is int]
        budget = max(0, min([self.shared_read_budget_bytes, *budgets]))
        if self._tier is not None and budget == 0:
            budget = DEFAULT_BUDGET_BYTES  # ranks read chunks other ranks' tiers hold
        target = _LoadTarget(
            step=manifest.step,
            attempt=manifest.attempt,
            world=len(plans),
            shared_budget=budget,
            latest=self.step == "latest",
        )
        return [dataclasses.replace(p, storage_data=target) for p in plans]

    # -- internals --------------------------------------------------------------------------

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        self.last_load_exchange = None
        target = plan.storage_data if isinstance(plan.storage_data, _LoadTarget) else None
        group = _exchange_group(target, self.options["storage"], tiered=self._policy is not None)
        try:
            for replans in range(LATEST_REPLANS + 1):
                failure = self._read_once(plan, planner, target, group)
                newer = self._step_after_removal(failure, target, group, replans)
                if newer is None:
                    break
                if target is not None:
                    target = dataclasses.replace(
                        target, step=newer.step, attempt=newer.manifest.attempt
                    )
        except BaseException:
            if self._tier is not None:  # a plan made again that failed: this one's ends here
                self._tier.reads_done()
            raise
        if self._tier is not None:
            self._end_tiered_read(failure)
        elif failure is not None:
            raise failure

    def _read_once(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        target: _LoadTarget | None,
        group: RankGroup | None,
    ) -> BaseException | None:
        """Every item of ``plan`` read from the open step; the error that stopped it, if any."""
        try:
            if group is None:
                self._check_step(target)
                self._read_alone(plan, planner)
            else:
                assert target is not None
                self._read_shared(plan, planner, target, group)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller, after agreeing
            return exc
        return None

    def _end_tiered_read(self, failure: BaseException | None) -> None:
        try:
            # Every rank's outcome on the tier group, before DCP's own exchange on the
            # default group: a rank lost while reading is named within the bound; a
            # failure, by rank.
            assert self._tier is not None
            step = self._tier.view.step
            self._gather(load_group(self.options["storage"], tiered=True), failure, None, step)
            self._tier.loaded()
        finally:
            self._tier.reads_done()  # a repaired copy, read from memory: written now
        # from the tier plan (read_metadata) to the last tensor
        self._tier.report.seconds = time.perf_counter() - self._tier.started
        self._tier.report.count()

    def _step_after_removal(
        self,
        failure: BaseException | None,
        target: _LoadTarget | None,
        group: RankGroup | None,
        replans: int,
    ) -> StepView | None:
        """The newest step, opened, when a load of ``"latest"`` failed because its step was
        removed while it read (another process's ``keep_last`` or gc after a newer save) and
        the newer step holds the same state layout: the plan is read again from it (with tiers,
        from where the tiers' plan of the newest step says). None: the outcome stands. Decided
        alike on every rank: over ``group`` (a tiered load's own group), or by a load in one
        process; a load whose ranks read alone cannot agree and keeps its error."""
        if not (target.latest if target is not None else self.step == "latest"):
            return None
        old = self._view().step
        if self._tier is not None:
            group = load_group(self.options["storage"], tiered=True)
        if group is None:
            if target is not None and target.world > 1:
                return None
            if not isinstance(failure, CheckpointNotFoundError) or replans == LATEST_REPLANS:
                return None
            self.view = None
            return self._adopt_newer(old, self._view())
        verdicts = group.gather(_verdict(failure))
        if "failed" in verdicts or "removed" not in verdicts or replans == LATEST_REPLANS:
            return None
        newer: StepView | None = None
        error: BaseException | None = None
        if self._tier is not None:
            try:
                newer = self._newer_tier_load(old, group)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it, then raises
                error = exc
        else:
            at = group.broadcast(self._newest_step() if group.rank == 0 else None)
            try:
                if isinstance(at, str):
                    raise CheckpointError(at)
                newer = self._adopt_newer(old, StepView.open(self.store, at[0]), at[1])
            except Exception as exc:  # noqa: BLE001 - every rank hears of it, then raises
                error = exc
        why = [w for w in group.gather(None if error is None else one_line(error)) if w]
        if error is not None:
            raise error
        if why:
            raise _OtherRanksFailed(f"rank {self.rank} stopped: {why[0]}")
        return newer

    def _newer_tier_load(self, old: int, group: RankGroup) -> StepView | None:
        """(collective over the tiered load's ``group``) The tiers' plan of the newest step,
        taken in place of the current one where it is newer with the same layout."""
        assert self._tier is not None and self._policy is not None
        tier = open_tiered_step(
            self.store, self._policy, "latest", group, DCP, healthy=self.healthy
        )
        try:
            newer = self._adopt_newer(old, tier.view)
        except BaseException:
            tier.reads_done()
            raise
        if newer is None:
            tier.reads_done()
            return None
        self._tier.reads_done()
        self._tier, self.last_load = tier, tier.report
        return newer

    def _newest_step(self) -> tuple[int, str] | str:
        """The newest step (as ``"latest"`` names it) and its attempt, or why there is none."""
        self.view = None
        try:
            view = self._view()
        except CheckpointError as exc:
            return one_line(exc)
        return view.step, view.manifest.attempt

    def _adopt_newer(
        self, old: int, newer: StepView, attempt: str | None = None
    ) -> StepView | None:
        if newer.step <= old:
            return None
        if attempt is not None and newer.manifest.attempt != attempt:
            raise CheckpointError(f"step {newer.step} of {self.store.uri} changed while it loaded")
        newer.require(DCP)
        planned = self._planned.state_dict_metadata if self._planned is not None else None
        if newer.dcp_metadata().state_dict_metadata != planned:
            raise CheckpointError(
                f"step {old} of {self.store.uri} was removed while it loaded (keep_last or gc "
                f"of another process) and the newest, step {newer.step}, holds another state "
                "layout: load again"
            )
        logger.warning(
            "rank %d: step %d of %s was removed while it loaded (keep_last or gc of another "
            "process): reading step %d, the newest now",
            self.rank,
            old,
            self.store.uri,
            newer.step,
        )
        self.view = newer
        return newer

    def _check_step(self, target: _LoadTarget | None) -> None:
        manifest = self._view().manifest
        if target is not None and (target.step, target.attempt) != (
            manifest.step,
            manifest.attempt,
        ):
            raise CheckpointError(
                f"rank {self.rank} resolved step {manifest.step} of {self.store.uri} but the "
                f"coordinator resolved step {target.step} (a step was committed during "
                "the load); pass StoreReader(step=N) explicitly"
            )

    def _read_shared(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        target: _LoadTarget,
        group: RankGroup,
    ) -> None:
        """This rank's items, read with the other ranks of ``group`` (every rank of the load
        calls this): one collective for the stored tensors each rank needs, from which every
        rank cuts the same batches (a stored tensor in one batch, at most ``read_batch_bytes``
        of any rank's in each); then per batch one collective for the chunks each rank needs,
        and the exchange of those two or more need. A rank's failure reaches the others at the
        next collective, and every rank stops there; a failure in the exchange itself (a chunk
        missing or corrupt) fails each rank that needed the chunk."""
        failure: BaseException | None = None
        locs: list[Location] = []
        sizes: dict[Location, int] = {}
        try:
            self._check_step(target)
            locs = [self._locate(item.storage_index) for item in plan.items]
            for loc in locs:
                if loc not in sizes:
                    sizes[loc] = self._index(loc[0]).tensors[loc[1]].nbytes
        except BaseException as exc:  # noqa: BLE001 - the other ranks wait for this rank
            failure = exc
        held = sorted(self._tier.held) if self._tier is not None else []
        every = self._gather(group, failure, (sorted(sizes.items()), held), target.step)
        holds = [set(h) for _, h in every] if self._tier is not None else None
        stats = ExchangeStats()
        for batch in _batches([dict(pairs) for pairs, _ in every], self.read_batch_bytes):
            items = [item for item, loc in zip(plan.items, locs, strict=True) if loc in batch]
            prepared: Batch | None = None
            needs: dict = {}
            try:
                if items and failure is None:
                    prepared = self._prepare_batch(items, planner)
                    needs = needed_chunks(prepared.merged, range(len(prepared.merged.tensors)))
            except BaseException as exc:  # noqa: BLE001 - the other ranks wait for this rank
                failure = exc
            every_need = self._gather(group, failure, needs, target.step)
            source = shared_source(
                self._view().store,
                needs,
                every_need,
                self.config,
                group=group.group,
                budget_bytes=target.shared_budget,
                holds=holds,
                fetch=self._tier.fetch if self._tier is not None else None,
            )
            try:
                if prepared is not None:
                    self._finish_batch(prepared, planner, self._read(prepared, source))
                elif source is not None:  # nothing to read here, chunks to send (a holder's)
                    for _ in source([], lambda digest, raw: 0):
                        pass
            except BaseException as exc:  # noqa: BLE001 - reported at the next collective
                failure = exc
                if source is not None:
                    source.finish(exc)  # what it has not exchanged yet, marked "not read"
            if source is not None:
                _add_stats(stats, source.stats)
                self.last_load_exchange = stats
        if failure is not None:
            raise failure

    def _gather(
        self, group: RankGroup, failure: BaseException | None, payload: Any, step: int
    ) -> list[Any]:
        """Every rank's ``payload`` (collective over ``group``), unless a rank has failed:
        then every rank raises, this one its own error or one naming the ranks that failed."""
        note = None if failure is None else one_line(failure)
        gathered = group.gather((note, payload if failure is None else None))
        if failure is not None:
            raise failure
        failed = [(r, n) for r, (n, _) in enumerate(gathered) if n is not None]
        if failed:
            why = "; ".join(f"rank {r}: {n}" for r, n in failed[:4])
            if len(failed) > 4:
                why += f"; and {len(failed) - 4} more rank(s)"
            raise _OtherRanksFailed(
                f"rank {self.rank} stopped reading step {step} of {self.store.uri}: the DCP load "
                f"failed on {len(failed)} other rank(s): {why}"
            )
        return [p for _, p in gathered]

    def _view(self) -> StepView:
        if self.view is None:
            view = StepView.open(self.store, self._step())
            view.require(DCP)
            self.view = view
            logger.debug(
                "rank %d: DCP load of step %d from %s", self.rank, view.step, self.store.uri
            )
        return self.view

    def _step(self) -> int | str:
        """The step to open: ``self.step``, or with ``healthy`` the healthy step it names."""
        if not self.healthy:
            return self.step
        good, why = healthy_steps_to_load(self.store, self.step)
        say = not dist.is_initialized() or dist.get_rank() == 0
        name_passed_over(why, good[0], where=f" in {self.store.uri}", say=say)
        return good[0]

    def _read(self, batch: Batch, source: ChunkSource | None) -> dict[int, torch.Tensor]:
        if source is None and self._tier is not None:
            store = self._view().store
            source = chunks_from_store(store, batch.merged.chunks, self.config, self._tier.fetch)
        return super()._read(batch, source)


def _batches(every: list[dict[Location, int]], limit: int) -> list[set[Location]]:
    """The batches of a shared read, the same on every rank: the stored tensors the ranks need
    (``every[r]``: rank r's, with their sizes) in one order, cut wherever one rank's bytes in
    the batch would pass ``limit`` (a larger tensor alone). A stored tensor is in one batch, so
    the ranks that need its chunks read them in the same exchange."""
    users: dict[Location, list[int]] = {}
    size: dict[Location, int] = {}
    for r, mine in enumerate(every):
        for loc, nbytes in mine.items():
            users.setdefault(loc, []).append(r)
            size[loc] = max(size.get(loc, 0), nbytes)
    batches: list[set[Location]] = []
    held = [0] * len(every)
    for loc in sorted(users):
        nbytes = size[loc]
        if not batches or any(held[r] and held[r] + nbytes > limit for r in users[loc]):
            batches.append(set())
            held = [0] * len(every)
        batches[-1].add(loc)
        for r in users[loc]:
            held[r] += nbytes
    return batches


def _verdict(failure: BaseException | None) -> str:
    """How a rank's read ended, as the others need to hear it to read a newer step."""
    if failure is None:
        return "read"
    if isinstance(failure, _OtherRanksFailed):
        return "stopped"
    return "removed" if isinstance(failure, CheckpointNotFoundError) else "failed"


def _add_stats(total: ExchangeStats, more: ExchangeStats) -> None:
    total.fetched += more.fetched
    total.received += more.received
    total.sent += more.sent
    total.rounds += more.rounds
    total.buffer_bytes = max(total.buffer_bytes, more.buffer_bytes)


def _exchange_group(
    target: _LoadTarget | None, storage: StorageOptions, *, tiered: bool
) -> RankGroup | None:
    """The group a load's shared read exchanges over, the same decision on every rank (all
    from the coordinator's ``target``); None: each rank reads its own items. Only a load over
    every rank of the default group shares (DCP's group is not known to a storage reader: one
    of as many ranks is the default group)."""
    if target is None or target.world < 2 or target.shared_budget <= 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != target.world:
        return None
    # Collective over all ranks, which are all here (in read_data) with the same target.
    return load_group(storage, tiered=tiered)
