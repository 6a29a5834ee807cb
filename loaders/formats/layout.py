"""What every format produces: a dataset cut into units, each one storage read of whole samples."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from loaders.errors import ShardCorruptError

_said: set[Hashable] = set()
_said_lock = threading.Lock()


def first_time(what: Hashable) -> bool:
    """True the first time this process asks about ``what`` (a dataset's one-time warning)."""
    with _said_lock:
        first = what not in _said
        _said.add(what)
    return first


def forget_said() -> None:
    """As if this process had said nothing yet (tests)."""
    with _said_lock:
        _said.clear()


@dataclass(frozen=True)
class Unit:
    """One read of whole samples: ``[start, end)`` of object ``key`` (the whole object when
    ``start`` is None), or the wider ``[read_start, read_end)`` when given."""

    key: str
    start: int | None
    end: int | None
    nbytes: int
    """Bytes the read returns."""
    mem_bytes: int
    """Bytes the unit takes once decoded (what the prefetch window accounts)."""
    num_samples: int
    first_id: int
    """Dataset-wide index of the unit's first sample."""
    read_start: int | None = None
    read_end: int | None = None
    """The bytes read when more than the samples' ``[start, end)``: token files with hashes
    read whole hash blocks, each checked against its hash, and decode the samples out of them."""

    def describe(self) -> str:
        """The samples' bytes (what the dataset fingerprint and errors name)."""
        return self.key if self.start is None else f"{self.key}[{self.start}:{self.end}]"

    def span(self) -> tuple[int | None, int | None]:
        """The range the read asks for."""
        if self.read_start is None:
            return self.start, self.end
        return self.read_start, self.read_end


class Layout(Protocol):
    """A dataset as opened by a format: its units, and how to decode a unit's bytes."""

    units: Sequence[Unit]
    reads_views: bool
    """``decode`` takes any read-only buffer (a memory map of a local file), not only bytes."""

    def decode(self, unit: Unit, data: bytes, replica: str) -> Sequence[Any]:
        """The unit's samples, in order (``replica`` is named in errors)."""
        ...


class Format(Protocol):
    """A dataset format: reads its index through the replicas and lays the dataset out."""

    name: str

    def open(self, replicas: Any) -> Layout: ...


def check_shard_key(key: object, what: str) -> str:
    """``key`` if it names an object inside the dataset root: a relative, normalised path
    (no ``..`` or ``.`` or empty component, no leading ``/``, no scheme, no backslash);
    :class:`ShardCorruptError` naming ``what`` (the index or manifest) otherwise."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if (
        not all(part and part not in (".", "..") for part in parts)
        or "\\" in key
        or ":" in parts[0]
        or any(ord(c) < 32 for c in key)
    ):
        raise ShardCorruptError(f"{what} names shard {key!r}, which is not inside the dataset")
    return key


def unit_samples(units: Sequence[Unit]) -> np.ndarray:
    return np.fromiter((u.num_samples for u in units), dtype=np.int64, count=len(units))
