"""Adapters that plug ckptstore into training frameworks (each imports its framework itself)."""
