"""Tail-latency-aware data loading: MDS, WebDataset and token-file shards read through
``ckptstore.store`` with replica fan-out, hedged reads, a bounded prefetch window and exact
resume. See docs/loaders.md."""

from loaders.config import LoaderConfig, ReplicaConfig
from loaders.dataset import ShardDataset, StatefulLoader
from loaders.errors import (
    LoaderError,
    ReadFailedError,
    ReadTimeoutError,
    ReplicaMismatchError,
    ShardCorruptError,
    ShardNotFoundError,
    ShardTooLargeError,
    UnknownFormatError,
)
from loaders.formats.mds import MDS, MDSWriter
from loaders.formats.tokens import TokenFiles, TokenWriter, hash_token_files
from loaders.formats.wds import WebDataset, WebDatasetWriter
from loaders.replicas import ReplicaSet

__all__ = [
    "MDS",
    "MDSWriter",
    "LoaderConfig",
    "LoaderError",
    "ReadFailedError",
    "ReadTimeoutError",
    "ReplicaConfig",
    "ReplicaMismatchError",
    "ReplicaSet",
    "ShardCorruptError",
    "ShardDataset",
    "ShardNotFoundError",
    "ShardTooLargeError",
    "StatefulLoader",
    "TokenFiles",
    "TokenWriter",
    "UnknownFormatError",
    "WebDataset",
    "WebDatasetWriter",
    "hash_token_files",
]
