"""Lightning checkpoints in a ckptstore URI: ``Trainer(plugins=[CkptstoreCheckpointIO(uri)])``.

Each checkpoint Lightning saves becomes the ckptstore step ``checkpoint["global_step"]``, saved
through a :class:`ckptstore.Checkpointer`: ``save_checkpoint`` returns once the state is staged
in host memory, encoding, upload and commit run in the background, ``teardown`` (end of
``fit``) waits for them and raises a failed save's error. The path Lightning saves to is a
label: it is recorded in the step's metadata (``user["lightning"]["path"]``), and
``load_checkpoint`` / ``remove_checkpoint`` find the step by it. Give ``ModelCheckpoint``
``dirpath=`` the store's path or URI (a plain path for a local store: Lightning expands local
dirpaths itself); nothing is written there except through this plugin, so its ``exists`` and
listing calls find no ``.ckpt`` files, and ``ckpt_path="last"`` (resolved by Lightning from such
files) finds nothing: resume with ``ckpt_path=`` a saved path, a step number or ``"latest"``.

A second save at a global step already saved or resumed from by this process (``save_last=True``
saves ``last.ckpt`` at the step its top-k checkpoint was saved at) is not written again: the new
path names that step for the rest of the process. Steps are write-once: a step committed by an
earlier run is not overwritten (:class:`ckptstore.StepExistsError`).

Values a ckptstore state cannot represent (enums, dataclasses, paths in hyper-parameters) are
saved as pickled blobs with their tensors pulled out and stored as verified chunks; loading them
follows ``weights_only`` as ``torch.load`` does (``ckptstore.integrations._pickled``).

Single-device strategies and DDP are supported: under DDP global rank 0 saves the whole state
(as Lightning has it) and every rank loads the step on its own, verified. FSDP and DeepSpeed
read their checkpoints with their own code, not through a ``CheckpointIO``: use
``ckptstore.dcp`` for those.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError:
    try:
        from lightning_fabric.plugins import CheckpointIO
    except ImportError:
        raise ImportError(
            "ckptstore.integrations.lightning needs Lightning: pip install lightning"
        ) from None

import torch
import torch.distributed as dist

from ckptstore.catalog import list_steps, load_manifest
from ckptstore.checkpointer import Checkpointer, SaveHandle
from ckptstore.errors import CheckpointNotFoundError, StepExistsError
from ckptstore.integrations._pickled import unwrap, wrap
from ckptstore.retention import collect, drop_step

__all__ = ["CkptstoreCheckpointIO"]

logger = logging.getLogger(__name__)

META_KEY = "lightning"


class CkptstoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves into the ckptstore ``uri``.

    Args:
        uri: the store: a path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        **checkpointer_options: passed to :class:`ckptstore.Checkpointer` (``compression``,
            ``staging_budget_bytes``, ...). Leave ``keep_last`` unset to let
            ``ModelCheckpoint(save_top_k=...)`` decide which steps go.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        **checkpointer_options: Any,
    ) -> None:
        self.uri = str(uri)
        self._options = {"storage_options": storage_options, **checkpointer_options}
        self._checkpointer: Checkpointer | None = None
        self._pending: dict[int, SaveHandle] = {}
        self._own_steps: set[int] = set()  # saved or resumed from by this process
        self._names: dict[str, int] = {}  # every path this process saved or loaded -> its step
        self._paths: dict[int, str] = {}  # committed step -> the path it was saved as (cache)
        self._doomed: set[int] = set()  # removal asked for, kept while another path names it
        self._sweeper: ThreadPoolExecutor | None = None
        self._sweeps: list[Future] = []

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            # Under DDP Lightning saves the whole state from global rank 0 only and loads it
            # on every rank: each process checkpoints on its own (DCP's no_dist).
            several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            self._checkpointer = Checkpointer(self.uri, no_dist=several, **self._options)
        return self._checkpointer

    # -- CheckpointIO -----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage ``checkpoint`` as step ``checkpoint["global_step"]`` and return; the commit
        runs in the background."""
        if storage_options is not None:
            raise TypeError(
                "CkptstoreCheckpointIO takes storage options in its constructor, not per save"
            )
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}: the checkpoint has no integer 'global_step' ({step!r})")
        path = str(path)
        if step in self._own_steps:
            logger.info("%s names step %d of %s, already saved", path, step, self.uri)
            self._name(path, step)
            return
        if step in self.checkpointer.steps():
            raise StepExistsError(
                f"{path}: step {step} is already committed in {self.uri} by an earlier run; "
                "steps are write-once: resume from it with ckpt_path= or use a new store"
            )
        metadata = {META_KEY: {"path": path}}
        self._pending[step] = self.checkpointer.save(step, wrap(checkpoint), metadata=metadata)
        self._own_steps.add(step)
        self._name(path, step)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved as ``path`` (also a step number, or ``"latest"``), verified;
        tensors on the CPU unless ``map_location`` says otherwise."""
        self._wait_saves()
        step = self._resolve(path)
        if step is None:
            raise CheckpointNotFoundError(
                f"no step in {self.uri} was saved as {str(path)!r} (steps: {self._steps_shown()}); "
                "pass a path saved through this plugin, a step number or 'latest'"
            )
        state: dict[str, Any] = {}
        self.checkpointer.load(state, step)
        state = _map_tensors(state, map_location)
        checkpoint = unwrap(state, weights_only=weights_only is not False)
        self._own_steps.add(step)
        if not _is_step_word(path):
            self._name(str(path), step)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Drop the step saved as ``path`` once no other path names it: it stops being listed
        at once; its chunks that no other step references are swept by ckptstore's garbage
        collection in the background."""
        path = str(path)
        step = self._resolve(path)
        if step is None:
            logger.warning("remove_checkpoint: no step in %s was saved as %s", self.uri, path)
            return
        self._names.pop(path, None)
        self._doomed.add(step)
        self._drop_if_unnamed(step)

    def teardown(self) -> None:
        """Wait for every pending save and chunk sweep; raise the first that failed."""
        self._wait_saves()
        sweeps, self._sweeps = self._sweeps, []
        for sweep in sweeps:
            sweep.result()

    # -- beyond CheckpointIO ----------------------------------------------------------------

    def steps(self) -> dict[int, str]:
        """Committed steps, ascending, with the path each was saved as."""
        self._wait_saves()
        return {step: self._saved_path(step) for step in list_steps(self.checkpointer.store)}

    def close(self) -> None:
        """``teardown`` and stop the checkpointer's background thread."""
        try:
            self.teardown()
        finally:
            if self._sweeper is not None:
                self._sweeper.shutdown()
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None

    # -- internals --------------------------------------------------------------------------

    def _wait_saves(self) -> None:
        self._pending.clear()
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def _name(self, path: str, step: int) -> None:
        previous = self._names.get(path)
        self._names[path] = step
        if previous is not None and previous != step:
            self._drop_if_unnamed(previous)

    def _drop_if_unnamed(self, step: int) -> None:
        names = sorted(p for p, s in self._names.items() if s == step)
        if step not in self._doomed or names:
            if names:
                logger.info("step %d of %s is kept: %s names it", step, self.uri, names[0])
            return
        self._doomed.discard(step)
        handle = self._pending.pop(step, None)
        if handle is not None:
            handle.wait()
        store = self.checkpointer.store
        if step not in list_steps(store):
            logger.warning("remove_checkpoint: step %d is not in %s", step, self.uri)
            return
        drop_step(store, step)
        self._own_steps.discard(step)
        self._paths.pop(step, None)
        logger.info("removed step %d from %s", step, self.uri)
        if self._sweeper is None:
            self._sweeper = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-lightning-gc")
        self._sweeps.append(self._sweeper.submit(collect, store, keep_last=None))

    def _resolve(self, path: Any) -> int | None:
        """The committed or pending step ``path`` names, or None."""
        if _is_step_word(path):
            return self.checkpointer.latest() if path == "latest" else int(path)
        text = str(path)
        if text in self._names:
            return self._names[text]
        steps = list_steps(self.checkpointer.store)[::-1]
        for step in steps:
            if self._saved_path(step) == text:
                return step
        name = os.path.basename(text)
        for step in steps:
            if os.path.basename(self._saved_path(step)) == name:
                return step
        return None

    def _saved_path(self, step: int) -> str:
        if step not in self._paths:
            user = load_manifest(self.checkpointer.store, step).user
            self._paths[step] = str((user.get(META_KEY) or {}).get("path", ""))
        return self._paths[step]

    def _steps_shown(self, shown: int = 8) -> str:
        steps = list_steps(self.checkpointer.store)
        more = f" and {len(steps) - shown} older" if len(steps) > shown else ""
        return (", ".join(map(str, steps[::-1][:shown])) + more) or "none"


def _is_step_word(path: Any) -> bool:
    """Whether ``path`` is a step number or ``"latest"`` rather than a saved path."""
    if isinstance(path, int):
        return not isinstance(path, bool)
    return isinstance(path, str) and (path.isdigit() or path == "latest")


def _map_tensors(value: Any, map_location: Any) -> Any:
    """``value`` with its tensors moved as ``torch.load(map_location=...)`` would move tensors
    saved on the CPU (a callable is called as ``fn(tensor, "cpu")``)."""
    if map_location is None:
        return value
    if isinstance(value, torch.Tensor):
        if callable(map_location):
            return map_location(value, "cpu")
        if isinstance(map_location, dict):
            target = map_location.get("cpu")
            return value if target is None else value.to(target)
        return value.to(map_location)
    if isinstance(value, dict):
        return {k: _map_tensors(v, map_location) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, map_location) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, map_location) for v in value)
    return value
