"""SIGTERM for a Checkpointer: finish the pending saves, then exit as SIGTERM would have.

Schedulers (SLURM, Kubernetes, torchrun) send SIGTERM some seconds before SIGKILL. With
``Checkpointer(uri, handle_sigterm=True)``::

    on SIGTERM   ``ckpt.preempted`` becomes true; saves pending now (and any the loop starts)
                 go on, for at most ``sigterm_grace_s``
    then         one log line per such save: committed, failed or abandoned
    and          the process ends as SIGTERM would have: the handler installed before ours runs
                 (if it returns, or there was none, the process dies of SIGTERM: exit 143)

When the process ends depends on whether the loop watches ``ckpt.preempted``. A loop that read
it before the signal is trusted to save its step and leave: the process ends at interpreter exit
once the Checkpointer has closed (the code after ``close()`` still runs), or at the grace
deadline if the Checkpointer is still open then. A loop that
never read it does not know it should stop: the process ends as soon as the pending saves are.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# After asking the main thread to end the process, how long before the watcher ends it itself
# (the main thread may be stuck in C code that never returns to Python).
_MAIN_THREAD_GRACE_S = 5.0


class SigtermGuard:
    """The SIGTERM handler of one Checkpointer (``ckpt`` names it in log lines)."""

    def __init__(self, *, grace_s: float, ckpt: str, closed: threading.Event) -> None:
        self.check_installable(grace_s)
        self.grace_s = grace_s
        self.ckpt = ckpt
        self.closed = closed
        self.signalled = threading.Event()
        self.aware = False  # the loop read ``preempted`` before the signal
        self._handles: list[Any] = []  # saves pending at the signal, and those started after
        self._lock = threading.Lock()
        self._deadline = 0.0
        self._ending = False
        self._reported = False
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_signal)
        # Threading's exit hooks run last registered first: the Checkpointer registers its own
        # (finish the pending saves) after this one.
        threading._register_atexit(self._at_exit)

    def _at_exit(self) -> None:
        if self.signalled.is_set():
            self.end_process()

    @staticmethod
    def check_installable(grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"sigterm_grace_s must be >= 0, got {grace_s}")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "handle_sigterm=True installs a SIGTERM handler, which Python allows only from "
                "the main thread: create this Checkpointer there, or pass handle_sigterm=False"
            )

    def uninstall(self) -> None:
        """Put the previous handler back (main thread, and only if ours is still installed)."""
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_signal:
                signal.signal(signal.SIGTERM, self._previous)

    def watch(self, handle: Any) -> None:
        """A save just started: if the signal finds it pending (or it starts after the signal),
        it is waited for and reported."""
        with self._lock:
            if not self.signalled.is_set():
                self._handles = [h for h in self._handles if not h.done()]
            self._handles.append(handle)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._ending:
            self._end(signum, frame)
            return
        if self.signalled.is_set():
            logger.warning("%s: SIGTERM again; still finishing the pending saves", self.ckpt)
            return
        self._deadline = time.monotonic() + self.grace_s
        self.signalled.set()
        with self._lock:
            self._handles = pending = [h for h in self._handles if not h.done()]
        logger.warning(
            "%s: SIGTERM: preempted; finishing %d pending save(s) within %gs, then exiting",
            self.ckpt,
            len(pending),
            self.grace_s,
        )
        threading.Thread(target=self._watch, name="ckptstore-sigterm", daemon=True).start()

    def _watch(self) -> None:
        if self.aware:
            self.closed.wait(self._left())
        else:
            while True:
                with self._lock:
                    waiting = [h for h in self._handles if not h.done()]
                if not waiting or self._left() <= 0:
                    break
                try:
                    waiting[0].wait(timeout_s=self._left())
                except BaseException:  # noqa: BLE001 - reported below, per save
                    pass
        if self.closed.is_set() and self.aware:
            return  # the loop left: the Checkpointer's exit hook ends the process
        self.end_process()

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def report(self) -> None:
        """One line per save the signal found pending or the loop started after it."""
        with self._lock:
            if self._reported:
                return
            self._reported = True
            handles = list(self._handles)
        for handle in handles:
            if not handle.done():
                logger.warning(
                    "%s: step %d abandoned: not committed within %gs of SIGTERM",
                    self.ckpt,
                    handle.step,
                    self.grace_s,
                )
            elif handle.exception() is not None:
                logger.warning(
                    "%s: step %d not committed: %s", self.ckpt, handle.step, handle.exception()
                )
            elif not handle.skipped:
                logger.warning("%s: step %d committed", self.ckpt, handle.step)

    def end_process(self) -> None:
        """Report, then end the process as SIGTERM would have, through the main thread (where
        Python runs signal handlers); if it does not get there, end it from here."""
        self.report()
        self._ending = True
        if threading.current_thread() is threading.main_thread():
            self._end(signal.SIGTERM, None)
            return
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        time.sleep(_MAIN_THREAD_GRACE_S)
        logger.error("%s: the main thread did not take SIGTERM; exiting", self.ckpt)
        os._exit(128 + signal.SIGTERM)

    def _end(self, signum: int, frame: Any) -> None:
        previous: Callable[..., Any] | int | None = self._previous
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        os.kill(os.getpid(), signal.SIGTERM)
