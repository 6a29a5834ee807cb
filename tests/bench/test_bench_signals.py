"""Every ``ckptbench`` subcommand that writes removes its files when stopped: SIGTERM (a
scheduler's stop, ``timeout``) unwinds as Ctrl-C does, and a storage run's writers stop
before its cleanup deletes (they kept writing while it listed: objects were left)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.signals import stop_run

pytestmark = pytest.mark.timeout(300)

RUNS = {
    "save": (["save", "--size", "32MiB", "--repeat", "50", "--methods", "ckptstore"], 5),
    # DCP wraps the KeyboardInterrupt or SystemExit in its CheckpointException (reviewer K:
    # a 57-line traceback and exit 1)
    "save-dcp": (["save", "--size", "64MiB", "--repeat", "50", "--methods", "dcp_sync"], 2),
    # an async save's thread kept writing after the run's cleanup (reviewer K: files left)
    "save-dcp-async": (
        ["save", "--size", "64MiB", "--repeat", "50", "--methods", "dcp_async,ckptstore_dcp"],
        2,
    ),
    "storage": (
        ["storage", "--duration-s", "60", "--sizes", "64KiB", "--max-write-bytes", "4GiB"],
        5,
    ),
}


def _files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_run_leaves_nothing_in_the_users_directory(tmp_path, run, signum):
    target = tmp_path / "uri"
    target.mkdir()
    (target / "user.txt").write_text("the user's")
    argv, files = RUNS[run]  # stopped once that many files are there (user.txt one of them)
    stop_run([*argv, "--uri", str(target)], lambda: len(_files(target)) >= files, signum)
    assert _files(target) == [str(target / "user.txt")]
    assert sorted(os.listdir(target)) == ["user.txt"]
