"""ckptstore: sharded, verified, asynchronous checkpoints on append-only object storage."""

from ckptstore.checkpointer import Checkpointer, SaveHandle
from ckptstore.codec import CodecConfig
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    FormatVersionError,
    ObjectExistsError,
    ObjectNotFoundError,
    PartialLoadError,
    StepExistsError,
    StorageAccessError,
    StorageError,
    StorageTimeoutError,
    UnsupportedStateError,
)
from ckptstore.rng import RNGState
from ckptstore.store import RetryPolicy, Store

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "Store",
    "RetryPolicy",
    "CodecConfig",
    "RNGState",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "CommitUnknownError",
    "PartialLoadError",
    "FormatVersionError",
    "StepExistsError",
    "UnsupportedStateError",
    "StorageError",
    "StorageAccessError",
    "StorageTimeoutError",
    "ObjectExistsError",
    "ObjectNotFoundError",
]
