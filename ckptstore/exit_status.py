"""A save that fails as the process exits ends it with status 1.

A script whose last act is ``save()`` (or ``dcp.async_save``) has that save finished by an exit
hook; if it fails, a scheduler must not read the job's exit as a success. Python keeps a normal
end's status whatever its exit hooks raise, so the last exit hook runs the others, flushes the
files left open, then ends the process with ``os._exit(1)`` (a script's own ``sys.exit(3)`` is
then 1 too; a child that ``multiprocessing`` forks ends by ``os._exit`` of its own, with its
status, the failure in its log alone)."""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
import warnings

_lock = threading.Lock()
_failed: list[bool] = []


def fail_at_exit() -> None:
    """The process, already exiting (called from a threading exit hook, which runs before
    atexit's), ends with status 1 once every atexit hook has run."""
    with _lock:
        if _failed:
            return
        _failed.append(True)
    atexit.register(_end_with_status_1)  # registered last: runs first


def _end_with_status_1() -> None:
    atexit.unregister(_end_with_status_1)
    atexit._run_exitfuncs()  # every other exit hook (logging's flush among them) still runs
    # What finalization would have flushed: files the script left open, then the streams.
    with warnings.catch_warnings():  # asking odd objects their type may warn
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, io.IOBase) and not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001 - a file that cannot flush now never would
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)
