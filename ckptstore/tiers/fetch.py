"""A restore's chunks from the tiers one rank reads: its own local copy of the step when it
holds the chunk, else durable storage; every chunk verified wherever it came from.

A local chunk that fails its check (missing, short, a flipped byte) is read from durable
storage instead, with one warning naming the tier and the object, where the step is there as
the same save; where it is not (a step only the local tiers hold), the error stands.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
)
from ckptstore.format import ChunkInfo
from ckptstore.pipeline import fetch_chunk
from ckptstore.store import Store
from ckptstore.tiers.restore import DURABLE, LOCAL, LoadReport

logger = logging.getLogger(__name__)

_PLAIN = (CheckpointCorruptError, CheckpointNotFoundError)  # kept as the error's kind


class TierFetch:
    """A ``ChunkFetch`` over ``local`` (holding the chunks ``held``, with their sizes there)
    and ``durable`` (None: the step is not there); what it read goes into ``report`` per
    tier, ``local``'s under ``local_tier``."""

    def __init__(
        self,
        *,
        local: Store | None,
        held: dict[str, ChunkInfo],
        durable: Store | None,
        report: LoadReport,
        rank: int,
        local_tier: str = LOCAL,
        durable_sized: bool = True,
    ) -> None:
        self.local = local
        self.local_tier = local_tier  # PEER where the local copy was just restored from a peer
        self.durable_sized = durable_sized  # the sizes asked with are the durable index's
        self.held = held if local is not None else {}
        self.durable = durable
        self.report = report
        self.rank = rank
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, digest: str, info: ChunkInfo | None) -> np.ndarray:
        if digest in self.held:
            assert self.local is not None
            started = time.perf_counter()
            try:
                raw = fetch_chunk(self.local, digest, self.held[digest], scratch=True)
            except (CheckpointCorruptError, CheckpointNotFoundError, StorageError) as exc:
                if self.durable is None:
                    kind = type(exc) if type(exc) in _PLAIN else CheckpointError
                    raise kind(
                        f"{' '.join(str(exc).split())}; step {self.report.step} is held by the "
                        "local tiers only: load an older step (StoreReader(step=N)), or remove "
                        f"this rank's copies ({self.local.uri}): the next load restores them "
                        "from a peer's where one holds them"
                    ) from exc
                self._warn(exc)
            else:
                self._count(self.local_tier, self.held[digest], started)
                return raw
        if self.durable is None:
            raise CheckpointNotFoundError(
                f"rank {self.rank}: chunk {digest} is in no tier this rank reads (the step is "
                "not in durable storage and this rank's local copy does not hold it)"
            )
        started = time.perf_counter()
        raw = fetch_chunk(self.durable, digest, info, scratch=True, sized=self.durable_sized)
        self._count(DURABLE, info if self.durable_sized else None, started)
        return raw

    def _count(self, tier: str, info: ChunkInfo | None, started: float) -> None:
        with self._lock:
            self.report.add(
                tier, info.stored if info else 0, time.perf_counter() - started, chunks=1
            )

    def _warn(self, error: BaseException) -> None:
        with self._lock:
            level = logging.INFO if self._warned else logging.WARNING
            self._warned = True
        assert self.local is not None
        logger.log(
            level,
            "rank %d: local tier %s: %s; reading it from %s instead",
            self.rank,
            self.local.uri,
            " ".join(str(error).split()),
            self.durable.uri if self.durable is not None else "",
        )
