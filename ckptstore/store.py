"""Object-store access over fsspec: the one place where bytes leave or enter storage.

Every request runs on a worker thread under a deadline and is retried with exponential backoff
and full jitter when its error is transient (timeouts, connection resets, 5xx, SlowDown). Puts are
write-once: local files are written to a temporary name, fsynced and hard-linked into place
(atomic, fails if the name exists); S3 uses ``If-None-Match: *``; memory uses exclusive create.
A hung attempt is abandoned after its deadline (its daemon thread is left to finish on its own),
and a whole request, retries included, ends within ``RetryPolicy.total_s`` (30 s by default, more
for large transfers) with an error naming the endpoint, so no caller waits long for a store that
does not answer.
"""

from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ckptstore.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageAccessError,
    StorageError,
    StorageTimeoutError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# Backends whose exclusive create is enforced by the backend itself.
_ENFORCED_CREATE_PROTOCOLS = {"file", "local", "memory", "s3", "s3a"}
_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    errno.EREMOTEIO,
}
TMP_MARK = ".tmp-"  # local puts write ``<key>.tmp-<uuid>`` and link it into place
_MUTATING_OPS = frozenset({"put", "delete"})
# No retry starts with less than this (or a quarter of an attempt's deadline) left of its request.
_MIN_ATTEMPT_S = 0.5
# Marks the log record of one failed attempt: the request's own error, if it comes to that, tells
# the outcome (``ckptstore`` shows these only with -v).
_RETRY_LOG = {"ckptstore_retry": True}
_S3_PROTOCOLS = ("s3", "s3a")
_TRANSIENT_NAME_HINTS = ("Timeout", "Connection", "ServerDisconnected", "SlowDown", "Throttl")


