"""A benchmark's temporary files removed on any exit: SIGTERM (a job scheduler's stop, `kill`,
`timeout`) raises ``SystemExit`` in the main thread, so every ``with`` block unwinds (open
Checkpointers close, temporary directories are removed) as it does for an exception or Ctrl-C
(``KeyboardInterrupt``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def terminate_unwinds() -> Iterator[None]:
    """While the block runs, the first SIGTERM raises ``SystemExit(143)`` (128 + SIGTERM, the
    status a process killed by it reports) in the main thread; later ones are ignored while
    the block cleans up. Outside the main thread (no handler can be set there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleaning up: a second one waits for it
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
