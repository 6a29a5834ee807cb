"""Tiers: every save to a node-local directory first, copies on peer nodes over the process
group, durable storage every M saves drained in the background; restore from the fastest tier
whose hashes check out (docs/FORMAT.md, "Tiers").

    policy     TierPolicy, Topology (nodes, holders, wards)                   (no torch)
    identity   store_identity, the durable store's write-once identity.json   (no torch)
    local      LocalTier: the stores of a local_dir, their copies, retention  (no torch)
    transfer   a committed copy sent between ranks' local tiers over gloo
    drain      a rank's part of a durable save from its local copy
    restore    plan_sources: the save every rank restores, each rank's sources; LoadReport

The submodules are imported by name (``ckptstore ls`` reads ``local`` without torch).
"""
