"""What names a DCP save or load here: checkpoint ids (a step or a store URI), and how a writer
or reader opens the store an id names. (The keys of DCP items in a rank index are
``ckptstore.format``'s ``storage_key``.)"""

from __future__ import annotations

import ast
import functools
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec

from ckptstore.format import check_step
from ckptstore.store import Store, open_store

logger = logging.getLogger(__name__)


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


def warn_if_inside(store: Store, home: Store) -> None:
    """A ``checkpoint_id`` naming a path inside the writer's own store (torchtitan's
    ``<folder>/step-<N>``) makes a store of its own there: said once per path."""
    if store.is_local and home.is_local:
        there, made_for = os.path.realpath(store.root), os.path.realpath(home.root)
        inside = there != made_for and Path(there).is_relative_to(made_for)
    else:
        inside = store.uri.startswith(home.uri.rstrip("/") + "/")
    if not inside or store.uri in _SAID_INSIDE:
        return
    _SAID_INSIDE.add(store.uri)
    digits = re.search(r"(\d+)/*$", store.uri)
    hint = f"checkpoint_id={int(digits.group(1))}" if digits else "a step as checkpoint_id"
    logger.warning(
        "StoreWriter: checkpoint_id %s lies inside the writer's store %s: it is made a store "
        "of its own, whose steps share no chunks with the others' and which keep_last never "
        "counts; %s saves that step of %s",
        store.uri,
        home.uri,
        hint,
        home.uri,
    )


_SAID_INSIDE: set[str] = set()


@functools.cache
def warn_if_main_unguarded() -> None:
    """Once per process, before DCP spawns its checkpoint process: spawn runs the main script
    again from the top in that process, so training code outside ``if __name__ ==
    "__main__":`` trains there again, and the save waits (up to torch's 30-minute init timeout)
    without a word. One warning naming the script where its top level has no such block."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(getattr(main, "__spec__", None), "name", "") or ""
    if not path or not str(path).endswith(".py") or spec.endswith("__main__"):
        return  # not a script spawn runs again (python -c, a package's __main__)
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, ValueError):
        return
    if any(isinstance(node, ast.If) and _names_main(node.test) for node in tree.body):
        return
    logger.warning(
        '%s has no `if __name__ == "__main__":` block: DCP\'s checkpoint process '
        "(async_checkpointer_type=PROCESS) is started with spawn, which runs the script again "
        "there, training included, and this save then waits for it (up to 30 minutes) with no "
        "other message; put the training code under that block",
        path,
    )


def _names_main(test: ast.expr) -> bool:
    """Whether ``test`` is (or contains) ``__name__ == "__main__"``."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            sides = [node.left, node.comparators[0]]
            names = {s.id for s in sides if isinstance(s, ast.Name)}
            values = {s.value for s in sides if isinstance(s, ast.Constant)}
            if names == {"__name__"} and values == {"__main__"}:
                return True
    return False
