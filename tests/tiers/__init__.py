"""Tiers (ckptstore.tiers, ckptstore.tiers.open_step, ckptstore.peer): node-local copies, peer
copies over gloo, durable storage every M saves."""
