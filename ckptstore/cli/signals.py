"""A command's temporary files removed on any exit (``ckptstore restore``'s partial output,
``ckptbench``'s run data): SIGTERM (a job scheduler's stop, `kill`, `timeout`) and SIGHUP (a
closed ssh session) raise ``SystemExit`` in the main thread, so every ``with`` block and
``except BaseException`` unwinds as it does for an exception or Ctrl-C (``KeyboardInterrupt``)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def terminate_unwinds() -> Iterator[None]:
    """While the block runs, the first SIGTERM or SIGHUP raises ``SystemExit(128 + signal)``
    (the status a process killed by it reports) in the main thread; later ones are ignored
    while the block cleans up. SIGINT raises ``KeyboardInterrupt``, but not again within
    ``SAME_PRESS_S`` of the last. Outside the main thread (no handler can be set there) a
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        _received.append(signum)
        for sig in _UNWOUND:  # cleaning up: a second one waits for it
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    def on_interrupt(signum: int, frame: object) -> None:
        now = time.monotonic()
        if _pressed and now - _pressed[-1] < SAME_PRESS_S:
            return  # the same press, delivered twice (`timeout -s INT` signals the group too)
        _pressed.append(now)
        _received.append(signum)
        raise KeyboardInterrupt

    _received.clear()  # this command's signals (a test calls several in one process)
    previous = {sig: signal.signal(sig, on_term) for sig in _UNWOUND}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored (nohup)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopped_by_signal() -> int | None:
    """The exit status of a command a signal stopped (130 for Ctrl-C, 128 + the signal for
    the others), or None if none came: what a library wrapped its ``KeyboardInterrupt`` or
    ``SystemExit`` in (DCP's ``CheckpointException``) still ends the command as the signal."""
    return 128 + _received[0] if _received else None


def raise_if_stopped() -> None:
    """Stop here if a signal came whose exception Python dropped: raised while a garbage
    collector's callback ran (a weakref's), it is only reported ("Exception ignored in ..."),
    and the command ran on to print its results and exit 0. Called before results are shown."""
    if not _received:
        return
    if _received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + _received[0])


_UNWOUND = (signal.SIGTERM, signal.SIGHUP)
# A SIGINT this soon after the one before is the same Ctrl-C reaching the process twice, and
# would cut short the cleanup the first one started; a later one stops the cleanup too.
SAME_PRESS_S = 1.0
_received: list[int] = []
_pressed: list[float] = []  # when each SIGINT that raised came (time.monotonic)
