"""Tiers (ckptstore.tiers, ckptstore.dcp.tiers, ckptstore.peer): node-local copies, peer
copies over gloo, durable storage every M saves."""
