"""Storage backends: single-attempt access to the objects of one store, one class per URL scheme.

A backend knows how its scheme stores bytes (write-once puts, ranged reads, listing); it neither
retries nor waits: :class:`~ckptstore.store.Store` runs every call under a deadline and retries
it. Paths are absolute for the backend (``<root>/<key>``). :func:`open_backend` picks the class
from the URL's scheme: local paths and ``file://``, ``memory://``, ``s3://`` (and ``s3a://``),
and any other fsspec protocol through its generic filesystem interface.
"""

from __future__ import annotations

import datetime
import errno
import inspect
import io
import mmap
import os
import re
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import fsspec

from ckptstore.errors import (
    ObjectNotRegularError,
    ObjectOutsideRootError,
    StorageError,
    UnsafeObjectError,
)
from ckptstore.store.processes import machine_tag, pid_gone
from ckptstore.store.retry import RetryPolicy, describe, is_precondition_failed

TMP_MARK = ".tmp-"  # local puts write ``<key>.tmp-<machine>-<pid>-<uuid>``, then link it
# The shape a put's temporary has: its writer's machine tag and pid (none before 2026-12-02).
_TEMPORARY = re.compile(r".+\.tmp-(?:([0-9a-f]{8})-([0-9]{1,10})-)?[0-9a-f]{32}")
S3_PROTOCOLS = ("s3", "s3a")

Data = bytes | memoryview | list
"""What a put writes: one buffer, or a list of buffers written as their concatenation."""


class Backend(ABC):
    """The operations a :class:`~ckptstore.store.Store` needs of a storage service."""

    enforces_create: bool = True
    """A put of an existing path fails (rather than overwriting it) by the service's own rule."""
    is_local: bool = False
    """Paths are files of this machine's file system."""
    remote: bool = True
    """Requests leave the process (messages name the endpoint)."""
    endpoint: str = ""
    """Where requests go, for messages: an S3 endpoint URL, a local directory."""
    clock_resolution_s: float = 0.0
    """How coarse :meth:`modified` times are (S3's ``LastModified``: whole seconds)."""
    requests_end_with_process: bool = False
    """No request of a process can land after that process is gone (a disk of this machine;
    a request sent over a network may be applied later)."""

    @abstractmethod
    def put_once(self, path: str, data: Data) -> None:
        """Write ``path`` once; ``FileExistsError`` if it exists. Durable when it returns."""

    @abstractmethod
    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``path`` (or ``[start, end)`` of it, cut short at its end)."""

    def get_view(self, path: str, start: int | None = None, end: int | None = None) -> Any:
        """Like :meth:`get`, as any read-only buffer (a backend may map it without a copy)."""
        return self.get(path, start, end)

    def copy_once(self, src: str, dst: str) -> None:
        """Write ``dst`` once with the bytes ``src`` holds (``FileExistsError`` if it exists).
        A remote store copies them itself: the bytes a read of ``src`` answered may not be its
        bytes (a transport that corrupts reads), and a copy must keep the store's own."""
        self.put_once(dst, self.get(src))

    @abstractmethod
    def size(self, path: str) -> int: ...

    def stat(self, path: str) -> tuple[int, str]:
        """The size of ``path`` and a token that changes when the object is written again (an
        ETag, a modification time): a cache keyed by it never serves an old object's bytes."""
        return self.size(path), repr(self.modified(path))

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def modified(self, path: str) -> float:
        """When ``path`` was written, in seconds since the epoch by the storage's own clock
        (not this host's): leases compare such times only with each other."""

    @abstractmethod
    def list(self, path: str) -> list[str]:
        """Every object below ``path`` (recursive), as absolute paths; [] if there is none."""

    def list_sizes(self, path: str) -> dict[str, int]:
        """``list``, with each object's size (from the listing where the store gives it)."""
        return {p: self.size(p) for p in self.list(path)}

    def list_times(self, path: str) -> dict[str, float]:
        """``list``, with each object's :meth:`modified` time (from the listing where the
        store gives it)."""
        return {p: self.modified(p) for p in self.list(path)}

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove ``path``; one already gone is not an error."""

    def refresh(self, path: str) -> None:
        """Make ``path``'s :meth:`modified` time now where that takes no rewrite (a local
        file's); elsewhere nothing. Best effort."""
        return None

    def stale_temporaries(
        self, root: str, *, older_than_s: float, now: float | None = None
    ) -> list[str]:
        """Paths below ``root`` of put temporaries left by a writer that died mid-put (aged
        against ``now``, the store's clock, else this host's)."""
        return []

    @abstractmethod
    def reopen(self) -> Backend:
        """The same backend opened afresh, as a new process must (no shared clients)."""


