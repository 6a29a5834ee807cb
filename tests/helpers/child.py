"""A Python script run in a child process with the repository on its path, bounded in time:
for tests whose failure on broken code is a hang or gigabytes of memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT


def run_child(script: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``script`` run to its end, its output captured; the test fails if it is still running
    after ``timeout_s``."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child process was still running after {timeout_s} s")


def run_script(script: str, timeout_s: float) -> list[str]:
    """The lines ``script`` printed; the test fails if it is still running after ``timeout_s``
    or printed nothing."""
    done = run_child(script, timeout_s)
    lines = done.stdout.strip().splitlines()
    assert lines, f"child exited {done.returncode} printing nothing: {done.stderr[-2000:]}"
    return lines


def growth_and_outcome(lines: list[str]) -> tuple[int, str]:
    """``(GROWTH n, last line)`` of a script that prints ``GROWTH <bytes>`` then its outcome."""
    growth = [int(line.split()[1]) for line in lines if line.startswith("GROWTH")]
    assert growth, f"the child printed no GROWTH line: {lines[-5:]}"
    return growth[0], lines[-1]


_MEASURED = """
import resource
resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))
{setup}
def _peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
_before = _peak()
try:
{action}
except Exception as exc:
    outcome = type(exc).__name__ + " " + str(exc).replace("\\n", " ")
print("GROWTH", _peak() - _before)
print(outcome)
"""


def growth_in_child(setup: str, action: str, timeout_s: float) -> tuple[int, str]:
    """Run ``setup``, then ``action`` (which sets ``outcome``), in a child process limited to
    4 GiB of data: how much its peak RSS grew during ``action``, in bytes, and its outcome (or
    the exception it raised, as one line)."""
    script = _MEASURED.format(
        setup=textwrap.dedent(setup).strip(),
        action=textwrap.indent(textwrap.dedent(action).strip(), "    "),
    )
    return growth_and_outcome(run_script(script, timeout_s))
