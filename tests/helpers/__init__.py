"""What several test modules share; test modules import from here, never from each other."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
FIXTURES = ROOT / "tests" / "fixtures"
"""Data files the tests read (tests/fixtures)."""
MDS_FIXTURES = FIXTURES / "mds"
"""MDS datasets written by mosaicml-streaming's own MDSWriter."""
