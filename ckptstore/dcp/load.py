"""Loading a whole DCP step in one process, without a process group."""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem

from ckptstore.dcp._torch_private import (
    EmptyStateDictLoadPlanner,
    load_in_this_process,
    set_element,
)
from ckptstore.dcp.reader import StoreReader, load_pickled_value
from ckptstore.errors import CheckpointError
from ckptstore.format import check_step
from ckptstore.options import StorageOptions
from ckptstore.store import Store


class _WeightsOnlyPlanner(EmptyStateDictLoadPlanner):
    """DCP's planner for loading into an empty state dict, whose pickled values are loaded by
    torch's weights-only unpickler instead of ``torch.load(weights_only=False)``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_pickled_value(value.getvalue(), f"{fqn!r} of {self.where}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_full_state_dict(store: Store, step: int) -> dict[str, Any]:
    """The whole state of DCP step ``step`` as a nested dict of full tensors and objects.

    Runs in this process alone (no process group needed): sharded tensors are assembled from
    every rank's pieces, like torch's ``dcp_to_torch_save``. Values DCP pickled are loaded by
    torch's weights-only unpickler; one that needs more is refused (``PickledValueRefusedError``).
    """
    reader = StoreReader(store.uri, step=check_step(step), storage=StorageOptions(store=store))
    reader.read_metadata()  # raises missing / wrong-kind / corrupt metadata errors unwrapped
    planner = _WeightsOnlyPlanner(f"step {step} in {store.uri}")
    state: dict[str, Any] = {}
    try:
        load_in_this_process(state, reader=reader, planner=planner)
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
        if len(errors) == 1 and isinstance(errors[0], CheckpointError):
            raise errors[0] from None
        # DCP's own text holds every rank's traceback: one line, the cause chained.
        first = errors[0] if errors else exc
        raise CheckpointError(
            f"step {step} in {store.uri} did not load: {type(first).__name__}: "
            f"{' '.join(str(first).split())[:300] or 'no message'}"
        ) from exc
    return state
