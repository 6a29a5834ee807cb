"""Damaged and hostile stores: bounded decoding, keys, retention, failed loads, commits."""
