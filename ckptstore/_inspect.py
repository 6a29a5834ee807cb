"""Reading a committed step for the ``ckptstore`` command: summaries, verification, rebuild.

Nothing here writes to the store. Tensor names of a ``state`` step are their paths in the rank's
JSON tree (``model/0.weight``, ``optim/state/0/exp_avg``); those of a ``dcp`` step are the DCP
storage keys of the rank index (``fqn`` or ``fqn@o0,o1`` for a shard).
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import zstandard

from ckptstore.catalog import list_steps, load_manifest, rank_of, read_rank_index
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    FormatVersionError,
    PickledValueRefusedError,
    StorageError,
    StorageTimeoutError,
    one_line,
)
from ckptstore.format import MAX_CHUNK_BYTES, ChunkInfo, Manifest, RankIndex, chunk_key, commit_key
from ckptstore.health import norm, status
from ckptstore.steps import StepView
from ckptstore.store import Store

logger = logging.getLogger(__name__)


# -- one step ------------------------------------------------------------------------------------


def ratio(raw: int, stored: int) -> float | None:
    return round(raw / stored, 4) if stored else None


def summarize(view: StepView) -> dict[str, Any]:
    """What ``inspect`` shows of a step, as a JSON-ready dict."""
    manifest = view.manifest
    chunks: dict[str, ChunkInfo] = {}
    ranks = []
    tensors = []
    for ref, index in zip(manifest.ranks, view.indexes()):
        chunks.update(index.chunks)
        names = view.tensor_names(index)
        offsets = view.shard_offsets(index)
        raw_total = stored_total = 0
        for i, entry in enumerate(index.tensors):
            raw = entry.nbytes
            # A packed chunk holds several tensors: each gets its share of the stored bytes.
            stored = 0.0
            for seg in entry.segments:
                info = index.chunks.get(seg.chunk)
                if info is not None and info.raw:
                    stored += seg.nbytes * info.stored / info.raw
            raw_total += raw
            stored_total += round(stored)
            digests = list(dict.fromkeys(seg.chunk for seg in entry.segments))
            tensors.append(
                {
                    "name": names[i],
                    "rank": index.rank,
                    "index": i,
                    "dtype": entry.dtype,
                    "shape": list(entry.shape),
                    "numel": _numel(entry.shape),
                    "raw_bytes": raw,
                    "stored_bytes": round(stored),
                    "numpy": entry.numpy,
                    # DCP only: the shard's offsets in the full tensor (None: a pickled object)
                    "offset": offsets.get(i),
                    "object": i in offsets and offsets[i] is None,
                    "chunks": digests,
                    **_tensor_health(entry.health),
                }
            )
        ranks.append(
            {
                "rank": index.rank,
                "index": ref.key,
                "tensors": len(index.tensors),
                "chunks": len(index.chunks),
                "raw_bytes": raw_total,
                "stored_bytes": stored_total,
            }
        )
    raw = sum(c.raw for c in chunks.values())
    stored = sum(c.stored for c in chunks.values())
    return {
        **manifest_summary(manifest),
        "attempt": manifest.attempt,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": ratio(raw, stored),
        "num_chunks": len(chunks),
        "num_tensors": len(tensors),
        "tensor_bytes": sum(t["raw_bytes"] for t in tensors),
        "dcp_metadata": manifest.dcp_metadata.key if manifest.dcp_metadata else None,
        "ranks": ranks,
        "tensors": tensors,
    }


def utc_text(timestamp: float) -> str:
    """``2026-12-04T12:24:32Z``."""
    from datetime import datetime, timezone

    when = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """One line of ``ls``: the step as its manifest describes it."""
    return {
        "step": manifest.step,
        "kind": manifest.kind,
        "world_size": manifest.world_size,
        "created_at": manifest.created_at,
        "created": utc_text(manifest.created_at),
        "raw_bytes": manifest.raw_bytes,
        "stored_bytes": manifest.stored_bytes,
        "compression_ratio": ratio(manifest.raw_bytes, manifest.stored_bytes),
        "user": manifest.user,
        "manifest": commit_key(manifest.step),
        "health": status(manifest.health),
        "health_record": manifest.health,
    }


def _tensor_health(health: list | None) -> dict[str, Any]:
    """A tensor's NaN and Inf counts and norm (None: not floating, or not recorded; a norm
    whose sum of squares overflowed float64 is None too, its counts given)."""
    if health is None:
        return {"nan": None, "inf": None, "norm": None}
    nan, inf, sumsq = health
    return {"nan": nan, "inf": inf, "norm": None if sumsq is None else norm(sumsq)}


def worst_first(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tensors`` (``summarize``'s) with the most NaN and Inf values first, then the largest
    norms; those without health last, in their order."""

    def key(t: dict[str, Any]) -> tuple:
        if t["nan"] is None:
            return (1, 0, 0.0)
        return (0, -(t["nan"] + t["inf"]), -(math.inf if t["norm"] is None else t["norm"]))

    return sorted(tensors, key=key)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# -- verification --------------------------------------------------------------------------------


