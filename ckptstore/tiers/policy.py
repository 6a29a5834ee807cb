"""Which tiers a save goes to, and where each rank's copies live.

A node-local directory (``local_dir``) holds one store per rank whose copies it keeps:
``<local_dir>/job-<j>/rank-<r>/`` (j: a hash of the durable store, so jobs may share a RAM disk),
an ordinary ckptstore store (chunks, indexes, manifests, leases) in
which every step is a one-rank step of rank r's state. A node keeps the stores of its own ranks
and, with ``peer_copies=K``, those of the ranks whose *holder* it is: rank r's copies go to the
rank of the same position on each of the K nodes after r's (a ring by node). Every tier copy of
a save carries the save's attempt, so ranks agree on one save, not only on one step number.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstore.codec import hash_bytes

DEFAULT_LOCAL_KEEP_LAST = 2
DEFAULT_PEER_BUDGET_BYTES = 64 * 2**20
DEFAULT_REPAIR_MEMORY_BYTES = 2**30
TIER_KEY = "ckptstore_tier"  # in a local copy's manifest.user: whose copy it is

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierPolicy:
    """``Checkpointer(local_dir=..., peer_copies=K, durable_every=M)``."""

    local_dir: Path
    peer_copies: int = 0
    durable_every: int = 1
    local_keep_last: int = DEFAULT_LOCAL_KEEP_LAST
    peer_budget_bytes: int = DEFAULT_PEER_BUDGET_BYTES
    repair_memory_bytes: int = DEFAULT_REPAIR_MEMORY_BYTES

    def collective_options(self) -> dict[str, Any]:
        """The fields every rank of a job must share: each decides which exchanges it joins."""
        return {
            "TierOptions.peer_copies": self.peer_copies,
            "TierOptions.durable_every": self.durable_every,
        }

    @classmethod
    def build(
        cls,
        local_dir: str | os.PathLike | None,
        *,
        peer_copies: int,
        durable_every: int,
        local_keep_last: int,
        peer_budget_bytes: int,
        repair_memory_bytes: int = DEFAULT_REPAIR_MEMORY_BYTES,
    ) -> TierPolicy | None:
        if local_dir is None:
            if peer_copies or durable_every != 1:
                given = [
                    f"{name}={value}"
                    for name, value, default in (
                        ("peer_copies", peer_copies, 0),
                        ("durable_every", durable_every, 1),
                    )
                    if value != default
                ]
                raise ValueError(f"{' and '.join(given)} needs local_dir (the tiers' directory)")
            return None
        if not isinstance(local_dir, (str, os.PathLike)) or isinstance(os.fspath(local_dir), bytes):
            raise TypeError(f"local_dir takes a path (str or os.PathLike), got {local_dir!r}")
        if not str(local_dir).strip():
            raise ValueError("local_dir is empty: give the node-local directory of the tiers")
        if str(local_dir).startswith(("s3://", "memory://", "gs://")):
            raise ValueError(f"local_dir must be a node-local path, got {local_dir!r}")
        if peer_copies < 0:
            raise ValueError(f"peer_copies must be >= 0, got {peer_copies}")
        if durable_every < 1:
            raise ValueError(f"durable_every must be >= 1, got {durable_every}")
        if local_keep_last < 1:
            raise ValueError(f"local_keep_last must be >= 1, got {local_keep_last}")
        if peer_budget_bytes < 1:
            raise ValueError(f"peer_budget_bytes must be >= 1, got {peer_budget_bytes}")
        if repair_memory_bytes < 0:
            raise ValueError(f"repair_memory_bytes must be >= 0, got {repair_memory_bytes}")
        path = Path(str(local_dir).removeprefix("file://")).expanduser().absolute()
        return cls(
            path,
            peer_copies,
            durable_every,
            local_keep_last,
            peer_budget_bytes,
            repair_memory_bytes,
        )


class DurableCadence:
    """Which saves also go to durable storage, for both front-ends: the first save and every
    ``durable_every``-th after it, and the next save planned once one bound there is known not
    to have got there (its save or its drain failed, or it was skipped as unhealthy), so a
    failure never leaves the job without a new durable step for ``durable_every`` more saves.
    A save that took the place of a drain that fell behind (``DrainSupersededError``) covers
    it. Ranks that learn of a failure at different saves may each make one durable: at most
    one extra durable save per rank and failure."""

    def __init__(self, durable_every: int) -> None:
        self.durable_every = durable_every
        self._saves = 0
        self._owed = False
        self._lock = threading.Lock()
        self.last_local_step: int | None = None  # the newest step stored, if local only

    def next_save(self) -> bool:
        """Whether the save being planned now goes to durable storage (counts it)."""
        with self._lock:
            self._saves += 1
            owed, self._owed = self._owed, False
            return owed or (self._saves - 1) % self.durable_every == 0

    def stored(self, step: int, *, local_only: bool) -> None:
        """``step`` is committed: to the local tiers alone, or (or its drain queued) to
        durable storage. A save skipped as unhealthy, or failed, stored nothing: not said."""
        self.last_local_step = step if local_only else None

    def warn_if_last_local(self, say: bool, local_dir: str, durable: str) -> None:
        """At a writer's close: one WARNING (where ``say``: one rank) if the newest step stored
        is in the local tiers alone, which go with the nodes (a job's last save wants
        ``durable_next()`` before it)."""
        if say and self.last_local_step is not None:
            logger.warning(
                "step %d, the newest step saved, is held only in the local tiers (%s), not in %s: "
                "it goes with the nodes; call durable_next() before a job's last save",
                self.last_local_step,
                local_dir,
                durable,
            )

    def missed(self) -> None:
        """A save bound for durable storage did not get there: the next save goes."""
        self.ask()

    def ask(self) -> None:
        """The next save goes to durable storage too, whatever ``durable_every`` says (the
        front-ends' ``durable_next()``: a job's last save, say)."""
        with self._lock:
            self._owed = True


def rank_dir(local_dir: str | os.PathLike, durable: str, rank: int) -> Path:
    """Where rank ``rank``'s copies for the job whose durable store is ``durable``
    (``store_identity``) live in ``local_dir``."""
    return Path(local_dir) / job_dir_name(durable) / f"rank-{rank:05d}"


def job_dir_name(durable: str) -> str:
    return f"job-{hash_bytes(durable.encode())[:12]}"


def tier_info(rank: int, world_size: int, durable_uri: str) -> dict[str, Any]:
    """What a local copy's manifest records of whose copy it is."""
    return {"rank": rank, "world_size": world_size, "durable": durable_uri}