# What an fsspec listing calls the token that changes when an object is written again.
_VERSIONS = (
    "ETag", "etag", "VersionId", "version_id", "generation",
    "LastModified", "last_modified", "updated", "mtime", "created",
)  # fmt: skip


def _time_of(info: dict[str, Any]) -> float | None:
    """An fsspec listing entry's modification time (s3fs: ``LastModified``), if it has one."""
    for name in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None


class FsspecBackend(Backend):
    """Any fsspec filesystem; exclusive create as far as the filesystem offers it (the store
    reads a put back where it does not)."""

    enforces_create = False

    def __init__(
        self, fs: fsspec.AbstractFileSystem, *, uri: str, root: str, options: dict[str, Any]
    ) -> None:
        self.fs = fs
        self.uri = uri
        self.root = root
        self.options = options
        self.endpoint = self._endpoint()

    def _endpoint(self) -> str:
        return f"{_protocols(self.fs)[0]}://"

    def reopen(self) -> Backend:
        fs, _ = fsspec.core.url_to_fs(self.uri, **self.options)
        return type(self)(fs, uri=self.uri, root=self.root, options=self.options)

    def put_once(self, path: str, data: Data) -> None:
        data = _one_buffer(data)
        self.fs.pipe_file(path, data if isinstance(data, bytes) else bytes(data), mode="create")

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        # Not from a listing cache either: s3fs answers a whole-object read of a key under a
        # prefix listed before it was written "not found", without a request.
        self.fs.invalidate_cache(path)
        if start is not None and end is not None and end <= start:
            self.size(path)  # an empty range of a missing object is still not found
            return b""  # S3 answers a whole object to a range it cannot express
        try:
            data = self.fs.cat_file(path, start=start, end=end)
        except OSError as exc:
            # S3 answers a range past the object's end 416 (EINVAL; an empty object: any
            # range) where a file's read is short; so is this.
            if exc.errno == errno.EINVAL and start is not None and start >= self.size(path):
                return b""
            raise
        if data is None:
            # fsspec's sync() answers None for a request its event loop dropped unfinished,
            # as it does while the interpreter exits.
            raise StorageError(f"get {path}: the S3 client stopped before it answered")
        return data

    def size(self, path: str) -> int:
        # Not from a listing cache: a chunk another process deleted must not look stored.
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def stat(self, path: str) -> tuple[int, str]:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        version = next((info[k] for k in _VERSIONS if info.get(k) is not None), "")
        return int(info["size"]), str(version)

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def modified(self, path: str) -> float:
        self.fs.invalidate_cache(path)
        return self.fs.modified(path).timestamp()

    def list(self, path: str) -> list[str]:
        return list(self._found(path))

    def list_sizes(self, path: str) -> dict[str, int]:
        return {name: int(info.get("size") or 0) for name, info in self._found(path).items()}

    def list_times(self, path: str) -> dict[str, float]:
        found = self._found(path)
        times = {name: _time_of(info) for name, info in found.items()}
        return {n: t if t is not None else self.modified(n) for n, t in times.items()}

    def _found(self, path: str) -> dict[str, dict[str, Any]]:
        try:
            self.fs.invalidate_cache(path)
            # Some stores (SeaweedFS) keep a directory after its last object is deleted, and
            # s3fs's find() of an emptied prefix returns that directory despite withdirs=False.
            found = self.fs.find(path, withdirs=False, detail=True)
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise
            self._listing_missed(path, exc)
            return {}
        return {name: info for name, info in found.items() if info.get("type") != "directory"}

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def _listing_missed(self, path: str, exc: FileNotFoundError) -> None:
        """A listing of ``path`` found nothing there (a prefix nothing was written under)."""


