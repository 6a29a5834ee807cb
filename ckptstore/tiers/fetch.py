"""A restore's chunks from the tiers one rank reads: its own local copy of the step when it
holds the chunk, else durable storage; every chunk verified wherever it came from.

A local chunk that fails its check (missing, short, a flipped byte) is read from durable
storage instead, with one warning naming the tier and the object, and written back into the
copy from there (verified, where durable storage holds it encoded as the copy's index says), so
the next load reads it locally again. Where the step is not in durable storage (only the local
tiers hold it), the chunk is looked for there by its digest all the same (an earlier step's
drain stored the same bytes: a chunk is its content); not found there either, the error stands.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    one_line,
)
from ckptstore.format import ChunkInfo, chunk_key
from ckptstore.pipeline import fetch_chunk, fetch_chunk_and_size
from ckptstore.retention import drop_step
from ckptstore.store import Store
from ckptstore.tiers.restore import DURABLE, LOCAL, LoadReport

if TYPE_CHECKING:
    from ckptstore.tiers.ahead import VerifiedAhead
    from ckptstore.tiers.transfer import RepairedCopy

logger = logging.getLogger(__name__)

_PLAIN = (CheckpointCorruptError, CheckpointNotFoundError)  # kept as the error's kind


class TierFetch:
    """A ``ChunkFetch`` over ``local`` (holding the chunks ``held``, with their sizes there)
    and ``durable`` (``durable_step`` False: the step is not there, only a bad local chunk is
    looked for there by its digest); what it read goes into ``report`` per
    tier, ``local``'s under ``local_tier``. ``repaired``: this rank's copy as a repair just
    received it, held in memory: its chunks are served from there (verified on arrival, not
    hashed again), not read back from ``local``. ``ahead``: chunks of ``local`` a thread
    verified while the load waited on a repair, served without reading them again.
    ``forget``: called with a chunk of ``local`` that fails its check, or is missing (then with
    ``missing=True``), and is read from ``durable`` instead (``LocalTier.forget_bad_chunk``: the copy's next save must not
    count it stored). A bad chunk of a step only the local tiers hold, found nowhere else,
    unlists the copy."""

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
        durable_step: bool = True,
        repaired: RepairedCopy | None = None,
        ahead: VerifiedAhead | None = None,
        forget: Callable[..., None] | None = None,
    ) -> None:
        self.local = local
        self.local_tier = local_tier  # PEER where the local copy was just restored from a peer
        self.durable_sized = durable_sized  # the sizes asked with are the durable index's
        self.durable_step = durable_step
        self.held = held if local is not None else {}
        self.durable = durable
        self.report = report
        self.rank = rank
        self.repaired = repaired
        self.ahead = ahead
        self.forget = forget  # a bad chunk of ``local``, removed so a save writes it again
        self._lock = threading.Lock()
        self._warned = False
        self._dropped = False

    def __call__(self, digest: str, info: ChunkInfo | None) -> np.ndarray:
        if self.repaired is not None and digest in self.repaired.chunks:
            started = time.perf_counter()
            raw = self.repaired.fetch(digest)
            self._count(self.local_tier, self.repaired.index.chunks[digest].stored, started)
            return raw
        if self.ahead is not None and digest in self.held:
            started = time.perf_counter()
            raw = self.ahead.take(digest)
            if raw is not None:
                self._count(self.local_tier, self.held[digest].stored, started)
                return raw
        heal = False
        bad_here: BaseException | None = None
        if digest in self.held:
            assert self.local is not None
            started = time.perf_counter()
            try:
                raw = fetch_chunk(self.local, digest, self.held[digest], scratch=True)
            except (CheckpointCorruptError, CheckpointNotFoundError, StorageError) as exc:
                if self.durable is None:
                    raise self._unlisted(exc) from exc
                bad_here = exc
                self._warn(exc)
                if self.forget is not None and isinstance(exc, _PLAIN):
                    missing = isinstance(exc, CheckpointNotFoundError)
                    then = (
                        f"read from {self.durable.uri} instead, and put back where it verifies"
                        if self.durable_step
                        else f"looked for by its digest in {self.durable.uri} (the step is not "
                        "there)"
                    )
                    self.forget(digest, missing=missing, then=then)  # not referenced by a save
                    heal = True
            else:
                self._count(self.local_tier, self.held[digest].stored, started)
                return raw
        if self.durable is None or (bad_here is None and not self.durable_step):
            raise CheckpointNotFoundError(
                f"rank {self.rank}: chunk {digest} is in no tier this rank reads (the step is "
                "not in durable storage and this rank's local copy does not hold it)"
            )
        started = time.perf_counter()
        try:
            raw, stored = fetch_chunk_and_size(
                self.durable,
                digest,
                info,
                scratch=True,
                sized=self.durable_sized,
                on_verified=(lambda data: self._heal(digest, data)) if heal else None,
            )
        except (*_PLAIN, StorageError) as exc:
            if self.durable_step or bad_here is None:
                raise
            # Not there by its digest either, or durable storage not reachable: the local
            # copy's damage is the error (and the copy is unlisted), as with no durable look.
            raise self._unlisted(bad_here) from exc
        self._count(DURABLE, stored, started)
        return raw

    def _heal(self, digest: str, stored: memoryview | bytes) -> None:
        """The local copy's bad chunk ``digest`` written again from ``stored``, the durable
        object's bytes as they verified, where they have the size the copy's index gives (the
        same encoding): the next load reads it locally again. Best effort: a failure is
        logged."""
        assert self.local is not None
        if len(stored) != self.held[digest].stored:
            return  # encoded otherwise there: the copy's index would not describe it
        try:
            self.local.put(chunk_key(digest), bytes(stored), shared=True)
        except (CheckpointError, OSError) as exc:
            logger.info(
                "rank %d: chunk %s not restored to the local tier: %s",
                self.rank,
                digest,
                one_line(exc),
            )
            return
        logger.info(
            "rank %d: chunk %s of the local tier restored from %s",
            self.rank,
            digest,
            self.durable.uri,
        )

    def _unlisted(self, error: BaseException) -> CheckpointError:
        """A chunk of this rank's own copy of a step that only the local tiers hold is missing
        or corrupt: the copy is unlisted (its manifest removed, under the store's rules), so
        that the next load restores it from a peer's copy where one holds it, else takes an
        older step; the error to raise says so."""
        assert self.local is not None
        step = self.report.step
        what = "this rank's copy stays listed"
        if isinstance(error, _PLAIN) and step is not None:
            try:
                with self._lock:  # once, whichever fetch thread found it first
                    if not self._dropped:
                        drop_step(self.local, step)
                        self._dropped = True
                what = (
                    "this rank's copy was unlisted: a load takes a peer's copy where one "
                    "holds it, else an older step"
                )
            except CheckpointError as exc:
                what = f"unlisting this rank's copy failed ({' '.join(str(exc).split())})"
        kind = type(error) if type(error) in _PLAIN else CheckpointError
        return kind(
            f"{' '.join(str(error).split())}; step {step} is held by the local tiers only "
            f"({self.local.uri}): {what}"
        )

    def _count(self, tier: str, stored: int, started: float) -> None:
        with self._lock:
            self.report.add(tier, stored, time.perf_counter() - started, chunks=1)

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
