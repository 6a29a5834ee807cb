"""Pointer files: the small JSON document left at a path a framework names for a checkpoint,
saying which save of which store holds its data::

    {"format": "ckptstore-pointer", "version": 1, "store": "s3://bucket/run42",
     "step": 1000, "save_id": "3f2a...", "global_step": 1000}

Pointers live wherever the framework writes its checkpoint files (a local directory or any
fsspec URL); a local pointer is replaced atomically (written beside, then renamed).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckptstore.errors import CheckpointCorruptError

FORMAT = "ckptstore-pointer"
VERSION = 1
MAX_BYTES = 64 * 1024  # a pointer is a few hundred bytes: a larger file is not one


@dataclass(frozen=True)
class Pointer:
    store: str  # the store's URI; local stores as an absolute path
    step: int
    save_id: str  # also in the step's metadata: tells this save from a later one at that step
    global_step: int
    pending: bool = False  # written as its save started; rewritten without it once committed
    written_at: float | None = None  # a pending one: when (time.time()), its save then queued
    # The (step, save_id) of the saves the pointers this one overwrote named, to unlist: a
    # kill between the commit and their unlisting left them listed, named by nothing.
    replaces: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, **asdict(self)}
        if not self.pending:
            del doc["pending"], doc["written_at"]  # as pointers were before the fields
        if not self.replaces:
            del doc["replaces"]
        return json.dumps(doc).encode()


def store_id(uri: str) -> str:
    """``uri`` as pointers record it: local paths absolute, no trailing ``/``."""
    uri = os.fspath(uri)
    if "://" not in uri:
        return os.path.abspath(uri)
    return uri.rstrip("/")


def is_pointer(data: bytes) -> bool:
    """Whether ``data`` claims to be a pointer (a JSON object), not e.g. a torch checkpoint."""
    return data.lstrip()[:1] == b"{"


def decode(data: bytes, path: str) -> Pointer:
    """The pointer in ``data`` read from ``path``, checked field by field."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path}: not a ckptstore pointer ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not a ckptstore pointer (no 'format': {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{path}: pointer version {doc.get('version')!r}, this ckptstore reads {VERSION}"
        )
    fields = {"store": str, "step": int, "save_id": str, "global_step": int}
    for name, kind in fields.items():
        value = doc.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CheckpointCorruptError(f"{path}: pointer field {name!r} is {value!r}")
    pending = doc.get("pending", False)
    if not isinstance(pending, bool):
        raise CheckpointCorruptError(f"{path}: pointer field 'pending' is {pending!r}")
    written_at = doc.get("written_at")
    if written_at is not None and (
        isinstance(written_at, bool) or not isinstance(written_at, (int, float))
    ):
        raise CheckpointCorruptError(f"{path}: pointer field 'written_at' is {written_at!r}")
    replaces = doc.get("replaces", [])
    if not isinstance(replaces, list) or not all(
        isinstance(r, list)
        and len(r) == 2
        and type(r[0]) is int
        and r[0] >= 0
        and isinstance(r[1], str)
        for r in replaces
    ):
        raise CheckpointCorruptError(f"{path}: pointer field 'replaces' is {replaces!r}")
    return Pointer(
        **{name: doc[name] for name in fields},
        pending=pending,
        written_at=written_at,
        replaces=tuple((step, save_id) for step, save_id in replaces),
    )


def read(path: str) -> bytes | None:
    """The bytes of the file at ``path``, or None if there is none."""
    fs, fspath = fsspec.core.url_to_fs(path)
    try:
        return fs.cat_file(fspath)
    except (FileNotFoundError, IsADirectoryError):
        return None


def load(path: str) -> Pointer | None:
    """The pointer at ``path``; None if there is no file there or it holds no pointer (a torch
    checkpoint, say). Raises as :func:`read` and :func:`decode` do."""
    data = read(path)
    if data is None or not is_pointer(data):
        return None
    return decode(data, path)


def write(path: str, pointer: Pointer) -> None:
    """Write ``pointer`` at ``path``, replacing what is there in one step."""
    fs, fspath = fsspec.core.url_to_fs(path)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(fspath, pointer.to_json())
        return
    directory = os.path.dirname(fspath) or "."
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".pointer-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(pointer.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, fspath)
    except BaseException:
        os.unlink(temporary)
        raise


def remove(path: str) -> bool:
    """Delete the file at ``path``; False if there was none."""
    fs, fspath = fsspec.core.url_to_fs(path)
    try:
        fs.rm_file(fspath)
    except FileNotFoundError:
        return False
    return True


def user_save_id(user: dict[str, Any], key: str) -> str | None:
    """The save id a step's metadata records under ``key``."""
    return (user.get(key) or {}).get("save_id")
