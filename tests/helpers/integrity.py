"""What a store holds: every committed step intact, its chunk files, the chunks its steps name."""

from __future__ import annotations

from pathlib import Path

from ckptstore import Store
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.pipeline import fetch_chunk


def verify_all(uri: str) -> list[int]:
    """Every committed step's manifest, indexes and chunks are present and intact."""
    store = Store(uri)
    steps = list_steps(store)
    for step in steps:
        manifest = load_manifest(store, step)
        for rank in range(manifest.world_size):
            index = load_rank_index(store, manifest, rank)
            for digest, info in index.chunks.items():
                fetch_chunk(store, digest, info)
    return steps


def chunk_files(root: Path) -> set[str]:
    """The names of the chunk files in the local store at ``root``."""
    return {p.name for p in (root / "chunks").rglob("*") if p.is_file()}


def referenced_chunks(uri: str) -> set[str]:
    """Every chunk a committed step's rank index names."""
    store = Store(uri)
    out: set[str] = set()
    for step in list_steps(store):
        manifest = load_manifest(store, step)
        for rank in range(manifest.world_size):
            out.update(load_rank_index(store, manifest, rank).chunks)
    return out
