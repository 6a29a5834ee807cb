"""Loading a whole DCP step in one process, without a process group."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ckptstore.dcp.reader import StoreReader
from ckptstore.errors import CheckpointError
from ckptstore.format import check_step
from ckptstore.store import Store


def load_full_state_dict(store: Store, step: int) -> dict[str, Any]:
    """The whole state of DCP step ``step`` as a nested dict of full tensors and objects.

    Runs in this process alone (no process group needed): sharded tensors are assembled from
    every rank's pieces, like torch's ``dcp_to_torch_save``.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = StoreReader(store.uri, step=check_step(step), store=store)
    reader.read_metadata()  # raises missing / wrong-kind / corrupt metadata errors unwrapped
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
        if len(errors) == 1 and isinstance(errors[0], CheckpointError):
            raise errors[0] from None
        raise
    return state
