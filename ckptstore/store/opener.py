"""How the front-ends and read-only tools open a store."""

from __future__ import annotations

import os
from typing import Any

from ckptstore.store.core import Store
from ckptstore.store.retry import RetryPolicy


def open_store(
    uri: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
    max_concurrency: int = 16,
    thread_nice: int = 0,
) -> Store:
    """The store at ``uri``, every request of which ends within ``timeout_s``; ``ValueError``
    for a local path that is there and not a directory (a file: its first save failed on a
    lease, naming no path the user gave, and ``latest()`` said None)."""
    store = Store(
        uri,
        storage_options=storage_options,
        retry=RetryPolicy.within(timeout_s),
        max_concurrency=max_concurrency,
        thread_nice=thread_nice,
    )
    if store.is_local and os.path.exists(store.root) and not os.path.isdir(store.root):
        raise ValueError(f"{uri} is a file, not a store directory: give a directory")
    return store
