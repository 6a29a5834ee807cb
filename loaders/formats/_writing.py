"""What every writer shares: the replica Stores it writes to, write-once puts, the index last."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from ckptstore.store import Store

logger = logging.getLogger(__name__)

Target = str | os.PathLike | Store


class DatasetSink:
    """Writes a dataset's objects to one or more replicas (each object to every replica) and,
    on :meth:`finish`, its index: the object whose presence makes the dataset readable."""

    def __init__(
        self,
        targets: Target | Sequence[Target],
        *,
        index: str,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(targets, (str, os.PathLike, Store)):
            targets = [targets]
        if not targets:
            raise ValueError("a dataset writer needs at least one store URI")
        self.stores = [
            t if isinstance(t, Store) else Store(t, storage_options=storage_options)
            for t in targets
        ]
        self.index = index
        for store in self.stores:
            if store.exists(index):
                raise FileExistsError(
                    f"{store.url(index)} already exists: a dataset is written once, "
                    "write to an empty location"
                )
        self.written: list[str] = []
        self._put: list[tuple[Store, str]] = []  # what abort deletes: only objects we wrote
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ValueError(f"the dataset writer of {self.stores[0].uri} is closed")

    def put(self, key: str, data: bytes | memoryview | list) -> None:
        """Write ``key`` to every replica (durable when it returns)."""
        self.check_open()
        for store in self.stores:
            store.put(key, data)
            self._put.append((store, key))
        self.written.append(key)

    def finish(self, index_bytes: bytes) -> None:
        """Write the index after every shard: only now is the dataset readable."""
        self.put(self.index, index_bytes)
        self.closed = True

    def abort(self) -> None:
        """Leave no index; delete the shards written so far (best effort: a killed process
        leaves them, but without an index they are not a dataset)."""
        self.closed = True
        for store, key in self._put:
            try:
                store.delete(key)
            except OSError as exc:
                logger.warning("could not delete %s of an aborted dataset: %s", store.url(key), exc)


class ShardWriter:
    """Base of the writers: a context manager that finishes the dataset on a clean exit and
    aborts it (no index) when the block raises."""

    sink: DatasetSink

    def close(self) -> None:
        """Write the last shard and then the index."""
        if self.sink.closed:
            return
        self._flush()
        self.sink.finish(self._index_bytes())

    def abort(self) -> None:
        self.sink.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def shards(self) -> list[str]:
        """Keys of the shards written so far, in order."""
        return [k for k in self.sink.written if k != self.sink.index]

    def _flush(self) -> None:
        raise NotImplementedError

    def _index_bytes(self) -> bytes:
        raise NotImplementedError
