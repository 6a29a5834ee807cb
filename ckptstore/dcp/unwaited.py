"""The saves a thread-based ``dcp.async_save`` runs that a script never waits for: finished at
exit before ``concurrent.futures`` refuses new work (which the S3 client needs), and each that
ended without committing named in one ERROR line (its error sits in a future nobody read)."""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # its exit hook must be registered before ours
import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ckptstore._torch_private import ASYNC_SAVE_THREAD_PREFIX
from ckptstore.dcp.ids import checkpoint_step
from ckptstore.errors import one_line
from ckptstore.exit_status import fail_at_exit

if TYPE_CHECKING:
    from ckptstore.dcp.writer import StoreWriter

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()  # every writer's ``_thread_saves``


class ThreadSave:
    """A thread-based ``async_save`` a writer staged on this rank, kept until it ends well:
    the step its ``checkpoint_id`` named (None: the next), the thread that reached the
    writer's set-up with it (None: none yet) and, once its future failed, why (one line; not
    the error, whose traceback would keep the staged state alive)."""

    __slots__ = ("step", "thread", "why")

    def __init__(self, step: int | None) -> None:
        self.step, self.thread, self.why = step, None, None


def staged(writer: StoreWriter, checkpoint_id: Any) -> None:
    """On ``async_save``'s caller thread, once ``writer`` staged its state: a save to follow."""
    try:
        step = None if checkpoint_id is None else checkpoint_step(checkpoint_id)
    except ValueError:
        step = None
    with _LOCK:
        writer._thread_saves.append(ThreadSave(step))


def reached(writer: StoreWriter, step: int | None) -> None:
    """On a save's thread as it reaches ``writer``'s set-up: how its future ends is kept (a
    save that fails after, in the writer or in DCP, on any rank, is named at exit)."""
    with _LOCK:
        waiting = [s for s in writer._thread_saves if s.thread is None]
        if not waiting:  # staged by another stager: not followed
            return
        save = next((s for s in waiting if s.step == step), waiting[0])
        save.thread = threading.current_thread()
    future = _this_threads_future()
    if future is None:  # not run by a concurrent.futures worker: how it ends is not known
        _forget(writer, save)
        return
    future.add_done_callback(lambda done: _ended(writer, save, done))


def _ended(writer: StoreWriter, save: ThreadSave, future: concurrent.futures.Future) -> None:
    error = future.exception()
    if error is None:
        _forget(writer, save)
    else:
        save.why = _why(error)


def _forget(writer: StoreWriter, save: ThreadSave) -> None:
    with _LOCK:
        if save in writer._thread_saves:
            writer._thread_saves.remove(save)


def _why(error: BaseException) -> str:
    """A failed save's error in one line: each rank's error of DCP's ``CheckpointException``."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return one_line(error)
    lines = [
        f"rank {rank}: {one_line(e[0] if isinstance(e, tuple) else e)}"
        for rank, e in sorted(failures.items())
    ]
    more = f"; and {len(lines) - 3} more ranks" if len(lines) > 3 else ""
    return "; ".join(lines[:3]) + more


def _this_threads_future() -> concurrent.futures.Future | None:
    """The future of the ``concurrent.futures`` work item this thread runs, if any."""
    run = concurrent.futures.thread._WorkItem.run.__code__
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is run:
            future = getattr(frame.f_locals.get("self"), "future", None)
            return future if isinstance(future, concurrent.futures.Future) else None
        frame = frame.f_back
    return None


def finish_async_saves() -> None:
    """Wait for every save a thread-based ``dcp.async_save`` runs in this process (each in a
    thread of its own; a failed one ends too, its error in its future)."""
    for thread in threading.enumerate():
        if (
            thread.name.startswith(ASYNC_SAVE_THREAD_PREFIX)
            and thread is not threading.current_thread()
        ):
            thread.join()


def _at_exit() -> None:
    """The saves ``dcp.async_save`` still runs, finished; then each save whose thread ended
    without committing it is named in one ERROR line: its error is in a future nobody may
    have read (a script that ends right after ``async_save``), on every rank, wherever it
    failed (in the writer, in DCP's own code before or after it). A ``dcp.save`` that failed
    raised its error to its caller, who may have gone on: that is not named."""
    finish_async_saves()
    for writer in list(_WRITERS):
        named: set[threading.Thread] = set()
        for attempt, (step, _, thread) in list(writer._started.items()):
            # A save of another thread (dcp.save) raised its error to its caller.
            if thread.name.startswith(ASYNC_SAVE_THREAD_PREFIX) and not thread.is_alive():
                named.add(thread)
                _name(writer, step, writer._why_failed.get(attempt, _IN_THE_FUTURE))
        with _LOCK:
            saves = list(writer._thread_saves)
        for save in saves:
            if save.thread is None:
                _name(writer, save.step, f"before it reached the StoreWriter ({_IN_THE_FUTURE})")
            elif save.why is not None and save.thread not in named:
                _name(writer, save.step, save.why)


_IN_THE_FUTURE = "its error is in the future dcp.async_save returned"


def _name(writer: StoreWriter, step: int | None, why: str) -> None:
    logger.error(
        "rank %d: dcp.async_save of %s to %s failed: %s",
        writer.rank,
        "the next step" if step is None else f"step {step}",
        writer.store.uri,
        why,
    )
    fail_at_exit()


_exit_hook_lock = threading.Lock()
_exit_hook: list[bool] = []
_WRITERS: weakref.WeakSet[StoreWriter] = weakref.WeakSet()


def watch(writer: StoreWriter) -> None:
    """``writer``'s unwaited saves finished (and a failed one named) at this process's exit;
    the hook registered once per process."""
    _finish_async_saves_at_exit()
    _WRITERS.add(writer)


def _finish_async_saves_at_exit() -> None:
    """Once per process: at exit, before ``concurrent.futures`` refuses new work (which the
    S3 client needs), the saves ``dcp.async_save`` still runs are finished. Without it a
    script that ends without waiting on its future lost the save (on S3: nothing stored, no
    error), where DCP's own writer commits it."""
    with _exit_hook_lock:
        if not _exit_hook:
            _exit_hook.append(True)
            threading._register_atexit(_at_exit)
