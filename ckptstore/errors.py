"""Exceptions raised by ckptstore. Each names the object, step or rank involved."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error ckptstore raises on purpose."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """Stored bytes do not match what the manifest says (hash, size, header)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step, or an object a committed step references, does not exist."""


class StepExistsError(CheckpointError, FileExistsError):
    """A step is already committed; steps are write-once."""


class FormatVersionError(CheckpointError, ValueError):
    """The store was written in a format version this reader does not know."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds a value ckptstore cannot save, or does not match the checkpoint."""


class StorageError(CheckpointError, OSError):
    """A storage request failed after its retries, or the store is unreachable."""


class ObjectExistsError(StorageError, FileExistsError):
    """A write-once put found the object already there."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist in the store."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage request exceeded its deadline."""


class StorageAccessError(StorageError, PermissionError):
    """Credentials are missing or do not grant access."""
