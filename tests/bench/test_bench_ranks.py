"""The bench's spawned ranks (``bench._gloo.run_ranks``, used by ``scale`` and ``recover``): a
failed run is one line naming the rank whose error caused the others', and leaves no file."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest

from bench._gloo import RankFailed, run_ranks
from ckptstore import RanksOutOfStepError

pytestmark = pytest.mark.timeout(300)


def _report(rank: int, tag: str) -> dict:
    return {"rank": rank, "tag": tag}


def _rank_1_loses_rank_0(rank: int) -> dict:
    if rank == 1:  # first to fail, because of rank 0's failure: not the cause to name
        raise RanksOutOfStepError("ranks out of step: rank 0 left in save()")
    time.sleep(0.5)
    raise PermissionError("access denied at http://127.0.0.1:8333 (bad secret)")


def _error_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pytorch-errorfile-*")))


def test_the_reports_come_back_by_rank():
    assert run_ranks(_report, ("x",), 2, what="run", timeout_s=120) == [
        {"rank": 0, "tag": "x"},
        {"rank": 1, "tag": "x"},
    ]


def test_a_failed_run_names_the_rank_that_caused_it_and_leaves_no_file():
    """Reviewer U: recover named rank 1's RanksOutOfStepError, not rank 0's access denied;
    scale printed every rank's traceback (120 lines) and torch left its error files."""
    before = _error_files()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_rank_1_loses_rank_0, (), 2, what="save job", timeout_s=120)
    assert str(failed.value) == (
        "the save job: rank 0 failed: PermissionError: access denied at http://127.0.0.1:8333 "
        "(bad secret) (1 other rank(s) failed too)"
    )
    assert _error_files() == before
