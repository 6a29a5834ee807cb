"""A rank's local copy as its local commit just wrote it, kept in memory for the phases after it.

The peer copy sends these bytes and the drain copies this index: neither reads back through
``catalog`` what this thread has just written. The local commit's save lease travels with it
(``lease``): held through the peer copy, so no sweep of the local store removes a chunk while it
is sent (one lease on the local store per save, not one per phase), and released by ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptstore.format import Manifest, RankIndex
from ckptstore.leases import Lease


@dataclass
class CommittedCopy:
    """Rank ``ward``'s committed copy of ``step`` (``attempt``) in its local store: the manifest,
    the index and (a DCP copy) the DCP metadata, as written; ``lease``, the local commit's
    save lease while it is held."""

    ward: int
    step: int
    attempt: str
    manifest: Manifest
    manifest_bytes: bytes
    index: RankIndex
    index_bytes: bytes
    metadata: bytes = b""  # a DCP copy's metadata object, b"" for a state copy
    lease: Lease | None = None

    def release(self) -> None:
        """Give up the local commit's lease, once every put that may still land has."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release_when_settled(0.0)
