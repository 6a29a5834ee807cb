"""A local disk cache of read units fetched from remote replicas, shared by processes.

One entry is one read unit (a whole MDS/WebDataset shard, or a token file's ranged read), stored
as ``<sha256>.unit``: a 32-byte header (magic, payload length, xxh3-128 of the entry's name and
then the payload, so an entry file copied or moved under another name fails its check) and the
payload. The name hashes the replica set's URIs, the shard key, the range and the size, and the
version tokens (ETags, modification times) of every shard the open surveyed, so two datasets, or
two versions of one dataset written at the same place, never share an entry (a dataset opened
with ``verify_replicas=False`` is not surveyed, whether its shards are declared or listed: its
entries are keyed without versions, and only the format's own hashes tell a rewritten shard). Everything the cache knows is in the directory: a new process (a
DataLoader worker, a restarted job, another loader on the same machine) sees the same state.

- **Verified.** An entry is checked on every read from the cache: file size, header, length and
  hash, then the format's own checks (MDS index hashes, sample counts) when it is decoded. A
  corrupt or torn entry is deleted and the unit fetched again from the replicas; its bytes are
  never served. A unit is cached only after it decoded cleanly from a replica.
- **Atomic fill.** A unit is written to ``.tmp-*`` in the directory, then renamed into place, so
  an entry is never seen half written. No fsync: a file torn by a power cut fails its hash.
- **Recency** is the entry's mtime, set on fill and on every hit (not atime, which ``noatime``
  and ``relatime`` mounts do not keep).
- **Eviction and the budget.** A fill takes an exclusive ``fcntl.flock`` on ``.lock``, which
  also holds the entries' total size (entry files, headers included). If the new entry does not
  fit in ``budget_bytes`` the least recently used entries are deleted until it does, then it is
  renamed in, all under the lock. LRU order comes from this process's last directory scan
  (entries touched or filled since are skipped as more recent; a new scan when the list runs
  out), so a fill does not list the directory each time. Each process scans before its first
  fill, so the shared total cannot drift for longer than one process's life (a crash between a
  rename and the counter update, files deleted by hand). So the entries stay within the budget
  exactly, up to that drift; on disk there may be more: temporaries being written (one unit per
  fetching thread, in every process) and entries deleted while a reader still holds them open.
  A unit larger than the budget is not cached.
- **Readers take no lock.** A read opens the entry and reads it through that descriptor; POSIX
  keeps an unlinked file's data until its last descriptor closes, so an eviction by another
  process never tears a read in progress (a reader that loses the race to ``open`` sees a miss).
  Entries are never modified in place, only created by rename and unlinked. A corrupt entry is
  deleted only if the name still holds the file that was read (same inode).

POSIX only (``fcntl``). Local replicas are not cached: with every replica local no cache is
opened, and bytes answered by a local replica of a mixed set are not stored.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec
import xxhash

from loaders.errors import ShardCorruptError
from loaders.formats.layout import Unit
from loaders.metrics import CacheStats

logger = logging.getLogger(__name__)

_MAGIC = b"ckptshd2"  # "ckptshd1" entries hashed the payload alone: refetched once
_HEADER = struct.Struct("<8sQ16s")  # magic, payload bytes, xxh3-128 of name + payload
_SUFFIX = ".unit"
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"
_STALE_TMP_S = 3600.0  # a temporary this old was left by a process that died while filling
_LOCAL_PROTOCOLS = {None, "file", "local", "memory"}


@dataclass(frozen=True)
class CacheEntry:
    name: str
    size: int
    """File size, header included (what the budget counts)."""
    mtime_ns: int
    """Last fill or hit."""


@dataclass(frozen=True)
class CachedUnit:
    """A verified entry read from the cache: its payload and the inode it was read from."""

    name: str
    data: bytes
    inode: int


class ShardCache:
    """A directory of cached read units within ``budget_bytes``, least recently used evicted.

    ``namespace`` identifies the replica set (its URIs): entries of other namespaces in the same
    directory are never returned, but share the budget."""

    def __init__(self, directory: str | os.PathLike, *, budget_bytes: int, namespace: str) -> None:
        if budget_bytes < 1:
            raise ValueError(f"cache budget_bytes must be >= 1, got {budget_bytes}")
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create cache directory {self.directory}: {exc}") from exc
        self.budget_bytes = budget_bytes
        self.namespace = namespace
        self.stats = CacheStats()
        self._clock_lock = threading.Lock()
        self._last_stamp = 0
        self._candidates: deque[CacheEntry] = deque()  # eviction order as of the last scan
        self._scanned = False  # this process scans once before its first fill
        self._warned = False  # a cache that cannot write is named once

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["stats"], state["_clock_lock"]
        state.update(_candidates=deque(), _scanned=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.stats = CacheStats()
        self._clock_lock = threading.Lock()

    # -- names and recency ------------------------------------------------------------------

    def entry_name(self, key: str, start: int | None, end: int | None, nbytes: int) -> str:
        ident = json.dumps([self.namespace, key, start, end, nbytes])
        return hashlib.sha256(ident.encode()).hexdigest() + _SUFFIX

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _stamp(self) -> int:
        """Now in ns, strictly increasing within this process (so LRU order has no ties)."""
        with self._clock_lock:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            return self._last_stamp

    def _touch(self, path: str) -> None:
        stamp = self._stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except FileNotFoundError:
            pass  # evicted since it was read: the read stands

    # -- reading ----------------------------------------------------------------------------

    def lookup(self, name: str, nbytes: int) -> CachedUnit | None:
        """The verified payload of entry ``name`` (``nbytes`` long), or None if absent; a corrupt
        entry is deleted (and counted) and None returned."""
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                problem = None
                if st.st_size != _HEADER.size + nbytes:
                    problem = f"is {st.st_size} bytes, expected {_HEADER.size + nbytes}"
                else:
                    header = f.read(_HEADER.size)
                    data = f.read(nbytes)
                    problem = _check(name, header, data, nbytes)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.stats.add(errors=1)
            logger.warning("shard cache entry %s unreadable, fetching from replicas: %s", path, exc)
            return None
        if problem is not None:
            self.reject(CachedUnit(name, b"", st.st_ino), problem)
            return None
        self._touch(path)
        return CachedUnit(name, data, st.st_ino)

    def reject(self, unit: CachedUnit, problem: str) -> None:
        """Delete a corrupt entry, unless the name already holds another (refilled) file."""
        path = self.path(unit.name)
        self.stats.add(corrupt=1)
        logger.warning(
            "shard cache entry %s is corrupt (%s): dropped, fetching again", path, problem
        )
        try:
            with self._locked() as lock:
                st = os.stat(path)
                if st.st_ino == unit.inode:
                    os.unlink(path)
                    total = _read_total(lock)
                    if total is not None:
                        _write_total(lock, max(0, total - st.st_size))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.stats.add(errors=1)
            logger.warning("shard cache %s: cannot drop %s: %s", self.directory, path, exc)

    # -- filling and eviction ---------------------------------------------------------------

    def put(self, name: str, data: bytes | memoryview) -> bool:
        """Store ``data`` as entry ``name``, evicting least recently used entries to stay within
        the budget. False when not stored: too large, already there, or a local I/O error (logged:
        a cache that cannot write never fails a read)."""
        payload = memoryview(data).cast("B")
        size = _HEADER.size + payload.nbytes
        if size > self.budget_bytes:
            self.stats.add(skipped=1)
            return False
        tmp = self.path(f"{_TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, payload.nbytes, _digest(name, payload)))
                f.write(payload)
            with self._locked() as lock:
                if os.path.exists(self.path(name)):
                    return False  # another reader filled it meanwhile
                total = _read_total(lock)
                if total is None or not self._scanned:
                    total = self._rescan()
                if total + size > self.budget_bytes:
                    total = self._evict(total, room=size)
                stamp = self._stamp()
                os.utime(tmp, ns=(stamp, stamp))
                os.rename(tmp, self.path(name))
                _write_total(lock, total + size)
        except OSError as exc:
            self._failed("cannot store an entry", exc)
            return False
        finally:
            _unlink_quietly(tmp)
        self.stats.add(fills=1, bytes_filled=payload.nbytes)
        return True

    def _rescan(self) -> int:
        """The entries' total size, from the directory; refreshes the eviction candidates."""
        entries = sorted(self.entries(), key=lambda e: (e.mtime_ns, e.name))
        self._candidates = deque(entries)
        self._scanned = True
        return sum(e.size for e in entries)

    def _evict(self, total: int, *, room: int) -> int:
        """Delete least recently used entries until ``room`` more bytes fit; the new total.

        Candidates come from this process's last scan, oldest first. One touched since (its
        mtime changed) or filled since is more recent than every candidate left, so skipping
        it keeps the order exact; when the candidates run out the directory is scanned again.
        Under the lock."""
        rescanned = False
        while total + room > self.budget_bytes:
            if not self._candidates:
                if rescanned:
                    break  # nothing left to evict (only this fill's room remains)
                total, rescanned = self._rescan(), True
                continue
            entry = self._candidates.popleft()
            path = self.path(entry.name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # evicted or dropped by another process
            if st.st_mtime_ns != entry.mtime_ns:
                continue
            _unlink_quietly(path)
            total -= st.st_size
            self.stats.add(evictions=1)
        return max(total, 0)

    def entries(self) -> list[CacheEntry]:
        """The entries now in the directory (every namespace); stale temporaries are removed."""
        out = []
        stale_before = time.time() - _STALE_TMP_S
        with os.scandir(self.directory) as it:
            for item in it:
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue
                if item.name.endswith(_SUFFIX) and not item.name.startswith(_TMP_PREFIX):
                    out.append(CacheEntry(item.name, st.st_size, st.st_mtime_ns))
                elif item.name.startswith(_TMP_PREFIX) and st.st_mtime < stale_before:
                    _unlink_quietly(item.path)
        return out

    def cached_bytes(self) -> int | None:
        """Bytes of the entries, as the shared counter has them (a scan if it has none); None
        when the directory cannot be locked or read (its error counted, as a failed fill's)."""
        try:
            with self._locked() as lock:
                total = _read_total(lock)
                if total is None:
                    total = self._rescan()
                    _write_total(lock, total)
                return total
        except OSError as exc:
            self._failed("cannot count its entries", exc, count=False)  # a read: no error
            return None

    def _failed(self, what: str, exc: OSError, *, count: bool = True) -> None:
        """One WARNING per process for a cache that cannot write (reads go on, uncached)."""
        if count:
            self.stats.add(errors=1)
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        logger.log(level, "shard cache %s: %s: %s", self.directory, what, exc)

    @contextmanager
    def _locked(self) -> Iterator[int]:
        """The directory's fill/evict lock (``flock``: exclusive between processes, and between
        threads, which each open their own descriptor); its descriptor holds the byte counter."""
        fd = os.open(self.path(_LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    def metrics(self) -> dict[str, Any]:
        return {
            **self.stats.as_dict(),
            "cached_bytes": self.cached_bytes(),
            "budget_bytes": self.budget_bytes,
        }


_TOTAL = struct.Struct("<q")


def _read_total(lock: int) -> int | None:
    """The entries' total size kept in the lock file, or None if it holds none (a new cache)."""
    raw = os.pread(lock, _TOTAL.size, 0)
    return _TOTAL.unpack(raw)[0] if len(raw) == _TOTAL.size else None


def _write_total(lock: int, total: int) -> None:
    os.pwrite(lock, _TOTAL.pack(total), 0)


def _digest(name: str, payload: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128(name.encode())
    h.update(payload)
    return h.digest()


def _check(name: str, header: bytes, data: bytes, nbytes: int) -> str | None:
    """Why an entry's header and payload are not a valid entry ``name`` of ``nbytes``, or
    None."""
    if len(header) != _HEADER.size or len(data) != nbytes:
        return "shorter than its header says"
    magic, length, digest = _HEADER.unpack(header)
    if magic != _MAGIC:
        return f"bad magic {magic!r}"
    if length != nbytes:
        return f"header says {length} bytes, expected {nbytes}"
    if _digest(name, data) != digest:
        return "xxh3-128 of its name and payload does not match its header"
    return None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def is_local_uri(uri: str) -> bool:
    """A local path, ``file://`` or ``memory://``: nothing a cache would speed up."""
    return fsspec.core.split_protocol(uri)[0] in _LOCAL_PROTOCOLS


def open_cache(
    directory: str | os.PathLike | None,
    budget_bytes: int | None,
    uris: Sequence[str],
    *,
    version: str = "",
) -> ShardCache | None:
    """The cache for a replica set with ``uris`` whose shards are at ``version`` (what
    ``ReplicaSet.content_version`` says), or None when there is no ``directory`` or every
    replica is local."""
    if directory is None or all(is_local_uri(u) for u in uris):
        return None
    assert budget_bytes is not None, "LoaderConfig checks cache_bytes with cache_dir"
    namespace = "\n".join([*sorted(uris), version])
    return ShardCache(directory, budget_bytes=budget_bytes, namespace=namespace)


def read_unit(
    cache: ShardCache,
    unit: Unit,
    fetch: Callable[[Callable[[Any, str], Any]], tuple[Any, str, Any]],
    decode: Callable[[Unit, Any, str], Any],
) -> Any:
    """``unit`` decoded, from the cache when it holds a valid entry, else through ``fetch`` (the
    replica read, given a decode callback whose result it returns) and then cached.

    ``fetch(post)`` must return ``post(raw, replica)`` for the replica that answered."""
    name = cache.entry_name(unit.key, *unit.span(), unit.nbytes)
    hit = cache.lookup(name, unit.nbytes)
    if hit is not None:
        try:
            decoded = decode(unit, hit.data, f"cache {cache.path(name)}")
        except ShardCorruptError as exc:
            cache.reject(hit, str(exc))
        else:
            cache.stats.add(hits=1, bytes_hit=unit.nbytes)
            return decoded
    cache.stats.add(misses=1)
    raw, replica, decoded = fetch(lambda raw, replica: (raw, replica, decode(unit, raw, replica)))
    if not is_local_uri(replica):
        cache.put(name, raw)
    return decoded
