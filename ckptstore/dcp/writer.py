"""The DCP ``StorageWriter``: a DCP save committed as a ckptstore step of kind ``dcp``, walked
through a ``SaveSession`` as ``Checkpointer``'s saves are."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstore import telemetry
from ckptstore._torch_private import (
    ASYNC_SAVE_THREAD_PREFIX,
    async_save_on_default_group,
    dcp_save_groups,
    dcp_saves_on_this_thread,
    saving_state_dict,
    starting_checkpoint_process,
    thread_async_save_call,
)
from ckptstore.catalog import list_steps
from ckptstore.dcp import unwaited
from ckptstore.dcp.ids import (
    checkpoint_step,
    store_opener,
    valid_checkpoint_id,
    warn_if_inside,
    warn_if_main_unguarded,
)
from ckptstore.dcp.items import item_tensor, write_tensors
from ckptstore.dcp.stager import HeldStaging, PooledStager
from ckptstore.errors import (
    CheckpointError,
    StepExistsError,
    UnsupportedStateError,
    is_full_store,
    one_line,
)
from ckptstore.exit_status import fail_at_exit
from ckptstore.format import KIND_DCP, check_step, commit_key, storage_key
from ckptstore.health import StepHealth
from ckptstore.metadata import DTYPES, encode_metadata
from ckptstore.options import (
    EncodingOptions,
    HealthPolicy,
    RetentionOptions,
    StagingOptions,
    StorageOptions,
    TierOptions,
    resolve,
)
from ckptstore.save import (
    RankWritten,
    SaveEngine,
    SaveSession,
)
from ckptstore.save.once import OneRound
from ckptstore.save.session import LatestIndex
from ckptstore.store import Store
from ckptstore.tiers.committed import CommittedCopy
from ckptstore.tiers.drain import DrainJob, DrainQueue
from ckptstore.tiers.group import RankGroup, front_end_group, refuse_options_apart
from ckptstore.tiers.identity import store_identity
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import DurableCadence, Topology
from ckptstore.tiers.saving import (
    LocalCommit,
    TierSaver,
    durable_holds,
    durable_steps,
    open_tiers,
)
from ckptstore.tiers.transfer import TransferStats, wait_written

logger = logging.getLogger(__name__)

# Metadata.version as written by torch's own FileSystemWriter (the DCP layout version we mimic).
_DCP_VERSION = "1.0.0"


# A rank's local plan after its durable_next(): this save goes to durable storage too.
_DURABLE_ASKED = "ckptstore: durable_next"


@dataclass(frozen=True)
class _SaveTarget:
    """What the coordinator decided for one save; travels in ``SavePlan.storage_data``, each
    rank's plan with where that rank's index of the latest committed step is (``known``)."""

    step: int
    attempt: str
    known: LatestIndex | None = None
    tiered: bool = False
    """Committed to every rank's local tier first (``local_dir``)."""
    durable: bool = True
    """Bound for the writer's store: drained there in the background from the local copies
    when tiered (a tiered save that is not goes there only if a rank's local tier fails)."""
    once: bool = False
    """Written straight to durable storage by every rank of the default process group: the
    ranks agree on one writer per distinct chunk (``save.once``; DCP's planner gives a
    replicated item one writer, this also catches identical bytes under different names)."""


@dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data`` as it crosses from a rank to the coordinator.

    ``finish`` keeps only ``(rank, tensor)`` in the persisted Metadata; ``written`` (one object
    shared by a rank's results, so pickled once) is for the manifest.
    """

    step: int
    attempt: str
    tensor: int
    written: RankWritten
    durable: bool = True
    """``written`` is in the writer's store (False: in the rank's local tier only)."""
    drained: bool = False
    """In the local tier, and the step's drain to the writer's store is queued."""


class StoreWriter(StorageWriter, PooledStager):
    """DCP ``StorageWriter`` that commits a ckptstore step of kind ``dcp``.

    Use as ``dcp.save(state, storage_writer=StoreWriter("s3://bucket/run"))`` (or ``async_save``).
    It is also DCP's ``AsyncStager``: ``dcp.async_save`` stages through ``stage()``, one copy into
    a staging buffer allocated once and reused (pinned, filled on a side stream, with CUDA), and
    the background save encodes from that buffer without copying again. A second ``async_save``
    waits in ``stage()`` while the previous one still holds the buffer. Keep one writer for
    every save of a run: back-to-back ``async_save`` calls need not wait for each other's
    futures, and each save can name its own step.

    The step of each save is, in this order:

    * the ``checkpoint_id`` given to ``dcp.save`` / ``dcp.async_save`` when it is an ``int`` or
      a ``str`` of digits: ``dcp.async_save(sd, storage_writer=writer, checkpoint_id=1000)``
      commits step 1000 in the writer's store (a ``checkpoint_id`` applies to that save only);
    * else the writer's ``step`` (the constructor argument; an attribute);
    * else the next free step: the latest committed step + 1, and after every step this
      writer has planned, so saves still in flight get distinct increasing steps (0 in an
      empty store). The coordinator decides, so every rank agrees.

    Any other ``checkpoint_id`` (a ``str`` that is not all digits, or an ``os.PathLike``) is a
    store URI, as for torch's own writers: it replaces the writer's store, and the step is
    chosen as if no ``checkpoint_id`` were given. A local directory named ``1000`` is therefore
    passed as ``"./1000"`` or ``Path("1000")``. Steps are write-once: saving a committed step
    fails with ``StepExistsError`` (wrapped by DCP in a ``CheckpointException``) and leaves
    the committed step untouched.

    Args:
        uri: the store (local path, ``file://``, ``memory://``, ``s3://bucket/prefix``, ...).
        step: the step of every save that names none through its ``checkpoint_id``; ``None``
            (the default) means the next free step. Saves without a ``checkpoint_id`` on a
            writer with a fixed ``step`` all target that step, so only the first can commit.
        keep_last: after a commit, the coordinator keeps this many newest steps and sweeps
            unreferenced objects (``retention.collect``); ``None`` keeps everything.
        storage, encoding, staging, retention, tiers: the option objects of
            ``ckptstore.options``, the same ones ``Checkpointer`` takes (a DCP save stages on
            the host: ``StagingOptions.budget_bytes`` bounds ``async_save``'s staging buffers).
            With ``tiers=TierOptions(local_dir=...)`` every save is committed first to each
            rank's local tier, ``local_dir/job-<j>/rank-<r>/`` (the rank's items, its index and
            the save's DCP metadata, as a one-rank step), which ``StoreReader(tiers=...)``
            restores from; ``peer_copies`` sends each rank's copy to the ranks at its position
            on the next K nodes; the first save and every ``durable_every``-th after it is
            drained to ``uri`` in the background (``durable(step)``, ``wait()``, ``close()``),
            as the Checkpointer's are. A rank that cannot write its local copy (a full disk)
            sends the save to ``uri`` instead, one warning.
        **deprecated: the flat keywords of earlier releases, folded into their option object
            with a ``DeprecationWarning``.

        health: a ``HealthPolicy`` (docs/FORMAT.md, "Health"): every save records each
            floating item's NaN and Inf counts and sum of squares; an unhealthy step is
            committed with one warning naming its worst items, skipped or refused.

    After a save, ``saved_step`` holds the step written (on every rank), and on the
    coordinator ``last_save`` the step's ``StepHealth`` as its commit judged it. ``use_collectives=False``
    is refused: one manifest commits all ranks, so the ranks must coordinate. DCP plan caching
    (``DefaultSavePlanner(enable_plan_caching=True)``) is refused too: a cached plan would carry
    the previous save's step.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        storage: StorageOptions | None = None,
        encoding: EncodingOptions | None = None,
        staging: StagingOptions | None = None,
        retention: RetentionOptions | None = None,
        tiers: TierOptions | None = None,
        health: HealthPolicy | None = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        given = dict(
            storage=storage,
            encoding=encoding,
            staging=staging,
            retention=retention,
            tiers=tiers,
            health=health,
        )
        o = resolve("StoreWriter", given, deprecated)
        if o["staging"].mode == "auto":  # DCP has staged the state itself, or saves in place
            o["staging"] = dataclasses.replace(o["staging"], mode="host")
        if o["staging"].mode != "host":
            raise ValueError(
                "a DCP save stages on the host: StagingOptions(mode='host'), or 'auto'"
            )
        self.options = o
        # What a copy of this writer in DCP's checkpoint process is rebuilt from (__reduce__).
        self._config = dict(uri=uri, storage_options=storage_options, keep_last=keep_last, **o)
        self._token = uuid.uuid4().hex
        # In DCP's checkpoint process: the training process that sent this writer, which must
        # still be there for a save to commit (an orphan would commit a step the restarted job
        # saves again: StepExistsError).
        self._trainer_pid: int | None = None
        self._init_tiers(o)
        self._sessions: dict[str, SaveSession] = {}  # coordinator: by attempt, until its commit
        # Coordinator, by attempt: the step, when it started (its persist time) and the thread
        # that runs it (a save whose thread ended uncommitted is named at exit).
        self._started: dict[str, tuple[int | None, float, threading.Thread]] = {}
        self._why_failed: dict[str, str] = {}  # by attempt: a failed save's error, one line
        self._skipped: dict[str, StepHealth] = {}  # tiered saves HealthPolicy skipped, by attempt
        if step is not None:
            check_step(step)
        self.step = step
        self.storage_options = storage_options
        self._open_store = store_opener(
            storage_options,
            timeout_s=o["storage"].timeout_s,
            max_concurrency=o["storage"].max_concurrency,
            thread_nice=o["storage"].background_nice,
        )
        self.store = o["storage"].store or self._open_store(uri)
        self.engine = SaveEngine.build(o, keep_last=keep_last, store=self.store)
        self._staged: dict[int, HeldStaging] = {}  # by the staging buffer's data_ptr
        self._saving: list[tuple[threading.Thread, HeldStaging]] = []
        self._thread_saves: list[unwaited.ThreadSave] = []  # staged here, not ended well
        self.rank = _rank()  # DCP's own from the first save on
        self.is_coordinator = True
        self._made_in_world = _world_size()  # a save reaching it with no group is refused
        self._home = self.store  # the store it was made for
        self.save_id = uuid.uuid4().hex
        self._target: _SaveTarget | None = None
        self.saved_step: int | None = None
        self.last_save: StepHealth | None = None
        # The step a save's checkpoint_id named, set by reset() and taken by the same save's
        # prepare_global_plan. DCP calls both on the thread running that save (each async_save
        # has a thread of its own), so overlapping saves cannot take each other's step.
        self._requested = threading.local()
        # Per store URI, the highest step this writer planned (coordinator): a step=None save
        # goes after it even while the save that planned it has not committed yet.
        self._planned: dict[str, int] = {}
        self._plan_lock = threading.Lock()

    def _init_tiers(self, o: dict[str, Any]) -> None:
        """The writer's tier state, empty until its first tiered save sets its tiers up
        (``_set_up_tiers``); with ``local_dir``, the exit hook that finishes its drains."""
        self._policy = o["tiers"].policy()
        self._node_rank = o["tiers"].node_rank
        self._topology: Topology | None = None
        self._tier_group: RankGroup | None = None
        self._local: LocalTier | None = None
        # The coordinator's: which saves go to durable storage (the tiers', ``_set_up_tiers``).
        self._cadence: DurableCadence | None = None
        self._durable_asked = False  # durable_next() on this rank, for its next save's plan
        self._tiers: TierSaver | None = None
        self._background_nice = o["storage"].background_nice
        self._drains: DrainQueue | None = None
        # By step: its drain to durable storage.
        self._durable: dict[int, concurrent.futures.Future[None]] = {}
        if self._policy is not None:  # a script that ends right after a save keeps its drain
            this = weakref.ref(self)
            threading._register_atexit(lambda: (w := this()) is not None and w._close_at_exit())
        unwaited.watch(self)
        # One save's tier exchanges at a time (overlapping async saves reach them in turn).
        self._tier_lock = threading.Lock()
        self._group_lock = threading.Lock()
        self._drain_group: RankGroup | None = None  # made with the tier group, until taken
        self._once_group: RankGroup | None = None  # untiered saves' one writer per chunk
        self._once_lock = threading.Lock()
        self._once_busy: set[str] = set()  # coordinator: attempts whose round has not ended
        self._tier_storage: dict[str, dict[MetadataIndex, tuple[int, int]]] = {}

    # -- DCP's checkpoint process ------------------------------------------------------------

    def __reduce__(self):
        """Pickle the configuration only (``async_save(..., async_checkpointer_type=PROCESS)``
        sends the writer to DCP's checkpoint process with every save). There it is rebuilt once
        per writer and reused by its later saves (``_writer_in_process``): its own store
        clients, staging pool and leases, in the process that writes. A tiered writer is
        refused: its local tiers and drain queue would live in that process, out of reach of
        this writer's ``durable()``, ``wait()`` and ``close()``."""
        if self._policy is not None:
            raise TypeError(
                "StoreWriter(tiers=TierOptions(local_dir=...)) cannot be sent to DCP's checkpoint "
                "process (async_checkpointer_type=PROCESS): its drains to durable storage would "
                "run there, beyond this writer's durable()/wait()/close(); use thread-based "
                "async_save"
            )
        if self.options["storage"].store is not None:
            raise TypeError(
                "StoreWriter(storage=StorageOptions(store=...)) cannot be sent to DCP's "
                "checkpoint process (async_checkpointer_type=PROCESS): give the store's URI"
            )
        return (_writer_in_process, (self._token, os.getpid(), self._config, self.step))

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: int | str | os.PathLike | None = None) -> None:
        """Start a new save. DCP calls this only when given a ``checkpoint_id``: an ``int`` or a
        ``str`` of digits is this save's step (same store); another ``str`` or an
        ``os.PathLike`` is a store URI that replaces the current store."""
        try:
            step = None if checkpoint_id is None else checkpoint_step(checkpoint_id)
        except ValueError as exc:
            raise ValueError(
                f"StoreWriter: checkpoint_id {checkpoint_id!r} is neither a step (an int or a "
                f"string of digits) nor a store URI: {exc}"
            ) from None
        if (
            step is None
            and checkpoint_id is not None
            and os.fspath(checkpoint_id) != self.store.uri
        ):
            named = os.fspath(checkpoint_id)
            if isinstance(named, str) and named != named.strip():
                raise ValueError(
                    f"StoreWriter: checkpoint_id {named!r} begins or ends with whitespace "
                    "(a store of that name would be made)"
                )
            self.store = self._open_store(checkpoint_id)
            warn_if_inside(self.store, self._home)
        self._requested.step = step
        self._requested.store = self.store
        self._requested.fresh = True
        self.save_id = uuid.uuid4().hex
        self._target = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: int | str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is a step (an ``int`` or a ``str`` of digits) or a URI
        fsspec can resolve to a filesystem."""
        return valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        """The store's URI (DCP logs it); the step of the last save is ``saved_step``."""
        try:
            if starting_checkpoint_process():  # read just before DCP spawns it
                warn_if_main_unguarded()
        except Exception as exc:  # noqa: BLE001 - a warning of ours never fails a save
            logger.debug("the check for a main block failed: %s", exc)
        return self.store.uri

    @property
    def last_peer_copy(self) -> TransferStats | None:
        """What this rank moved in the last save's peer copies (tiers with ``peer_copies``)."""
        return self._tiers.last_peer_copy if self._tiers is not None else None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # async_save stages on its caller's thread, in the job's process group: a writer made
        # before the group learns it here, so that its save reaching it after the group is
        # destroyed is refused (and named at exit) as any other writer's is.
        if self._made_in_world == 0 and (world := _world_size()) > 0:
            self._made_in_world, self.rank = world, _rank()
        staged = super().stage(state_dict)
        call = thread_async_save_call()
        if call.threaded and self._writes_for(call.storage_writer):
            if not call.no_dist and _whole_world(_group_size(call.process_group)):
                self._groups_made()
            unwaited.staged(self, call.checkpoint_id)
        return staged

    def _groups_made(self) -> None:
        """The groups this writer's saves exchange over, made on the caller's thread of an
        ``async_save`` over every rank: there every rank makes them in the order its script
        calls ``async_save``. Made on the save threads, two writers' saves in flight could pair
        one rank's first group with another rank's second, each save exchanging with the
        other's (and both failing)."""
        if self._policy is not None:
            self._tier_group_made()
        else:
            self._once_group_made()

    def _once_group_made(self) -> RankGroup:
        """The group of untiered saves' rounds of one writer per chunk, made by every rank
        with the first save that reaches it."""
        with self._group_lock:
            if self._once_group is None:
                self._once_group = self._group(tiered=False)
            return self._once_group

    def _writes_for(self, storage_writer: Any) -> bool:
        """Whether the save of an ``async_save`` given ``storage_writer`` reaches this writer:
        it is that writer, or one of the script's own that may hand its calls on to it; not
        another StoreWriter or one of torch's (this writer only stages for them)."""
        if storage_writer is self:
            return True
        if storage_writer is None or isinstance(storage_writer, StoreWriter):
            return False
        return not type(storage_writer).__module__.startswith("torch.")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._save_store().uri, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        requested = getattr(self._requested, "step", None) if self._requested_fresh() else None
        with self._named_if_unwaited(self.step if requested is None else requested):
            if threading.current_thread().name.startswith(ASYNC_SAVE_THREAD_PREFIX):
                unwaited.reached(self, requested)
                self.bind_staging(saving_state_dict())
            self._set_up(is_coordinator, **kwargs)

    def _requested_fresh(self) -> bool:
        return getattr(self._requested, "fresh", False)

    def _set_up(self, is_coordinator: bool, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "ckptstore.dcp.StoreWriter needs use_collectives=True: one manifest commits "
                "every rank's data"
            )
        if self._made_in_world > 1 and _world_size() == 0:
            raise ValueError(
                f"StoreWriter was made in a process group of {self._made_in_world} ranks and "
                "this save reached it with none (destroy_process_group() while a save was "
                "pending?): each rank would commit a step of its own data alone; wait for "
                "async_save's future first (a save of this process alone takes a new "
                "StoreWriter)"
            )
        self.is_coordinator = is_coordinator
        if not self._requested_fresh():
            # No reset() for this save: a step named by an earlier save on this thread that
            # failed before planning must not carry over.
            self._requested.step = None
            self._requested.store = None
        self._requested.fresh = False
        self.rank = int(kwargs.get("rank", 0) or 0)
        _warn_if_async_on_the_training_group()
        _warn_if_saves_share_a_group()
        if self._policy is not None:
            self._set_up_tiers()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not plan.usable:  # DCP's plan cache: the save after the first sends no plan
            raise ValueError(
                "StoreWriter does not support DCP plan caching (a planner made with "
                "enable_plan_caching=True): each save's plan names its own step"
            )
        for item in plan.items:  # refused before a byte is written, not at the load
            if item.tensor_data is not None:
                dtype = str(item.tensor_data.properties.dtype).removeprefix("torch.")
                if dtype not in DTYPES:
                    raise UnsupportedStateError(
                        f"{item.index.fqn}: a tensor of {dtype}, which a DCP step cannot "
                        f"hold (its dtypes: {', '.join(DTYPES)})"
                    )
        with self._plan_lock:  # the coordinator hears every rank's durable_next()
            asked, self._durable_asked = self._durable_asked, False
        return dataclasses.replace(plan, storage_data=_DURABLE_ASKED) if asked else plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # This save's checkpoint_id step (taken, so a later save that names none on this
        # thread does not inherit it), else the writer's fixed step, else the next free one.
        step = getattr(self._requested, "step", None)
        self._requested.step = None
        step = self.step if step is None else step
        with self._named_if_unwaited(step):
            return self._plan_global(plans, step)

    @contextlib.contextmanager
    def _named_if_unwaited(self, step: int | None) -> Iterator[None]:
        """A save refused before it was recorded (its process group gone, a step already
        committed, a store not reached): an ``async_save`` nobody waits for is still named at
        exit."""
        recorded = set(self._started)
        try:
            yield
        except BaseException as exc:
            thread = threading.current_thread()
            if thread.name.startswith(ASYNC_SAVE_THREAD_PREFIX) and set(self._started) <= recorded:
                attempt = f"unplanned-{uuid.uuid4().hex}"
                self._started[attempt] = (step, time.perf_counter(), thread)
                self._note_failure(attempt, exc)
            raise

    def _next_step(self, uri: str, tiered: bool) -> int:
        """The step of a save the writer numbers: after every step the store and the local
        tiers hold, and every save it numbered. Numbered on from a durable listing that does
        not answer only where this writer has numbered a save of the store before, and no load
        came since (else a step the store holds, or one below its newest: no resume takes it)."""
        known = (
            tiered
            and uri in self._planned
            and not (self._local is not None and self._local.durable_unasked)
        )
        steps = durable_steps(self.store) if known else list_steps(self._save_store())
        if self._local is not None:  # steps only the local tiers hold count too
            steps = sorted({*steps, *self._local.copies(self.rank)})
        return max(steps[-1] + 1 if steps else 0, self._planned.get(uri, -1) + 1)

    def _plan_global(self, plans: list[SavePlan], step: int | None) -> list[SavePlan]:
        uri = self._save_store().uri
        with self._plan_lock:
            local = self._local is not None and self._save_store() is self.store
            if step is None:
                step = self._next_step(uri, local)
            elif self._holds(step, local, bound=False) or (  # bound: said at its write
                self._tiers is not None and step in self._tiers.committed
            ):
                raise StepExistsError(
                    f"step {step} is already committed in {uri}"
                    f"{' or its local tiers' if self._local is not None else ''}; steps are "
                    "write-once"
                )
            self._planned[uri] = max(step, self._planned.get(uri, -1))
        tiered = self._local is not None and self._save_store() is self.store
        durable = True
        if tiered:
            assert self._policy is not None and self._tier_group is not None
            if len(plans) != self._tier_group.world_size:
                raise ValueError(
                    f"StoreWriter(tiers=TierOptions(local_dir=...)) saves over every rank of the default process "
                    f"group ({self._tier_group.world_size}); this DCP save runs on {len(plans)}"
                )
            assert self._cadence is not None
            with self._plan_lock:
                durable = self._cadence.next_save()
            durable = durable or any(p.storage_data == _DURABLE_ASKED for p in plans)
        target = _SaveTarget(
            step=step,
            attempt=uuid.uuid4().hex,
            tiered=tiered,
            durable=durable,
            once=not tiered and _whole_world(len(plans)) and not self._once_busy,
        )
        if target.once:
            # Until the coordinator's round ends, a save planned meanwhile (an overlapping
            # async_save on a process group of its own) writes its chunks alone: two rounds in
            # flight could reach the writer's one group in another order on each rank.
            self._once_busy.add(target.attempt)
        self._target = target
        self._started[target.attempt] = (
            target.step,
            time.perf_counter(),
            threading.current_thread(),
        )
        if tiered:
            # Where each item will be, as finish() records it: rank r's i-th item at (r, i).
            self._tier_storage[target.attempt] = {
                item.index: (r, i) for r, p in enumerate(plans) for i, item in enumerate(p.items)
            }
        # A tiered step is committed to durable storage by its drain, which takes its lease.
        try:
            self._release_leases_of_ended_saves()
            latest = self._begin_lease(target) if durable and not tiered else {}
        except BaseException as exc:
            self._note_failure(target.attempt, exc)
            raise
        logger.debug(
            "rank %d: DCP save to %s as step %d, attempt %s",
            self.rank,
            self._save_store().uri,
            step,
            target.attempt,
        )
        # DCP hands plans[r] to rank r.
        return [
            dataclasses.replace(p, storage_data=dataclasses.replace(target, known=latest.get(r)))
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target = plan.storage_data
        if not isinstance(target, _SaveTarget):
            raise RuntimeError(
                "SavePlan.storage_data was not set by StoreWriter.prepare_global_plan "
                f"(got {type(target).__name__}); was the plan cached from another writer?"
            )
        self._target = target
        try:
            if target.tiered:  # every rank takes part in the tier's exchanges, items or not
                results = self._write_tiered(plan.items, planner, target)
            else:
                results = self._write_direct(plan.items, planner, target)
        except BaseException as exc:
            self._note_failure(target.attempt, exc)
            raise
        self.saved_step = target.step
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_direct(
        self, items: list[WriteItem], planner: SavePlanner, target: _SaveTarget
    ) -> list[WriteResult]:
        """This rank's items written straight to the writer's store; with ``target.once``
        every rank, items or not, takes part in one round of one writer per distinct chunk
        (a rank that fails before its write joins it with its error: the save fails on every
        rank, before any index names a chunk it was to write)."""
        if not target.once:
            self._check_not_committed(target)
            return self._write(items, planner, target) if items else []
        with self._once_lock:  # one save's round at a time (overlapping async saves)
            round_ = OneRound(self._once_group_made(), target.attempt)
            try:
                self._check_not_committed(target)
                results = self._write(items, planner, target, group=round_) if items else []
            except BaseException as exc:
                round_.finish(exc)
                raise
            else:
                round_.finish()
            finally:  # every rank has joined this round's last exchange (or left it with us)
                self._once_busy.discard(target.attempt)
            return results

    def _group(self, *, tiered: bool) -> RankGroup:
        """A group of every rank (made by every rank) for this writer's exchanges."""
        o = self.options
        return front_end_group(o["storage"], tiered=tiered, gc_wait_s=o["retention"].gc_wait_s)

    def _holds(self, step: int, tiered: bool, bound: bool = True) -> bool:
        """Whether the store saved to holds ``step`` (tiered: a store that does not answer
        is taken not to, the local tier taking the save: ``durable_holds``)."""
        if tiered and self._local is not None:
            return durable_holds(self._save_store(), step, self._local, bound)
        return self._save_store().exists(commit_key(step))

    def _check_not_committed(self, target: _SaveTarget, tiered: bool = False) -> None:
        """``StepExistsError`` where the store saved to holds the step (``_holds``)."""
        if target.durable and self._holds(target.step, tiered):
            self._release_lease(target.attempt)  # on the coordinator: it will not commit
            raise StepExistsError(
                f"rank {self.rank}: step {target.step} is already committed in "
                f"{self._save_store().uri} (another writer, or another save naming the same "
                "step, committed it meanwhile; or DCP plan caching reused an old plan: "
                "enable_plan_caching is not supported by StoreWriter)"
            )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._save_store()
        storage_data: dict[MetadataIndex, tuple[int, int]] = {}
        ranks: dict[int, _Written] = {}
        for rank_results in results:
            for wr in rank_results:
                loc = wr.storage_data
                assert isinstance(loc, _Written), f"unexpected storage_data {loc!r}"
                storage_data[wr.index] = (loc.written.rank, loc.tensor)
                ranks.setdefault(loc.written.rank, loc)
        # The results say which save they belong to, so a writer shared by overlapping
        # async saves still commits each one under its own step.
        targets = {_SaveTarget(w.step, w.attempt) for w in ranks.values()}
        assert len(targets) <= 1, f"ranks wrote different saves: {targets}"
        target = targets.pop() if targets else self._target
        assert target is not None, "finish() before prepare_global_plan()"
        skipped = self._skipped.pop(target.attempt, None) if not ranks else None
        if skipped is not None:  # unhealthy, HealthPolicy(on_unhealthy="skip"): stored nowhere
            self._tier_storage.pop(target.attempt, None)
            self._started.pop(target.attempt, None)
            self.last_save = skipped
            if target.durable and self._cadence is not None:
                self._cadence.missed()  # a later save goes to durable storage in its place
            return
        planned = self._tier_storage.pop(target.attempt, None)
        if planned is not None and planned != storage_data:
            self._release_lease(target.attempt)
            raise RuntimeError(
                f"DCP save of step {target.step}: the items' locations differ from those the "
                "plan gave the local tiers (the planner changed the plan after "
                "prepare_global_plan)"
            )
        if planned is not None and not any(w.durable for w in ranks.values()):
            self._finish_local(target, drained=any(w.drained for w in ranks.values()))
            return
        session = self._session(target)
        try:
            self._check_trainer(target)
            metadata.version = _DCP_VERSION
            metadata.storage_data = storage_data
            metadata.storage_meta = StorageMeta(checkpoint_id=store.uri, save_id=target.attempt)
            health = session.commit(
                [w.written for w in ranks.values()],
                world_size=len(results),
                dcp_metadata=encode_metadata(metadata),
            )
        except BaseException as exc:
            self._started.pop(target.attempt, None)
            self._note_failure(target.attempt, exc)
            telemetry.saves_total.inc(frontend="dcp", outcome="failed")
            if planned is not None and self._cadence is not None:
                self._cadence.missed()  # a tiered save its local tier sent here: a later one goes
            self._release_lease(target.attempt)
            self._reclaim_if_full(session, exc)
            raise
        finally:
            self._release_lease(target.attempt)
        self.last_save = health
        if not health.committed:  # HealthPolicy(on_unhealthy="skip")
            self._started.pop(target.attempt, None)
            return
        self._committed(target)
        session.retain()

    def _check_trainer(self, target: _SaveTarget) -> None:
        """In DCP's checkpoint process: refuse to commit once the training process that asked
        for the save is gone (killed: this process lives on as an orphan, and the restarted job
        resumes from an older step and saves this one again)."""
        if self._trainer_pid is not None and os.getppid() != self._trainer_pid:
            raise CheckpointError(
                f"step {target.step} of {self.store.uri} not committed: the training process "
                f"(pid {self._trainer_pid}) that asked for it is gone"
            )

    # -- tiers ------------------------------------------------------------------------------

    def _tier_group_made(self) -> RankGroup:
        """The tier group, made by every rank with the first save that reaches it."""
        assert self._policy is not None
        with self._group_lock:
            if self._tier_group is None:
                group = self._group(tiered=True)
                refuse_options_apart(group, self._policy.collective_options())
                self._drain_group = self._group(tiered=True)
                self._tier_group = group
            return self._tier_group

    def _drain_group_taken(self) -> RankGroup:
        """The drain group made with the tier group, for the tiers first opened; a new one
        for the tiers of each store the writer moves to after (made by every rank as the save
        reaching it opens them)."""
        with self._group_lock:
            group, self._drain_group = self._drain_group, None
        return group if group is not None else self._group(tiered=True)

    def _set_up_tiers(self) -> None:
        """The tier group (made once, by every rank: DCP calls this on each) and this rank's
        tiers for the writer's store (made again, by every rank, when the store changes)."""
        group = self._tier_group_made()
        if group.rank != self.rank:
            raise ValueError(
                f"StoreWriter(tiers=TierOptions(local_dir=...)) saves over every rank of the default process "
                f"group; DCP's rank {self.rank} is rank {group.rank} there"
            )
        local = self._local
        durable = store_identity(self.store)
        if local is None or (local.world_size, local.durable_uri) != (group.world_size, durable):
            # The drains queued for the store the writer leaves. Not close(): it joins every
            # thread-based async save of the process, this one's twin among them (a deadlock).
            self._close_drains()
            with self._plan_lock:
                self._durable.clear()  # by step: of the store left
            committed = self._tiers.committed if self._tiers is not None else set()
            tiers = open_tiers(
                self._policy,
                self.engine,
                group,
                self.store,
                node_rank=self._node_rank,
                drain_group=self._drain_group_taken(),
                timeout_s=self.store.retry.timeout_s,
                thread_nice=self._background_nice,
                keep_alive=self,  # its exit hook finishes the drains of a writer let go
            )
            self._local, self._topology, self._drains = tiers.local, tiers.topology, tiers.drains
            self._tiers, self._cadence = tiers.saver, tiers.cadence  # its first save goes durable
            self._tiers.committed = committed  # a writer's steps, whichever store it moved to

    def _tier_metadata(self, planner: SavePlanner, target: _SaveTarget) -> bytes:
        """On the coordinator: the DCP metadata ``finish`` will record, for the local copies,
        which are committed before it runs."""
        metadata = getattr(planner, "metadata", None)
        if not isinstance(metadata, Metadata):
            raise UnsupportedStateError(
                f"StoreWriter(tiers=TierOptions(local_dir=...)) needs a save planner that keeps its global "
                f"metadata as .metadata (DefaultSavePlanner does; {type(planner).__name__} "
                "does not)"
            )
        return encode_metadata(
            dataclasses.replace(
                metadata,
                version=_DCP_VERSION,
                storage_data=self._tier_storage[target.attempt],
                storage_meta=StorageMeta(checkpoint_id=self.store.uri, save_id=target.attempt),
            )
        )

    def _write_tiered(
        self, items: list[WriteItem], planner: SavePlanner, target: _SaveTarget
    ) -> list[WriteResult]:
        """This rank's items committed to its local tier (every rank or none: they agree), then,
        for a durable step or where a rank's local tier failed, to the writer's store."""
        assert self._local is not None and self._tier_group is not None
        tensors: list[torch.Tensor] = []
        staged: HeldStaging | None = None
        fatal: BaseException | None = None  # this rank cannot take part in the save at all
        try:
            self._check_not_committed(target, tiered=True)
            tensors = [item_tensor(item, planner) for item in items]
            staged = self._take_staged(tensors)
        except Exception as exc:  # noqa: BLE001 - the other ranks hear of it, then it is raised
            fatal = exc
        keys = {storage_key(item.index): i for i, item in enumerate(items)}
        try:
            with self._tier_lock:
                done = self._commit_local(target, planner, tensors, staged, keys, fatal)
                if done.skipped:
                    assert done.health is not None
                    if self.is_coordinator:  # its finish() reports the save
                        self._skipped[target.attempt] = done.health
                    return []
                written = done.written
                if written is not None:
                    copy = self._tiers.copy_to_peers(
                        target.step, target.attempt, drain=target.durable
                    )
                    written = dataclasses.replace(written, rank=self.rank)  # rank 0's there
                    if target.durable:
                        self._queue_drain(target, copy)
            durable = written is None
            drained = target.durable and not durable
            if durable:
                with self._tier_lock:
                    written = self._write_durable(target, tensors, staged, keys)
        except BaseException:
            self._release_lease(target.attempt)  # on the coordinator: it will not commit
            if target.durable and self._cadence is not None:
                self._cadence.missed()
            raise
        finally:
            if staged is not None:
                staged.release()
        if written is None:
            return []
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=t.numel() * t.element_size(),
                storage_data=_Written(target.step, target.attempt, i, written, durable, drained),
            )
            for i, (item, t) in enumerate(zip(items, tensors))
        ]

    def _commit_local(
        self,
        target: _SaveTarget,
        planner: SavePlanner,
        tensors: list[torch.Tensor],
        staged: HeldStaging | None,
        keys: dict[str, int],
        fatal: BaseException | None,
    ) -> LocalCommit:
        """Every rank's local copy of the step (``TierSaver.commit_local``): what this rank
        wrote there, None if a rank could not (the save then goes to durable storage), or
        skipped (an unhealthy step that ``HealthPolicy`` stores nowhere)."""
        assert self._tiers is not None

        def write(session: SaveSession) -> RankWritten:
            entries, chunks = self._encode(session, staged, tensors)
            # A tier copy is a one-rank step: the rank's index is rank 0's there.
            return session.put_index(0, entries, chunks, items=keys)

        return self._tiers.commit_local(
            step=target.step,
            attempt=target.attempt,
            kind=KIND_DCP,
            write=write,
            metadata=lambda: self._tier_metadata(planner, target),
            fatal=fatal,
        )

    def _write_durable(
        self,
        target: _SaveTarget,
        tensors: list[torch.Tensor],
        staged: HeldStaging | None,
        keys: dict[str, int],
    ) -> RankWritten | None:
        """This rank's items in the writer's store, for a step the local tiers could not take:
        the coordinator takes the save's lease first, and every rank hears whether it could;
        then every rank, items or not, takes part in one round of one writer per distinct
        chunk, as a save straight to durable storage does."""
        assert self._tier_group is not None
        latest: dict[int, LatestIndex] | None = None
        error = None
        if self.is_coordinator:
            try:
                latest = self._begin_lease(target)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                error = exc
        heard = self._tier_group.agree(error, latest)
        if not heard.ok:
            raise CheckpointError(f"DCP step {target.step}: {heard.why()}")
        known = next((p.get(self.rank) for p in heard.payloads if p is not None), None)
        session = self._session(target)
        session.learn(self.rank, known)
        round_ = OneRound(self._tier_group, target.attempt)
        try:
            written = None
            if keys:
                entries, chunks = self._encode(session, staged, tensors, group=round_)
                written = session.put_index(self.rank, entries, chunks, items=keys)
        except BaseException as exc:
            round_.finish(exc)
            raise
        round_.finish()
        return written

    def _finish_local(self, target: _SaveTarget, drained: bool) -> None:
        """``finish`` of a step only the local tiers hold (each rank committed its copy;
        ``drained``: its drain to durable storage is queued)."""
        self._release_lease(target.attempt)
        self._committed(target, local_only=not drained)
        logger.info(
            "DCP step %d committed to the local tiers%s",
            target.step,
            " (its drain to durable storage is queued)" if drained else " only",
        )

    def _queue_drain(self, target: _SaveTarget, copy: CommittedCopy | None) -> None:
        """Every rank queues the step's drain, in save order (the tier lock is held); ``copy``:
        this rank's copy as committed, and its local lease (``TierSaver.copy_to_peers``)."""
        assert self._drains is not None
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._plan_lock:
            self._durable[target.step] = future
            for step in [s for s, f in self._durable.items() if f.done()][:-16]:
                del self._durable[step]  # keep the newest done ones only
        self._drains.put(DrainJob(target.step, target.attempt, KIND_DCP, future, copy=copy))

    # -- durability ---------------------------------------------------------------------------

    def durable_next(self) -> None:
        """With ``local_dir``: the next save is committed to durable storage too, whatever
        ``durable_every`` says (a job's last save: its local copies alone may go with the
        nodes). Every rank calls it before the same save. Without tiers every save is; a
        writer's first save is anyway."""
        with self._plan_lock:
            self._durable_asked = self._policy is not None  # sent in this rank's next plan

    def durable(self, step: int) -> concurrent.futures.Future[None] | None:
        """With ``local_dir``: the future of ``step``'s drain to durable storage (done once it
        is committed there; failed with the error that kept it from there, a
        ``DrainSupersededError`` when drains fell behind saves and a newer step went first);
        None for a step not bound for durable storage, or saved there directly. A DCP save
        returns once every rank's local copy is committed; its drain runs in the background."""
        with self._plan_lock:
            return self._durable.get(step)

    def wait(self) -> None:
        """Block until every drain to durable storage queued so far is over; raise, once, that
        steps committed to the local tiers did not reach durable storage."""
        if self._drains is None:
            return
        self._drains.wait()
        self._drains.raise_failures()

    def close(self) -> None:
        """Finish the saves a thread-based ``dcp.async_save`` runs in this process and the
        queued drains, and stop the drain thread (collective with ``local_dir``: every rank
        closes its writer); raises as ``wait``. A later save opens the tiers again."""
        unwaited.finish_async_saves()
        wait_written()  # a copy a tiered load repaired, written in the background
        self._close_drains()

    def _close_drains(self) -> None:
        """Drain what is queued to durable storage, stop the drain thread and let the tiers
        go (a later save opens them again); raises as ``wait``."""
        drains = self._drains
        if drains is None:
            return
        drains.close()
        if self._cadence is not None and self._policy is not None:
            say = self.is_coordinator  # the rank whose finish() saw where each save went
            self._cadence.warn_if_last_local(say, str(self._policy.local_dir), self.store.uri)
        try:
            self.wait()
        finally:
            self._drains = None
            self._local = None  # a save after close() opens the tiers again

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nobody is left to raise it to
            logger.error("rank %d: at exit: %s", self.rank, one_line(exc))
            fail_at_exit()

    def _note_failure(self, attempt: str, exc: BaseException) -> None:
        """Keep a failed save's error (the newest few): said at exit where nobody waited."""
        self._why_failed[attempt] = one_line(exc)
        while len(self._why_failed) > 16:
            del self._why_failed[next(iter(self._why_failed))]

    def _committed(self, target: _SaveTarget, local_only: bool = False) -> None:
        if self._cadence is not None:
            self._cadence.stored(target.step, local_only=local_only)
        started = self._started.pop(target.attempt, None)
        if started is not None:
            seconds = time.perf_counter() - started[1]
            telemetry.save_persist_seconds.observe(seconds, frontend="dcp")
        telemetry.saves_total.inc(frontend="dcp", outcome="committed")
        self.saved_step = target.step

    def _save_store(self) -> Store:
        """The store of the save running on this thread: the one its ``reset()`` named, so an
        overlapping save that switches stores cannot redirect this one; else ``self.store``."""
        return getattr(self._requested, "store", None) or self.store

    # -- the save lease (coordinator) --------------------------------------------------------

    def _session(self, target: _SaveTarget) -> SaveSession:
        """The coordinator's session of ``target`` (holding its lease), else a session of this
        rank's own, without a lease: the coordinator's covers every rank, and the chunks its
        plan says this rank's latest index holds stay stored under it."""
        return self._sessions.get(target.attempt) or SaveSession(
            self.engine, self._save_store(), step=target.step, attempt=target.attempt, kind=KIND_DCP
        )

    def _begin_lease(self, target: _SaveTarget) -> dict[int, LatestIndex]:
        """Take the save's lease before any rank looks for stored chunks (prepare_global_plan
        runs before DCP hands the ranks their plans); it covers every rank until the commit.
        Where each rank's index of the latest committed step is, by rank. A save that fails
        on another rank never reaches ``finish``: its lease is held until its thread ends or
        plans another save (``_release_leases_of_ended_saves``)."""
        session = self._session(target)
        latest = session.begin(self.rank)
        self._sessions[target.attempt] = session
        return latest

    def _release_leases_of_ended_saves(self) -> None:
        """The leases of saves that DCP ended without ``finish`` (a rank other than the
        coordinator failed: DCP raises on the coordinator without a word to its writer), let go:
        a DCP save runs start to end on one thread, so the save of a thread that has ended, or
        that plans another save now, is over. Held, it would keep every later retention and
        ``ckptstore gc`` from sweeping a chunk while this process lives."""
        now = threading.current_thread()
        # A save made from within another on this thread (a signal handler's): that one is not
        # over, nor can the saves of this thread be told apart from it.
        nested = dcp_saves_on_this_thread() > 1
        for attempt in list(self._sessions):
            started = self._started.get(attempt)
            if started is None:
                continue
            if (started[2] is now and not nested) or not started[2].is_alive():
                self._release_lease(attempt)

    def _release_lease(self, attempt: str) -> None:
        session = self._sessions.pop(attempt, None)
        if session is not None:
            session.release()

    def _reclaim_if_full(self, session: SaveSession, error: BaseException) -> None:
        """A save that failed on a full store sweeps what failed saves left, on the coordinator
        (its own write or the commit failed so; a rank's that failed alone is not heard of), as
        the Checkpointer's saves do (``SaveSession.reclaim``), its lease released first."""
        if self.is_coordinator and is_full_store(error):
            session.reclaim()

    # -- internals --------------------------------------------------------------------------

    def _encode(
        self,
        session: SaveSession,
        staged: HeldStaging | None,
        tensors: list[torch.Tensor],
        group: OneRound | None = None,
    ):
        """(entries, chunks) of ``tensors`` written through ``session``; ``staged`` is kept."""
        return write_tensors(
            self.engine, self.rank, session, staged, tensors, keep=True, group=group
        )

    def _write(
        self,
        items: list[WriteItem],
        planner: SavePlanner,
        target: _SaveTarget,
        *,
        group: OneRound | None = None,
    ) -> list[WriteResult]:
        session = self._session(target)
        try:
            session.learn(self.rank, target.known)
            tensors = [item_tensor(item, planner) for item in items]
            staged = self._take_staged(tensors)
            entries, chunks = write_tensors(
                self.engine, self.rank, session, staged, tensors, group=group
            )
            written = session.put_index(
                self.rank,
                entries,
                chunks,
                items={storage_key(item.index): i for i, item in enumerate(items)},
            )
        except BaseException as exc:
            self._release_lease(target.attempt)  # on the coordinator: it will not commit
            self._reclaim_if_full(session, exc)
            raise
        logger.debug(
            "rank %d: wrote %d DCP items of step %d (%d chunks)",
            self.rank,
            len(items),
            target.step,
            len(chunks),
        )
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=t.numel() * t.element_size(),
                storage_data=_Written(target.step, target.attempt, i, written),
            )
            for i, (item, t) in enumerate(zip(items, tensors))
        ]


