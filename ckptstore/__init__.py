"""ckptstore: sharded, verified, asynchronous checkpoints on append-only object storage."""

from typing import TYPE_CHECKING, Any

from ckptstore.codec import CodecConfig
from ckptstore.errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitUnknownError,
    DrainSupersededError,
    FormatVersionError,
    NoHealthyStepError,
    NoLoadableStepError,
    ObjectExistsError,
    ObjectNotFoundError,
    PartialLoadError,
    RankLostError,
    RanksOutOfStepError,
    StepExistsError,
    StorageAccessError,
    StorageError,
    StorageFullError,
    StorageTimeoutError,
    TooLargeForHostError,
    UnhealthyStepError,
    UnsupportedStateError,
)
from ckptstore.health import StepHealth
from ckptstore.options import (
    EncodingOptions,
    HealthPolicy,
    PreemptionOptions,
    ReadOptions,
    RetentionOptions,
    StagingOptions,
    StorageOptions,
    TierOptions,
)
from ckptstore.store import RetryPolicy, Store

if TYPE_CHECKING:
    from ckptstore.checkpointer import Checkpointer, SaveHandle
    from ckptstore.rng import RNGState

# Imported on first use: they need torch, which the CLI's ls, inspect and --help do without.
_LAZY = {
    "Checkpointer": "ckptstore.checkpointer",
    "SaveHandle": "ckptstore.checkpointer",
    "RNGState": "ckptstore.rng",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "Store",
    "RetryPolicy",
    "StorageOptions",
    "EncodingOptions",
    "StagingOptions",
    "RetentionOptions",
    "TierOptions",
    "ReadOptions",
    "PreemptionOptions",
    "HealthPolicy",
    "StepHealth",
    "CodecConfig",
    "RNGState",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "NoHealthyStepError",
    "NoLoadableStepError",
    "CommitUnknownError",
    "DrainSupersededError",
    "PartialLoadError",
    "RankLostError",
    "RanksOutOfStepError",
    "FormatVersionError",
    "StepExistsError",
    "UnsupportedStateError",
    "UnhealthyStepError",
    "TooLargeForHostError",
    "StorageError",
    "StorageAccessError",
    "StorageFullError",
    "StorageTimeoutError",
    "ObjectExistsError",
    "BucketNotFoundError",
    "ObjectNotFoundError",
]