@dataclass
class Problem:
    """One object of a step that is missing, corrupt or unreadable."""

    step: int
    object: str  # the key, relative to the store
    what: str  # manifest | rank-index | dcp-metadata | chunk
    problem: str  # missing | corrupt | unreadable | unsupported | refused
    error: str
    tensors: list[str] = field(default_factory=list)  # names of tensors whose bytes it holds

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify(exc: BaseException) -> str:
    """missing | unsupported (a format version this reader does not know) | refused (a value
    stored pickled that a safe load does not unpickle; its bytes are intact) | corrupt |
    unreadable (the storage failed: network, permissions)."""
    if isinstance(exc, FileNotFoundError):  # CheckpointNotFoundError, ObjectNotFoundError
        return "missing"
    if isinstance(exc, MemoryError):  # the verifier's memory, not the data, ran out
        return "unreadable"
    if isinstance(exc, FormatVersionError):
        return "unsupported"
    if isinstance(exc, PickledValueRefusedError):
        return "refused"
    if isinstance(exc, CheckpointCorruptError):
        return "corrupt"
    if isinstance(exc, _DECODING):
        return "corrupt"  # a decoder tripping over bytes it did not expect
    # The storage (CheckpointError, OSError) or this process (a thread that cannot start, a
    # RuntimeError: gc --remove-corrupt deleted good steps under a thread limit) failed
    return "unreadable"


# What a decoder raises on bytes it did not expect (RecursionError: JSON nested too deep)
_DECODING = (
    ValueError, KeyError, IndexError, TypeError, struct.error, RecursionError, zstandard.ZstdError
)  # fmt: skip


@dataclass
class StepCheck:
    """What ``verify`` found for one step."""

    step: int
    kind: str | None = None
    world_size: int | None = None
    ranks: int = 0
    tensors: int = 0
    chunks: int = 0
    raw_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    # chunk digest -> what reading it found (None: fine); filled once the chunks are checked.
    chunk_refs: dict[str, ChunkInfo | None] = field(default_factory=dict)
    users: dict[str, list[str]] = field(default_factory=dict)  # digest -> tensor names

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ok": self.ok,
            "kind": self.kind,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "tensors": self.tensors,
            "chunks": self.chunks,
            "raw_bytes": self.raw_bytes,
            "problems": [p.as_dict() for p in self.problems],
        }