# Writers rebuilt in this process from another's pickle, by the token of the original; the
# newest few only (DCP's checkpoint process runs one save at a time, and a run that makes a
# writer per save must not pile up their staging pools here).
_REBUILT: dict[str, StoreWriter] = {}
_REBUILT_KEPT = 4


def _group_size(process_group: Any) -> int:
    """The ranks of DCP's ``process_group`` (None: the default group's; 0 without one)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_world_size(process_group)


def _whole_world(ranks: int) -> bool:
    """Whether a DCP save over ``ranks`` ranks runs on every rank of this process's default
    group (then each calls ``write_data`` and can make a group of them all)."""
    return (
        ranks > 1
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() == ranks
    )


def _writer_in_process(token: str, pid: int, config: dict[str, Any], step: int | None):
    """A ``StoreWriter`` unpickled from ``config``: in another process (DCP's checkpoint
    process) the one rebuilt for the same original writer by an earlier save, so its store
    clients and staging pool are built once; a fresh one in the original's own process."""
    config = dict(config)
    uri = config.pop("uri")
    if pid == os.getpid():
        writer = StoreWriter(uri, step=step, **config)
        writer._token = token
        return writer
    writer = _REBUILT.pop(token, None)
    if writer is None:
        writer = StoreWriter(uri, step=step, **config)
        writer._token = token
        writer._trainer_pid = pid
    _REBUILT[token] = writer  # the newest last
    while len(_REBUILT) > _REBUILT_KEPT:
        del _REBUILT[next(iter(_REBUILT))]
    writer.step = step
    return writer


