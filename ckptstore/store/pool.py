"""Daemon worker threads for storage requests, and their scheduling priority."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger("ckptstore.store")

R = TypeVar("R")


class ElasticPool:
    """Daemon worker threads that grow on demand and retire when idle.

    Unlike ``concurrent.futures.ThreadPoolExecutor`` a worker stuck in a hung call never blocks
    interpreter exit, and never starves later calls: a new worker starts when none is idle.
    A future's done-callbacks run on its worker after the worker counts as idle, so they must
    not wait for another task of the same pool (that task may be queued behind them).
    """

    def __init__(self, name: str, idle_timeout_s: float = 10.0, nice: int = 0) -> None:
        self._name = name
        self._idle_timeout_s = idle_timeout_s
        self._nice = niced(nice)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._count = 0

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        future: Future[R] = Future()
        with self._lock:
            self._tasks.put((future, fn, args))
            if self._idle > 0:
                self._idle -= 1
                return future
            self._count += 1
            index = self._count
        threading.Thread(target=self._work, name=f"{self._name}-{index}", daemon=True).start()
        return future

    def _work(self) -> None:
        set_thread_nice(self._nice)
        while True:
            try:
                future, fn, args = self._tasks.get(timeout=self._idle_timeout_s)
            except queue.Empty:
                with self._lock:
                    # A task may have been queued for us after the timeout fired.
                    if not self._tasks.empty():
                        continue
                    self._idle -= 1
                    return
            result: Any = None
            error: BaseException | None = None
            running = future.set_running_or_notify_cancel()
            if running:
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    error = exc
            # An idle worker must not keep its last task's arguments (a chunk's bytes) alive.
            del fn, args
            # Idle before the waiter wakes: a caller that submits its next task as soon as this
            # one's result is in (``Store.map``) reuses this worker instead of starting another.
            with self._lock:
                self._idle += 1
            if running:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
            del future, result, error


def niced(nice: int) -> int | None:
    """The nice value ``nice`` above the calling thread's, for threads to be started later
    (None where there is nothing to change or no way to)."""
    if not nice:
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)
    except (AttributeError, OSError):
        return None


def set_thread_nice(value: int | None) -> None:
    """Give the calling thread nice value ``value`` (Linux schedules threads apart), so that it
    yields the cores to the training loop's threads when they compete; None does nothing."""
    if value is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)
    except OSError as exc:
        logger.debug("cannot set the nice value of %s: %s", threading.current_thread(), exc)