def check_step_objects(store: Store, step: int) -> StepCheck:
    """Check the manifest, rank indexes and DCP metadata of ``step`` and the structure of the
    indexes; list the chunks to re-hash in ``chunk_refs`` (done by :func:`check_chunks`)."""
    check = StepCheck(step=step)
    try:
        manifest = load_manifest(store, step)
    except Exception as exc:  # noqa: BLE001 - reported as a problem of this object
        check.problems.append(
            Problem(step, commit_key(step), "manifest", classify(exc), message(exc))
        )
        return check
    check.kind, check.world_size = manifest.kind, manifest.world_size
    try:
        view = StepView(store, manifest)
    except CheckpointError as exc:
        check.problems.append(Problem(step, commit_key(step), "manifest", "corrupt", message(exc)))
        return check
    indexes: dict[int, RankIndex] = {}
    for ref in manifest.ranks:
        try:
            index = read_rank_index(store, ref)
            view.check_kind(index, store.url(ref.key))
        except Exception as exc:  # noqa: BLE001 - reported as a problem of this object
            check.problems.append(Problem(step, ref.key, "rank-index", classify(exc), message(exc)))
            continue
        check.ranks += 1
        check.tensors += len(index.tensors)
        indexes[rank_of(ref.key)] = index
        names = view.tensor_names(index)
        for i, entry in enumerate(index.tensors):
            label = names[i] if manifest.world_size == 1 else f"{names[i]} (rank {index.rank})"
            for seg in entry.segments:
                users = check.users.setdefault(seg.chunk, [])
                if not users or users[-1] != label:
                    users.append(label)
        for digest, info in index.chunks.items():
            check.chunk_refs.setdefault(digest, info)
        for digest in check.users:
            check.chunk_refs.setdefault(digest, None)
    check.chunks = len(check.chunk_refs)
    check.raw_bytes = sum(info.raw for info in check.chunk_refs.values() if info is not None)
    for found in view.problems(indexes):
        check.problems.append(
            Problem(
                step,
                found.key,
                found.what,
                classify(found.error),
                message(found.error) + found.hint,
            )
        )
    return check


def check_chunks(
    store: Store,
    chunks: dict[str, ChunkInfo | None],
    *,
    read_concurrency: int = 8,
    on_chunk: Callable[[int], None] | None = None,
) -> Iterator[tuple[str, BaseException | None]]:
    """Fetch, decode and re-hash every chunk; yields ``(digest, error or None)`` for each,
    never stopping at the first bad one. Once ``read_concurrency`` (at least 3) reads in a row
    got no answer in time (the store stopped answering), the rest are unreadable at once, not
    after a timeout each, but for a probe now and then whose answer reads on."""
    from ckptstore import pipeline  # torch: only where chunks are read
    from ckptstore.device import host_available_bytes

    silent = _Silence(read_concurrency)

    def one(item: tuple[str, ChunkInfo | None]) -> tuple[str, BaseException | None, int]:
        digest, info = item
        skipped = silent.skip()
        if skipped is not None:
            return digest, skipped, info.raw if info is not None else 0
        try:
            # A chunk decodes into its declared raw size: one beyond any chunk this format
            # writes now and the host's memory is not tried (a hostile index's 64 GiB chunk of
            # 2 MB stored); a chunk of at most MAX_CHUNK_BYTES always is.
            if (
                info is not None
                and info.raw > MAX_CHUNK_BYTES
                and info.raw > (available := host_available_bytes()) // read_concurrency
            ):
                raise MemoryError(
                    f"chunk {chunk_key(digest)} declares {info.raw} raw bytes, more than this "
                    f"host's available memory ({available} bytes) allows each of "
                    f"{read_concurrency} reads"
                )
            raw = pipeline.fetch_chunk(store, digest, info, scratch=info is not None)
            if info is not None and raw.size != info.raw:
                raise CheckpointCorruptError(
                    f"chunk {store.url(chunk_key(digest))}: {raw.size} raw bytes, "
                    f"the index says {info.raw}"
                )
            silent.heard(None)
            return digest, None, int(raw.size)
        except Exception as exc:  # noqa: BLE001 - reported; verification goes on
            silent.heard(exc)
            return digest, exc, info.raw if info is not None else 0

    for digest, error, nbytes in store.map(
        one, list(chunks.items()), max_concurrency=read_concurrency
    ):
        if on_chunk is not None:
            on_chunk(nbytes)
        yield digest, error


class _Silence:
    """Reads of one check that got no answer in time, in a row: after ``limit`` of them the
    store is taken to have stopped answering, and later reads are skipped (:meth:`skip`) but
    for one in ``limit``, a probe: an answer to it reads on. After ``PROBES`` probes in a row
    got none, no more: the probes wait one after another, and a check of thousands of chunks
    would last as long as the store's silence, whatever the timeout."""

    PROBES = 3

    def __init__(self, limit: int) -> None:
        self.limit = max(3, limit)
        self._lock = threading.Lock()
        self._in_a_row = 0
        self._skipped = 0
        self._last: BaseException | None = None

    def heard(self, error: BaseException | None) -> None:
        with self._lock:
            if isinstance(error, StorageTimeoutError):
                self._in_a_row += 1
                self._last = error
            else:  # an answer, good or bad
                self._in_a_row = self._skipped = 0

    def skip(self) -> StorageTimeoutError | None:
        """The error of a read not made (the store stopped answering); None: read it."""
        with self._lock:
            if self._in_a_row < self.limit:
                return None
            self._skipped += 1
            if self._skipped % self.limit == 0 and self._in_a_row < self.limit + self.PROBES:
                return None  # a probe
            return StorageTimeoutError(
                f"not read: the store stopped answering ({self._in_a_row} reads in a row got "
                f"no answer in time; the last: {one_line(self._last)})"
            )


