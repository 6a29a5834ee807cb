"""The save and restore pipelines shared by Checkpointer and the DCP backend.

Save: the caller's tensors are laid out in one staging buffer so that every chunk is a
contiguous slice of it (large tensors split into ``chunk_bytes`` pieces, small tensors of the
same element width packed together), then copied in (stage). In the background each chunk is
hashed, skipped if the save knows it is stored (content addressing: ``put_chunk``), else
encoded and put as one exclusive create; at most ``encode_threads`` chunks are in flight, so the
memory beyond the staging buffer is bounded by about ``2 * encode_threads * chunk_bytes`` (a
chunk's byte planes while it is encoded, its encoded body while it is put; a remote put sends
that body without copying it, see ``store``).

Restore: the chunks a set of tensors needs are fetched with one get each (sized by the index),
``read_concurrency`` at a time, decoded and hash-verified on the fetching thread, then copied into
the destination tensors; a chunk's bytes reach a tensor only after its hash checked out. Where the
verified bytes come from is a ``ChunkSource``: the store by default, or ranks that share the
chunks (``ckptstore.shared_read``).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ckptstore import telemetry
from ckptstore.codec import (
    CodecConfig,
    check_raw_size,
    decode,
    encode_parts,
    hash_bytes,
    possible_encoded_size,
)
from ckptstore.device import host_available_bytes
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TooLargeForHostError,
    UnsafeObjectError,
    one_line,
)
from ckptstore.format import (
    MAX_CHUNK_BYTES,
    ChunkInfo,
    RankIndex,
    Segment,
    TensorEntry,
    chunk_key,
    shape_text,
)
from ckptstore.health import ChunkScan
from ckptstore.staging import align
from ckptstore.store import Store

logger = logging.getLogger(__name__)

MiB = 2**20


@dataclass(kw_only=True)
class PipelineConfig:
    """How state is cut into chunks, encoded and moved."""

    chunk_bytes: int = 32 * MiB
    """Target size of a chunk: large tensors are split into pieces this big."""
    pack_below_bytes: int | None = None
    """Tensors smaller than this are packed together into shared chunks (default: the
    smaller of 1 MiB and a quarter of ``chunk_bytes``)."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    encode_threads: int = max(4, os.cpu_count() or 4)
    """Chunks hashed, encoded and uploaded at once during a save."""
    read_concurrency: int = 8
    """Chunks fetched and decoded at once during a restore."""

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= MAX_CHUNK_BYTES or self.chunk_bytes % 64:
            raise ValueError(
                f"chunk_bytes must be within [4096, {MAX_CHUNK_BYTES}] and a multiple of 64, "
                f"got {self.chunk_bytes}"
            )
        if self.pack_below_bytes is None:
            self.pack_below_bytes = min(MiB, self.chunk_bytes // 4)
        if not 0 <= self.pack_below_bytes <= self.chunk_bytes:
            raise ValueError("pack_below_bytes must be within [0, chunk_bytes]")
        if self.encode_threads < 1 or self.read_concurrency < 1:
            raise ValueError("encode_threads and read_concurrency must be >= 1")

    @classmethod
    def from_args(
        cls,
        *,
        chunk_bytes: int | None = None,
        compression: str | int | None = "auto",
        encode_threads: int | None = None,
    ) -> PipelineConfig:
        """The save settings that Checkpointer and the DCP writer take from their arguments
        (None: the default)."""
        given = {"chunk_bytes": chunk_bytes, "encode_threads": encode_threads}
        return cls(
            codec=CodecConfig.parse(compression),
            **{name: value for name, value in given.items() if value is not None},
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"unknown dtype {name!r} in checkpoint")
    return dtype


def codec_itemsize(dtype: torch.dtype) -> int:
    """Byte-grouping width: the element size for floats, 1 (no grouping) otherwise."""
    return dtype.itemsize if (dtype.is_floating_point or dtype.is_complex) else 1


@dataclass
class ChunkSpan:
    start: int
    end: int
    itemsize: int


@dataclass
class ChunkLayout:
    """Where each tensor sits in the staging buffer and which chunks cut that buffer."""

    total_bytes: int
    offsets: list[int]  # per tensor, start in the buffer
    chunks: list[ChunkSpan]
    gaps: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` of the alignment padding inside packed chunks: a staging buffer's
    bytes there are zeroed (``zero_gaps``), else a chunk would carry whatever memory the
    buffer held before (and ranks or saves of the same tensors would hash it apart)."""


def plan_layout(tensors: list[torch.Tensor], cfg: PipelineConfig) -> ChunkLayout:
    offsets = [0] * len(tensors)
    chunks: list[ChunkSpan] = []
    gaps: list[tuple[int, int]] = []
    cursor = 0
    packs: dict[int, list[int]] = defaultdict(list)
    large: list[int] = []
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        (packs[codec_itemsize(t.dtype)] if n < cfg.pack_below_bytes else large).append(i)
    for itemsize, members in packs.items():
        start = cursor
        for i in members:
            n = tensors[i].numel() * tensors[i].element_size()
            if cursor > start and cursor + n > start + cfg.chunk_bytes:
                chunks.append(ChunkSpan(start, cursor, itemsize))
                start = cursor
            offsets[i] = cursor
            if align(cursor + n) > cursor + n:
                gaps.append((cursor + n, align(cursor + n)))
            cursor = align(cursor + n)
        if cursor > start:
            chunks.append(ChunkSpan(start, cursor, itemsize))
    for i in large:
        t = tensors[i]
        n = t.numel() * t.element_size()
        offsets[i] = cursor
        for piece in range(cursor, cursor + n, cfg.chunk_bytes):
            chunks.append(
                ChunkSpan(piece, min(piece + cfg.chunk_bytes, cursor + n), codec_itemsize(t.dtype))
            )
        cursor = align(cursor + n)
    return ChunkLayout(total_bytes=cursor, offsets=offsets, chunks=chunks, gaps=gaps)


def chunks_holding(layout: ChunkLayout, spans: list[tuple[int, int]]) -> ChunkLayout:
    """The part of ``layout`` that holds the byte ranges ``spans`` (``(offset, nbytes)`` in
    its buffer, one per tensor): those tensors at those offsets, and only the chunks they
    touch (a rank writes only the staged chunks that hold its own items)."""
    starts = [c.start for c in layout.chunks]
    needed: set[int] = set()
    for offset, nbytes in spans:
        c = bisect.bisect_right(starts, offset) - 1
        while c < len(starts) and starts[c] < offset + nbytes:
            needed.add(c)
            c += 1
    return ChunkLayout(
        total_bytes=layout.total_bytes,
        offsets=[offset for offset, _ in spans],
        chunks=[layout.chunks[c] for c in sorted(needed)],
        gaps=layout.gaps,
    )


def tensor_entries(
    tensors: list[torch.Tensor], layout: ChunkLayout, digests: list[str]
) -> list[TensorEntry]:
    """Each tensor's dtype, shape and segments, given the digests of the layout's chunks."""
    starts = [c.start for c in layout.chunks]
    entries = []
    for t, offset in zip(tensors, layout.offsets):
        n = t.numel() * t.element_size()
        segments = []
        position, end = offset, offset + n
        c = int(np.searchsorted(starts, position, side="right")) - 1 if n else 0
        while position < end:
            span = layout.chunks[c]
            take = min(end, span.end) - position
            segments.append(Segment(digests[c], position - span.start, take))
            position += take
            c += 1
        entries.append(
            TensorEntry(dtype=dtype_name(t.dtype), shape=list(t.shape), segments=segments)
        )
    return entries


# The least share of a chunk that compression must save for it to be stored so on a store on
# this machine's disk (raw reads there run at ~10 GB/s, zstd decodes at ~2.5 GB/s per thread).
LOCAL_MIN_SAVING = 0.25


class CompressionGovernor:
    """Decides chunk by chunk whether compressing pays for itself.

    It pays while encoding a byte takes less time than uploading the bytes compression saves:
    ``encode_s_per_byte < put_s_per_byte * (1 - stored/raw)``. Both rates are moving averages
    of what the save threads observe; every ``probe_every``-th chunk is encoded regardless, so
    the estimate follows the storage as it speeds up or slows down. A probe whose compression
    does not pay is stored raw (``keeps``): its encoding is spent either way, but a compressed
    chunk would make every restore decode it, at a fraction of a fast store's read speed, for a
    few percent of space. On a store on this machine's disk (``local``) a chunk is also kept
    compressed only where that saves at least ``LOCAL_MIN_SAVING`` of it: such a store is read
    back at page-cache or NVMe speed, several times what zstd decodes, so every restore would
    pay more than the space saved; the per-byte put times of small local files (a fixed cost
    per file) do not show that, and a save's first chunks are encoded before any is timed.
    """

    def __init__(self, probe_every: int = 8, smoothing: float = 0.2) -> None:
        self.probe_every = probe_every
        self.smoothing = smoothing
        self._lock = threading.Lock()
        self._n = 0
        self.encode_s_per_byte: float | None = None
        self.put_s_per_byte: float | None = None
        self.ratio: float | None = None
        self.compressed = 0  # chunks stored compressed
        self.raw = 0  # chunks stored raw, probes that did not pay included
        self.probes_kept_raw = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def _pays(self) -> bool | None:
        """None while a rate is unknown."""
        if None in (self.encode_s_per_byte, self.put_s_per_byte, self.ratio):
            return None
        saved = self.put_s_per_byte * max(0.0, 1.0 - self.ratio)
        return self.encode_s_per_byte < saved

    def should_compress(self) -> bool:
        """Whether to encode the next chunk compressed (it pays, or it is a probe)."""
        with self._lock:
            self._n += 1
            pays = self._pays()
            return pays is None or pays or self._n % self.probe_every == 0

    def keeps(self, *, raw: int, encoded: int, encode_s: float, local: bool = False) -> bool:
        """Whether a chunk just encoded compressed (``encoded`` bytes of ``raw``, in
        ``encode_s``) is stored so: its encoding is observed, then it is kept unless
        compression is known not to pay."""
        if raw <= 0:
            return True
        with self._lock:
            self.encode_s_per_byte = self._ema(self.encode_s_per_byte, encode_s / raw)
            self.ratio = self._ema(self.ratio, encoded / raw)
            small = local and encoded > raw * (1.0 - LOCAL_MIN_SAVING)
            if small or self._pays() is False:
                self.probes_kept_raw += 1
                return False
            return True

    def observe_put(self, *, stored: int, put_s: float, compressed: bool) -> None:
        if stored <= 0:
            return
        with self._lock:
            self.put_s_per_byte = self._ema(self.put_s_per_byte, put_s / stored)
            if compressed:
                self.compressed += 1
            else:
                self.raw += 1


_RAW = CodecConfig(level=None)


def put_chunk(
    store: Store,
    raw,
    itemsize: int,
    codec: CodecConfig,
    *,
    hedged: bool = False,
    governor: CompressionGovernor | None = None,
    known: dict[str, ChunkInfo] | None = None,
    digest: str | None = None,
    recheck: Rechecks | None = None,
) -> tuple[str, ChunkInfo]:
    """Hash ``raw`` (unless its ``digest`` is given: hashed already by the caller); encode and
    put it unless the store already holds that chunk.

    ``known``: chunks the save may reference without asking the store (``SaveSession.begin``
    says which are safe); a chunk found there costs no request, and every chunk put or found
    is added to it. A chunk not in it is most likely new: it is put at once, as one exclusive
    create whose "already exists" answer is the dedup. Without ``known``, or on a backend
    that does not enforce exclusive create (an overwrite could change the stored size another
    step's index records), the store is asked for the chunk's size first.

    ``hedged``: a slow put is duplicated by the store; both are exclusive creates of the same
    content-addressed key, so whichever lands second finds the object there and nothing is
    written twice.

    ``recheck``: the chunks found in ``known`` (stored by an earlier save) to read back and,
    found damaged or missing, write again from ``raw`` (:func:`recheck_chunk`)."""
    if digest is None:
        digest = hash_bytes(raw)
    key = chunk_key(digest)
    if known is not None and (info := known.get(digest)) is not None:
        if recheck is not None and recheck.chosen(digest):
            info = _rechecked(store, digest, known, recheck, raw, itemsize, codec)
        return digest, info
    info = None
    if known is None or not store.backend.enforces_create:
        try:
            info = ChunkInfo(len(raw), store.size(key))
        except ObjectNotFoundError:
            pass
    if info is None:
        info = _encode_and_put(store, key, raw, itemsize, codec, hedged, governor)
    if recheck is not None and digest in recheck.suspect:  # found there, maybe the bad one
        info = recheck_chunk(store, digest, info, raw, itemsize, codec)
        clear_suspect(store, digest)
    if known is not None:
        known[digest] = info  # a dict's item assignment is atomic: put threads share it
    return digest, info


# Chunks a load in this process found damaged or missing, by store: a save that would reference
# one reads it back first and writes it again, not only about one save in ``recheck_every``
# (a frozen tensor's damaged chunk was referenced by every later step, each unloadable).
_SUSPECT_MAX = 100_000
_suspect: dict[str, set[str]] = {}
_suspect_lock = threading.Lock()


def _store_key(store: Store) -> str:
    return os.path.realpath(store.root) if store.is_local else store.uri.rstrip("/")


def suspect_chunk(store: Store, digest: str) -> None:
    """A load found chunk ``digest`` of ``store`` damaged or missing."""
    with _suspect_lock:
        known = _suspect.setdefault(_store_key(store), set())
        if len(known) < _SUSPECT_MAX:
            known.add(digest)


def suspect_chunks(store: Store) -> set[str]:
    """The chunks of ``store`` loads in this process found damaged or missing, not yet
    rechecked by a save."""
    with _suspect_lock:
        return set(_suspect.get(_store_key(store), ()))


def clear_suspect(store: Store, digest: str) -> None:
    """Chunk ``digest`` of ``store`` was read back intact, or written again, by a save."""
    with _suspect_lock:
        _suspect.get(_store_key(store), set()).discard(digest)


class Rechecks:
    """Which of the chunks a save references without writing it are read back: about one in
    ``period`` (0: none), chosen by the chunk and the step, and every ``suspect`` one (found
    damaged by a load; :func:`suspect_chunks`) (:meth:`chosen`: every rank of the save
    chooses the same, the ranks' suspects shared), each once in the save however often it
    holds it (:meth:`claim`)."""

    def __init__(self, period: int, step: int, suspect: set[str] | None = None) -> None:
        self.period, self.step = period, step
        self.suspect = suspect if suspect is not None else set()
        self._lock = threading.Lock()
        self._claims: dict[str, threading.Event] = {}

    def chosen(self, digest: str) -> bool:
        return digest in self.suspect or self.by_turn(digest)

    def by_turn(self, digest: str) -> bool:
        """Its turn, about one save in ``period`` (the same on every rank of the save)."""
        key = f"{digest}/{self.step}".encode()
        return bool(self.period) and xxhash.xxh3_64_intdigest(key) % self.period == 0

    def claim(self, digest: str) -> threading.Event | None:
        """None for the first caller of this save, who rechecks ``digest`` and then calls
        :meth:`done`; for any other, the event that tells it is done."""
        with self._lock:
            if digest in self._claims:
                return self._claims[digest]
            self._claims[digest] = threading.Event()
            return None

    def done(self, digest: str) -> None:
        self._claims[digest].set()


def _rechecked(
    store: Store,
    digest: str,
    known: dict[str, ChunkInfo],
    recheck: Rechecks,
    raw,
    itemsize: int,
    codec: CodecConfig,
) -> ChunkInfo:
    """Known chunk ``digest`` as :func:`recheck_chunk` leaves it, rechecked once in the save:
    a second holder of it waits for the first one's recheck."""
    waiting = recheck.claim(digest)
    if waiting is not None:
        waiting.wait()
        return known[digest]
    try:
        known[digest] = recheck_chunk(store, digest, known[digest], raw, itemsize, codec)
        clear_suspect(store, digest)
    finally:
        recheck.done(digest)
    return known[digest]


def recheck_chunk(
    store: Store, digest: str, info: ChunkInfo, raw, itemsize: int, codec: CodecConfig
) -> ChunkInfo:
    """Read stored chunk ``digest`` back (:func:`chunk_damage`); found damaged or missing,
    write it again from ``raw`` (its bytes, hashed to ``digest`` by this save) in the encoding
    whose size ``info`` records where one gives it (:func:`rewrite_chunk`). Its info as stored
    now."""
    damage = chunk_damage(store, digest, info)
    if damage is None:
        return info
    parts = encode_parts(raw, itemsize, codec)
    if sum(map(len, parts)) != info.stored and codec.level is not None:
        plain = encode_parts(raw, itemsize, _RAW)
        parts = plain if sum(map(len, plain)) == info.stored else parts
    if not store.is_local:
        parts = [_joined(parts)]
    return rewrite_chunk(store, digest, info, parts, damage)


def chunk_damage(store: Store, digest: str, info: ChunkInfo) -> CheckpointError | None:
    """What is wrong with stored chunk ``digest``, read back and checked as a load checks it
    (its stored size ``info``, its xxh3 after decoding), twice before it is called damaged:
    missing or damaged; None if it checks out, or if a read fails otherwise (a storage error
    checks nothing)."""
    damage: CheckpointError | None = None
    for _ in range(2):
        try:
            # Not into the thread's scratch buffer: a save's encode threads would each keep
            # one of a chunk's size between saves for the few chunks they recheck.
            fetch_chunk(store, digest, info)
            return None
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            damage = exc
        except StorageError as exc:
            logger.info("chunk %s not rechecked: %s", store.url(chunk_key(digest)), one_line(exc))
            return None
    return damage


REWRITE_SETTLE_S = 60.0
"""How long a rewrite waits for its delete of a damaged chunk, given up at its deadline, to
end before it puts the good bytes (a delete landing after the put would undo it)."""


def rewrite_chunk(
    store: Store, digest: str, info: ChunkInfo, parts: list, damage: CheckpointError
) -> ChunkInfo:
    """Replace stored chunk ``digest``, found ``damage``d, by ``parts`` (its good bytes,
    encoded; ``info``: the sizes the indexes that referenced it record), then read it back:
    every step sharing it whose index records the stored size now reads it again. A chunk
    found missing is not deleted first (a read that missed a good one must not remove it).
    Its info as stored now; :class:`CheckpointError` where it is not stored intact, so that no
    save commits naming it."""
    key = chunk_key(digest)
    if not isinstance(damage, CheckpointNotFoundError):
        store.delete(key)
        if not store.settle(REWRITE_SETTLE_S, ops=("delete",)):
            raise CheckpointError(
                f"{damage}; not written again: deleting it did not end within "
                f"{REWRITE_SETTLE_S:.0f}s"
            )
    try:
        store.put(key, parts, shared=True)
    except ObjectExistsError:  # written again meanwhile, or there all along (checked below)
        pass
    try:
        now = ChunkInfo(info.raw, store.size(key))
    except ObjectNotFoundError as exc:
        raise CheckpointError(f"{damage}; written again, then gone") from exc
    again = chunk_damage(store, digest, now)
    if again is not None:
        raise CheckpointError(f"{damage}; written again, and still: {again}")
    logger.warning(
        "%s; written again from this save's bytes (every step sharing it reads it again%s)",
        damage,
        "" if now.stored == info.stored else f": those whose index records {info.stored} not",
    )
    return now


def _encode_and_put(
    store: Store,
    key: str,
    raw,
    itemsize: int,
    codec: CodecConfig,
    hedged: bool,
    governor: CompressionGovernor | None,
) -> ChunkInfo:
    local = store.is_local
    compress = codec.level is not None and (governor is None or governor.should_compress())
    t0, cpu0 = time.perf_counter(), time.thread_time()
    parts = encode_parts(raw, itemsize, codec if compress else _RAW)
    if compress and governor is not None:
        encoded = sum(map(len, parts))
        spent = time.perf_counter() - t0
        if not governor.keeps(raw=len(raw), encoded=encoded, encode_s=spent, local=local):
            parts, compress = encode_parts(raw, itemsize, _RAW), False
    telemetry.encode_cpu_seconds_total.inc(time.thread_time() - cpu0)
    if not local:
        parts = [_joined(parts)]  # remote puts need one buffer: don't hold both copies
    t1 = time.perf_counter()

    try:
        store.put(key, parts, hedged=hedged, shared=True)
        stored = sum(map(len, parts))
        telemetry.bytes_total.inc(len(raw), kind="raw")
        telemetry.bytes_total.inc(stored, kind="stored")
    except ObjectExistsError:  # another rank or save wrote the same content first
        stored = existing_chunk_size(store, key, len(raw))
        store.refresh(key)  # a step that names it now is as young as the chunks it wrote
    if governor is not None:
        governor.observe_put(
            stored=sum(map(len, parts)), put_s=time.perf_counter() - t1, compressed=compress
        )
    return ChunkInfo(len(raw), stored)


def existing_chunk_size(store: Store, key: str, raw_len: int) -> int:
    """The size of the chunk at ``key`` that a put found already there, refused where no
    encoding of its ``raw_len`` bytes has it (a damaged leftover, a store answering sizes
    wrong): an index naming it would never load."""
    stored = store.size(key)
    if not possible_encoded_size(stored, raw_len):
        raise StorageError(
            f"{store.url(key)} is already there, and the store says it is {stored} bytes, "
            f"which no encoding of its {raw_len} bytes is (damaged, or a store answering "
            "sizes wrong): this save fails rather than reference it"
        )
    return stored


def _joined(parts: list) -> np.ndarray:
    """``parts`` in one array, copied by numpy without the GIL (``b"".join`` holds it for
    the whole copy, stalling a training loop's Python for milliseconds per chunk)."""
    out = np.empty(sum(memoryview(p).nbytes for p in parts), dtype=np.uint8)
    position = 0
    for part in parts:
        data = np.frombuffer(part, dtype=np.uint8)
        out[position : position + data.size] = data
        position += data.size
    return out


def write_chunks(
    store: Store,
    buffer: np.ndarray,
    layout: ChunkLayout,
    cfg: PipelineConfig,
    *,
    hedged: bool = False,
    governor: CompressionGovernor | None = None,
    known: dict[str, ChunkInfo] | None = None,
    spans: list[tuple[ChunkSpan, str]] | None = None,
    scan: ChunkScan | None = None,
    recheck: Rechecks | None = None,
) -> tuple[list[str], dict[str, ChunkInfo]]:
    """Put every chunk of ``layout`` (slices of ``buffer``), or only ``spans`` of it, each with
    its digest (hashed already: not hashed again); their digests, in layout order or in the
    order of ``spans``. ``known``, ``recheck``: see :func:`put_chunk`. ``scan``: the health scan of the
    tensors in ``buffer``, taken as each chunk is hashed (not with ``spans``: their hashing
    pass scanned them)."""

    def put(task: ChunkSpan | tuple[ChunkSpan, str]) -> tuple[str, ChunkInfo]:
        span, digest = task if isinstance(task, tuple) else (task, None)
        raw = buffer[span.start : span.end]
        if digest is None and scan is not None:
            digest = scan.hash(span.start, raw)
        result = put_chunk(
            store,
            raw,
            span.itemsize,
            cfg.codec,
            hedged=hedged,
            governor=governor,
            known=known,
            digest=digest,
            recheck=recheck,
        )
        if not store.is_local:
            # A remote chunk's body lives for its whole upload and is freed into the arena of
            # whichever thread allocated it; trimmed only per save, those arenas hold several
            # chunks' worth of freed bodies at once (~200 MiB at 4 in flight).
            release_free_memory()
        return result

    try:
        # drain: a failed save's other puts end before its error is raised (nothing of it is
        # still writing, a full disk's temporaries included, when wait() raises).
        results = list(
            store.map(
                put,
                layout.chunks if spans is None else spans,
                max_concurrency=cfg.encode_threads,
                drain=True,
            )
        )
    finally:
        release_free_memory()
    return [d for d, _ in results], {d: info for d, info in results}


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_trim = _malloc_trim()


def release_free_memory() -> None:
    """Give the memory a save's chunks were encoded and sent in back to the OS.

    Each worker thread allocates through its own glibc arena, which keeps what it freed; over
    back-to-back saves those arenas fill with free pages, and the process grows by tens of MiB
    per save."""
    if _trim is not None:
        _trim(0)


_scratch = threading.local()


def _thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """A per-thread buffer reused across chunks (no fresh pages to fault in per chunk)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_scratch, name, buf)
    return buf[:nbytes]


def fetch_chunk(
    store: Store,
    digest: str,
    info: ChunkInfo | None = None,
    *,
    scratch: bool = False,
    sized: bool = True,
) -> np.ndarray:
    """A chunk's raw bytes, decoded and verified against its digest.

    With ``scratch`` the bytes land in a per-thread buffer that the thread's next fetch
    overwrites: copy them out before fetching again. ``sized=False``: ``info``'s stored size
    is another store's (this one may hold the chunk encoded otherwise); only its raw size
    bounds the read and the decode."""
    return fetch_chunk_and_size(store, digest, info, scratch=scratch, sized=sized)[0]


def fetch_chunk_and_size(
    store: Store,
    digest: str,
    info: ChunkInfo | None = None,
    *,
    scratch: bool = False,
    sized: bool = True,
    on_verified: Callable[[memoryview | bytes], None] | None = None,
) -> tuple[np.ndarray, int]:
    """``fetch_chunk``, and how many stored bytes it read. ``on_verified``: called with the
    stored bytes once they decoded to ``digest`` (valid only during the call). A chunk of a
    remote store whose bytes fail their checks is read once more before it is called corrupt
    (a ranged GET carries no checksum: an answer damaged on the way would fail a whole step)."""
    try:
        try:
            return _fetch_once(store, digest, info, scratch, sized, on_verified)
        except CheckpointCorruptError as exc:
            if not store.backend.remote:
                raise
            first = exc
        raw, n = _fetch_once(store, digest, info, scratch, sized, on_verified)
    except (CheckpointCorruptError, CheckpointNotFoundError):
        suspect_chunk(store, digest)  # the next save referencing it writes it again
        raise
    logger.warning("%s; read again, it checks out (damaged on the way)", one_line(first))
    return raw, n


def _fetch_once(
    store: Store,
    digest: str,
    info: ChunkInfo | None,
    scratch: bool,
    sized: bool,
    on_verified: Callable[[memoryview | bytes], None] | None,
) -> tuple[np.ndarray, int]:
    key = chunk_key(digest)
    # A memory map on local paths: no copy, no fresh pages to fault in.
    read = store.get_view if scratch else store.get
    try:
        # With the stored size from the index: one ranged GET (a plain one is sized by a HEAD
        # first on S3), one byte longer than the chunk so that a longer object shows.
        if info is None:
            data = read(key)
        elif sized:
            data = read(key, 0, info.stored + 1)
        else:  # at most what any encoding of raw bytes takes (zstd's bound, generously)
            data = read(key, 0, info.raw + info.raw // 64 + 4096)
    except ObjectNotFoundError as exc:
        raise CheckpointNotFoundError(f"chunk {store.url(key)} is missing") from exc
    except UnsafeObjectError as exc:  # damaged or hostile, as a wrong byte is
        raise CheckpointCorruptError(f"chunk {store.url(key)}: {exc}") from exc
    if info is not None and sized and len(data) != info.stored:
        raise CheckpointCorruptError(
            f"chunk {store.url(key)}: {len(data)} bytes stored, the index says {info.stored}"
        )
    out = None
    if scratch and info is not None:
        check_raw_size(data, info.raw, store.url(key))  # before its buffer is allocated
        out = _thread_buffer("decoded", info.raw)
    raw_len = info.raw if info is not None else None
    raw = decode(data, expected_hash=digest, name=store.url(key), out=out, raw_len=raw_len)
    if on_verified is not None:
        on_verified(data)
    return raw, len(data)


ChunkSource = Callable[[list[str], Callable[[str, np.ndarray], int]], Iterator[int]]
"""Where a restore's chunks come from: ``source(digests, deliver)`` calls ``deliver(digest, raw)``
once per digest with its raw bytes, verified against the digest (the bytes may be overwritten
once ``deliver`` returns), and yields what each call returned; closing the iterator stops it
(what it left undelivered is not delivered), and its first error is raised by the iteration."""
ChunkFetch = Callable[[str, "ChunkInfo | None"], np.ndarray]
"""One chunk's raw bytes, verified, in the fetching thread's scratch buffer (``fetch_chunk``
with ``scratch=True`` from one store, or from the tiers a restore reads)."""


def chunks_from_store(
    store: Store,
    chunks: dict[str, ChunkInfo],
    cfg: PipelineConfig,
    fetch: ChunkFetch | None = None,
) -> ChunkSource:
    """The plain ``ChunkSource``: each chunk fetched from ``store`` with one get (sized by
    ``chunks``, the index's sizes), or by ``fetch``, ``cfg.read_concurrency`` at a time (on
    ``store``'s threads), and delivered on the fetching thread."""

    def read(digests: list[str], deliver: Callable[[str, np.ndarray], int]) -> Iterator[int]:
        def load(digest: str) -> int:
            info = chunks.get(digest)
            if fetch is not None:
                return deliver(digest, fetch(digest, info))
            return deliver(digest, fetch_chunk(store, digest, info, scratch=True))

        # drain: a failed read's fetches end before its error is raised (a worker still
        # decoding in a C extension as the process exits aborts it: a CLI restore exited 134)
        return store.map(load, digests, max_concurrency=cfg.read_concurrency, drain=True)

    return read


def _byte_view(t: torch.Tensor) -> np.ndarray:
    flat = t.reshape(-1)
    held = flat.untyped_storage().nbytes() - flat.storage_offset() * flat.element_size()
    if held < flat.numel() * flat.element_size():  # a dtype packing elements (never written)
        raise CheckpointCorruptError(
            f"a {t.dtype} tensor of {flat.numel()} elements holds {held} bytes: not loadable"
        )
    return flat.view(torch.uint8).numpy()


_Segments = dict[str, list[tuple[int, int, int, int]]]
"""By chunk digest, the segments a read takes from it: (tensor, offset in the chunk, bytes,
position in the tensor's bytes)."""


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """An empty tensor for ``what`` of a step; one larger than this host's available memory
    is refused naming it (a damaged or hostile index's, or a step for a larger host) before
    the allocator fails, or the kernel kills the process as it fills."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _CHECKED_ABOVE and nbytes > (available := host_available_bytes()):
        raise TooLargeForHostError(
            f"{what}: {dtype} {shape_text(shape)} is {nbytes} bytes, more than this host's "
            f"available memory ({available} bytes): a damaged index, or a step for a larger host"
        )
    return torch.empty(shape, dtype=dtype)


_CHECKED_ABOVE = 1 << 30  # smaller tensors are not worth reading /proc/meminfo for


def _plan_reads(
    index: RankIndex, wanted: dict[int, torch.Tensor | None]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], _Segments]:
    """For ``read_tensors``: the tensor returned for each of ``wanted``, the tensor its bytes
    are written into (the destination itself, or a temporary) and the segments of each chunk.
    A tensor whose entry's size does not match its dtype and shape is corrupt."""
    out: dict[int, torch.Tensor] = {}
    fill: dict[int, torch.Tensor] = {}
    by_chunk: _Segments = defaultdict(list)
    for i, dest in wanted.items():
        entry = index.tensors[i]
        dtype, shape = parse_dtype(entry.dtype), entry.shape
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if entry.nbytes != expected:
            raise CheckpointCorruptError(
                f"tensor {i} of rank {index.rank}: {entry.nbytes} bytes for {dtype} {shape_text(shape)}"
            )
        if (
            dest is not None
            and dest.device.type == "cpu"
            and dest.is_contiguous()
            and not (dest.is_conj() or dest.is_neg())  # its bytes are not its values
        ):
            target = dest
        else:
            target = new_tensor(shape, dtype, f"tensor {i} of rank {index.rank}")
        out[i] = dest if dest is not None else target
        fill[i] = target
        position = 0
        for seg in entry.segments:
            if seg.nbytes:  # an empty one (a crafted index's) has nothing to copy
                by_chunk[seg.chunk].append((i, seg.offset, seg.nbytes, position))
            position += seg.nbytes
    return out, fill, by_chunk


def read_tensors(
    store: Store,
    index: RankIndex,
    wanted: dict[int, torch.Tensor | None],
    cfg: PipelineConfig,
    *,
    on_chunk: Callable[[int], None] | None = None,
    written: set[int] | None = None,
    source: ChunkSource | None = None,
) -> dict[int, torch.Tensor]:
    """Load the tensors ``wanted`` (index -> destination, or None for a new tensor), their
    chunks from ``source`` (default: ``chunks_from_store``).

    A destination that is CPU and contiguous is filled in place, chunk by chunk, each chunk's
    bytes only once it verified; any other is filled through a temporary and ``copy_``, once
    every chunk verified. ``on_chunk(raw_bytes)`` is called after each chunk (progress).

    When this raises, nothing more is written to a destination (chunks still in flight are
    dropped), and ``written``, if given, holds the indexes of the destinations that received
    bytes (it is filled on success too).
    """
    out, fill, by_chunk = _plan_reads(index, wanted)
    views = {i: _byte_view(t) for i, t in fill.items() if t.numel()}
    in_place = {i for i, dest in wanted.items() if dest is not None and fill[i] is dest}
    touched = written if written is not None else set()
    gate = threading.Condition()
    writers = 0  # chunks being copied into their tensors right now
    stopped = False  # the read failed: copy nothing more

    def deliver(digest: str, raw: np.ndarray) -> int:
        nonlocal writers
        segments = by_chunk[digest]
        for _, offset, nbytes, _ in segments:
            if offset + nbytes > raw.size:
                raise CheckpointCorruptError(
                    f"chunk {digest}: segment [{offset}, {offset + nbytes}) past its end "
                    f"({raw.size} bytes)"
                )
        with gate:
            if stopped:
                return 0
            writers += 1
        try:
            for i, offset, nbytes, position in segments:
                if i in in_place:
                    touched.add(i)
                views[i][position : position + nbytes] = raw[offset : offset + nbytes]
        finally:
            with gate:
                writers -= 1
                gate.notify_all()
        return raw.size

    if source is None:
        source = chunks_from_store(store, index.chunks, cfg)
    results = source(list(by_chunk), deliver)
    try:
        for nbytes in results:
            if on_chunk is not None:
                on_chunk(nbytes)
    except BaseException:
        results.close()  # cancels the fetches not yet started
        # Chunks in flight must not write into the caller's tensors after this returns: the
        # caller is told which tensors were written, and may load them again right away.
        with gate:
            stopped = True
            gate.wait_for(lambda: writers == 0)
        raise
    for i, dest in wanted.items():
        if dest is not None and fill[i] is not dest:
            touched.add(i)
            dest.copy_(fill[i])
    return out
