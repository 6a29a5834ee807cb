"""TierOptions checks every field when it is made: a bad value is one ValueError naming it."""

from __future__ import annotations

import pytest

from ckptstore import TierOptions


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"peer_copies": 1}, "peer_copies=1 needs local_dir"),
        ({"durable_every": 3}, "durable_every=3 needs local_dir"),
        ({"local_dir": "s3://b/x"}, "local_dir must be a node-local path"),
        ({"local_dir": "L", "peer_copies": -1}, "peer_copies must be >= 0, got -1"),
        ({"local_dir": "L", "durable_every": 0}, "durable_every must be >= 1, got 0"),
        ({"local_dir": "L", "local_keep_last": 0}, "local_keep_last must be >= 1, got 0"),
        ({"local_dir": "L", "peer_budget_bytes": 0}, "peer_budget_bytes must be >= 1, got 0"),
        ({"local_dir": "L", "repair_memory_bytes": -1}, "repair_memory_bytes must be >= 0"),
        # tiers reviewer: "" put the tiers in the working directory, node_rank=-1 was taken
        ({"local_dir": ""}, "local_dir is empty"),
        ({"local_dir": "L", "node_rank": -1}, "TierOptions.node_rank must be >= 0, got -1"),
    ],
)
def test_a_bad_field_is_one_value_error_naming_it(given, message):
    with pytest.raises(ValueError, match=message):
        TierOptions(**given)


def test_repair_memory_bytes_reaches_the_policy(tmp_path):
    assert TierOptions(local_dir=tmp_path).policy().repair_memory_bytes == 2**30
    assert TierOptions(local_dir=tmp_path, repair_memory_bytes=0).policy().repair_memory_bytes == 0


def test_a_local_dir_given_as_bytes_is_refused():
    """Tiers reviewer: b"/tmp/x" made a directory named "b'/tmp/x'" in the working directory."""
    with pytest.raises(TypeError, match=r"local_dir takes a path \(str or os.PathLike\)"):
        TierOptions(local_dir=b"/tmp/x")
