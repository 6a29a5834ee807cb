"""Storage: the one place where bytes leave or enter storage.

:class:`Store` runs every request under a deadline, retries it, counts it
(:attr:`Store.counters`) and, when asked, hedges it; a :class:`~ckptstore.store.backends.Backend`
per URL scheme does the single attempts.
"""

from ckptstore.store.backends import (
    TMP_MARK,
    Backend,
    FsspecBackend,
    LocalBackend,
    MemoryBackend,
    S3Backend,
    describe_endpoint,
    open_backend,
)
from ckptstore.store.core import Request, Store
from ckptstore.store.counters import StoreCounters
from ckptstore.store.hedge import HedgePolicy, Hedger
from ckptstore.store.opener import open_store
from ckptstore.store.pool import ElasticPool, niced, set_thread_nice
from ckptstore.store.retry import RetryPolicy, is_transient

__all__ = [
    "Store",
    "open_store",
    "RetryPolicy",
    "Request",
    "StoreCounters",
    "HedgePolicy",
    "Hedger",
    "Backend",
    "FsspecBackend",
    "LocalBackend",
    "MemoryBackend",
    "S3Backend",
    "open_backend",
    "describe_endpoint",
    "is_transient",
    "ElasticPool",
    "niced",
    "set_thread_nice",
    "TMP_MARK",
]
