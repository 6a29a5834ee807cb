"""A command run in a process of its own and stopped by a signal once it is ready."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.helpers import ROOT
from tests.helpers.wait import wait_until


def stop_run(
    argv: list[str],
    ready,
    signum: int,
    env: dict | None = None,
    *,
    module: str = "bench.cli",
    prelude: str = "",
    twice: bool = False,
) -> tuple[int, str]:
    """``python -m module *argv`` (``ckptbench``, or ``ckptstore.cli``) in a process of its own,
    after ``prelude`` (Python run first), sent ``signum`` once ``ready()`` holds; its exit
    status (checked: 130 for SIGINT, else 128 + signum) and stderr. Bounded: two minutes to get
    ready, two and a half to end. ``twice``: the signal sent again at once (as ``timeout -s INT``
    sends it: to the process and to its process group)."""
    # Python's own Ctrl-C handler even where SIGINT starts ignored (a shell's background job)
    start = (
        f"import runpy, signal, sys; {prelude or 'pass'}; "
        "signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = {[module, *argv]!r}; runpy.run_module({module!r}, run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: proc.poll() is not None or ready(), timeout_s=120)
        assert proc.poll() is None, f"the run ended before it was stopped: {proc.stderr.read()}"
        proc.send_signal(signum)
        if twice:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == (130 if signum == signal.SIGINT else 128 + signum), err
    assert "Traceback" not in err
    return proc.returncode, err
