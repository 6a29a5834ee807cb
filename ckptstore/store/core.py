"""The store: every request to a backend runs here, under a deadline, retried, counted, and on
request hedged.

Every request runs on a worker thread under a deadline and is retried with exponential backoff
and full jitter when its error is transient (timeouts, connection resets, 5xx, SlowDown). A hung
attempt is abandoned after its deadline (its daemon thread is left to finish on its own), and a
whole request, retries included, ends within ``RetryPolicy.total_s`` (30 s by default, more for
large transfers) with an error naming the endpoint, so no caller waits long for a store that
does not answer. Puts are write-once (see :mod:`ckptstore.store.backends`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptstore.errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageAccessError,
    StorageError,
    StorageFullError,
    StorageTimeoutError,
)
from ckptstore.store.backends import Backend, Data, open_backend
from ckptstore.store.counters import OK, StoreCounters
from ckptstore.store.hedge import HedgePolicy, Hedger
from ckptstore.store.pool import ElasticPool
from ckptstore.store.retry import (
    RetryPolicy,
    describe,
    is_access_error,
    is_busy,
    is_transient,
    is_unanswered,
    whoami,
)

logger = logging.getLogger("ckptstore.store")

T = TypeVar("T")
R = TypeVar("R")

_MUTATING_OPS = frozenset({"put", "copy", "delete"})
# No retry starts with less than this (or a quarter of an attempt's deadline) left of its request.
_MIN_ATTEMPT_S = 0.5
# A put the store has no room for: a full disk, a user's quota spent (what failed saves left
# is then swept as for a full disk, ``SaveSession.reclaim``).
_FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# Marks the log record (INFO) of one failed attempt: the request's own error, if it comes to that,
# tells the outcome, and the store's counters count retries (``ckptstore`` shows these with -v).
_RETRY_LOG = {"ckptstore_retry": True}


@dataclass(frozen=True)
class Request:
    """One storage request, as the retry loop, its messages and the counters see it."""

    op: str
    key: str
    nbytes: int = 0
    """Bytes the request moves, where known: more bytes get a longer deadline."""
    shared: bool = False
    """A put of a content-addressed object other writers put too (a chunk)."""
    policy: RetryPolicy | None = None
    """This request's retries and deadlines, where not the store's."""


# The first component of every key a store writes below its top (docs/FORMAT.md).
_LAYOUT = frozenset(
    {"chunks", "steps", "indexes", "commits", "pending", "leases", "quarantine", "resumes"}
)


class Store:
    """A prefix in an object store, addressed by relative keys such as ``chunks/ab/abcd...``.

    ``uri`` is a local path, ``file://``, ``memory://``, ``s3://bucket/prefix`` or anything else
    fsspec resolves. Credentials and endpoints come from ``storage_options`` or the standard
    environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). ``backend`` replaces the one
    ``uri``'s scheme opens (it must serve ``uri``; tests wrap one to inject faults).
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int = 16,
        thread_nice: int = 0,
        backend: Backend | None = None,
        hedge: HedgePolicy | None = None,
    ) -> None:
        if not isinstance(uri, (str, os.PathLike)):
            raise TypeError(f"store URI must be a path or URI string, not {uri!r}")
        uri = os.fspath(uri)
        if not uri:
            raise ValueError("store URI is empty")
        if uri != uri.strip():  # another store than the one meant, made without a word
            raise ValueError(f"store URI {uri!r} begins or ends with whitespace: strip it")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not 0 <= thread_nice <= 19:
            raise ValueError(f"thread_nice must be within [0, 19], got {thread_nice}")
        self.retry = retry or RetryPolicy()
        if backend is None:
            backend, _ = open_backend(uri, storage_options=storage_options, retry=self.retry)
        self.backend = backend
        self.uri = uri
        self.root = backend.root
        self._storage_options = storage_options
        self.max_concurrency = max_concurrency
        self._thread_nice = thread_nice
        self.counters = StoreCounters()
        self.hedger = Hedger(hedge, counters=self.counters)
        self._abandoned: dict[Future, str] = {}  # a request abandoned at its deadline -> its op
        self._abandoned_lock = threading.Condition()
        self._workers = ElasticPool(f"ckptstore-io[{uri}]", nice=thread_nice)
        self._callers = ElasticPool(f"ckptstore-req[{uri}]", nice=thread_nice)

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def reopen(self) -> Store:
        """This store opened afresh with the same settings and backend (wrappers included), as
        another process needs it: no clients, threads or counts shared."""
        return self._opener(self.backend.reopen())(self.uri)

    def __reduce__(self) -> tuple[Callable[[str], Store], tuple[str]]:
        # Pickled (into a spawned worker) as its settings and backend: unpickling reopens it.
        return self._opener(self.backend), (self.uri,)

    def _opener(self, backend: Backend) -> Callable[[str], Store]:
        return functools.partial(
            Store,
            storage_options=self._storage_options,
            retry=self.retry,
            max_concurrency=self.max_concurrency,
            thread_nice=self._thread_nice,
            backend=backend,
            hedge=self.hedger.policy,
        )

    @property
    def is_local(self) -> bool:
        return self.backend.is_local

    def overlaps(self, path: str | os.PathLike) -> bool:
        """Whether the local ``path`` is this store's directory, inside it, or holds it (links
        resolved): writing or replacing it would damage the store. False for a remote store."""
        if not self.is_local:
            return False
        mine = os.path.realpath(self.root)
        other = os.path.realpath(os.fspath(path))
        return os.path.commonpath([mine, other]) in (mine, other)

    @property
    def endpoint(self) -> str:
        """Where requests go, for messages: the S3 endpoint URL, the directory of a local store."""
        return self.backend.endpoint

    def path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):  # a second line behind format's checks
            raise CheckpointCorruptError(f"key {key!r} leads outside the store {self.uri}")
        return f"{self.root}/{key}" if key else self.root

    def url(self, key: str) -> str:
        """A readable name of ``key`` for messages."""
        return f"{self.uri.rstrip('/')}/{key}"

    # -- the request loop -------------------------------------------------------------------

    def _request(
        self,
        op: str,
        key: str,
        fn: Callable[..., R],
        *args: Any,
        nbytes: int = 0,
        in_thread: bool = False,
    ) -> R:
        """``fn(*args)`` as one request: retried, under deadlines, counted. ``in_thread``: each
        attempt runs in the calling thread, with no deadline of its own (the caller bounds it)."""
        return self._request_as(Request(op, key, nbytes), fn, *args, in_thread=in_thread)

    def _request_as(
        self, request: Request, fn: Callable[..., R], *args: Any, in_thread: bool = False
    ) -> R:
        op, nbytes = request.op, request.nbytes
        try:
            result = self._attempts(request, fn, args, in_thread)
        except BaseException as exc:
            self.counters.request(op, _error_kind(exc))
            raise
        moved = nbytes if op == "put" else len(result) if op == "get" else 0
        self.counters.request(op, OK, moved)
        return result

    def _attempts(
        self, request: Request, fn: Callable[..., R], args: tuple, in_thread: bool = False
    ) -> R:
        op, key, policy = request.op, request.key, request.policy or self.retry
        last: BaseException | None = None
        budget = policy.budget_s(request.nbytes)
        end = time.monotonic() + budget
        floor = min(_MIN_ATTEMPT_S, policy.timeout_s / 4)
        made = 0
        unanswered = False
        attempt = -1
        while (attempt := attempt + 1) < policy.attempts or (
            policy.total_s is not None and is_busy(last)
        ):
            if attempt:
                delay = policy.backoff_s(attempt - 1)
                if time.monotonic() + delay + floor >= end:
                    break  # no time left for another attempt: the request's deadline is near
                time.sleep(delay)
            deadline = min(policy.deadline_s(request.nbytes), end - time.monotonic())
            if made and deadline < floor:
                break
            if made:
                self.counters.retry(op)
            made += 1
            if op == "put":
                self.counters.sent(op, request.nbytes)
            if in_thread:
                try:
                    return fn(*args)
                except Exception as exc:  # noqa: BLE001 - classified below, as a worker's is
                    error = exc
            else:
                future = self._workers.submit(fn, *args)
                try:
                    # exception(), not result(): re-raising the worker's error here would add
                    # this thread's frames to its traceback, and with them the caller's locals
                    # (a chunk's bytes) to any reference cycle that traceback is part of
                    # (fsspec's sync() makes one for every error), freed only by the cyclic GC.
                    error = future.exception(timeout=deadline)
                except TimeoutError:
                    if not future.cancel() and op in _MUTATING_OPS:
                        self._track_abandoned(future, op)
                    unanswered = True
                    last = StorageTimeoutError(
                        f"{op} {self.url(key)}: no answer within {deadline:.1f}s{self._from()}"
                    )
                    logger.info(
                        "%s %s: attempt %d timed out after %.1fs%s",
                        op,
                        self.url(key),
                        made,
                        deadline,
                        self._from(),
                        extra=_RETRY_LOG,
                    )
                    continue
                if error is None:
                    return future.result()
            unanswered = unanswered or is_unanswered(error)
            if not is_transient(error):
                if op == "put" and self._landed(request, made, error, args):
                    return None  # type: ignore[return-value] - the earlier attempt landed
                # No local holds the error raised: this frame, in its traceback, would make a
                # cycle of it (and the caller's locals) that only the cyclic GC frees.
                raise self._translate(op, key, error, unanswered) from error
            last = error
            logger.info(
                "%s %s: attempt %d failed (%s)",
                op,
                self.url(key),
                made,
                error,
                extra=_RETRY_LOG,
            )
        waited = budget - max(0.0, end - time.monotonic())
        raise self._gave_up(request, last, made, waited, unanswered) from last

    def _gave_up(
        self, request: Request, last: BaseException | None, made: int, waited: float,
        unanswered: bool,
    ) -> StorageError:  # fmt: skip
        """The error of a request whose ``made`` attempts failed, the last with ``last``."""
        op, where, tries = request.op, self.url(request.key), f"{made} attempt{'s' * (made != 1)}"
        if isinstance(last, StorageTimeoutError):
            final: StorageError = StorageTimeoutError(
                f"{op} {where}: no answer within {waited:.1f}s{self._from()} ({tries})"
            )
        else:
            at = f" (endpoint {self.endpoint})" if self.backend.remote else ""
            final = StorageError(f"{op} {where} failed after {tries}{at}: {describe(last)}")
        final.unanswered = unanswered
        return final

    def _from(self) -> str:
        """`` from <endpoint>`` for a remote store (messages about requests with no answer)."""
        return f" from {self.endpoint}" if self.backend.remote else ""

    def _track_abandoned(self, future: Future, op: str) -> None:
        """Remember a put or delete that outlived its deadline: it may still land."""
        with self._abandoned_lock:
            self._abandoned[future] = op
        future.add_done_callback(self._forget_abandoned)

    def _forget_abandoned(self, future: Future) -> None:
        with self._abandoned_lock:
            self._abandoned.pop(future, None)
            self._abandoned_lock.notify_all()

    def settle(self, timeout_s: float | None, ops: Collection[str] = _MUTATING_OPS) -> bool:
        """Wait until every request of ``ops`` (puts and deletes) this store gave up on has
        really ended; False if some are still running after ``timeout_s``.

        A request abandoned at its deadline keeps running and may land later. Garbage
        collection calls this for its deletes before it lets savers reuse chunks again, so
        that a delete it issued cannot land after a new save referenced the chunk (a save's
        put stuck on a hung connection has nothing to do with that, and does not hold it)."""
        with self._abandoned_lock:
            return self._abandoned_lock.wait_for(
                lambda: not any(op in ops for op in self._abandoned.values()), timeout=timeout_s
            )

    def _landed(self, request: Request, made: int, error: BaseException, args: tuple) -> bool:
        """Whether a put's "already exists" is its own earlier attempt, which timed out or
        failed and then landed (an S3 500 may have been written), or one the HTTP client sent
        again below us (a reset after the body landed): ``path`` holds exactly its ``data``
        (success, not a conflict). Read back after a retry, and for an object only this
        writer writes (a manifest, an index, a lease: not ``shared``) on any conflict."""
        if made < 2 and request.shared:
            return False
        if not isinstance(self._translate("put", request.key, error), ObjectExistsError):
            return False
        path, data = args
        try:
            stored = bytes(self.backend.get(path))
        except Exception:  # noqa: BLE001 - unreadable: the conflict stands
            return False
        expected = b"".join(map(bytes, data)) if isinstance(data, list) else bytes(data)
        return stored == expected

    def _translate(
        self, op: str, key: str, exc: BaseException, unanswered: bool = False
    ) -> StorageError:
        """``exc`` as the store's error of ``op`` on ``key``; ``unanswered``: an attempt of
        the request got no answer (``StorageError.unanswered``)."""
        error = self._translated(op, key, exc)
        error.unanswered = error.unanswered or unanswered  # one passed through keeps its own
        return error

    def _translated(self, op: str, key: str, exc: BaseException) -> StorageError:
        where = self.url(key)
        if isinstance(exc, FileExistsError) or (
            isinstance(exc, OSError) and exc.errno == errno.EEXIST
        ):
            return ObjectExistsError(f"{where} already exists (objects are write-once)")
        if isinstance(exc, FileNotFoundError):
            if "bucket" in str(exc).lower():
                at = f" at {self.endpoint}" if self.backend.remote else ""
                return BucketNotFoundError(f"{op} {where}: the bucket does not exist{at}")
            return ObjectNotFoundError(f"{where} does not exist")
        if is_access_error(exc):
            if self.backend.remote:
                return StorageAccessError(
                    f"{op} {where}: access denied or no credentials at {self.endpoint} "
                    f"({describe(exc)})"
                )
            denied = getattr(exc, "filename", None)
            on = f" on {denied}" if denied and denied != where else ""
            return StorageAccessError(
                f"{op} {where}: permission denied{on} (running as {whoami()})"
            )
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return StorageFullError(f"{op} {where}: {_FULL_ERRNOS[exc.errno]}")
        if isinstance(exc, StorageError):
            return exc
        if op == "list" and isinstance(exc, KeyError) and self.backend.remote:
            # s3fs reading a page that says it is cut short and names no next page
            return StorageError(
                f"list {where}: {self.endpoint} answered a listing page s3fs cannot follow "
                f"(missing {exc}): the endpoint cut or garbled its listing"
            )
        return StorageError(f"{op} {where} failed: {describe(exc)}")

    # -- single requests --------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: Data,
        *,
        verify_readback: bool = False,
        hedged: bool = False,
        shared: bool = False,
    ) -> None:
        """Write ``key`` once; :class:`ObjectExistsError` if it is already there.

        ``data`` may be a list of buffers, written as their concatenation.
        Durable when it returns (fsynced on local paths). With ``verify_readback`` (or on a
        backend that does not enforce exclusive create) the object is read back and compared,
        so a writer that lost a race to another is told so rather than believing it won.
        ``hedged``: a put still running after the hedge delay is duplicated (both are exclusive
        creates of the same key: the one that lands second finds the object there).
        ``shared``: a content-addressed object other writers put too (a chunk): its "already
        exists" is the caller's to judge, not read back unless an earlier attempt may have
        landed (an object only this writer writes is read back on any conflict).
        """
        nbytes = sum(map(len, data)) if isinstance(data, list) else len(data)
        put = lambda: self._put(key, data, nbytes, verify_readback, shared)  # noqa: E731
        if hedged:
            self._hedged("put", nbytes, put)
        else:
            put()

    def _put(
        self, key: str, data: Data, nbytes: int, verify_readback: bool, shared: bool = False
    ) -> None:
        enforced = self.backend.enforces_create
        if not enforced and self.exists(key):
            raise ObjectExistsError(f"{self.url(key)} already exists (objects are write-once)")
        request = Request("put", key, nbytes, shared)
        self._request_as(request, self.backend.put_once, self.path(key), data)
        if verify_readback or not enforced:
            expected = b"".join(data) if isinstance(data, list) else bytes(data)
            if self.get(key) != expected:
                raise ObjectExistsError(
                    f"{self.url(key)} was written concurrently by another writer"
                )

    def get(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        *,
        hedged: bool = False,
        in_thread: bool = False,
        small: bool = False,
    ) -> bytes:
        """The bytes of ``key``, or of ``[start, end)`` of it; ``hedged``: duplicated when slow.
        ``in_thread``: the request runs in the calling thread with no per-attempt deadline, for
        a caller that runs it in a thread of its own and bounds it itself (the loader's replica
        reads): one thread hand-over less per request. ``small``: ``end`` is only a cap (a
        manifest's 64 MiB); the deadline is a small object's, not the cap's."""
        nbytes = 0 if small else None
        return self._get(self.backend.get, key, start, end, hedged, in_thread, nbytes)

    def get_view(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        *,
        hedged: bool = False,
        in_thread: bool = False,
    ):
        """``key`` (or ``[start, end)`` of it) as a read-only buffer; on local paths a memory
        map of the file's pages (no copy), elsewhere the bytes, as ``get`` returns them."""
        return self._get(self.backend.get_view, key, start, end, hedged, in_thread)

    def _get(
        self,
        read: Callable,
        key: str,
        start: int | None,
        end: int | None,
        hedged: bool,
        in_thread: bool,
        nbytes: int | None = None,
    ):
        if nbytes is None:
            nbytes = (end - (start or 0)) if end is not None else 0
        if hedged and in_thread:
            raise ValueError("a get is hedged or in_thread, not both (a hedge needs a deadline)")

        def get() -> Any:
            return self._request(
                "get", key, read, self.path(key), start, end, nbytes=nbytes, in_thread=in_thread
            )

        return self._hedged("get", nbytes, get) if hedged else get()

    def _hedged(self, op: str, nbytes: int, fn: Callable[[], R]) -> R:
        return self.hedger.call(fn, self._callers.submit, op=op, nbytes=nbytes)

    def size(self, key: str) -> int:
        return self._request("size", key, self.backend.size, self.path(key))

    def stat(self, key: str) -> tuple[int, str]:
        """``key``'s size and a token that changes when it is written again
        (``Backend.stat``); one request, counted as a size request."""
        return self._request("size", key, self.backend.stat, self.path(key))

    def exists(self, key: str, *, within_s: float | None = None) -> bool:
        """Whether ``key`` is stored; ``within_s``: the request ends within it (or within the
        store's own bound, if less), retries included."""
        policy = None
        if within_s is not None and within_s < self.retry.budget_s():
            policy = RetryPolicy.within(within_s, timeout_s=min(self.retry.timeout_s, within_s))
        request = Request("exists", key, policy=policy)
        return self._request_as(request, self.backend.exists, self.path(key))

    def refresh(self, key: str) -> None:
        """``key``'s modification time made now where the store can without a rewrite (a local
        or NFS file): a chunk a save found stored counts as young again for ``ckptstore gc
        --grace-s``. Elsewhere nothing; never an error."""
        self.backend.refresh(self.path(key))

    def modified(self, key: str) -> float:
        """When ``key`` was written, by the store's clock (seconds since the epoch, as coarse
        as ``clock_resolution_s``); for leases, which never compare it with a host's clock."""
        return self._request("modified", key, self.backend.modified, self.path(key))

    @property
    def clock_resolution_s(self) -> float:
        return self.backend.clock_resolution_s

    def list(self, prefix: str = "") -> list[str]:
        """Keys of every object below ``prefix``, sorted."""
        base = self.path(prefix.rstrip("/"))
        paths = self._request("list", prefix, self.backend.list, base)
        return sorted(self._key(p) for p in paths)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Key -> size of every object below ``prefix`` (one listing on object stores)."""
        base = self.path(prefix.rstrip("/"))
        found = self._request("list", prefix, self.backend.list_sizes, base)
        return {self._key(p): size for p, size in sorted(found.items())}

    def list_times(self, prefix: str = "") -> dict[str, float]:
        """Key -> modification time (by the store's clock) of every object below ``prefix``
        (one listing on object stores)."""
        base = self.path(prefix.rstrip("/"))
        found = self._request("list", prefix, self.backend.list_times, base)
        return {self._key(p): when for p, when in sorted(found.items())}

    def _key(self, path: str) -> str:
        return path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path

    def stale_temporaries(self, *, older_than_s: float, now: float | None = None) -> list[str]:
        """Keys of put temporaries (local: ``<key>.tmp-<uuid>``) not modified for
        ``older_than_s``: left by a writer that died mid-put. Empty where puts leave none. Only
        those of this store's own layout (a key at its top, or under one of its prefixes): a
        store nested in a directory below is not this store's (a gc of a parent directory
        deleted a nested store's temporaries)."""
        paths = self.backend.stale_temporaries(self.root, older_than_s=older_than_s, now=now)
        keys = (self._key(p) for p in paths)
        return sorted(k for k in keys if "/" not in k or k.split("/", 1)[0] in _LAYOUT)

    def copy(self, src: str, dst: str) -> None:
        """Write ``dst`` once with ``src``'s bytes, copied by the store itself where it can
        (:class:`ObjectExistsError` if ``dst`` exists; ``src`` missing: ObjectNotFoundError)."""
        self._request("copy", dst, self.backend.copy_once, self.path(src), self.path(dst))

    def delete(self, key: str) -> None:
        """Remove ``key``; a key that is already gone is not an error."""
        self._request("delete", key, self.backend.delete, self.path(key))

    # -- many requests ----------------------------------------------------------------------

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Run a blocking store call such as ``store.get`` in the background."""
        return self._callers.submit(fn, *args)

    def map(
        self,
        fn: Callable[[T], R],
        items: Iterable[T],
        *,
        max_concurrency: int | None = None,
        drain: bool = False,
    ) -> Iterator[R]:
        """``fn`` over ``items`` with at most ``max_concurrency`` calls in flight, in order.

        A sliding window: the next call starts as soon as the oldest completes. The first error
        cancels what has not started and is raised; with ``drain``, only once the calls already
        running have ended (each bounded by its requests' deadlines), so that a failed batch of
        writes leaves nothing writing.
        """
        window = max_concurrency or self.max_concurrency
        pending: list[Future[R]] = []
        try:
            for item in items:
                pending.append(self._callers.submit(fn, item))
                if len(pending) >= window:
                    yield _oldest(pending)
            while pending:
                yield _oldest(pending)
        finally:
            running = [future for future in pending if not future.cancel()]
            if drain:
                futures_wait(running)

    def check_reachable(self) -> None:
        """Raise a clear error now if the store cannot be listed (bad bucket, credentials)."""
        self.list("")


def _oldest(pending: list[Future[R]]) -> R:
    """The oldest call's result, taken off ``pending`` once it has ended: a wait interrupted
    (SIGTERM's SystemExit, Ctrl-C) leaves it there for ``map`` to drain."""
    result = pending[0].result()
    pending.pop(0)
    return result


def _error_kind(exc: BaseException) -> str:
    """The outcome label of a request that raised ``exc``."""
    for cls, kind in (
        (ObjectNotFoundError, "not_found"),
        (ObjectExistsError, "exists"),
        (StorageTimeoutError, "timeout"),
        (StorageAccessError, "access"),
        (StorageFullError, "no_space"),
    ):
        if isinstance(exc, cls):
            return kind
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno in _FULL_ERRNOS:
        return "no_space"
    if cause is not None and is_transient(cause):
        return "transient"  # failed after its last retry
    return "error"
