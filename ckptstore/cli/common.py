"""What every ``ckptstore`` command shares: its errors, opening the store, JSON and progress
output, and a reader of stdout that goes away."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptstore.catalog import dcp_checkpoint_there, store_nearby
from ckptstore.errors import CheckpointError, CheckpointNotFoundError, StorageAccessError
from ckptstore.integrations import _pointer
from ckptstore.store import RetryPolicy, Store
from ckptstore.tiers.identity import IDENTITY_KEY

PROG = "ckptstore"


class UsageError(ValueError):
    """Bad input on the command line: exit status 2."""


class Failed(Exception):
    """The command ran and found problems it already reported: exit status 1."""


def emit_json(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, indent=2, default=str))


def open_store(args: argparse.Namespace) -> Store:
    """The store of ``args.uri``; an error unless it exists (a missing local directory or
    bucket is "no checkpoints there", never an empty listing), except for ``ls`` with
    ``--local-dir``: the local tiers may hold steps of a job whose durable store has none yet."""
    try:
        return _open_existing_store(args)
    except CheckpointNotFoundError:
        if not getattr(args, "local_dir", None):
            raise
        return Store(args.uri, storage_options=dict(args.storage_options) or None)


def _shown(uri: str) -> str:
    """``uri`` as typed, quoted where a space at an end or a control character would hide."""
    return repr(uri) if uri != uri.strip() or not uri.isprintable() else uri


def _what_file(path: str) -> str:
    """What the file at ``path``, given where a store is expected, is: a Lightning pointer
    (``last.ckpt``) names its store and step."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
            return "not a store directory"
        with open(path, "rb") as f:
            data = f.read(_pointer.MAX_BYTES + 1)
        pointer = _pointer.decode(data, path) if _pointer.is_pointer(data) else None
    except (OSError, CheckpointError, RecursionError):
        pointer = None
    if pointer is None:
        return "a file, not a store directory"
    store = _shown(pointer.store)
    return (
        f"a pointer to step {pointer.step} of the store {store}, as the Lightning plugin "
        f"writes: give {store} --step {pointer.step}"
    )


def _open_existing_store(args: argparse.Namespace) -> Store:
    options = dict(args.storage_options)
    timeout = getattr(args, "timeout", None)
    retry = RetryPolicy.within(timeout) if timeout else None
    try:
        store = Store(args.uri, storage_options=options or None, retry=retry)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    except ImportError as exc:  # an fsspec backend whose package is not installed
        raise UsageError(f"cannot open store {args.uri!r}: {exc}") from exc
    if store.is_local:
        try:
            is_dir = stat.S_ISDIR(os.stat(store.root).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(
                f"no ckptstore checkpoints at {_shown(args.uri)} (no such path)"
            ) from None
        except PermissionError as exc:
            raise StorageAccessError(
                f"cannot open store {args.uri}: permission denied on {exc.filename or store.root}"
            ) from exc
        if not is_dir:
            raise CheckpointNotFoundError(
                f"no ckptstore checkpoints at {_shown(args.uri)} ({_what_file(store.root)})"
            )
    # A missing bucket, bad credentials, an unreadable directory or an endpoint that does not
    # answer fail here, clearly (listing only commits/: the whole prefix may hold millions of
    # chunks).
    if not store.list("commits") and not holds_store_data(store):
        ranks = sorted(Path(store.root).glob("job-*/rank-*")) if store.is_local else []
        if ranks:
            raise CheckpointNotFoundError(
                f"no ckptstore data at {args.uri}: it is a local tier directory (a rank's copies "
                f"are a store of their own: {ranks[0]}; every tier of a step: ckptstore ls "
                f"DURABLE_URI --local-dir {args.uri})"
            )
        raise CheckpointNotFoundError(
            f"no ckptstore data at {args.uri}"
            + (
                dcp_checkpoint_there(store)
                or store_nearby(store, remote=True)  # the store it lies in, or one just below
                or " (nothing under commits/, steps/, indexes/, leases/ or chunks/: a mistyped "
                "path or prefix?)"
            )
        )
    return store


def holds_store_data(store: Store) -> bool:
    """True if anything a save writes is there (a store whose steps were all removed, or whose
    first save is under way, still holds chunks, attempts or leases; one whose only save was
    killed may hold only put temporaries, which gc removes)."""
    prefixes = ("leases", "steps", "indexes", "pending", "chunks")
    return (
        any(store.list(prefix) for prefix in prefixes)
        or store.exists(IDENTITY_KEY)  # a tiered job's store before its first durable step
        or bool(store.stale_temporaries(older_than_s=0))
    )


@contextmanager
def progress(total: int, desc: str) -> Iterator[Callable[[int], Any]]:
    """A byte progress bar on stderr when it is a terminal; otherwise a no-op callback."""
    if total > 0 and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        )
        try:
            yield bar.update
        finally:
            bar.close()
    else:
        yield lambda n: None


def stdout_gone() -> None:
    """The reader of stdout went away (EPIPE: ``ckptstore ls ... | head -1``): a normal end.
    Point stdout at /dev/null so that the interpreter's final flush of what is still buffered
    does not fail again (it would print "Exception ignored ... BrokenPipeError" and exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def flush_stdout() -> None:
    """Flush stdout now; a reader that went away is :func:`stdout_gone`, not an error."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_gone()
