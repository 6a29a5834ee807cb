"""torchtitan 0.3 checkpoints in a ckptstore store, through torchtitan's own config seam::

    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    config = Trainer.Config(..., checkpoint=CkptstoreCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, async_mode="async", keep_latest_k=3))

``Trainer.Config.checkpoint`` takes any ``BaseCheckpointManager.Config``; the trainer calls its
``build(dataloader=, model_parts=, optimizers=, lr_schedulers=, states=, sd_adapter=,
base_folder=)`` and drives the manager it returns (``load(step=checkpoint.load_step)`` before
training; per step ``maybe_wait_for_staging()`` before the optimizer step, then ``save(step,
last_step=...)``; ``close()``). The fields are torchtitan's ``CheckpointManager.Config``'s, by the
same names and with the same meaning, plus ckptstore's own option objects.

Why DCP and not ``Checkpointer``: torchtitan's state is DTensors (FSDP2, TP) flattened to
fully qualified names, and a job may resume on another parallelism. DCP's planner reshards it;
``ckptstore.dcp.StoreWriter`` / ``StoreReader`` make each save one verified, atomically
committed step of the store at ``folder`` (``filesystem.join(dump_folder, folder)`` as torchtitan
resolves it, or a URI such as ``s3://bucket/run``). So the manager keeps torchtitan's call order
and its state dict as torchtitan's own ``CheckpointManager`` builds it, and changes only where
the bytes go and how the newest step is found:

- resume (``load_step=-1``) takes the newest *committed* step of the store's catalog (never a
  listing of folders: an interrupted save is never seen) that loads: one whose chunks are corrupt
  or missing is skipped with a warning and quarantined, the one before it loaded
  (``ckptstore.dcp.resume``), so a damaged step does not crash every restart. ``load_step=N``
  loads that step, and a step the store does not hold is ``FileNotFoundError``, as in torchtitan. Step 0 (a seed checkpoint)
  loads the model only, as in torchtitan. With nothing committed, ``initial_load_path`` (another
  ckptstore store: its newest step, or step N when the path ends in ``/step-N`` as torchtitan's
  checkpoint folders do; ``initial_load_model_only`` applies) or a fresh start.
- steps are write-once (torchtitan rewrites a ``step-N`` folder in place): ``load_step=N`` with
  a newer step committed is refused unless ``load_only``, since training on would save steps
  that exist. To roll back, train on in a new ``folder`` with ``initial_load_path=
  "<old folder>/step-N"`` and ``initial_load_model_only=False``.
- ``keep_latest_k`` is the store's retention (the newest K committed steps are kept and chunks no
  kept step references are swept, under the store's gc lease, safe while a save is in flight).
- ``async_mode``: ``disabled`` is ``dcp.save``; ``async`` is ``dcp.async_save`` in a thread over
  a gloo group of its own, staged into the writer's pooled buffer (one copy, reused);
  ``async_with_pinned_mem`` stages with DCP's ``DefaultStager`` in the background (pinned
  memory where CUDA is) and overlaps the staging with the next step's forward and backward
  (``maybe_wait_for_staging``), as torchtitan does. The upload runs in DCP's checkpoint
  process (``AsyncCheckpointerType.PROCESS``), as torchtitan's does, when the writer has no
  tiers (``StoreWriter`` pickles its configuration and is rebuilt there once); a writer with
  ``tiers`` stays in the trainer's process, where its drains to the store remain in reach of
  ``close()``, and uploads from a background thread (``AsyncCheckpointerType.THREAD``). DCP
  spawns its checkpoint process, which imports the training script again: keep the script's
  code under ``if __name__ == "__main__":``.
- the last step (``training.steps``) is saved synchronously and, with tiers, drained to the
  store before it returns (``durable_next()``: it is the run's result, whichever save
  ``durable_every`` drains): the model alone cast to
  ``export_dtype`` when ``last_save_model_only``, and with ``last_save_in_hf`` also exported as
  Hugging Face safetensors (``ckptstore.export``; names from ``sd_adapter.to_hf`` when the model
  has an adapter) to ``<folder>/hf/step-<N>``.

Not supported: ``initial_load_in_hf`` (load the Hugging Face weights with torchtitan's own
manager once, or convert them). Values DCP pickles (the dataloader's state) are loaded by
torch's weights-only unpickler (``StoreReader``). torchtitan's dataloader then runs
``pickle.loads`` on its own bytes (each rank's ``dp_rank_<k>``): those are unpickled first with
plain values and tensors alone (``_pickled.check_pickled_state``), and one naming anything else
is :class:`~ckptstore.errors.UnsupportedStateError` before torchtitan sees it, so a hostile
store runs no code through ``load()``.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

try:
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ImportError as exc:
    raise ImportError(
        "ckptstore.integrations.torchtitan needs torchtitan 0.3 and what its checkpoint manager "
        f"imports: pip install 'ckptstore[torchtitan]' ({exc})"
    ) from exc

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.staging import StagingOptions as DCPStagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from ckptstore.catalog import list_steps, load_manifest
from ckptstore.dcp import StoreReader, StoreWriter, resume
from ckptstore.errors import CheckpointNotFoundError, one_line
from ckptstore.integrations._pickled import check_pickled_state
from ckptstore.options import (
    EncodingOptions,
    ReadOptions,
    RetentionOptions,
    StagingOptions,
    StorageOptions,
    TierOptions,
)
from ckptstore.store.backends import refuse_a_mistyped_scheme

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["CkptstoreCheckpointManager"]

logger = logging.getLogger(__name__)

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_STEP_DIR = re.compile(r"step-(\d+)")
HF_DIR = "hf"
"""Where ``last_save_in_hf`` exports go, under the checkpoint folder: ``hf/step-<N>``."""


class CkptstoreCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, saved to and loaded from a ckptstore store
    (see the module's docstring). Built by ``CkptstoreCheckpointManager.Config(...).build(...)``
    with the arguments torchtitan's trainer passes."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config`` fields (``folder`` may also be a URI) and
        ckptstore's option objects, each as ``StoreWriter`` / ``StoreReader`` take it."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Save mode: synchronous, threaded async, or async with background (pinned) staging."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options of the store (credentials, endpoint); default: the environment. Set
        in a config module (a dict is no command-line flag); the option objects below are
        (``--checkpoint.tiers.local-dir /nvme/ckpt``, ``--checkpoint.storage.timeout-s 60``)."""

        storage: StorageOptions = field(default_factory=StorageOptions)
        """How the store is reached (concurrency, request deadlines)."""

        encoding: EncodingOptions = field(default_factory=EncodingOptions)
        """How chunks are cut, compressed and uploaded."""

        staging: StagingOptions = field(default_factory=StagingOptions)
        """Staging for ``async``: the bound of the writer's host buffers."""

        retention: RetentionOptions = field(default_factory=RetentionOptions)
        """Leases of saves and of the retention sweep (``keep_latest_k`` is the count kept)."""

        tiers: TierOptions = field(default_factory=TierOptions)
        """Node-local and peer tiers with background drains to the store (``local_dir``)."""

        reads: ReadOptions = field(default_factory=ReadOptions)
        """How a load reads (concurrency, batch bytes, chunks shared between ranks)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ASYNC_MODES:
                raise ValueError(
                    f"Invalid async_mode: {self.async_mode!r} (one of {', '.join(ASYNC_MODES)})"
                )
            self.async_mode = mode
            if self.initial_load_in_hf:
                raise ValueError(
                    "initial_load_in_hf is not supported by CkptstoreCheckpointManager: "
                    "initial_load_path names a ckptstore store"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder)
        if "://" not in str(self.folder) and not os.path.lexists(self.folder):
            refuse_a_mistyped_scheme(str(config.folder))  # joined, s3:/b/run is a local path
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.sd_adapter = sd_adapter
        self.async_mode = config.async_mode
        self.storage_options = config.storage_options or None
        tiers = config.tiers if config.tiers and config.tiers.local_dir is not None else None
        self._read_options = dict(storage=config.storage, reads=config.reads, tiers=tiers)
        self.save_future: Future | None = None
        self.staging_future: Future | None = None
        self.stager: DefaultStager | None = None
        self.last_export: Any = None
        """The ``ckptstore.export.ExportResult`` of the last ``last_save_in_hf`` export."""
        self._process_based: bool | None = None  # async_with_pinned_mem: decided at its 1st save
        self.pg: dist.ProcessGroup | None = None
        if self.async_mode != "disabled":
            self.pg = dist.new_group(backend="gloo")
        writer_options = dict(
            keep_last=self.keep_latest_k or None,
            storage_options=self.storage_options,
            storage=config.storage,
            encoding=config.encoding,
            staging=config.staging,
            retention=config.retention,
        )
        self.writer = StoreWriter(self.folder, tiers=tiers, **writer_options)
        logger.info(
            "rank %d: checkpoints are loaded from and saved to the ckptstore store %s",
            _rank(),
            self.folder,
        )

    def __del__(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nobody is left to raise it to
            logger.error("rank %d: closing the checkpoint manager: %s", _rank(), exc)

    # -- saving ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._save_last_step(curr_step)
            return True
        states = self._flattened_model_states_sd()
        if self.async_mode == "async_with_pinned_mem":
            result = self._async_save_staged(states, curr_step)
            self.staging_future = result.staging_completion
            self.save_future = result.upload_completion
        elif self.async_mode == "async":
            self.save_future = dcp.async_save(
                states,
                storage_writer=self.writer,
                checkpoint_id=str(curr_step),
                process_group=self.pg,
            )
        else:
            dcp.save(states, storage_writer=self.writer, checkpoint_id=str(curr_step))
        return True

    def _async_save_staged(self, states: dict[str, Any], step: int) -> AsyncSaveResponse:
        """``async_with_pinned_mem``: DCP's ``DefaultStager`` copies the state in the background
        (into pinned memory with CUDA) while the loop runs the next forward and backward; the
        upload runs in a checkpoint process, as torchtitan's, when the writer can be sent there,
        else in a thread."""
        if self._process_based is None:
            self._process_based = _picklable(self.writer)
            if not self._process_based:
                logger.info(
                    "rank %d: async_with_pinned_mem uploads from a thread (the StoreWriter "
                    "cannot be sent to a checkpoint process)",
                    _rank(),
                )
        if self.stager is None:
            accelerated = torch.cuda.is_available()
            self.stager = DefaultStager(
                DCPStagingOptions(
                    use_pinned_memory=accelerated,
                    use_shared_memory=self._process_based,
                    use_async_staging=True,
                    use_non_blocking_copy=accelerated,
                )
            )
        kind = (
            AsyncCheckpointerType.PROCESS if self._process_based else AsyncCheckpointerType.THREAD
        )
        result = dcp.async_save(
            states,
            storage_writer=self.writer,
            checkpoint_id=str(step),
            process_group=self.pg,
            async_checkpointer_type=kind,
            async_stager=self.stager,
        )
        if not isinstance(result, AsyncSaveResponse):
            raise RuntimeError(f"dcp.async_save with an async stager returned {type(result)}")
        return result

    def _save_last_step(self, curr_step: int) -> None:
        if self.last_save_model_only:
            states = {
                k: v.to(self.export_dtype)
                if isinstance(v, torch.Tensor)
                and v.is_floating_point()
                and v.dtype != self.export_dtype
                else v
                for k, v in self.states[MODEL].state_dict().items()
            }
            if self.last_save_in_hf and self.sd_adapter is not None:
                states = self.sd_adapter.to_hf(states)
            logger.info(
                "rank %d: saving a model-only checkpoint in %s at the last step, step %d",
                _rank(),
                self.export_dtype,
                curr_step,
            )
        else:
            states = self._flattened_model_states_sd()
        # The last step goes to the store, even with tiers that drain only every
        # durable_every-th save: it is the run's result (and what last_save_in_hf exports).
        self.writer.durable_next()
        dcp.save(states, storage_writer=self.writer, checkpoint_id=str(curr_step))
        drained = self.writer.durable(curr_step)  # None: saved to the store directly
        if drained is not None:
            drained.result()
        if self.last_save_in_hf:
            self._export_hf(curr_step)

    def _export_hf(self, step: int) -> None:
        """Rank 0 writes step ``step`` as safetensors to ``<folder>/hf/step-<step>``; every rank
        hears whether it did."""
        from ckptstore.export import export_safetensors

        out_dir = os.path.join(self.folder, HF_DIR, f"step-{step}")
        failure: list[str | None] = [None]
        if _rank() == 0:
            try:
                self.last_export = export_safetensors(
                    self.folder, out_dir, step=step, overwrite=True,
                    storage_options=self.storage_options,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                failure[0] = f"{type(exc).__name__}: {exc}"
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise RuntimeError(f"step {step}: the Hugging Face export failed: {failure[0]}")

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _flattened_model_states_sd(
        self, state_dict: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        states = state_dict if state_dict is not None else self.states
        sd = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    # -- loading --------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        reader = self._reader(self.folder)
        if step == -1:
            load_step = _agreed(reader.latest())
            if load_step:  # step 0 is torchtitan's model-only seed: nothing older to try
                if self._resume(reader):
                    return True
                load_step = None  # every step went between the listing and the load
        else:
            if self._read_options["tiers"] is None:
                committed = list_steps(reader.store)
                if step not in committed:
                    raise FileNotFoundError(
                        f"--checkpoint.load_step={step} not found in {self.folder} "
                        f"(committed steps: {_some(committed)})"
                    )
                newest = committed[-1]
            else:  # the local tiers' steps too (collective, as the load)
                newest = _agreed(reader.latest())
            if newest is not None and newest > step and not self.load_only:
                raise ValueError(
                    f"--checkpoint.load_step={step} is older than step {newest} committed "
                    f"in {self.folder}: steps are write-once, so the saves after it would "
                    "collide; load it with load_only=True, or train on in a new folder with "
                    f"initial_load_path={_step_path(self.folder, step)!r}"
                )
            load_step = step
        if load_step is not None:
            # A job restarted with the same arguments resumes here; initial_* are ignored.
            model_only = load_step == 0
            source = self.folder
        elif self.initial_load_path:
            source, named = _split_step(self.initial_load_path)
            reader = self._reader(source)
            committed = list_steps(reader.store)
            load_step = _agreed(committed[-1] if committed else None) if named is None else named
            if load_step is None or load_step not in committed:
                raise ValueError(
                    f"Checkpoint.initial_load_path is invalid: {self.initial_load_path} "
                    f"names no committed ckptstore step (committed: {_some(committed)})"
                    + _dcp_folder_hint(self.initial_load_path)
                )
            if load_manifest(reader.store, load_step).dcp_metadata is None:
                raise ValueError(
                    f"Checkpoint.initial_load_path is invalid: step {load_step} of {source} "
                    "was saved by ckptstore.Checkpointer, not through DCP as torchtitan saves: "
                    "load it with Checkpointer.load into the model and save it through DCP first"
                )
            model_only = self.initial_load_model_only
        else:
            logger.info("rank %d: no checkpoint in %s: a fresh start", _rank(), self.folder)
            return False
        reader.step = load_step
        logger.info("rank %d: loading step %d of %s", _rank(), load_step, source)
        states = self._states_to_load(model_only)
        try:
            dcp.load(states, storage_reader=reader)
        except CheckpointException as exc:
            failures = [e for e, _ in exc.failures.values()] + [reader.metadata_error]
            clear = _one_line_load_error(
                failures, load_step, source, named=step != -1, stored=reader.stored_keys
            )
            if clear is None:
                raise
            raise clear from exc
        # The model's entries are flattened into the loaded dict: hand them to the model.
        self.states[MODEL].load_state_dict(states)
        return True

    def _resume(self, reader: StoreReader) -> bool:
        """The newest step that loads (``ckptstore.dcp.resume``): a corrupt or incomplete
        newest step is skipped, named in a warning and quarantined, not a crash at every
        restart."""
        states = self._states_to_load(model_only=False)
        seed: dict[str, Any] = {}  # step 0 holds the model alone, as in _load

        def state_for(step: int) -> dict[str, Any]:
            if step:
                return states
            seed.update(self._states_to_load(model_only=True))
            return seed

        try:
            step = resume(states, reader, state_for=state_for)
        except CheckpointException as exc:
            failures = [e for e, _ in exc.failures.values()] + [reader.metadata_error]
            failed = getattr(exc, "step", None)
            clear = (
                None
                if failed is None
                else _one_line_load_error(
                    failures, failed, self.folder, named=False, stored=reader.stored_keys
                )
            )
            if clear is None:
                raise
            raise clear from exc
        if step is None:
            return False
        logger.info("rank %d: loaded step %d of %s", _rank(), step, self.folder)
        self.states[MODEL].load_state_dict(states if step else seed)
        return True

    def _reader(self, uri: str) -> StoreReader:
        return StoreReader(uri, storage_options=self.storage_options, **self._read_options)

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self.states[MODEL].state_dict()
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        keep = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
        if keep.get(DATALOADER) is not None:
            keep[DATALOADER] = _CheckedDataloader(keep[DATALOADER])
        return self._flattened_model_states_sd(keep)

    # -- waiting and closing --------------------------------------------------------------------

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is None:
            return
        self.staging_future.result()
        self.staging_future = None

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        future, self.save_future = self.save_future, None
        future.result()

    def _close(self) -> None:
        if getattr(self, "writer", None) is None:
            return
        try:
            self.maybe_wait_for_staging()
            self.maybe_wait_for_saving()
        finally:
            if self.stager is not None:
                self.stager.close()
                self.stager = None
            writer, self.writer = self.writer, None
            writer.close()


class _CheckedDataloader:
    """torchtitan's dataloader as DCP loads it, its pickled state checked first: its
    ``load_state_dict`` runs ``pickle.loads`` on the bytes the step holds (each rank's
    ``dp_rank_<k>``), which would run any code a hostile checkpoint put there."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        return self.dataloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            try:  # whatever pickle.loads takes: any buffer (an ndarray too), not bytes alone
                data = memoryview(value).tobytes()
            except TypeError:
                continue
            check_pickled_state(data, f"the step's dataloader state {key!r}")
        self.dataloader.load_state_dict(state_dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agreed(step: int | None) -> int | None:
    """Rank 0's ``step``, on every rank (a save committed while ranks list must not split
    them)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return step
    box = [step]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_TRAINING_STATE = frozenset({DATALOADER, OPTIMIZER, LR_SCHEDULER, "train_state"})
_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (\S+?)\.?$")


def _one_line_load_error(
    failures: list[BaseException | None],
    step: int,
    source: str,
    *,
    named: bool,
    stored: frozenset[str] | None,
) -> Exception | None:
    """What a failed ``dcp.load`` of ``step`` (its ranks' ``failures``; ``stored``: the keys
    the step holds, where known) means to a torchtitan user, in one line, where it is one of
    the errors they can act on: a ``load_step`` no tier holds, a step that holds the model
    alone (the final save of a run with ``last_save_model_only``), or one saved at another
    data-parallel degree (a dataloader state per data-parallel rank)."""
    for error in failures:
        if named and isinstance(error, CheckpointNotFoundError):
            return FileNotFoundError(
                f"--checkpoint.load_step={step} not found in {source}: {one_line(error)}"
            )
        missing = _MISSING_KEY.search(str(error)) if isinstance(error, RuntimeError) else None
        if missing:
            return _missing_key_error(missing.group(1), step, source, stored or frozenset())
    return None


def _missing_key_error(key: str, step: int, source: str, stored: frozenset[str]) -> ValueError:
    tops = {k.split(".", 1)[0] for k in stored}
    if key.split(".", 1)[0] in _TRAINING_STATE and stored and not tops & _TRAINING_STATE:
        return ValueError(
            f"step {step} of {source} holds the model alone, not {key} (the final save "
            "of a run with last_save_model_only, torchtitan's default): it does not "
            "resume training; train on in a new folder with "
            f"initial_load_path={_step_path(source, step)!r}, or save the last step "
            "whole with last_save_model_only=False"
        )
    ranks = sorted(k for k in stored if k.startswith(f"{DATALOADER}.dp_rank_"))
    if key.startswith(f"{DATALOADER}.dp_rank_") and ranks:
        return ValueError(
            f"step {step} of {source} holds the dataloader state of {len(ranks)} "
            f"data-parallel rank(s), not {key}: it was saved at another data-parallel degree; "
            "load it at that degree, or with exclude_from_loading=['dataloader'] (each "
            "rank's dataloader starts over)"
        )
    return ValueError(f"step {step} of {source} does not hold {key}")


def _step_path(uri: str, step: int) -> str:
    return f"{uri.rstrip('/')}/step-{step}"


def _split_step(path: str) -> tuple[str, int | None]:
    """``(store, step)`` of an ``initial_load_path``: ``<store>/step-<N>`` names step N of the
    store (torchtitan's own way to name a checkpoint), any other path a store's newest step."""
    head, _, last = path.rstrip("/").rpartition("/")
    match = _STEP_DIR.fullmatch(last)
    if head and match:
        return head, int(match.group(1))
    return path, None


def _dcp_folder_hint(path: str) -> str:
    """Why a plain DCP checkpoint folder (torchtitan's own ``step-N``) does not load here."""
    try:
        fs, root = fsspec.core.url_to_fs(path)
        found = fs.exists(f"{root.rstrip('/')}/.metadata")
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if not found:
        return ""
    return (
        "; it is a plain DCP checkpoint (it holds .metadata), as torchtitan's own manager "
        "writes: start from it with that manager's initial_load_path once, then save with "
        "ckptstore"
    )


def _some(steps: list[int]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(str(s) for s in steps[-8:])
    return shown if len(steps) <= 8 else f"..., {shown}"


def _picklable(obj: Any) -> bool:
    """Whether ``obj`` can be sent to DCP's checkpoint process."""
    try:
        pickle.dumps(obj)
    except (TypeError, AttributeError, pickle.PicklingError):
        return False
    return True
