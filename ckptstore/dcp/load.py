"""Loading a whole DCP step in one process, without a process group."""

from __future__ import annotations

import os
from typing import Any

from ckptstore.format import check_step
from ckptstore.step_reader import full_state_dict
from ckptstore.steps import DCP, StepView
from ckptstore.store import Store, open_store


def load_full_state_dict(
    store: Store | str | os.PathLike,
    step: int,
    *,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """The whole state of DCP step ``step`` of ``store`` (a ``Store``, or its URI, opened with
    ``storage_options``, each request bounded by ``timeout_s``) as a nested dict of full
    tensors and objects.

    Runs in this process alone (no process group needed): sharded tensors are assembled from
    every rank's pieces, like torch's ``dcp_to_torch_save``. Values DCP pickled are loaded by
    torch's weights-only unpickler; one that needs more is refused (``PickledValueRefusedError``).
    A step that is missing, not a DCP step, or without DCP metadata raises before any item is
    read.
    """
    if not isinstance(store, Store):
        store = open_store(store, storage_options=storage_options, timeout_s=timeout_s)
    view = StepView.open(store, check_step(step))
    view.require(DCP)
    return full_state_dict(view)
