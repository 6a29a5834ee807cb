"""Tiers: every save to a node-local directory first, copies on peer nodes over the process
group, durable storage every M saves drained in the background; restore from the fastest tier
whose hashes check out (docs/FORMAT.md, "Tiers")."""

from ckptstore.tiers.drain import drain_rank
from ckptstore.tiers.local import Copy, LocalTier
from ckptstore.tiers.policy import TIER_KEY, TierPolicy, Topology, node_identity
from ckptstore.tiers.restore import LoadReport, SourceStats, plan_sources
from ckptstore.tiers.transfer import Transfer, TransferStats, transfer

__all__ = [
    "TIER_KEY",
    "Copy",
    "LoadReport",
    "LocalTier",
    "SourceStats",
    "TierPolicy",
    "Topology",
    "Transfer",
    "TransferStats",
    "drain_rank",
    "node_identity",
    "plan_sources",
    "transfer",
]
