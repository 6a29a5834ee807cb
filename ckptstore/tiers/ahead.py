"""A rank's own copy of a step, verified while the load waits on another rank's repair.

A tiered load in which some rank first gets its copy back from a peer (``transfer.restore_copies``)
holds every rank in that collective. A rank whose own copy is intact has nothing to receive
there; where the host has two cores per rank, a thread maps that copy's chunks and checks their
hashes meanwhile, and the load's reads take the chunks it verified from it (``TierFetch``), not
mapped or hashed again. A chunk is named by the xxh3 of its raw bytes, so bytes that hash to the
name are the chunk whichever index names it. What the thread did not verify (it was stopped,
its byte budget was spent, or the chunk failed) is read as it always was, and a bad chunk's
error is met there.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ckptstore.catalog import load_manifest, read_rank_index
from ckptstore.codec import decode
from ckptstore.format import chunk_key
from ckptstore.store import Store
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.transfer import cores_per_rank

logger = logging.getLogger(__name__)

# The repair itself keeps more than a core per rank busy (gloo's copies, the receiver's buffers
# touched ahead and its hashing): with one core per rank (2 ranks on the 2-core dev VM) the
# thread's mapping and hashing slowed the repair by what it took off the read after it.
AHEAD_CORES = 2


class VerifiedAhead:
    """Chunks of ``store``'s copy of ``step`` (the save ``attempt``), verified by a thread
    started now. A chunk stored as one raw plane is kept as a view of the store's mapped pages
    (no memory of its own); a decoded one counts against ``budget_bytes``, and the thread stops
    at the first that would pass it."""

    def __init__(self, store: Store, step: int, attempt: str, budget_bytes: int) -> None:
        self.store = store
        self.step = step
        self.attempt = attempt
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # decoded bytes held (mapped pages not counted)
        self._verified: dict[str, tuple[np.ndarray, int]] = {}  # digest -> (raw, own bytes)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ckptstore-verify-ahead", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            manifest = load_manifest(self.store, self.step)
            if manifest.attempt != self.attempt:
                return
            chunks = read_rank_index(self.store, manifest.ranks[0]).chunks
        except Exception as exc:  # noqa: BLE001 - the load reads the copy and meets it itself
            logger.debug("verify ahead of %s step %d: %s", self.store.uri, self.step, exc)
            return
        for digest, info in chunks.items():
            if self._stop.is_set():
                return
            try:
                mapped = self.store.get_view(chunk_key(digest), 0, info.stored + 1)
                if len(mapped) != info.stored:
                    continue
                raw = decode(mapped, expected_hash=digest, name=digest, raw_len=info.raw)
            except Exception:  # noqa: BLE001 - read again by the load, which reports it
                continue
            own = 0 if np.may_share_memory(raw, np.frombuffer(mapped, dtype=np.uint8)) else raw.size
            with self._lock:
                if self.held_bytes + own > self.budget_bytes:
                    return
                self.held_bytes += own
                self._verified[digest] = (raw, own)

    def stop(self) -> None:
        """No chunk more is verified once this returns (it waits for the one in hand); may be
        called again, from any thread."""
        self._stop.set()
        self._thread.join()

    def take(self, digest: str) -> np.ndarray | None:
        """Chunk ``digest``'s raw bytes, verified, handed out once; None if it was not. The
        first call stops the thread: the load reads now, and verifies the rest itself."""
        self.stop()
        with self._lock:
            raw, own = self._verified.pop(digest, (None, 0))
            self.held_bytes -= own
            return raw

    def close(self) -> None:
        """Stopped, and every chunk it holds let go (a load that read elsewhere, or failed)."""
        self.stop()
        with self._lock:
            self._verified.clear()
            self.held_bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._verified)


def verify_ahead(
    local: LocalTier, group, step: int, attempt: str | None, intact: bool
) -> VerifiedAhead | None:
    """Called by every rank of a load about to repair copies (collective the first time: it
    counts the ranks on this host): this rank's own copy verified ahead where it is ``intact``
    (its source is its local copy of the save ``attempt``) and the host has ``AHEAD_CORES``
    cores per rank; else None."""
    cores = cores_per_rank(group.ranks_on_host())
    if not intact or attempt is None or cores < AHEAD_CORES:
        return None
    return VerifiedAhead(local.store(group.rank), step, attempt, local.policy.repair_memory_bytes)
