"""What names a DCP save or load here: checkpoint ids (a step or a store URI), and how a writer
or reader opens the store an id names. (The keys of DCP items in a rank index are
``ckptstore.format``'s ``storage_key``.)"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import fsspec

from ckptstore.format import check_step
from ckptstore.store import Store, open_store


def store_opener(
    storage_options: dict[str, Any] | None,
    *,
    timeout_s: float,
    max_concurrency: int,
    thread_nice: int = 0,
) -> Callable[[str | os.PathLike], Store]:
    """How a writer or reader opens its store, and another one a ``checkpoint_id`` names."""
    return functools.partial(
        open_store,
        storage_options=storage_options,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
        thread_nice=thread_nice,
    )


def _fsspec_resolves(checkpoint_id: str | os.PathLike) -> bool:
    try:
        fsspec.core.url_to_fs(os.fspath(checkpoint_id))
    except Exception:  # noqa: BLE001 - any failure means "not ours to handle"
        return False
    return True


def valid_checkpoint_id(checkpoint_id: Any) -> bool:
    """A step (an ``int`` or a ``str`` of digits) or a URI fsspec resolves."""
    try:
        if checkpoint_step(checkpoint_id) is not None:
            return True
    except (TypeError, ValueError):
        return False
    return _fsspec_resolves(checkpoint_id)


def checkpoint_step(checkpoint_id: Any) -> int | None:
    """The step a DCP ``checkpoint_id`` names for ``StoreWriter``, or None for a store URI.

    An ``int`` or a ``str`` of ASCII digits (``"1000"``) is a step; any other ``str`` or
    ``os.PathLike`` is a store URI (name a local directory called ``1000`` as ``"./1000"`` or
    ``Path("1000")``). Anything else, or a step out of range, is a ``ValueError``."""
    if isinstance(checkpoint_id, str):
        if checkpoint_id.isascii() and checkpoint_id.isdigit():
            return check_step(int(checkpoint_id))
        return None
    if isinstance(checkpoint_id, os.PathLike):
        return None
    return check_step(checkpoint_id)  # an int (bools and negative ints are refused)
