"""Staging for ``dcp.async_save``: one copy of the state into a pooled buffer, handed to the
save that writes it."""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ckptstore import telemetry
from ckptstore._torch_private import dead_checkpoint_process
from ckptstore.save import SaveEngine, Staged

logger = logging.getLogger(__name__)

# How long stage() waits for the previous async save to hand the staging buffer back.
_STAGING_WAIT_S = 60.0
_SAVING_LOCK = threading.Lock()  # every writer's ``_saving``


class PooledStager(AsyncStager):
    """DCP's ``AsyncStager`` over a ``SaveEngine``'s staging pool: ``stage()`` copies the
    state's tensors into one pooled buffer and ``write_data`` of the same save finds them
    there (``_take_staged``). The writer sets ``engine``, ``rank``, ``_staged`` and ``_saving``."""

    engine: SaveEngine
    rank: int
    _staged: dict[int, HeldStaging]  # by the staging buffer's data_ptr
    _saving: list[tuple[threading.Thread, HeldStaging]]  # async saves' threads, their staging

    _synchronize_after_execute = False  # stage() returns a finished (or device-fenced) copy

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict over a copy of its tensors in the writer's staging buffer.

        Plain tensors and DTensors (their local shards) are copied; other values are kept as
        they are, as DCP's own stager does. A state holding other tensor subclasses
        (ShardedTensor) is staged by DCP's ``DefaultStager`` instead."""
        leaves: list[torch.Tensor] = []
        if not _collect_tensors(state_dict, leaves):
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                return stager.stage(state_dict)
            finally:
                stager.close()
        t0 = time.perf_counter()
        wait_s = _STAGING_WAIT_S
        dead = dead_checkpoint_process()
        if dead is not None:  # the failed saves' futures pin their buffers: no buffer to wait for
            wait_s = 0.0
            _warn_once(dead, self.rank)
        copied = self.engine.stage_somewhere(
            leaves, wait_s=wait_s, rank=self.rank, reclaim=self._reclaim_ended
        )
        staged = HeldStaging(copied, self.engine, self._staged)
        self._staged[copied.buffer.data_ptr()] = staged
        out = _StagedState(_replace_tensors(state_dict, iter(copied.copy.views)))
        # write_data hands the buffer back once it is written; a save that fails before, or a
        # rank left with nothing to write, hands it back when DCP lets go of the staged state.
        weakref.finalize(out, staged.release)
        telemetry.save_blocked_seconds.observe(time.perf_counter() - t0, frontend="dcp")
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage()`` returns once the copy is done or fenced."""

    def close(self) -> None:
        """Nothing to release: the staging buffer goes with the writer."""

    def bind_staging(self, state_dict: Any) -> None:
        """On the thread of a thread-based ``async_save``, given the state it saves: the
        staging of ``stage()`` it writes is handed back once the thread ends, if its write
        did not hand it back before (a save that failed first: its future, which a loop may
        keep until its next ``async_save``, keeps the staged state alive)."""
        self._reclaim_ended()  # and forgets the saves over
        leaves: list[torch.Tensor] = []
        try:
            _collect_tensors(state_dict, leaves)
        except Exception:  # noqa: BLE001 - the save goes on; only the early hand-back is lost
            logger.debug("rank %d: the staged state of this save was not found", self.rank)
            return
        for t in leaves:
            if t.numel():
                held = self._staged.get(t.untyped_storage().data_ptr())
                if held is not None:
                    with _SAVING_LOCK:
                        self._saving.append((threading.current_thread(), held))
                return

    def _reclaim_ended(self) -> None:
        """Hand back the stagings of saves whose thread has ended (``bind_staging``)."""
        with _SAVING_LOCK:  # the caller's stage() and a save's thread both come here
            ended = [(t, held) for t, held in self._saving if not t.is_alive()]
            self._saving[:] = [e for e in self._saving if e not in ended]
        for _, held in ended:
            held.release()

    def _take_staged(self, tensors: list[torch.Tensor]) -> HeldStaging | None:
        """The staging of ``stage()`` these tensors live in, if any (it is this save's)."""
        for t in tensors:
            if t.numel():
                found = self._staged.pop(t.untyped_storage().data_ptr(), None)
                if found is not None:
                    return found
        return None


_warned: set[int] = set()


def _warn_once(pid: int, rank: int) -> None:
    if pid not in _warned:
        _warned.add(pid)
        logger.warning(
            "rank %d: DCP's checkpoint process (pid %d) has exited: every process-based "
            "async_save of this process will fail (torch starts it once); use thread-based "
            "async_save or restart the job",
            rank,
            pid,
        )


class HeldStaging:
    """What ``StoreWriter.stage()`` copied, until its save has written it."""

    def __init__(
        self, copied: Staged, engine: SaveEngine, registry: dict[int, HeldStaging]
    ) -> None:
        self.copied = copied
        self._engine = engine
        self._registry = registry
        # Its key in the registry, taken now: sending the staged state to DCP's checkpoint
        # process moves the buffer to shared memory, which changes its data_ptr.
        self._key = copied.buffer.data_ptr()
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        """Hand the buffer back (once; later calls do nothing)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if self._registry.get(self._key) is self:
            del self._registry[self._key]
        self._engine.release(self.copied)


class _StagedState(dict):
    """The state dict ``stage()`` returns (a dict that can be weakly referenced). Pickled
    (DCP's process-based async sends it to its checkpoint process) as each staging storage
    once, as a plain byte tensor, and where each tensor lies in it: torch 2.13 crashes
    (SIGSEGV) pickling a second DTensor whose local tensor shares a storage with another's."""

    def __reduce__(self):
        bases: dict[int, torch.Tensor] = {}
        pieces: list[tuple] = []
        skeleton = _as_pieces(dict(self), bases, pieces)
        return (_rebuilt, (skeleton, list(bases.values()), pieces))


class _Piece:
    """Where the ``index``-th staged tensor lies; ``spec``: its DTensor's, if it was one."""

    def __init__(self, index: int, spec: Any = None) -> None:
        self.index, self.spec = index, spec


def _as_pieces(obj: Any, bases: dict[int, torch.Tensor], pieces: list[tuple]) -> Any:
    """``obj`` with each tensor replaced by a ``_Piece``; ``pieces`` gets (base, byte offset,
    dtype, shape, stride) of each, ``bases`` a byte tensor over each storage they lie in."""

    def piece(tensor: torch.Tensor) -> _Piece:
        is_dtensor = isinstance(tensor, DTensor)
        spec, local = (tensor._spec, tensor._local_tensor) if is_dtensor else (None, tensor)
        storage = local.untyped_storage()
        if storage.data_ptr() not in bases:
            bases[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(storage)
        base = list(bases).index(storage.data_ptr())
        offset = local.storage_offset() * local.element_size()
        pieces.append((base, offset, local.dtype, tuple(local.shape), local.stride()))
        return _Piece(len(pieces) - 1, spec)

    return _mapped(obj, lambda v: piece(v) if isinstance(v, torch.Tensor) else v)


def _rebuilt(skeleton: Any, bases: list[torch.Tensor], pieces: list[tuple]) -> dict:
    """The staged state dict, its tensors views of ``bases`` again (``_StagedState``)."""
    tensors = []
    for base, offset, dtype, shape, stride in pieces:
        if math.prod(shape) == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        span = 1 + sum((n - 1) * step for n, step in zip(shape, stride))
        flat = bases[base][offset : offset + span * dtype.itemsize].view(dtype)
        tensors.append(flat.as_strided(shape, stride))

    def tensor(piece: _Piece) -> torch.Tensor:
        local = tensors[piece.index]
        return local if piece.spec is None else DTensor(local, piece.spec, requires_grad=False)

    return _mapped(skeleton, lambda v: tensor(v) if isinstance(v, _Piece) else v)


def _collect_tensors(obj: Any, out: list[torch.Tensor]) -> bool:
    """Append the tensors (local shards of DTensors) of a state dict to ``out``, in a fixed
    order; False if it holds a tensor subclass ``stage()`` cannot rebuild."""
    plain = (torch.Tensor, torch.nn.Parameter)

    def collect(value: Any) -> Any:
        if isinstance(value, DTensor):
            out.append(value.to_local().detach())
        elif isinstance(value, torch.Tensor):
            if type(value) not in plain:
                raise _CannotStage
            out.append(value.detach())
        return value

    try:
        _mapped(obj, collect)
    except _CannotStage:
        return False
    return True


def _replace_tensors(obj: Any, views) -> Any:
    """``obj`` with its tensors replaced, in ``_collect_tensors`` order, by ``views``."""

    def view(value: Any) -> Any:
        if isinstance(value, DTensor):
            # Not DTensor.from_local: it would move the local copy back to the mesh's device.
            return DTensor(next(views), value._spec, requires_grad=False)
        return next(views) if isinstance(value, torch.Tensor) else value

    return _mapped(obj, view)


class _CannotStage(Exception):
    """A tensor subclass ``stage()`` cannot rebuild."""


def _mapped(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with each value that is not a dict, list or tuple replaced by ``leaf(value)``,
    in one fixed order (every walk of the staged state goes through here)."""
    if isinstance(obj, dict):
        return {k: _mapped(v, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mapped(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_mapped(v, leaf) for v in obj)
    return leaf(obj)
