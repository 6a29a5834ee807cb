"""A command's temporary files removed on any exit (``ckptstore restore``'s partial output,
``ckptbench``'s run data): SIGTERM (a job scheduler's stop, `kill`, `timeout`) and SIGHUP (a
closed ssh session) raise ``SystemExit`` in the main thread, so every ``with`` block and
``except BaseException`` unwinds as it does for an exception or Ctrl-C (``KeyboardInterrupt``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def terminate_unwinds() -> Iterator[None]:
    """While the block runs, the first SIGTERM or SIGHUP raises ``SystemExit(128 + signal)``
    (the status a process killed by it reports) in the main thread; later ones are ignored
    while the block cleans up. Outside the main thread (no handler can be set there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        for sig in _UNWOUND:  # cleaning up: a second one waits for it
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_term) for sig in _UNWOUND}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_UNWOUND = (signal.SIGTERM, signal.SIGHUP)
