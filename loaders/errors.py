"""Exceptions raised by the loader. Each names the shard, offset and replica involved."""

from __future__ import annotations


class LoaderError(Exception):
    """Base class of every error the loader raises on purpose (not a ``CheckpointError``: the
    loader reads datasets, not checkpoints)."""


class ShardCorruptError(LoaderError, ValueError):
    """A shard's bytes do not match its index (hash, size, header, encoding)."""


class ShardTooLargeError(LoaderError, ValueError):
    """A shard whose bytes verify takes more decoded than a bound the dataset was opened with
    (``MDS.max_shard_bytes``): the same on every replica, no replica's fault."""


class ShardNotFoundError(LoaderError, FileNotFoundError):
    """A shard (or the dataset index) is missing from every replica."""


class ReplicaMismatchError(LoaderError, ValueError):
    """Two replicas of one dataset hold different contents."""


class ReadTimeoutError(LoaderError, TimeoutError):
    """A read did not complete on any replica within its overall deadline."""


class ReadFailedError(LoaderError, OSError):
    """A read failed on every replica it was tried on."""


class UnknownFormatError(LoaderError, ValueError):
    """The dataset format, a column encoding or a compression is not supported."""