class S3Backend(FsspecBackend):
    """S3 and S3-compatible services through s3fs; puts are ``If-None-Match: *`` creates."""

    enforces_create = True
    clock_resolution_s = 1.0

    def __init__(
        self, fs: fsspec.AbstractFileSystem, *, uri: str, root: str, options: dict[str, Any]
    ) -> None:
        super().__init__(fs, uri=uri, root=root, options=options)
        # s3fs retries a throttled or timed-out request itself with the body it already read
        # to its end (0 of N bytes sent, then a wait for the read timeout): the store retries.
        fs.retries = 1

    def _listing_missed(self, path: str, exc: FileNotFoundError) -> None:
        """S3 lists an empty prefix as empty: a listing answered 404 (not NoSuchBucket) came
        from something else answering HTTP at the endpoint (a web server, another service's
        port), which must not pass for an empty store (a job would start afresh)."""
        raise StorageError(
            f"list {path}: {self.endpoint} answered 'not found' to a listing "
            f"({describe(exc.__cause__ or exc)}), which no S3 service does: is it an S3 "
            "endpoint (the right host and port)?"
        ) from exc

    def copy_once(self, src: str, dst: str) -> None:
        self.fs.invalidate_cache(dst)
        if self.fs.exists(dst):
            raise FileExistsError(errno.EEXIST, f"{dst} already exists")
        self.fs.copy(src, dst)  # CopyObject: the bytes never leave the store

    def _endpoint(self) -> str:
        client_kwargs = getattr(self.fs, "client_kwargs", None) or {}
        return (
            getattr(self.fs, "endpoint_url", None)
            or client_kwargs.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "AWS S3"
        )

    def put_once(self, path: str, data: Data) -> None:
        try:
            self.fs.pipe_file(path, _BufferBody(_one_buffer(data)), mode="create")
        except OSError as exc:
            # If-None-Match is the put's only condition; s3fs knows its failure as
            # FileExistsError only when the server names the condition (SeaweedFS does not).
            if not isinstance(exc, FileExistsError) and is_precondition_failed(exc):
                raise FileExistsError(errno.EEXIST, f"{path} already exists") from exc
            raise


_MEMORY_LOCK = threading.Lock()


class MemoryBackend(FsspecBackend):
    """fsspec's process-wide memory filesystem (tests, benchmarks)."""

    enforces_create = True
    remote = False

    def _endpoint(self) -> str:
        return "memory"

    def put_once(self, path: str, data: Data) -> None:
        data = _one_buffer(data)
        # fsspec's own exclusive create scans every key; the store is one dict in-process.
        with _MEMORY_LOCK:
            if self.fs._strip_protocol(path) in self.fs.store:
                raise FileExistsError(path)
            self.fs.pipe_file(path, bytes(data))

    # The store is one dict shared by every thread: a listing iterates it, so no put or
    # delete may change it meanwhile ("dictionary changed size during iteration").
    def list(self, path: str) -> list[str]:
        with _MEMORY_LOCK:
            return super().list(path)

    def list_sizes(self, path: str) -> dict[str, int]:
        with _MEMORY_LOCK:
            return super().list_sizes(path)

    def list_times(self, path: str) -> dict[str, float]:
        with _MEMORY_LOCK:
            return super().list_times(path)

    def delete(self, path: str) -> None:
        with _MEMORY_LOCK:
            super().delete(path)


