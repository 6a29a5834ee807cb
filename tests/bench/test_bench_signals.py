"""Every ``ckptbench`` subcommand that writes removes its files when stopped: SIGTERM (a
scheduler's stop, ``timeout``) unwinds as Ctrl-C does, and a storage run's writers stop
before its cleanup deletes (they kept writing while it listed: objects were left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.timeout(300)

RUNS = {
    "save": ["save", "--size", "32MiB", "--repeat", "50", "--methods", "ckptstore"],
    "storage": ["storage", "--duration-s", "60", "--sizes", "64KiB", "--max-write-bytes", "4GiB"],
}


def _files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def stop_run(argv: list[str], ready, signum: int, env: dict | None = None) -> tuple[int, str]:
    """``ckptbench *argv`` in a process of its own, sent ``signum`` once ``ready()`` holds; its
    exit status and stderr. Bounded: two minutes to get ready, two and a half to end."""
    # Python's own Ctrl-C handler even where SIGINT starts ignored (a shell's background job)
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = {['ckptbench', *argv]!r}; runpy.run_module('bench.cli', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: proc.poll() is not None or ready(), timeout_s=120)
        assert proc.poll() is None, f"the run ended before it was stopped: {proc.stderr.read()}"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == (143 if signum == signal.SIGTERM else 130), err
    assert "Traceback" not in err
    return proc.returncode, err


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_run_leaves_nothing_in_the_users_directory(tmp_path, run, signum):
    target = tmp_path / "uri"
    target.mkdir()
    (target / "user.txt").write_text("the user's")
    stop_run([*RUNS[run], "--uri", str(target)], lambda: len(_files(target)) >= 5, signum)
    assert _files(target) == [str(target / "user.txt")]
    assert sorted(os.listdir(target)) == ["user.txt"]
