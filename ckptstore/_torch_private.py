"""Every private name of ``torch.distributed`` that ckptstore uses, and only here.

DCP has no public way to load a whole checkpoint into an empty state dict in one process without
a process group (its ``dcp_to_torch_save`` does that for a directory only), nor to narrow a
stored shard to the slice a read asks for. ``step_reader``'s planner also reads attributes
that ``DefaultLoadPlanner`` sets (``flatten_state_dict``, ``mappings``, ``original_state_dict``).
Checked against torch 2.13.0 (`make test`) and 2.14.1 (`make test-torch-next`): the same names
and signatures. When a torch release moves one of these, this file is the one to change.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader

__all__ = [
    "ASYNC_SAVE_THREAD_PREFIX",
    "AsyncSaveCall",
    "async_save_on_default_group",
    "dcp_save_groups",
    "dcp_saves_on_this_thread",
    "dead_checkpoint_process",
    "EmptyStateDictLoadPlanner",
    "load_in_this_process",
    "narrow_tensor_by_index",
    "saving_state_dict",
    "set_element",
    "starting_checkpoint_process",
    "thread_async_save_call",
]

# The name of the thread a thread-based ``dcp.async_save`` runs its save in (one executor per
# save, shut down after it): joined at exit so that a script ending without waiting on the
# future still commits (``dcp.writer.finish_async_saves``).
ASYNC_SAVE_THREAD_PREFIX = "AsyncCheckpointExecutor"


def dcp_saves_on_this_thread() -> int:
    """How many DCP saves this thread is inside (``_save_state_dict`` frames on its stack, which
    every ``dcp.save`` and each save of an ``async_save`` runs through): more than one where a
    save is made from within another (a signal handler's emergency save)."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    code, found = _save_state_dict.__code__, 0
    frame = sys._getframe()
    while frame is not None:
        found += frame.f_code is code
        frame = frame.f_back
    return found


def saving_state_dict() -> Any:
    """The state dict of the innermost DCP save on this thread's stack (``_save_state_dict``'s
    ``state_dict``), None outside one."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is _save_state_dict.__code__:
            return frame.f_locals.get("state_dict")
        frame = frame.f_back
    return None


@dataclasses.dataclass(frozen=True)
class AsyncSaveCall:
    """What the ``dcp.async_save`` this thread is inside was given (``thread_async_save_call``)."""

    threaded: bool = False  # a thread-based one (not DCP's checkpoint process)
    storage_writer: Any = None
    checkpoint_id: Any = None
    process_group: Any = None
    no_dist: bool = False


def thread_async_save_call() -> AsyncSaveCall:
    """The ``dcp.async_save`` call this thread is inside (staging the state it saves);
    ``AsyncSaveCall()`` outside one."""
    from torch.distributed.checkpoint import state_dict_saver

    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "async_save" and code.co_filename == state_dict_saver.__file__:
            found = frame.f_locals
            kind = getattr(found.get("async_checkpointer_type"), "name", None)
            return AsyncSaveCall(
                threaded=kind == "THREAD",
                storage_writer=found.get("storage_writer"),
                checkpoint_id=found.get("checkpoint_id"),
                process_group=found.get("process_group"),
                no_dist=bool(found.get("no_dist", False)),
            )
        frame = frame.f_back
    return AsyncSaveCall()


def async_save_on_default_group() -> bool:
    """Whether this thread runs the save of a thread-based ``async_save`` whose collectives
    use the default process group (``_save_state_dict``'s ``process_group`` left None)."""
    import threading

    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    if not threading.current_thread().name.startswith(ASYNC_SAVE_THREAD_PREFIX):
        return False
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is _save_state_dict.__code__:
            found = frame.f_locals
            return found.get("process_group") is None and not found.get("no_dist", False)
        frame = frame.f_back
    return False


def dcp_save_groups() -> dict[int, Any]:
    """The process group of each DCP save under way in this process (``process_group`` of the
    innermost ``_save_state_dict`` on each thread's stack; None: the default group), by thread
    id; saves with ``no_dist`` (no collectives) left out."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    code, found = _save_state_dict.__code__, {}
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code is code:
                if not frame.f_locals.get("no_dist", False):
                    found[ident] = frame.f_locals.get("process_group")
                break
            frame = frame.f_back
    return found


def starting_checkpoint_process() -> bool:
    """Whether this thread is about to start DCP's checkpoint process (a process-based
    ``async_save``'s first save: ``_execute_save_impl`` on the stack, no process yet); False
    on a torch without process-based saves."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return False
    impl = getattr(
        getattr(executor, "_ProcessBasedAsyncCheckpointExecutor", None), "_execute_save_impl", None
    )
    code = getattr(impl, "__code__", None)
    if code is None or getattr(executor, "_CHECKPOINT_PROCESS", None) is not None:
        return False
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def dead_checkpoint_process() -> int | None:
    """The pid of DCP's checkpoint process (``async_save(async_checkpointer_type=PROCESS)``,
    started once per process and never again) if it has exited; None while it runs or before
    it started (or on a torch without process-based saves)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor
    except ImportError:
        return None

    process = getattr(_async_process_executor, "_CHECKPOINT_PROCESS", None)
    child = getattr(process, "_save_process", None)
    if child is None or child.is_alive():
        return None
    return child.pid


# Rebuilds the state dict from the step's metadata (the state dict it is given must be empty).
EmptyStateDictLoadPlanner = _EmptyStateDictLoadPlanner


def load_in_this_process(
    state: dict[str, Any], *, reader: StorageReader, planner: LoadPlanner
) -> None:
    """DCP's load, run by this process alone: no process group, this process the coordinator."""
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