class LocalBackend(FsspecBackend):
    """Files of a local directory: puts are written to a temporary name, fsynced and hard-linked
    into place (atomic, fails if the name exists); reads may be memory maps."""

    enforces_create = True
    is_local = True
    remote = False

    def _endpoint(self) -> str:
        self.requests_end_with_process = on_local_disk(self.root)
        self._real_root = os.path.realpath(self.root)
        return self.root

    def _inside(self, path: str) -> str:
        """``path``, unless a link makes it lead out of the store's root: a hostile store's
        link is never followed (to read a file of the host, or to write or delete one)."""
        real = os.path.realpath(path)
        if real != path and os.path.commonpath((real, self._real_root)) != self._real_root:
            raise ObjectOutsideRootError(
                f"{path} leads outside the store's root {self.root} (to {real}) through a "
                "link: not followed"
            )
        return path

    def put_once(self, path: str, data: Data) -> None:
        directory = os.path.dirname(self._inside(path))
        tag = machine_tag()
        writer = f"{tag}-{os.getpid()}-" if tag else ""
        tmp = f"{path}{TMP_MARK}{writer}{uuid.uuid4().hex}"
        for tries_left in range(4, -1, -1):
            try:
                _make_directories(directory)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileNotFoundError:  # a delete pruned a directory of the path as it emptied
                if not tries_left:
                    raise
        try:
            try:
                for part in data if isinstance(data, list) else [data]:
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
        if not os.path.lexists(path):
            # Deleted between the link and the unlink: that delete found our temporary in the
            # directory and left it; prune it now that it may be empty.
            self._prune(directory)
            return
        try:
            dir_fd = os.open(directory, os.O_RDONLY)
        except FileNotFoundError:
            return  # the object was deleted already and its directory pruned
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def copy_once(self, src: str, dst: str) -> None:
        """A hard link: no byte read or written, fails if ``dst`` exists (a link planted at
        ``src`` is refused, never linked)."""
        src, directory = self._inside(src), os.path.dirname(self._inside(dst))
        mode = os.lstat(src).st_mode
        if stat.S_ISLNK(mode):
            raise UnsafeObjectError(f"{src} is a symbolic link: not copied")
        if not stat.S_ISREG(mode):
            raise ObjectNotRegularError(f"{src} is not a regular file (mode {mode:o}): not copied")
        _make_directories(directory)
        os.link(src, dst)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _open_file(self, path: str) -> Any:
        """``path`` opened for reading, if it is a regular file: a FIFO or device planted in a
        store is refused at once (opening a FIFO would wait for a writer for ever)."""
        fd = os.open(self._inside(path), os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ObjectNotRegularError(
                    f"{path} is not a regular file (mode {mode:o}): not read"
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with self._open_file(path) as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def get_view(self, path: str, start: int | None = None, end: int | None = None) -> Any:
        """A pre-faulted memory map of the file's pages (no copy and no fresh pages)."""
        with self._open_file(path) as f:
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
        return os.stat(self._inside(path)).st_size

    def stat(self, path: str) -> tuple[int, str]:
        st = os.stat(self._inside(path))
        return st.st_size, f"{st.st_mtime_ns}:{st.st_ino}"

    def modified(self, path: str) -> float:
        # set by the file system (an NFS server's clock)
        return os.stat(self._inside(path)).st_mtime

    def exists(self, path: str) -> bool:
        try:
            # not os.path.exists: that says False where access is denied
            os.stat(self._inside(path))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def list(self, path: str) -> list[str]:
        """An error where a directory cannot be read (a store that only looks empty would be
        worse)."""
        out = []
        for dirpath, dirs, files in os.walk(path, onerror=_raise_unless_gone):
            out.extend(os.path.join(dirpath, f) for f in files if TMP_MARK not in f)
            # No directory of a store is named as an object: one that is stands where an
            # object was (a manifest replaced), listed so that reading it fails by name.
            out.extend(os.path.join(dirpath, d) for d in dirs if d.endswith(".json"))
        return out

    def list_sizes(self, path: str) -> dict[str, int]:
        return {name: st.st_size for name, st in self._stats(path)}

    def refresh(self, path: str) -> None:
        try:
            os.utime(self._inside(path))
        except OSError:
            pass  # gone, or not ours to touch: its time stays

    def list_times(self, path: str) -> dict[str, float]:
        return {name: st.st_mtime for name, st in self._stats(path)}

    def _stats(self, path: str) -> Iterator[tuple[str, os.stat_result]]:
        for name in self.list(path):
            try:
                yield name, os.lstat(name)
            except FileNotFoundError:
                continue  # deleted since the listing

    def delete(self, path: str) -> None:
        target = os.path.join(self._inside(os.path.dirname(path)), os.path.basename(path))
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            try:
                os.rmdir(target)  # an empty directory planted at a key
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:
                    raise
                raise IsADirectoryError(
                    errno.EISDIR,
                    f"{target} is a directory with files in it, where an object belongs: not "
                    "deleted (move it out of the store)",
                ) from None
        self._prune(os.path.dirname(path))

    def _prune(self, directory: str) -> None:
        """Remove ``directory`` and its parents below the root while they are empty (a store
        keeps no empty directories behind its deletes; a put recreates what it needs)."""
        root = self.root.rstrip(os.sep)
        while directory.startswith(root + os.sep):
            try:
                os.rmdir(directory)
            except OSError:  # not empty (or already gone): its parents are not either
                return
            directory = os.path.dirname(directory)

    def stale_temporaries(
        self, root: str, *, older_than_s: float, now: float | None = None
    ) -> list[str]:
        """Put temporaries ``older_than_s`` old by ``now`` (the store's clock, which stamps
        them; else this host's), and at once those whose writer ran on this machine and is
        gone (``kill -9`` mid-save)."""
        now, here = time.time() if now is None else now, machine_tag()
        out = []
        for dirpath, _, files in os.walk(root):
            for name in files:
                shape = _TEMPORARY.fullmatch(name)
                if shape is None:  # only the shape a put writes
                    continue
                path = os.path.join(dirpath, name)
                tag, pid = shape.groups()
                if here and tag == here and pid_gone(int(pid)):
                    out.append(path)
                    continue
                try:
                    if now - os.stat(path).st_mtime >= older_than_s:
                        out.append(path)
                except FileNotFoundError:
                    continue
        return out


def _make_directories(directory: str) -> None:
    """``os.makedirs(directory, exist_ok=True)``, where a directory pruned between its ``mkdir``
    (EEXIST) and its check is :class:`FileNotFoundError` (the put tries again), never the
    :class:`FileExistsError` that would read as "the object already exists"."""
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        if os.path.isdir(directory):
            return  # pruned and created again meanwhile
        if os.path.lexists(directory):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", directory) from None
        raise FileNotFoundError(errno.ENOENT, "pruned as it was created", directory) from None


_BACKENDS: dict[str, type[FsspecBackend]] = {
    "file": LocalBackend,
    "local": LocalBackend,
    "memory": MemoryBackend,
    "s3": S3Backend,
    "s3a": S3Backend,
}


def open_backend(
    uri: str, *, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> tuple[FsspecBackend, str]:
    """The backend of ``uri``'s scheme and the root path of ``uri`` in it."""
    options = dict(storage_options or {})
    if fsspec.core.split_protocol(uri)[0] in S3_PROTOCOLS:
        _check_s3_uri_and_options(uri, options)
        options = bounded_s3_options(options, retry or RetryPolicy())
        _forget_s3_filesystems_if_the_environment_changed()
    try:
        fs, root = fsspec.core.url_to_fs(uri, **options)
    except (ValueError, ImportError) as exc:
        scheme, _, rest = uri.partition("://")
        if rest and scheme.lower() != scheme and scheme.lower() in fsspec.available_protocols():
            raise ValueError(
                f"cannot open store {uri!r}: {exc}; schemes are lower case: did you mean "
                f"{scheme.lower()}://{rest}?"
            ) from exc
        raise ValueError(f"cannot open store {uri!r}: {exc}") from exc
    root = root.rstrip("/")
    if "file" in _protocols(fs) and not os.path.lexists(root):
        refuse_a_mistyped_scheme(uri)
    return _backend_class(fs)(fs, uri=uri, root=root, options=options), root


_aws_environment: tuple | None = None  # AWS_* variables and files when S3 was last opened


def _forget_s3_filesystems_if_the_environment_changed() -> None:
    """fsspec hands back a filesystem made with the same arguments earlier in the process,
    keyed by its arguments alone: credentials or an endpoint fixed in ``AWS_*`` variables or
    the AWS credentials and config files (in a notebook, a retry loop) went unused, and errors
    named the new endpoint."""
    global _aws_environment
    variables = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    files = []
    for name, default in (
        ("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
        ("AWS_CONFIG_FILE", "config"),
    ):
        path = os.path.expanduser(os.environ.get(name) or f"~/.aws/{default}")
        try:
            with open(path, "rb") as f:
                files.append((path, hash(f.read(1 << 20))))  # edits within a clock tick too
        except OSError:
            continue
    now = (variables, tuple(files))
    if _aws_environment is not None and now != _aws_environment:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    _aws_environment = now


def _check_s3_uri_and_options(uri: str, options: dict[str, Any]) -> None:
    """A URI without a bucket, and an option s3fs would pass on to a session that takes no such
    argument (a ``TypeError`` at the first request), are refused by name."""
    path = fsspec.core.split_protocol(uri)[1]
    if not path.strip("/"):
        raise ValueError(f"cannot open store {uri!r}: it names no bucket (s3://BUCKET[/PREFIX])")
    if path.startswith("/") or "//" in path.rstrip("/"):
        tidy = "s3://" + "/".join(part for part in path.split("/") if part)
        raise ValueError(
            f"cannot open store {uri!r}: an empty path segment ('//') makes keys that no "
            f"listing finds (did you mean {tidy}?)"
        )
    import aiobotocore.session
    import s3fs

    known = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
    for fn in (s3fs.S3FileSystem.__init__, aiobotocore.session.AioSession.__init__):
        known |= set(inspect.signature(fn).parameters) - {"self", "kwargs"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"cannot open store {uri!r}: unknown storage option(s) {', '.join(unknown)} (s3fs "
            "takes e.g. endpoint_url, key, secret, anon, client_kwargs, config_kwargs)"
        )
    for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
        if options.get(name) is not None and not isinstance(options[name], dict):
            raise ValueError(
                f"cannot open store {uri!r}: storage option {name} must be a JSON object "
                f"(-o '{name}={{...}}'), got {options[name]!r:.60}"
            )


def refuse_a_mistyped_scheme(uri: str) -> None:
    """``s3:/bucket/run`` (one slash) is a local path to fsspec: a new store would be made in
    a directory named ``s3:``. Refused when that path does not exist yet."""
    colon_left_out = re.match(r"([A-Za-z][A-Za-z0-9+.-]+)//(?!/)(.+)", uri)  # s3//bucket/run
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):/?(?!/)(.*)", uri) or colon_left_out
    if match and match.group(1).lower() in fsspec.available_protocols():
        scheme, rest = match.groups()
        raise ValueError(
            f"cannot open store {uri!r}: it reads as a local path; did you mean {scheme}://{rest}?"
        )


def describe_endpoint(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """A readable name of where ``fs``'s requests go: the endpoint URL of an S3 filesystem
    (from its options or ``AWS_ENDPOINT_URL[_S3]``; ``AWS S3`` if none), a local directory."""
    return _backend_class(fs)(fs, uri=root, root=root, options={}).endpoint


def bounded_s3_options(options: dict[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """``options`` with botocore's connect and read timeouts no longer than an attempt's
    deadline and botocore's own retries off (the store retries), where the caller set none.

    Otherwise botocore waits 60 s per read and retries 4 times, inside each attempt and inside
    s3fs's own 5 retries: an attempt abandoned at its deadline would go on in the background
    for many minutes, holding a pooled connection. Bounded, it ends within about 5 x
    (connect + read timeout)."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", min(5.0, policy.timeout_s))
    config.setdefault("read_timeout", policy.timeout_s)
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**options, "config_kwargs": config}


def _backend_class(fs: fsspec.AbstractFileSystem) -> type[FsspecBackend]:
    return next((_BACKENDS[p] for p in _protocols(fs) if p in _BACKENDS), FsspecBackend)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _one_buffer(data: Data) -> bytes | memoryview:
    if isinstance(data, list):
        return data[0] if len(data) == 1 else b"".join(data)
    return data


def _raise_unless_gone(exc: OSError) -> None:
    """``os.walk``'s error handler: a directory that does not exist (or was removed while
    walking) holds nothing; any other error (permission denied, I/O) is raised."""
    if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        raise exc


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

    def __getitem__(self, key: slice) -> _BufferBody:
        return _BufferBody(self._view[key])  # a multipart upload's part (botocore takes no view)

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


# File systems whose every operation a process makes ends with that process (a network file
# system's client may have sent a delete that its server applies after the process died).
_LOCAL_DISK_TYPES = frozenset(
    "ext2 ext3 ext4 xfs btrfs zfs f2fs bcachefs tmpfs ramfs overlay vfat exfat ntfs3".split()
)


def on_local_disk(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``path`` (made or not) is on a disk file system of this machine, by
    ``mountinfo``; False where that cannot be told."""
    return filesystem_type(path, mountinfo) in _LOCAL_DISK_TYPES


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` (made or not) is on: that of the mount with the
    longest mount point above it in ``mountinfo``; None where that cannot be told."""
    path = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open(mountinfo) as f:
            for line in f:
                fields, _, after = line.partition(" - ")
                mount = fields.split()[4].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, after.split()[0]
    except (OSError, IndexError):
        return None
    return fstype
