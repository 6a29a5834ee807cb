"""Values of the MDS fixtures' ``expected.jsonl`` as the readers return them."""

from __future__ import annotations

import numpy as np


def expected_value(value):
    """A value of ``expected.jsonl`` (arrays and bytes spelled as JSON) as the reader returns it."""
    if isinstance(value, dict) and "ndarray" in value:
        return np.array(value["data"], dtype=value["ndarray"]).reshape(value["shape"])
    if isinstance(value, dict) and "hex" in value:
        return bytes.fromhex(value["hex"])
    return value
