"""What every rank of both jobs does (:class:`RecoverPlan`), the state each rank holds, and
the checks of a run's layout."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_RANKS = 16
"""Ranks run as processes, each with its own torch (~0.3 GB) and state."""
DEFAULT_BUCKET = "ckptbench-recover"
METHODS = ("tiers", "plain")
"""Save methods: with tiers, and without (a plain saver on a sibling prefix of the durable
store)."""
FRONTENDS = ("checkpointer", "dcp")
"""What saves and restores: ``Checkpointer``, or ``dcp.async_save`` / ``dcp.load`` with
``ckptstore.dcp``'s ``StoreWriter`` / ``StoreReader``."""
BASELINE = "dcp"
"""The restore every front-end compares with: DCP's own reader of DCP's own save."""
DAMAGES = ("node", "chunk")
"""What happens to the last node before each restore round: its local directory wiped (a
replaced node), or one byte flipped in one chunk of each of its ranks' own copies of the
newest step (a bad sector)."""


@dataclass(kw_only=True)
class RecoverPlan:
    """What every rank of both jobs does."""

    durable_uri: str
    plain_uri: str
    dcp_path: str
    dcp_is_local: bool
    local_root: str
    ranks_per_node: int
    nodes: int
    bytes_per_rank: int
    tensors: int
    repeat: int
    peer_budget_bytes: int
    seed: int = 0
    background_nice: int = 0
    """``background_nice`` of the save job's savers, both."""
    timeout_s: float = 300.0
    """Deadline of one storage request (moto is slow under four ranks' uploads)."""
    group_timeout_s: float = 1800.0
    frontend: str = "checkpointer"
    damage: str = "node"

    @property
    def wiped_node(self) -> int:
        return self.nodes - 1

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_dir(self, node: int) -> str:
        return os.path.join(self.local_root, f"node{node}")

    def tier_options(self, rank: int) -> Any:
        """The tiers every tiered saver and reader of ``rank`` takes: its node's directory,
        a copy on the next node, every save durable."""
        from ckptstore import TierOptions

        node = self.node_of(rank)
        return TierOptions(
            local_dir=self.node_dir(node),
            peer_copies=1,
            durable_every=1,
            node_rank=node,
            peer_budget_bytes=self.peer_budget_bytes,
        )


def damage_node(plan: RecoverPlan, originals: dict[Path, bytes]) -> None:
    """Damage the last node's local directory as ``plan.damage`` says (``DAMAGES``). A chunk
    flipped by an earlier round (which that round's load removed from the tier) is put back
    from ``originals`` first, so every round meets one bad chunk per rank."""
    import shutil

    node_dir = plan.node_dir(plan.wiped_node)
    if plan.damage == "node":
        shutil.rmtree(node_dir, ignore_errors=True)
        return
    for path, data in originals.items():
        path.parent.mkdir(parents=True, exist_ok=True)  # the tier may prune an empty one
        path.write_bytes(data)
    world = plan.nodes * plan.ranks_per_node
    for rank in (r for r in range(world) if plan.node_of(r) == plan.wiped_node):
        for copy in Path(node_dir).glob(f"job-*/rank-{rank:05d}"):
            path, data = flip_one_chunk(copy)
            originals.setdefault(path, data)


def flip_one_chunk(copy: Path) -> tuple[Path, bytes]:
    """One byte flipped in the middle of the first chunk (by digest) of the newest committed
    step of the copy (a rank directory of a local tier) at ``copy``; the chunk's path and its
    bytes before."""
    from ckptstore.catalog import list_steps, load_manifest, read_rank_index
    from ckptstore.format import chunk_key
    from ckptstore.store import Store

    store = Store(str(copy))
    step = list_steps(store)[-1]
    index = read_rank_index(store, load_manifest(store, step).ranks[0])
    path = copy / chunk_key(sorted(index.chunks)[0])
    before = path.read_bytes()
    data = bytearray(before)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path, before


def rank_state(rank: int, tensors: int, nbytes: int) -> dict[str, torch.Tensor]:
    """``tensors`` zeroed float32 tensors holding ``nbytes`` between them, named by rank (so
    DCP, which merges every rank's keys into one checkpoint, keeps each rank's apart)."""
    numel = max(1, nbytes // tensors // 4)
    return {f"rank{rank:02d}.layer{i:02d}": torch.zeros(numel) for i in range(tensors)}


def fill(state: dict[str, torch.Tensor], rank: int, step: int, seed: int) -> None:
    """The state of ``rank`` at ``step``: normal values, the same for the same arguments."""
    for i, t in enumerate(state.values()):
        g = torch.Generator().manual_seed(((seed * 1009 + rank) * 1009 + step) * 1009 + i)
        t.normal_(generator=g)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Equal keys, and every tensor's bytes equal (-0.0 is not 0.0, a NaN equals itself)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().view(torch.uint8)

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
        for k in a
    )


def check_layout(ranks: int, ranks_per_node: int, frontend: str = "checkpointer") -> int:
    """The node count of ``ranks`` over nodes of ``ranks_per_node``; ValueError unless at
    least two nodes of equal size (a node's ranks need peers on another node, with either
    frontend)."""
    if not 2 <= ranks <= MAX_RANKS:
        raise ValueError(f"bad --ranks {ranks}: must be within 2..{MAX_RANKS}")
    if ranks_per_node < 1 or ranks % ranks_per_node:
        raise ValueError(f"bad --ranks-per-node {ranks_per_node}: must divide --ranks {ranks}")
    nodes = ranks // ranks_per_node
    if nodes < 2:
        why = "peer copies need 2 or more" + (" (--frontend dcp too)" if frontend == "dcp" else "")
        raise ValueError(f"--ranks {ranks} --ranks-per-node {ranks_per_node} is one node: {why}")
    return nodes