def verify_steps(
    store: Store,
    steps: list[int],
    *,
    read_concurrency: int = 8,
    on_chunk: Callable[[int], None] | None = None,
) -> list[StepCheck]:
    """Re-check ``steps`` completely: manifests, rank indexes, DCP metadata, and every chunk
    fetched, decoded and re-hashed once however many steps share it. Never stops at the first
    problem; each :class:`StepCheck` lists its own."""
    checks = [check_step_objects(store, step) for step in steps]
    check_all_chunks(store, checks, read_concurrency=read_concurrency, on_chunk=on_chunk)
    return checks


UNREAD = (
    "the reads failed (the store did not answer or refused them, or this machine ran out of "
    "memory): this says nothing of the checkpoint"
)


def problems_error(uri: str, problems: list[Problem]) -> CheckpointError:
    """The error a verify that found ``problems`` raises, as the CLI reports them: reads that
    failed (``unreadable``) say nothing of the checkpoint (``StorageError``), unless there is
    damage beside them; values stored pickled are intact (``PickledValueRefusedError``)."""
    shown = "; ".join(f"step {p.step}: {p.object} {p.problem} ({p.error})" for p in problems[:5])
    more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    found = {p.problem for p in problems} - {"unreadable"}
    kind = {
        frozenset(): StorageError,
        frozenset({"missing"}): CheckpointNotFoundError,
        frozenset({"refused"}): PickledValueRefusedError,
        frozenset({"unsupported"}): FormatVersionError,
    }.get(frozenset(found), CheckpointCorruptError)
    why = f" ({UNREAD})" if not found else ""
    return kind(f"{len(problems)} problem(s) in {uri}: {shown}{more}{why}")


def removed_while_checked(store: Store, checks: list[StepCheck]) -> list[int]:
    """The steps of ``checks`` with problems that are no longer committed: a job's keep_last
    or a gc removed them while they were checked, and their missing objects say nothing of
    the store. A step still listed (its commit a broken link, say) keeps its problems, as
    every step does when the store cannot be listed."""
    if not any(check.problems for check in checks):
        return []
    try:
        listed = set(list_steps(store))
    except CheckpointError:
        return []
    return [c.step for c in checks if c.problems and c.step not in listed]


def chunks_to_check(checks: list[StepCheck]) -> dict[str, ChunkInfo | None]:
    """Every chunk the ``checks`` reference, once (with its sizes where an index gave them)."""
    chunks: dict[str, ChunkInfo | None] = {}
    for check in checks:
        for digest, info in check.chunk_refs.items():
            if chunks.get(digest) is None:
                chunks[digest] = info
    return chunks


def check_all_chunks(
    store: Store,
    checks: list[StepCheck],
    *,
    read_concurrency: int = 8,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Re-hash every chunk the ``checks`` reference once; add a problem to each step that
    uses a bad one."""
    chunks = chunks_to_check(checks)
    errors = dict(check_chunks(store, chunks, read_concurrency=read_concurrency, on_chunk=on_chunk))
    for check in checks:
        for digest in check.chunk_refs:
            error = errors[digest]
            if error is not None:
                check.problems.append(
                    Problem(
                        check.step,
                        chunk_key(digest),
                        "chunk",
                        classify(error),
                        message(error),
                        tensors=check.users.get(digest, []),
                    )
                )


def message(exc: BaseException) -> str:
    """The first line of an error, for a one-line report."""
    if isinstance(exc, MemoryError):
        why = f": {exc}" if str(exc) else ""
        return f"out of memory while checking it (the data itself was not judged){why}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, (CheckpointError, OSError)) and first:
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
