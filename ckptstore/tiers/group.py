"""Coordination of ranks on a dedicated gloo group (made once, by every rank), so that what
a background thread exchanges never interleaves with the training loop's collectives."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptstore.errors import one_line


class RankGroup:
    """The ranks of ``process_group`` (None: all) on a gloo group of their own; with one rank,
    or without ``torch.distributed``, every exchange returns this rank's value alone."""

    def __init__(self, process_group: Any, timeout_s: float, *, no_dist: bool = False) -> None:
        self.active = not no_dist and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.group = None
        if self.active and self.world_size > 1:
            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            self.group = dist.new_group(
                ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s)
            )
        self.active = self.group is not None

    def broadcast(self, value: Any) -> Any:
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def scatter(self, values: list[Any] | None) -> Any:
        """``values[r]`` of rank 0 on each rank r (``values`` is read on rank 0 only)."""
        if not self.active:
            assert values is not None
            return values[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, values, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        if not self.active:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def agree(self, error: BaseException | None, payload: Any = None) -> Agreement:
        """Every rank's outcome of a step every rank took (``error``: None if it succeeded on
        this one) and ``payload``: collective, so every rank hears every rank's error."""
        mine = None if error is None else (one_line(error), type(error).__name__)
        everything = self.gather((mine, payload))
        return Agreement(
            failures=[(r, e[0], e[1]) for r, (e, _) in enumerate(everything) if e is not None],
            payloads=[p for _, p in everything],
        )


@dataclass
class Agreement:
    """What every rank heard of one step: the ranks that failed, each with its error as one
    line and the error's type name, and every rank's payload (by rank)."""

    failures: list[tuple[int, str, str]]
    payloads: list[Any]

    @property
    def ok(self) -> bool:
        return not self.failures

    def why(self, shown: int = 4) -> str:
        """The failures as one line: ``rank r: Error: text; ...``."""
        text = "; ".join(f"rank {r}: {line}" for r, line, _ in self.failures[:shown])
        more = len(self.failures) - shown
        return text + (f"; and {more} more" if more > 0 else "")