_WARNED_DEFAULT_GROUP: list[bool] = []
_WARNED_SHARED_GROUP: list[bool] = []


def _warn_if_saves_share_a_group() -> None:
    """Once per process: a DCP save that starts while another save's collectives run on the
    same process group (two ``async_save`` in flight on one group): theirs cross, and both
    hang with any DCP writer."""
    if _WARNED_SHARED_GROUP or _world_size() < 2:
        return
    groups = dcp_save_groups()
    me = threading.get_ident()
    if me not in groups:
        return
    mine = groups[me]
    if not any(t != me and g is mine for t, g in groups.items()):
        return
    _WARNED_SHARED_GROUP.append(True)
    logger.warning(
        "a DCP save starts while another runs its collectives on the same process group (%s): "
        "the two saves' collectives cross and both hang, with any DCP writer; wait for the "
        "previous async_save's future, or give each save in flight a group of its own "
        '(made once before the loop: dist.new_group(backend="gloo"))',
        "the default group" if mine is None else "one group",
    )


def _warn_if_async_on_the_training_group() -> None:
    """Once per process: a thread-based ``async_save`` on the default group of a gloo job runs
    its collectives beside the training loop's on the same group, and DCP's with any writer
    deadlock with a training collective made while the save is in flight."""
    if _WARNED_DEFAULT_GROUP or _world_size() < 2:
        return
    if torch.distributed.get_backend() != "gloo" or not async_save_on_default_group():
        return
    _WARNED_DEFAULT_GROUP.append(True)
    logger.warning(
        "dcp.async_save runs this save's collectives on the default process group (gloo), in a "
        "thread beside the training loop: a collective the loop makes on that group while the "
        "save is in flight deadlocks both (with any DCP writer); pass async_save(..., "
        'process_group=dist.new_group(backend="gloo")), as torchtitan does'
    )


def _rank() -> int:
    """This process's rank in the default process group; 0 without one."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    """The default process group's size; 0 without one."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