@dataclass(kw_only=True)
class RetryPolicy:
    """How a request is retried, how long each attempt may take and how long all of them may.

    With the defaults a request to an endpoint that never answers fails after 30 s (three
    attempts of 10 s), a request that fails quickly and transiently is tried up to 5 times.
    """

    attempts: int = 5
    """Attempts per request, the first included."""
    base_delay_s: float = 0.05
    """Backoff before the second attempt; doubles each time, with full jitter."""
    max_delay_s: float = 2.0
    """Upper bound of one backoff."""
    timeout_s: float = 10.0
    """Deadline of one attempt of a small request."""
    total_s: float | None = 30.0
    """Deadline of a whole small request: all its attempts, backoffs included, end within this
    (None: only ``attempts`` bounds it). No attempt starts once it has passed, and the last
    one is cut short to end by it."""
    min_bytes_per_s: float = 2 * 2**20
    """Large transfers get ``size / min_bytes_per_s`` more seconds, per attempt and in total."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.timeout_s <= 0:
            raise ValueError(f"RetryPolicy.timeout_s must be > 0, got {self.timeout_s}")
        if self.total_s is not None and self.total_s <= 0:
            raise ValueError(f"RetryPolicy.total_s must be > 0 or None, got {self.total_s}")

    @classmethod
    def within(cls, total_s: float, **kwargs: Any) -> RetryPolicy:
        """The default policy with every request ending within ``total_s`` (large transfers
        get more); an attempt may take the default ``timeout_s`` or ``total_s`` if less."""
        kwargs.setdefault("timeout_s", min(cls.timeout_s, total_s))
        return cls(total_s=total_s, **kwargs)

    def deadline_s(self, nbytes: int = 0) -> float:
        """Deadline of one attempt of a request moving ``nbytes``."""
        return self.timeout_s + nbytes / self.min_bytes_per_s

    def budget_s(self, nbytes: int = 0) -> float:
        """The longest a request moving ``nbytes`` takes, all attempts and backoffs included."""
        extra = nbytes / self.min_bytes_per_s
        if self.total_s is not None:
            return self.total_s + extra
        return self.attempts * (self.timeout_s + extra) + (self.attempts - 1) * self.max_delay_s

    def backoff_s(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2**attempt))


class ElasticPool:
    """Daemon worker threads that grow on demand and retire when idle.

    Unlike ``concurrent.futures.ThreadPoolExecutor`` a worker stuck in a hung call never blocks
    interpreter exit, and never starves later calls: a new worker starts when none is idle.
    """

    def __init__(self, name: str, idle_timeout_s: float = 10.0, nice: int = 0) -> None:
        self._name = name
        self._idle_timeout_s = idle_timeout_s
        self._nice = niced(nice)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._count = 0

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        future: Future[R] = Future()
        with self._lock:
            self._tasks.put((future, fn, args))
            if self._idle > 0:
                self._idle -= 1
                return future
            self._count += 1
            index = self._count
        threading.Thread(target=self._work, name=f"{self._name}-{index}", daemon=True).start()
        return future

    def _work(self) -> None:
        set_thread_nice(self._nice)
        while True:
            try:
                future, fn, args = self._tasks.get(timeout=self._idle_timeout_s)
            except queue.Empty:
                with self._lock:
                    # A task may have been queued for us after the timeout fired.
                    if not self._tasks.empty():
                        continue
                    self._idle -= 1
                    return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(exc)
            # An idle worker must not keep its last task's arguments (a chunk's bytes) alive.
            del future, fn, args
            with self._lock:
                self._idle += 1


def niced(nice: int) -> int | None:
    """The nice value ``nice`` above the calling thread's, for threads to be started later
    (None where there is nothing to change or no way to)."""
    if not nice:
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)
    except (AttributeError, OSError):
        return None


def set_thread_nice(value: int | None) -> None:
    """Give the calling thread nice value ``value`` (Linux schedules threads apart), so that it
    yields the cores to the training loop's threads when they compete; None does nothing."""
    if value is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)
    except OSError as exc:
        logger.debug("cannot set the nice value of %s: %s", threading.current_thread(), exc)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, resets, throttling, server errors."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError)):
            return False
        if isinstance(exc, (TimeoutError, ConnectionError)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        name = type(exc).__name__
        if name == "NoCredentialsError":
            return False
        if any(hint in name for hint in _TRANSIENT_NAME_HINTS):
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = str(response.get("Error", {}).get("Code", ""))
            if status >= 500 or code in {"SlowDown", "Throttling", "RequestTimeout"}:
                return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _is_access_error(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, PermissionError) or type(exc).__name__ in {
            "NoCredentialsError",
            "PartialCredentialsError",
            "InvalidAccessKeyId",
        }:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _is_precondition_failed(exc: BaseException) -> bool:
    """True if ``exc`` (or its cause) is an S3 ``412 PreconditionFailed`` answer."""
    cause = exc.__cause__
    response = getattr(cause, "response", None) if cause is not None else None
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code == "PreconditionFailed" or status == 412


_MEMORY_LOCK = threading.Lock()


class _BufferBody(io.BytesIO):
    """An S3 request body that reads a buffer in place.

    botocore wraps a bytes body in a ``BytesIO``, and aiohttp sizes that through
    ``getbuffer()``, which makes the BytesIO copy the whole body (under the GIL) for as long as
    the upload runs; a bytes body also has to be made first, another copy under the GIL. This
    body serves any buffer (a chunk's numpy array) with small reads: ``getbuffer()`` is a view,
    ``len()`` and slices are what s3fs asks of a body."""

    def __init__(self, data) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, key: slice) -> memoryview:
        return self._view[key]

    def getbuffer(self) -> memoryview:
        return self._view[:]  # a new view: callers release theirs

    def getvalue(self) -> bytes:
        return self._view.tobytes()

    def read(self, size: int | None = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else self._pos + size
        out = self._view[self._pos : end].tobytes()
        self._pos += len(out)
        return out

    def read1(self, size: int | None = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = min(out.nbytes, self._view.nbytes - self._pos)
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _raise_unless_gone(exc: OSError) -> None:
    """``os.walk``'s error handler: a directory that does not exist (or was removed while
    walking) holds nothing; any other error (permission denied, I/O) is raised."""
    if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        raise exc


class Backend:
    """Raw single-attempt access to one fsspec filesystem; paths are absolute for that fs."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.is_memory = isinstance(fs, MemoryFileSystem)
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.enforces_create = any(p in _ENFORCED_CREATE_PROTOCOLS for p in protocols)
        self._is_s3 = any(p in ("s3", "s3a") for p in protocols)

    def put_once(self, path: str, data: bytes | memoryview | list) -> None:
        if self.is_local:
            self._put_local(path, data if isinstance(data, list) else [data])
            return
        if isinstance(data, list):
            data = data[0] if len(data) == 1 else b"".join(data)
        if self.is_memory:
            # fsspec's own exclusive create scans every key; the store is one dict in-process.
            with _MEMORY_LOCK:
                if self.fs._strip_protocol(path) in self.fs.store:
                    raise FileExistsError(path)
                self.fs.pipe_file(path, bytes(data))
        elif self._is_s3:
            try:
                self.fs.pipe_file(path, _BufferBody(data), mode="create")
            except OSError as exc:
                # If-None-Match is the put's only condition; s3fs knows its failure as
                # FileExistsError only when the server names the condition (SeaweedFS does not).
                if not isinstance(exc, FileExistsError) and _is_precondition_failed(exc):
                    raise FileExistsError(errno.EEXIST, f"{path} already exists") from exc
                raise
        else:
            self.fs.pipe_file(path, data if isinstance(data, bytes) else bytes(data), mode="create")

    def _put_local(self, path: str, parts: list) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(tmp, path)  # atomic, fails with EEXIST: never clobbers
        finally:
            # Also after a failed write (a full disk): a temporary left behind keeps it full.
            os.unlink(tmp)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if self.is_local:
            with open(path, "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - (start or 0))
        return self.fs.cat_file(path, start=start, end=end)

    def get_view(self, path: str, start: int | None = None, end: int | None = None):
        """The object (or ``[start, end)`` of it) as a read-only buffer: on local paths a
        pre-faulted memory map of the file's pages (no copy and no fresh pages), elsewhere the
        bytes. Like ``get``, a range past the end of the object is cut short."""
        if not self.is_local:
            return self.get(path, start, end)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            lo = min(start or 0, size)
            hi = size if end is None else max(lo, min(end, size))
            if hi == lo:
                return b""
            base = lo - lo % mmap.ALLOCATIONGRANULARITY
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(f.fileno(), hi - base, flags=flags, prot=mmap.PROT_READ, offset=base)
        return memoryview(m)[lo - base :]

    def size(self, path: str) -> int:
        if self.is_local:
            return os.stat(path).st_size
        # Not from s3fs's listing cache: a chunk another process deleted must not look stored.
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def exists(self, path: str) -> bool:
        if self.is_local:
            try:
                os.stat(path)  # not os.path.exists: that says False where access is denied
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def list(self, path: str) -> list[str]:
        """Every object below ``path`` (recursive), as absolute fs paths; an error where a
        directory cannot be read (a store that only looks empty would be worse)."""
        try:
            if self.is_local:
                out = []
                for dirpath, _, files in os.walk(path, onerror=_raise_unless_gone):
                    out.extend(os.path.join(dirpath, f) for f in files if TMP_MARK not in f)
                return out
            self.fs.invalidate_cache(path)
            # Some stores (SeaweedFS) keep a directory after its last object is deleted, and
            # s3fs's find() of an emptied prefix returns that directory despite withdirs=False.
            found = self.fs.find(path, withdirs=False, detail=True)
            return [name for name, info in found.items() if info.get("type") != "directory"]
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise
            return []

    def delete(self, path: str) -> None:
        if self.is_local:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        else:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass


class Store:
    """A prefix in an object store, addressed by relative keys such as ``chunks/ab/abcd...``.

    ``uri`` is a local path, ``file://``, ``memory://``, ``s3://bucket/prefix`` or anything else
    fsspec resolves. Credentials and endpoints come from ``storage_options`` or the standard
    environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int = 16,
        faults: Any = None,
        thread_nice: int = 0,
    ) -> None:
        uri = os.fspath(uri)
        if not uri:
            raise ValueError("store URI is empty")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.retry = retry or RetryPolicy()
        options = dict(storage_options or {})
        if fsspec.core.split_protocol(uri)[0] in _S3_PROTOCOLS:
            options = _bounded_s3_options(options, self.retry)
        try:
            fs, root = fsspec.core.url_to_fs(uri, **options)
        except (ValueError, ImportError) as exc:
            raise ValueError(f"cannot open store {uri!r}: {exc}") from exc
        self.uri = uri
        self.root = root.rstrip("/")
        # Where requests go, for messages: the S3 endpoint URL, the directory of a local store.
        self.endpoint = describe_endpoint(fs, self.root)
        self._remote = not isinstance(fs, (LocalFileSystem, MemoryFileSystem))
        self.max_concurrency = max_concurrency
        backend = Backend(fs)
        if faults is not None:
            from ckptstore.faults import FaultyBackend

            backend = FaultyBackend(backend, faults)
        self.backend = backend
        if not 0 <= thread_nice <= 19:
            raise ValueError(f"thread_nice must be within [0, 19], got {thread_nice}")
        self._abandoned: set[Future] = set()
        self._abandoned_lock = threading.Condition()
        self._workers = ElasticPool(f"ckptstore-io[{uri}]", nice=thread_nice)
        self._callers = ElasticPool(f"ckptstore-req[{uri}]", nice=thread_nice)

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    @property
    def is_local(self) -> bool:
        return self.backend.is_local

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def url(self, key: str) -> str:
        """A readable name of ``key`` for messages."""
        return f"{self.uri.rstrip('/')}/{key}"

    # -- the request loop -------------------------------------------------------------------

    def _request(self, op: str, key: str, fn: Callable[..., R], *args: Any, nbytes: int = 0) -> R:
        policy = self.retry
        last: BaseException | None = None
        budget = policy.budget_s(nbytes)
        end = time.monotonic() + budget
        floor = min(_MIN_ATTEMPT_S, policy.timeout_s / 4)
        made = 0
        for attempt in range(policy.attempts):
            if attempt:
                delay = policy.backoff_s(attempt - 1)
                if time.monotonic() + delay + floor >= end:
                    break  # no time left for another attempt: the request's deadline is near
                time.sleep(delay)
            deadline = min(policy.deadline_s(nbytes), end - time.monotonic())
            if made and deadline < floor:
                break
            made += 1
            future = self._workers.submit(fn, *args)
            try:
                # exception(), not result(): re-raising the worker's error here would add this
                # thread's frames to its traceback, and with them the caller's locals (a chunk's
                # bytes) to any reference cycle that traceback is part of (fsspec's sync() makes
                # one for every error), to be freed only by the cyclic GC.
                error = future.exception(timeout=deadline)
            except TimeoutError:
                if not future.cancel() and op in _MUTATING_OPS:
                    self._track_abandoned(future)
                last = StorageTimeoutError(
                    f"{op} {self.url(key)}: no answer within {deadline:.1f}s{self._from()}"
                )
                logger.warning(
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
            if not is_transient(error):
                raise self._translate(op, key, error) from error
            last = error
            logger.warning(
                "%s %s: attempt %d failed (%s)",
                op,
                self.url(key),
                made,
                error,
                extra=_RETRY_LOG,
            )
        tries = f"{made} attempt{'s' if made != 1 else ''}"
        if isinstance(last, StorageTimeoutError):
            waited = budget - max(0.0, end - time.monotonic())
            raise StorageTimeoutError(
                f"{op} {self.url(key)}: no answer within {waited:.1f}s{self._from()} ({tries})"
            ) from last
        where = f" (endpoint {self.endpoint})" if self._remote else ""
        raise StorageError(
            f"{op} {self.url(key)} failed after {tries}{where}: {_describe(last)}"
        ) from last

    def _from(self) -> str:
        """`` from <endpoint>`` for a remote store (messages about requests with no answer)."""
        return f" from {self.endpoint}" if self._remote else ""

    def _track_abandoned(self, future: Future) -> None:
        """Remember a put or delete that outlived its deadline: it may still land."""
        with self._abandoned_lock:
            self._abandoned.add(future)
        future.add_done_callback(self._forget_abandoned)

    def _forget_abandoned(self, future: Future) -> None:
        with self._abandoned_lock:
            self._abandoned.discard(future)
            if not self._abandoned:
                self._abandoned_lock.notify_all()

    def settle(self, timeout_s: float) -> bool:
        """Wait until every put or delete this store gave up on has really ended; False if
        some are still running after ``timeout_s``.

        A request abandoned at its deadline keeps running and may land later. Garbage
        collection calls this before it lets savers reuse chunks again, so that a delete it
        issued cannot land after a new save referenced the chunk."""
        with self._abandoned_lock:
            return self._abandoned_lock.wait_for(lambda: not self._abandoned, timeout=timeout_s)

    def _translate(self, op: str, key: str, exc: BaseException) -> BaseException:
        where = self.url(key)
        if isinstance(exc, FileExistsError) or (
            isinstance(exc, OSError) and exc.errno == errno.EEXIST
        ):
            return ObjectExistsError(f"{where} already exists (objects are write-once)")
        if isinstance(exc, FileNotFoundError):
            if "bucket" in str(exc).lower():
                return ObjectNotFoundError(f"{op} {where}: the bucket does not exist")
            return ObjectNotFoundError(f"{where} does not exist")
        if _is_access_error(exc):
            if self._remote:
                return StorageAccessError(
                    f"{op} {where}: access denied or no credentials at {self.endpoint} "
                    f"({_describe(exc)})"
                )
            denied = getattr(exc, "filename", None)
            on = f" on {denied}" if denied and denied != where else ""
            return StorageAccessError(
                f"{op} {where}: permission denied{on} (running as {_whoami()})"
            )
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return StorageError(f"{op} {where}: no space left on device")
        if isinstance(exc, StorageError):
            return exc
        return StorageError(f"{op} {where} failed: {_describe(exc)}")

    # -- single requests --------------------------------------------------------------------

    def put(
        self, key: str, data: bytes | memoryview | list, *, verify_readback: bool = False
    ) -> None:
        """Write ``key`` once; :class:`ObjectExistsError` if it is already there.

        ``data`` may be a list of buffers, written as their concatenation.
        Durable when it returns (fsynced on local paths). With ``verify_readback`` (or on a
        backend that does not enforce exclusive create) the object is read back and compared,
        so a writer that lost a race to another is told so rather than believing it won.
        """
        enforced = self.backend.enforces_create
        if not enforced and self.exists(key):
            raise ObjectExistsError(f"{self.url(key)} already exists (objects are write-once)")
        nbytes = sum(map(len, data)) if isinstance(data, list) else len(data)
        self._request("put", key, self.backend.put_once, self.path(key), data, nbytes=nbytes)
        if verify_readback or not enforced:
            expected = b"".join(data) if isinstance(data, list) else bytes(data)
            if self.get(key) != expected:
                raise ObjectExistsError(
                    f"{self.url(key)} was written concurrently by another writer"
                )

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``key``, or of ``[start, end)`` of it."""
        nbytes = (end - (start or 0)) if end is not None else 0
        return self._request(
            "get", key, self.backend.get, self.path(key), start, end, nbytes=nbytes
        )

    def get_view(self, key: str, start: int | None = None, end: int | None = None):
        """``key`` (or ``[start, end)`` of it) as a read-only buffer; on local paths a memory
        map of the file's pages (no copy), elsewhere the bytes, as ``get`` returns them."""
        nbytes = (end - (start or 0)) if end is not None else 0
        return self._request(
            "get", key, self.backend.get_view, self.path(key), start, end, nbytes=nbytes
        )

    def size(self, key: str) -> int:
        return self._request("size", key, self.backend.size, self.path(key))

    def exists(self, key: str) -> bool:
        return self._request("exists", key, self.backend.exists, self.path(key))

    def list(self, prefix: str = "") -> list[str]:
        """Keys of every object below ``prefix``, sorted."""
        base = self.path(prefix.rstrip("/"))
        paths = self._request("list", prefix, self.backend.list, base)
        cut = len(self.root) + 1
        return sorted(p[cut:] if p.startswith(self.root + "/") else p for p in paths)

    def stale_temporaries(self, *, older_than_s: float) -> list[str]:
        """Keys of local put temporaries (``<key>.tmp-<uuid>``) not modified for
        ``older_than_s``: left by a writer that died mid-put. Always empty elsewhere."""
        if not self.is_local:
            return []
        cut = len(self.root) + 1
        now = time.time()
        out = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if TMP_MARK not in name:
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if now - os.stat(path).st_mtime >= older_than_s:
                        out.append(path[cut:])
                except FileNotFoundError:
                    continue
        return sorted(out)

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
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            running = [future for future in pending if not future.cancel()]
            if drain:
                futures_wait(running)

    def check_reachable(self) -> None:
        """Raise a clear error now if the store cannot be listed (bad bucket, credentials)."""
        self.list("")


def describe_endpoint(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """A readable name of where ``fs``'s requests go: the endpoint URL of an S3 filesystem
    (from its options or ``AWS_ENDPOINT_URL[_S3]``; ``AWS S3`` if none), a local directory."""
    if isinstance(fs, LocalFileSystem):
        return root
    if isinstance(fs, MemoryFileSystem):
        return "memory"
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if any(p in _S3_PROTOCOLS for p in protocols):
        client_kwargs = getattr(fs, "client_kwargs", None) or {}
        return (
            getattr(fs, "endpoint_url", None)
            or client_kwargs.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "AWS S3"
        )
    return f"{protocols[0]}://"


def _bounded_s3_options(options: dict[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """``options`` with botocore's connect and read timeouts no longer than an attempt's
    deadline and botocore's own retries off (this module retries), where the caller set none.

    Otherwise botocore waits 60 s per read and retries 4 times, inside each attempt and inside
    s3fs's own 5 retries: an attempt abandoned at its deadline would go on in the background
    for many minutes, holding a pooled connection. Bounded, it ends within about 5 x
    (connect + read timeout)."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", min(5.0, policy.timeout_s))
    config.setdefault("read_timeout", policy.timeout_s)
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**options, "config_kwargs": config}


def _whoami() -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(os.geteuid()).pw_name!r}"
    except (ImportError, KeyError, AttributeError):
        return f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "this user"


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
