"""Stores and requests: backends, access, hedging, deadlines, leases, counted requests."""
