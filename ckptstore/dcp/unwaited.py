"""The saves a thread-based ``dcp.async_save`` runs that a script never waits for: finished at
exit before ``concurrent.futures`` refuses new work (which the S3 client needs), and each that
ended without committing named in one ERROR line (its error sits in a future nobody read)."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import threading
import weakref
from typing import TYPE_CHECKING

from ckptstore._torch_private import ASYNC_SAVE_THREAD_PREFIX
from ckptstore.exit_status import fail_at_exit

if TYPE_CHECKING:
    from ckptstore.dcp.writer import StoreWriter

logger = logging.getLogger(__name__)


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
    have read (a script that ends right after ``async_save``). A ``dcp.save`` that failed
    raised its error to its caller, who may have gone on: that is not named."""
    finish_async_saves()
    for writer in list(_WRITERS):
        for attempt, (step, _, thread) in list(writer._started.items()):
            # A save of another thread (dcp.save) raised its error to its caller.
            if thread.name.startswith(ASYNC_SAVE_THREAD_PREFIX) and not thread.is_alive():
                why = writer._why_failed.get(
                    attempt, "its error is in the future dcp.async_save returned"
                )
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
