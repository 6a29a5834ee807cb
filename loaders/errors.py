"""Exceptions raised by the loader. Each names the shard, offset and replica involved."""

from __future__ import annotations


class LoaderError(Exception):
    """Base class of every error the loader raises on purpose (not a ``CheckpointError``: the
    loader reads datasets, not checkpoints)."""


class ShardCorruptError(LoaderError, ValueError):
    """A shard's bytes do not match its index (hash, size, header, encoding)."""


class ShardTooLargeError(ShardCorruptError):
    """A shard (or an index, a manifest, a dataset) larger than a bound the dataset was opened
    with (``max_shard_bytes``, ``MDS.max_index_bytes``, ``TokenFiles.read_bytes``): a shard
    corrupt or hostile, or a real one past the bound, which is to be raised to read it. Found
    at open, or (MDS json values) as the shard is decoded: the same on every replica, no
    replica's fault."""


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
