"""The global sample order of an epoch, and which positions of it each rank and worker reads.

The order is a function of (seed, epoch) and the dataset only: units (read pieces) are permuted,
grouped into blocks of ``shuffle_block_units`` units, and the samples of each block permuted.
Rank ``r`` of ``W`` reads global positions ``start + r + i*W`` for ``i < (total - start) // W``
(the tail that does not fill a round is dropped, so every rank reads equally many), and worker
``w`` of ``N`` takes the rank's positions ``i`` with ``(i // batch_size) % N == w``, so that a
DataLoader's round-robin over its workers yields the rank's positions in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(list(key)))


@dataclass(frozen=True)
class Reader:
    """Who reads: rank of world, worker of workers, and the DataLoader batch size."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1
    batch_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} is outside {self.num_workers} workers")


@dataclass
class BlockPlan:
    """One reader's samples of one shuffle block, in delivery order."""

    index: int
    positions: np.ndarray  # global positions in the epoch order
    units: np.ndarray  # unit of each sample
    local: np.ndarray  # sample index within its unit
    needed: list[int]  # distinct units, in order of first need


class EpochOrder:
    """The order of every sample of one epoch."""

    def __init__(
        self, unit_samples: np.ndarray, *, seed: int, epoch: int, shuffle: bool, block_units: int
    ) -> None:
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self._samples = np.asarray(unit_samples, dtype=np.int64)
        units = np.flatnonzero(self._samples > 0)
        if shuffle:
            units = _rng(seed, epoch).permutation(units)
        self.blocks = [units[i : i + block_units] for i in range(0, len(units), block_units)]
        sizes = [int(self._samples[b].sum()) for b in self.blocks]
        self.block_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.total = int(self.block_starts[-1])

    def rank_length(self, start: int, world_size: int) -> int:
        """Positions each rank reads from global position ``start`` to the end of the epoch."""
        return max(self.total - start, 0) // world_size

    def block_order(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(unit, sample within unit) of each position of block ``b``, in order."""
        units = self.blocks[b]
        counts = self._samples[units]
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        idx = np.arange(int(counts.sum()), dtype=np.int64)
        if self.shuffle:
            idx = _rng(self.seed, self.epoch, b + 1).permutation(idx)
        slot = np.searchsorted(firsts, idx, side="right") - 1
        return units[slot], idx - firsts[slot]

    def plan(self, reader: Reader, start: int) -> Iterator[BlockPlan]:
        """The blocks ``reader`` reads from global position ``start``, in order."""
        r, w = reader.rank, reader.world_size
        length = self.rank_length(start, w)
        if length == 0:
            return
        first_block = int(np.searchsorted(self.block_starts, start, side="right")) - 1
        for b in range(first_block, len(self.blocks)):
            lo, hi = int(self.block_starts[b]), int(self.block_starts[b + 1])
            # rank-local indices i whose position start + r + i*w falls in [lo, hi)
            i_lo = max(0, -(-(lo - start - r) // w))
            i_hi = min(length, -(-(hi - start - r) // w))
            if i_lo >= length:
                return
            if i_hi <= i_lo:
                continue
            i = np.arange(i_lo, i_hi, dtype=np.int64)
            if reader.num_workers > 1:
                i = i[(i // reader.batch_size) % reader.num_workers == reader.worker]
                if not len(i):
                    continue
            positions = start + r + i * w
            units, local = self.block_order(b)
            offsets = positions - lo
            u, loc = units[offsets], local[offsets]
            _, first = np.unique(u, return_index=True)
            needed = u[np.sort(first)].tolist()
            yield BlockPlan(index=b, positions=positions, units=u, local=loc, needed=needed)