@dataclass(frozen=True)
class Topology:
    """Nodes and who holds whose copies, the same on every rank (built from every rank's node)."""

    nodes: list[list[int]]  # node -> its ranks, ascending; nodes ordered by their smallest rank
    node_of: dict[int, int]  # rank -> index into nodes
    peer_copies: int

    @classmethod
    def build(cls, node_ids: list[Any], peer_copies: int) -> Topology:
        """``node_ids[r]``: the node rank r runs on (any value ranks on one node share)."""
        members: dict[Any, list[int]] = {}
        for rank, node in enumerate(node_ids):
            members.setdefault(node, []).append(rank)
        nodes = sorted(members.values(), key=lambda ranks: ranks[0])
        if peer_copies >= len(nodes):
            raise ValueError(
                f"peer_copies={peer_copies} needs at least {peer_copies + 1} nodes; the job "
                f"runs on {len(nodes)} (give node_rank= or set GROUP_RANK / LOCAL_WORLD_SIZE)"
            )
        node_of = {rank: n for n, ranks in enumerate(nodes) for rank in ranks}
        return cls(nodes, node_of, peer_copies)

    def holders(self, rank: int) -> list[int]:
        """The ranks that keep ``rank``'s peer copies, nearest node first."""
        n = self.node_of[rank]
        position = self.nodes[n].index(rank)
        out = []
        for k in range(1, self.peer_copies + 1):
            ranks = self.nodes[(n + k) % len(self.nodes)]
            out.append(ranks[position % len(ranks)])
        return out

    def wards(self, rank: int) -> list[int]:
        """The ranks whose peer copies ``rank`` keeps."""
        return [r for r in sorted(self.node_of) if rank in self.holders(r)]


def node_identity(node_rank: int | None, rank: int) -> Any:
    """This rank's node: ``node_rank`` if given, else torchrun's ``GROUP_RANK``, else the rank
    over ``LOCAL_WORLD_SIZE``, else the host name."""
    if node_rank is not None:
        return int(node_rank)
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    if "LOCAL_WORLD_SIZE" in os.environ:
        return rank // max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    return os.uname().nodename
