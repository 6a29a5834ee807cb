"""Tier copies between nodes over the process group, never through storage.

A ``Transfer`` copies one committed copy (a step of one rank's state, ``ward``) from the local
tier of rank ``src`` into the local tier of rank ``dst``: after a save, each rank's copy to its
holders; on restore, a holder's copy back to a rank whose node lost it. Every rank of the group
calls ``transfer`` with the same list (it is collective); a rank takes part in the transfers
that name it. The destination ends with a byte-identical copy: the same chunks, index and
manifest, the manifest written last, under a save lease of its store.

Per transfer: the source sends the manifest and index (and a DCP copy's metadata); the destination answers with the chunks
it lacks (those of its newest copy are known stored, under its one lease: ``open_destination``); the
source sends those in rounds of at most half of ``budget_bytes`` (a larger chunk alone), each
chunk from its store's mapped pages (no copy), then a status byte per chunk; two rounds are in
flight: one crosses while the destination checks the last. The destination decodes and hashes
every chunk before it writes it (a bad byte never enters a tier, where later saves would reuse
it), then writes index and manifest. Memory: two receive buffers per transfer a rank receives,
reused round after round, at most ``budget_bytes`` together (or two chunks, where a chunk is
larger than half of it); a repair held in memory (below) receives each round into a buffer of
its own instead, made and touched ahead of the round by a thread where the host has a core per
rank (``_FaultAhead``). A failure (unreadable source, bad chunk, full disk) fails that transfer
alone, after every rank finished the exchange; the outcomes are agreed by every rank. A repair's
source learns which chunks its destination refused, checks them in its own store and unlists its
copy where one is damaged there (``drop_if_damaged``), so that no later load plans on it.

A load's repair (``restore_copies``) whose copy's stored chunks take at most
``TierPolicy.repair_memory_bytes`` keeps what it verified instead of writing it: the decoded
manifest and index, the DCP metadata and every chunk as stored (``RepairedCopy``). The load
reads its tensors from those bytes (decoded, not hashed again) and then hands the copy to
``write_behind``: a thread of its own writes the chunks, index and metadata and commits the
manifest last under the save lease the transfer took (``RepairedCopy.write_local``), and the
next save, tiered load, repair or ``close()`` waits for it (``wait_written``). Until the
manifest lands the copy is unlisted, so a crash in between leaves at most unreferenced chunks
and an index, which local retention collects.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptstore.catalog import (
    commit_manifest,
    list_steps,
    load_manifest,
    load_manifest_bytes,
    load_rank_index,
    read_object,
    read_rank_index_bytes,
)
from ckptstore.codec import decode
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ObjectExistsError,
    UnsafeObjectError,
    one_line,
)
from ckptstore.format import (
    ChunkInfo,
    Manifest,
    RankIndex,
    chunk_key,
    commit_key,
    decode_manifest,
    decode_rank_index,
    object_ref,
)
from ckptstore.leases import SAVE, Lease, acquire_save_lease
from ckptstore.pipeline import fetch_chunk
from ckptstore.retention import drop_step
from ckptstore.shared_read import cut_rounds
from ckptstore.tiers.committed import CommittedCopy
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.restore import PEER, LoadReport

logger = logging.getLogger(__name__)

_OK = 1
_BAD = 2


class Damage(str):
    """A transfer's outcome that says the copy's bytes are damaged or missing at one end: data
    a load may pass over for an older step. Any other outcome (a disk that is full or fails, a
    lease not taken) says nothing of the data: a resume does not skip the step for it."""


def _outcome(what: str, exc: BaseException) -> str:
    """``what`` failed with ``exc``, as an outcome: ``Damage`` unless ``exc`` is a storage
    failure other than a missing object."""
    text = f"{what}: {one_line(exc)}"
    # A missing object, or one that is no plain file of the store (a link out, a FIFO), is
    # the copy's damage; any other OSError is the disk's or the store's.
    storage = isinstance(exc, OSError) and not isinstance(
        exc, (FileNotFoundError, UnsafeObjectError)
    )
    return text if storage else Damage(text)


def _either(first: str | None, then: str) -> str:
    """One transfer's outcome from two of its errors: the first, unless it says damage and the
    other does not (a source that could not read a chunk, and the destination that lacks it)."""
    if first is None or (isinstance(first, Damage) and not isinstance(then, Damage)):
        return then
    return first


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    ward: int
    step: int
    attempt: str
    repair: bool = False
    """A restore's transfer: the destination's own copy of this save failed, so whatever it
    holds of it (manifest, index, chunks) is checked or replaced, never trusted."""


@dataclass
class TransferStats:
    """What one rank's transfers moved."""

    sent_bytes: int = 0
    received_bytes: int = 0
    chunks_sent: int = 0
    chunks_received: int = 0
    chunks_already_held: int = 0
    chunks_from_node: int = 0  # taken from another copy on this node instead of the wire
    chunks_kept_here: int = 0  # a repair's chunks that this rank's own store still held intact
    buffer_bytes: int = 0  # the most receive-buffer bytes held at once
    rounds_in_flight: int = 0  # the most rounds posted and not yet finished at once
    seconds: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _Outgoing:
    t: Transfer
    header: bytes = b""  # manifest + index + DCP metadata (a DCP copy's)
    sizes: tuple[int, int, int, int] = (0, 0, 0, 0)  # manifest, index, chunk count, metadata
    index: RankIndex | None = None
    lease: Lease | None = None
    error: str | None = None
    send: list[str] = field(default_factory=list)
    suspect: list[str] = field(default_factory=list)  # chunks this copy could not send whole


@dataclass
class _Incoming:
    t: Transfer
    lease: Lease | None = None  # the destination's save lease of its store, until the commit
    known: dict[str, ChunkInfo] = field(default_factory=dict)  # stored here, under that lease
    manifest: bytes = b""
    index_bytes: bytes = b""
    index: RankIndex | None = None
    index_key: str = ""
    metadata: tuple[str, bytes] | None = None  # a DCP copy's metadata object: key, bytes
    error: str | None = None
    held: bool = False  # the step is already there, this very save
    want: list[str] = field(default_factory=list)
    kept: dict[str, Any] | None = None  # a repair held in memory: digest -> verified bytes
    in_place: set[str] = field(default_factory=set)  # verified where they are: not written again
    decoded: Manifest | None = None  # the manifest, as ``take_header`` decoded and checked it
    buffers: list[torch.Tensor] = field(default_factory=list)  # ``_ring``'s, when not kept
    ahead: _FaultAhead | None = None  # a kept repair's buffers, on a core per rank
    refused: list[str] = field(default_factory=list)  # chunks that arrived and failed a check


@dataclass
class _Posted:
    """A round ``post_round`` started: its sends' and receives' works, what each destination
    takes from it, the bytes of its receive buffers, and what it sends (mapped pages)."""

    works: list[Any]
    takes: list[tuple[_Incoming, list[str], torch.Tensor]]
    nbytes: int
    sends: list[tuple[torch.Tensor, int]]  # held until the works are done


@dataclass
class RepairedCopy:
    """A repair's copy of rank ``ward``'s save as this rank received and verified it, held in
    memory so that the load reads it from there (no second read, no second hash): the decoded
    manifest and index, the DCP metadata object of a DCP copy, and every chunk as stored
    (digest -> bytes, each hashed once on arrival). ``write_local`` then writes it to the local
    tier (chunks, index, metadata, the manifest last) under the lease its transfer took."""

    ward: int
    step: int
    manifest: Manifest
    index: RankIndex
    index_bytes: bytes
    metadata: bytes | None
    chunks: dict[str, Any]  # bytes, or views of the round buffers they arrived in
    _write: Callable[[], None] | None = field(default=None, repr=False)

    def fetch(self, digest: str, info: ChunkInfo | None = None) -> np.ndarray:
        """A ``ChunkFetch``: the chunk's raw bytes, decoded from memory, not hashed again."""
        data, chunk = self.chunks.get(digest), self.index.chunks.get(digest)
        if data is None or chunk is None:
            raise CheckpointNotFoundError(
                f"chunk {digest} is not in rank {self.ward}'s copy of step {self.step}"
            )
        name = f"{digest} of rank {self.ward}'s repaired copy"
        return decode(data, expected_hash=digest, name=name, raw_len=chunk.raw, verify=False)

    def write_local(self) -> None:
        """Write the copy to this node's local tier and commit it (once; the chunks are let go
        after). A failure is a warning: the load has its bytes, the next load repairs again."""
        write, self._write = self._write, None
        if write is not None:
            write()
        self.chunks = {}


@dataclass
class _Rounds:
    """Each transfer's chunks in rounds, as this rank sends (``out``) and receives (``into``)
    them; how many rounds both ends agreed on; the most any transfer of this rank has."""

    out: dict[Transfer, list[list[str]]]
    into: dict[Transfer, list[list[str]]]
    agreed: dict[Transfer, int]
    total: int


def _rounds(digests: list[str], chunks: dict[str, ChunkInfo], budget: int) -> list[list[str]]:
    """Stored chunks and their status bytes, in rounds of at most half of ``budget`` bytes (a
    larger chunk alone): two rounds of a transfer are in flight at once."""
    return cut_rounds([(d, chunks[d].stored + 1) for d in digests], max(1, budget // 2))


def _round_bytes(round_: list[str], chunks: dict[str, ChunkInfo]) -> int:
    return sum(chunks[d].stored + 1 for d in round_)


def _ring(
    buffers: list[torch.Tensor], i: int, rounds: list[list[str]], chunks: dict[str, ChunkInfo]
) -> torch.Tensor:
    """Round ``i``'s receive buffer of a transfer that keeps none of its rounds: one of two,
    reused every other round (round ``i - 2`` is done by the time round ``i`` is posted)."""
    if not buffers:
        largest = max(_round_bytes(r, chunks) for r in rounds)
        buffers += [torch.empty(largest, dtype=torch.uint8) for _ in rounds[:2]]
    return buffers[i % 2][: _round_bytes(rounds[i], chunks)]


class _FaultAhead:
    """Fresh receive buffers of ``sizes`` bytes, in order, each page touched by a thread of its
    own at most ``ahead`` buffers before the round that takes it (``take``): a kept repair's
    rounds (held for the load, never reused) then receive into pages already there. Into
    untouched memory each page's fault and zeroing happen inside the copy off the socket, and
    a round crosses at about half the rate of a warm buffer (docs/BENCHMARKS.md). Only where
    the host has a core per rank (``cores_per_rank``): with more ranks than cores, the thread
    slowed the restore down."""

    def __init__(self, sizes: list[int], ahead: int = 2) -> None:
        self._futures: list[Future] = [Future() for _ in sizes]
        self._room = threading.Semaphore(ahead)
        threading.Thread(
            target=self._make, args=(sizes,), name="ckptstore-repair-buffers", daemon=True
        ).start()

    def _make(self, sizes: list[int]) -> None:
        for size, future in zip(sizes, self._futures):
            self._room.acquire()
            if not future.set_running_or_notify_cancel():
                continue  # ``cancel``led
            try:
                buf = torch.empty(size, dtype=torch.uint8)
                buf.numpy()[:: mmap.PAGESIZE] = 0
                future.set_result(buf)
            except BaseException as exc:  # noqa: BLE001 - the round that takes it raises it
                future.set_exception(exc)

    def take(self, i: int) -> torch.Tensor:
        try:
            return self._futures[i].result()
        finally:
            self._room.release()

    def cancel(self) -> None:
        """The buffers no round took are not made (an exchange that ended early)."""
        for future in self._futures:
            future.cancel()
        for _ in self._futures:
            self._room.release()


def cores_per_rank(ranks_on_host: int) -> float:
    """The cores this rank may count on: its own where ranks are bound to cores of their own
    (fewer than the host's), else the host's shared by the ranks on it."""
    total = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return mine if mine < total else total / max(1, ranks_on_host)


def _intact(store, digest: str, info: ChunkInfo) -> bool:
    """Whether the stored chunk ``digest`` has the size and hash it should."""
    try:
        fetch_chunk(store, digest, info, scratch=True)
    except (CheckpointError, OSError):
        return False
    return True


class _Exchange:
    def __init__(
        self,
        group: Any,
        local: LocalTier,
        budget_bytes: int,
        keep_bytes: int = -1,
        fault_ahead: bool = False,
    ) -> None:
        self.group = group
        self.local = local
        self.budget = budget_bytes
        self.keep_bytes = keep_bytes  # a repair's copy up to this many bytes stays in memory
        self.fault_ahead = fault_ahead  # its receive buffers touched ahead (``_FaultAhead``)
        self.rank = dist.get_rank(group)
        self.stats = TransferStats()

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _start(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
    ) -> list[Any]:
        ops = [dist.P2POp(dist.isend, t, self._global(peer), self.group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(peer), self.group) for t, peer in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def _p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
        for work in self._start(sends, recvs):
            work.wait()

    # -- the source side ----------------------------------------------------------------------

    def open_source(self, t: Transfer, copy: CommittedCopy | None = None) -> _Outgoing:
        out = _Outgoing(t)
        if copy is not None and (copy.ward, copy.step, copy.attempt) == (t.ward, t.step, t.attempt):
            # As the local commit just wrote it, under its lease, which the caller holds until
            # the transfer ends: nothing read back.
            out.index = copy.index
            out.header = copy.manifest_bytes + copy.index_bytes + copy.metadata
            out.sizes = (
                len(copy.manifest_bytes),
                len(copy.index_bytes),
                len(copy.index.chunks),
                len(copy.metadata),
            )
            return out
        try:
            store = self.local.store(t.ward)
            # Under a save lease no sweep removes the chunks while they are sent.
            out.lease = Lease(
                store,
                SAVE,
                f"{t.step:020d}-{t.attempt}-copy{t.dst:05d}-{uuid.uuid4().hex[:12]}",
                ttl_s=self.local.engine.lease_ttl_s,
                info={"step": t.step, "attempt": t.attempt, "copy_to": t.dst},
            ).acquire()
            manifest, manifest_bytes = load_manifest_bytes(store, t.step)
            if manifest.attempt != t.attempt or not self.local.belongs(manifest, t.ward):
                raise CheckpointError(
                    f"{store.uri} holds another save of step {t.step} ({manifest.attempt})"
                )
            index, index_bytes = read_rank_index_bytes(store, manifest.ranks[0])
            metadata = b""
            if manifest.dcp_metadata is not None:
                metadata = read_object(store, manifest.dcp_metadata, "DCP metadata")
            out.index = index
            out.header = manifest_bytes + index_bytes + metadata
            out.sizes = (len(manifest_bytes), len(index_bytes), len(index.chunks), len(metadata))
        except (CheckpointError, OSError) as exc:
            out.error = _outcome(f"rank {self.rank} cannot read its copy of rank {t.ward}", exc)
        return out

    def parts(self, out: _Outgoing, round_: list[str]) -> list[torch.Tensor]:
        """What the source sends of ``round_``: each chunk's stored bytes as its store maps
        them (no copy; zeros for one it cannot read), then one status byte per chunk."""
        store = self.local.store(out.t.ward)
        parts, status = [], torch.full((len(round_),), _OK, dtype=torch.uint8)
        for k, digest in enumerate(round_):
            info = out.index.chunks[digest]
            try:
                data = store.get_view(chunk_key(digest), 0, info.stored + 1)
                if len(data) != info.stored:
                    raise CheckpointError(f"chunk {digest}: {len(data)} bytes, not {info.stored}")
                with warnings.catch_warnings():  # read-only pages: gloo only reads them
                    warnings.simplefilter("ignore", UserWarning)
                    parts.append(torch.frombuffer(data, dtype=torch.uint8))
                self.stats.chunks_sent += 1
                self.stats.sent_bytes += info.stored
            except (CheckpointError, OSError) as exc:
                parts.append(torch.zeros(info.stored, dtype=torch.uint8))
                status[k] = _BAD
                out.suspect.append(digest)
                out.error = out.error or _outcome(
                    f"rank {self.rank} cannot read chunk {digest}", exc
                )
        return parts + [status]

    # -- the destination side -----------------------------------------------------------------

    def open_destination(self, t: Transfer) -> _Incoming:
        """One save lease of ``t.ward``'s store here, taken (once no gc sweeps) before anything
        stored is looked at and held until the copy's manifest is written (``commit``); then
        the chunks its newest copy of that ward holds, known stored (none for a repair: what
        the store holds of the save may be bad; its manifest is unlisted once the source's
        header arrived whole, ``take_header``)."""
        inc = _Incoming(t)
        engine = self.local.engine
        try:
            store = self.local.store(t.ward)  # made if missing: a local_dir gone bad fails here
            inc.lease = acquire_save_lease(
                store,
                f"{t.step:020d}-{t.attempt}-from{t.src:05d}",
                ttl_s=engine.lease_ttl_s,
                gc_wait_s=engine.gc_wait_s,
                what=f"copy of rank {t.ward}'s step {t.step}",
                info={"step": t.step, "attempt": t.attempt, "rank": 0, "copy_from": t.src},
            )
            if not t.repair:
                existing, inc.known = self.local.newest_copy(t.ward, t.step)
                if existing is not None and existing != t.attempt:
                    raise CheckpointError(f"{store.uri} holds another save of step {t.step}")
                inc.held = existing is not None
        except (CheckpointError, OSError) as exc:
            inc.error = f"rank {self.rank} cannot take rank {t.ward}'s copy: {one_line(exc)}"
        if inc.held or inc.error is not None:
            _release(inc)  # nothing to write
        return inc

    def take_header(self, inc: _Incoming, header: bytes, sizes: tuple[int, int, int, int]) -> None:
        if inc.error or inc.held:
            return
        t, store = inc.t, self.local.store(inc.t.ward)
        try:
            manifest = decode_manifest(
                header[: sizes[0]], f"copy of {store.url(commit_key(t.step))}"
            )
            if (
                manifest.step != t.step
                or manifest.attempt != t.attempt
                or not self.local.belongs(manifest, t.ward)
                or len(manifest.ranks) != 1
            ):
                raise CheckpointError(f"rank {t.src} sent another save than step {t.step}")
            ref = manifest.ranks[0]
            index_bytes = header[sizes[0] : sizes[0] + sizes[1]]
            if object_ref(ref.key, index_bytes) != ref:
                raise CheckpointError(f"rank {t.src} sent an index that its manifest does not name")
            metadata = header[sizes[0] + sizes[1] : sizes[0] + sizes[1] + sizes[3]]
            if manifest.dcp_metadata is not None:
                if object_ref(manifest.dcp_metadata.key, metadata) != manifest.dcp_metadata:
                    raise CheckpointError(
                        f"rank {t.src} sent DCP metadata that its manifest does not name"
                    )
                inc.metadata = (manifest.dcp_metadata.key, metadata)
            elif metadata:
                raise CheckpointError(f"rank {t.src} sent DCP metadata its manifest does not name")
            inc.index = decode_rank_index(index_bytes, store.url(ref.key))
            if t.repair and store.exists(commit_key(t.step)):
                # Unlisted only once a copy to replace it arrived, until that one is committed.
                drop_step(store, t.step)
            inc.manifest, inc.index_bytes, inc.index_key = header[: sizes[0]], index_bytes, ref.key
            inc.decoded = manifest
            if t.repair and sum(c.stored for c in inc.index.chunks.values()) <= self.keep_bytes:
                inc.kept = {}  # held for the load, written after it (``RepairedCopy``)
            inc.want = [d for d in sorted(inc.index.chunks) if d not in inc.known]
            self.stats.chunks_already_held += len(inc.index.chunks) - len(inc.want)
            inc.want = self.take_from_node(inc)
        except (CheckpointError, OSError, ValueError) as exc:
            inc.error = _outcome(
                f"rank {self.rank}: the copy of rank {t.ward} from rank {t.src}", exc
            )

    def take_from_node(self, inc: _Incoming) -> list[str]:
        """The chunks ``inc`` still wants from its source, each taken from the nearest holder
        that verifies: in a repair, the destination's own store first (a copy with one bad
        chunk sends one chunk over the wire, not the copy); then another copy on this node
        (replicated state: a data-parallel rank of this node saved the same bytes), verified
        and copied, instead of crossing the wire."""
        assert inc.index is not None
        store = self.local.store(inc.t.ward)
        siblings = [self.local.store(w) for w in self.local.wards_here() if w != inc.t.ward]
        holders = ([store] if inc.t.repair else []) + siblings
        if not inc.want or not holders:
            return inc.want

        def copy(digest: str) -> str | None:
            info = inc.index.chunks[digest]
            key = chunk_key(digest)
            for holder in holders:
                try:
                    data = holder.get(key, 0, info.stored + 1)  # one more tells a longer one
                    if len(data) != info.stored:
                        continue
                    decode(data, expected_hash=digest, name=holder.url(key), raw_len=info.raw)
                    if holder is store:
                        inc.in_place.add(digest)  # intact where it is
                    if inc.kept is not None:
                        inc.kept[digest] = data
                    elif holder is not store:  # a bad one of a repair's store is replaced
                        _put_chunk(store, digest, info, data, repair=inc.t.repair)
                except (CheckpointError, OSError):
                    continue
                return None
            return digest

        wanted = [d for d in store.map(copy, inc.want, drain=True) if d is not None]
        here = len(inc.in_place)
        self.stats.chunks_kept_here += here
        self.stats.chunks_from_node += len(inc.want) - len(wanted) - here
        return wanted

    def store_round(self, inc: _Incoming, round_: list[str], buffer: torch.Tensor) -> None:
        if inc.error:
            return
        store = self.local.store(inc.t.ward)  # made already: open_destination took its lease
        view = buffer.numpy()
        items, position = [], 0
        for digest in round_:
            info = inc.index.chunks[digest]
            items.append((digest, info, position))
            position += info.stored
        status = view[position:]
        if inc.error:
            return

        def put(k: int) -> None:
            digest, info, start = items[k]
            if status[k] != _OK:
                raise CheckpointCorruptError(f"rank {inc.t.src} could not read chunk {digest}")
            data = view[start : start + info.stored]
            name = f"{digest} of rank {inc.t.ward} from rank {inc.t.src}"
            try:
                decode(data, expected_hash=digest, name=name, raw_len=info.raw)
            except CheckpointError:
                inc.refused.append(digest)
                raise
            if inc.kept is not None:
                inc.kept[digest] = data  # a view: the round's buffer stays for the load
            else:
                _put_chunk(store, digest, info, data, repair=inc.t.repair)
            self.stats.chunks_received += 1
            self.stats.received_bytes += info.stored

        try:
            for _ in store.map(put, range(len(items)), drain=True):
                pass
        except (CheckpointError, OSError) as exc:
            inc.error = _outcome(
                f"rank {self.rank}: the copy of rank {inc.t.ward} from rank {inc.t.src}", exc
            )

    def write_kept(self, inc: _Incoming) -> None:
        """A kept repair's deferred write (``RepairedCopy.write_local``): its chunks, then
        index, metadata and manifest (``commit``), then the lease released."""
        store, kept = self.local.store(inc.t.ward), inc.kept or {}
        assert inc.index is not None
        chunks = inc.index.chunks

        def put(digest: str) -> None:
            _put_chunk(store, digest, chunks[digest], kept[digest], repair=True)

        try:
            for _ in store.map(put, sorted(set(kept) - inc.in_place), drain=True):
                pass
        except (CheckpointError, OSError) as exc:
            inc.error = f"writing chunks: {one_line(exc)}"
        self.commit(inc)
        if inc.error is not None:
            logger.warning(
                "rank %d: the copy of rank %d's step %d restored from rank %d was loaded but "
                "could not be written to %s (the next load restores it again): %s",
                self.rank,
                inc.t.ward,
                inc.t.step,
                inc.t.src,
                store.uri,
                inc.error,
            )

    def commit(self, inc: _Incoming) -> None:
        """The copy's index and DCP metadata, then, its lease checked, its manifest, written
        once (``catalog.commit_manifest``: an ambiguous put read back); the lease released
        once every put that may still land has; then local retention."""
        if inc.held:
            return
        try:
            if inc.error is None:
                store = self.local.store(inc.t.ward)
                objects = [(inc.index_key, inc.index_bytes)]
                if inc.metadata is not None:
                    objects.append(inc.metadata)
                for key, data in objects:
                    _put_copy_object(store, key, data, repair=inc.t.repair)
                if inc.lease is not None:
                    inc.lease.check()
                commit_manifest(store, inc.t.step, inc.manifest)
        except (CheckpointError, OSError) as exc:
            inc.error = (
                f"rank {self.rank}: committing the copy of rank {inc.t.ward}: {one_line(exc)}"
            )
        finally:
            _release(inc)
        if inc.error is None:
            self.local.retain(inc.t.ward)

    # -- the phases of a transfer, every rank in the same order ------------------------------

    def exchange_headers(
        self, outgoing: list[_Outgoing], incoming: list[_Incoming]
    ) -> dict[Transfer, tuple[int, int, int, int] | str]:
        """Headers: sizes (or an error) of what each source sends; then the bytes point to
        point, taken by each destination. Returns what every source told."""
        headers = self._gather({o.t: (o.sizes if o.error is None else o.error) for o in outgoing})
        told = {t: h for part in headers for t, h in part.items()}
        sends = [
            (torch.frombuffer(bytearray(o.header), dtype=torch.uint8), o.t.dst)
            for o in outgoing
            if o.error is None
        ]
        recvs = []
        for inc in incoming:
            h = told[inc.t]
            if isinstance(h, str):
                inc.error = inc.error or h
            else:
                size = h[0] + h[1] + h[3]
                recvs.append((torch.empty(size, dtype=torch.uint8), inc.t.src, inc, h))
        self._p2p(sends, [(buf, src) for buf, src, _, _ in recvs])
        for buf, _, inc, h in recvs:
            self.take_header(inc, bytes(buf.numpy()), h)
        return told

    def exchange_masks(
        self,
        outgoing: list[_Outgoing],
        incoming: list[_Incoming],
        told: dict[Transfer, tuple[int, int, int, int] | str],
    ) -> None:
        """Which chunks each destination lacks: a mask over the index's chunks, sorted."""
        masks_out = []
        for inc in incoming:
            if isinstance(told[inc.t], str):
                continue
            n = told[inc.t][2]
            mask = torch.zeros(max(n, 1), dtype=torch.uint8)
            if inc.index is not None and inc.error is None:
                wanted = set(inc.want)
                for i, digest in enumerate(sorted(inc.index.chunks)):
                    mask[i] = digest in wanted
            masks_out.append((mask, inc.t.src))
        masks_in = []
        for o in outgoing:
            if o.error is None:
                masks_in.append((torch.zeros(max(len(o.index.chunks), 1), dtype=torch.uint8), o))
        self._p2p(masks_out, [(m, o.t.dst) for m, o in masks_in])
        for mask, o in masks_in:
            digests = sorted(o.index.chunks)
            o.send = [d for i, d in enumerate(digests) if mask[i]]

    def agree_rounds(
        self, transfers: list[Transfer], outgoing: list[_Outgoing], incoming: list[_Incoming]
    ) -> _Rounds:
        """Chunks, in rounds of at most ``budget`` bytes per transfer; both ends must agree on
        every transfer's rounds, whatever failed on either side."""
        out = {
            o.t: _rounds(o.send, o.index.chunks, self.budget) for o in outgoing if o.error is None
        }
        into = {
            inc.t: _rounds(inc.want, inc.index.chunks, self.budget)
            for inc in incoming
            if inc.index is not None and inc.error is None
        }
        counts = self._gather(
            {t: len(r) for t, r in out.items()} | {("in", t): len(r) for t, r in into.items()}
        )
        agreed: dict[Transfer, int] = {}
        for part in counts:
            for key, n in part.items():
                t = key[1] if isinstance(key, tuple) and key and key[0] == "in" else key
                agreed[t] = min(agreed.get(t, n), n)
        for t in transfers:
            agreed.setdefault(t, 0)
        total = max([agreed[t] for t in transfers if self.rank in (t.src, t.dst)] or [0])
        return _Rounds(out, into, agreed, total)

    def post_round(
        self, i: int, outgoing: list[_Outgoing], incoming: list[_Incoming], rounds: _Rounds
    ) -> _Posted:
        """Start round ``i`` of every transfer that has one: sources send their chunks' bytes
        and status bytes, destinations post a receive for each into one buffer (chunks back
        to back, then the status bytes); nothing is waited for (``finish_round``)."""
        sends, recvs, takes, nbytes = [], [], [], 0
        for o in outgoing:
            if o.t in rounds.out and i < rounds.agreed[o.t]:
                parts = self.parts(o, rounds.out[o.t][i])
                sends += [(part, o.t.dst) for part in parts]
        for inc in incoming:
            if inc.t in rounds.into and i < rounds.agreed[inc.t]:
                round_ = rounds.into[inc.t][i]
                if inc.kept is not None:  # the load reads these bytes: a buffer of their own
                    if inc.ahead is not None:
                        buf = inc.ahead.take(i)
                    else:
                        buf = torch.empty(_round_bytes(round_, inc.index.chunks), dtype=torch.uint8)
                else:
                    buf = _ring(inc.buffers, i, rounds.into[inc.t], inc.index.chunks)
                sizes = [inc.index.chunks[d].stored for d in round_] + [len(round_)]
                recvs += [(part, inc.t.src) for part in torch.split(buf, sizes)]
                takes.append((inc, round_, buf))
                nbytes += buf.numel()
        return _Posted(self._start(sends, recvs), takes, nbytes, sends)

    def finish_round(self, posted: _Posted) -> None:
        """Wait for a round ``post_round`` started; destinations check and keep or store it."""
        for work in posted.works:
            work.wait()
        for inc, round_, buf in posted.takes:
            self.store_round(inc, round_, buf)

    def exchange_rounds(
        self, outgoing: list[_Outgoing], incoming: list[_Incoming], rounds: _Rounds
    ) -> None:
        """Every round, two at a time: round ``i + 1`` is read and crosses while round ``i`` is
        checked and stored (every rank posts a round before it waits for the one before, so
        the pairs' sends and receives always meet)."""
        for inc in incoming:
            if inc.kept is not None and inc.t in rounds.into and self.fault_ahead:
                own = rounds.into[inc.t][: rounds.agreed[inc.t]]
                inc.ahead = _FaultAhead([_round_bytes(r, inc.index.chunks) for r in own])
        try:
            pending: _Posted | None = None
            for i in range(rounds.total):
                posted = self.post_round(i, outgoing, incoming, rounds)
                held = posted.nbytes + (pending.nbytes if pending is not None else 0)
                self.stats.buffer_bytes = max(self.stats.buffer_bytes, held)
                in_flight = 1 + (pending is not None)
                self.stats.rounds_in_flight = max(self.stats.rounds_in_flight, in_flight)
                if pending is not None:
                    self.finish_round(pending)
                pending = posted
            if pending is not None:
                self.finish_round(pending)
        finally:
            for inc in incoming:
                if inc.ahead is not None:
                    inc.ahead.cancel()
                    inc.ahead = None

    def agree_outcomes(
        self, transfers: list[Transfer], outgoing: list[_Outgoing], incoming: list[_Incoming]
    ) -> dict[Transfer, str | None]:
        """Each transfer's outcome as every rank sees it: the first error either end had. A
        repair's source whose chunks its destination refused (or it could not send whole)
        checks them in its store, and unlists its copy if one is damaged there."""
        mine = {inc.t: inc.error for inc in incoming}
        mine.update({o.t: o.error for o in outgoing if o.error is not None})
        refused = {inc.t: inc.refused for inc in incoming if inc.t.repair and inc.refused}
        outcomes: dict[Transfer, str | None] = {t: None for t in transfers}
        suspects = {o.t: list(o.suspect) for o in outgoing if o.t.repair}
        for part, their_refused in self._gather((mine, refused)):
            for t, error in part.items():
                if error is not None:
                    outcomes[t] = _either(outcomes[t], error)
            for t, digests in their_refused.items():
                if t in suspects:
                    suspects[t] += digests
        for t, error in outcomes.items():
            if error is not None and self.rank in (t.src, t.dst):
                self.stats.failed[f"rank {t.ward} step {t.step} {t.src}->{t.dst}"] = error
        for o in outgoing:
            if suspects.get(o.t):
                self.drop_if_damaged(o, suspects[o.t])
        return outcomes

    def drop_if_damaged(self, out: _Outgoing, digests: list[str]) -> None:
        """A repair's source: each chunk of ``digests`` is read and checked again in its own
        store; one missing or failing its check (a read error proves nothing) unlists this
        copy of the step and is removed, so that no later load plans on this copy and no later
        copy reuses the bad bytes. The destination loads from elsewhere or fails this once."""
        t, store = out.t, self.local.store(out.t.ward)
        assert out.index is not None
        bad: list[tuple[str, str]] = []
        for digest in sorted(set(digests)):
            try:
                fetch_chunk(store, digest, out.index.chunks[digest], scratch=True)
            except (CheckpointCorruptError, FileNotFoundError) as exc:
                bad.append((digest, one_line(exc)))
            except (CheckpointError, OSError):
                continue
        if not bad:
            return
        try:
            if load_manifest(store, t.step).attempt == t.attempt:
                drop_step(store, t.step)
            for digest, _ in bad:
                store.delete(chunk_key(digest))
        except (CheckpointError, OSError) as exc:
            logger.warning("rank %d: unlisting %s step %d: %s", self.rank, store.uri, t.step, exc)
            return
        logger.warning(
            "rank %d: its copy of rank %d's step %d (%s) has %d damaged chunk(s), sent to rank "
            "%d: unlisted, no load plans on it again (first: %s)",
            self.rank,
            t.ward,
            t.step,
            store.uri,
            len(bad),
            t.dst,
            bad[0][1],
        )


_writing: list[threading.Thread] = []  # the repaired copies' writes still running
_writing_lock = threading.Lock()


def write_behind(copies: list[RepairedCopy]) -> None:
    """Write ``copies`` (a load's, its tensors filled from them) to the local tier in a
    thread of their own, so that the load returns to training first. The next save's local
    commit, the next tiered load's planning and ``close()`` wait for it (``wait_written``); the
    thread is not a daemon: a process that ends waits for it. A crash while it runs leaves the
    copy unlisted (its manifest is written last) and its chunks to local retention."""
    if not copies:
        return

    def write() -> None:
        for copy in copies:
            copy.write_local()

    thread = threading.Thread(target=write, name="ckptstore-repair-write")
    with _writing_lock:
        _writing.append(thread)
        thread.start()


def wait_written() -> None:
    """Return once every repaired copy ``write_behind`` took is written (or failed, with its
    warning)."""
    with _writing_lock:
        threads = list(_writing)
    for thread in threads:
        thread.join()
    with _writing_lock:
        _writing[:] = [t for t in _writing if t.is_alive()]


def _put_chunk(store: Any, digest: str, info: ChunkInfo, data: Any, *, repair: bool) -> None:
    """Write one verified chunk of a copy. One already there must be intact in a repair, and
    outside one the same encoding unless no copy the store lists names it (a copy the resumed
    job unlisted left it, stored otherwise: the compression changed); else the verified bytes
    replace it."""
    key = chunk_key(digest)
    try:
        store.put(key, data, shared=True)
    except ObjectExistsError:
        if repair:
            if _intact(store, digest, info):
                return
        elif store.size(key) == info.stored:
            return
        elif _named_by_a_listed_copy(store, digest):
            raise CheckpointError(
                f"{store.url(key)} holds chunk {digest} encoded otherwise"
            ) from None
        store.delete(key)  # under the copy's save lease: no retention sweeps meanwhile
        store.put(key, data, shared=True)


def _named_by_a_listed_copy(store: Any, digest: str) -> bool:
    """Whether a copy ``store`` lists names chunk ``digest`` (one that cannot be read: maybe)."""
    try:
        for step in list_steps(store):
            manifest = load_manifest(store, step)
            for rank in range(manifest.world_size):
                if digest in load_rank_index(store, manifest, rank).chunks:
                    return True
    except (CheckpointError, OSError):
        return True
    return False


def _put_copy_object(store: Any, key: str, data: bytes, *, repair: bool) -> None:
    """Write one object of a copy (index, DCP metadata); one already there must be the same
    bytes, or, in a repair, is replaced."""
    try:
        store.put(key, data)
    except ObjectExistsError:
        if store.get(key) != data:
            if not repair:
                raise
            store.delete(key)
            store.put(key, data)


def transfer(
    transfers: list[Transfer],
    *,
    group: Any,
    local: LocalTier,
    budget_bytes: int,
    source: CommittedCopy | None = None,
) -> tuple[dict[Transfer, str | None], TransferStats]:
    """Run ``transfers`` (collective over ``group``: same list on every rank); each one's
    outcome (None: the destination holds the copy, committed) as every rank sees it, and what
    this rank moved. ``source``: a copy this rank sends as its local commit wrote it, under
    that commit's lease (the caller's); any other is read from its store under a lease."""
    outcomes, stats, _ = _run(transfers, group, local, budget_bytes, keep_bytes=-1, source=source)
    return outcomes, stats


def _release(inc: _Incoming) -> None:
    """Give the destination's lease up (once) when every put that may still land has: a
    manifest put abandoned at its deadline must not find its chunks swept."""
    lease, inc.lease = inc.lease, None
    if lease is not None:
        lease.release_when_settled(0.0)


def _deferred(inc: _Incoming) -> bool:
    """Whether ``inc`` is a repair held in memory, whole, its write left for after the load."""
    return inc.kept is not None and inc.error is None and not inc.held


def _run(
    transfers: list[Transfer],
    group: Any,
    local: LocalTier,
    budget_bytes: int,
    keep_bytes: int,
    source: CommittedCopy | None = None,
    fault_ahead: bool = False,
) -> tuple[dict[Transfer, str | None], TransferStats, dict[int, RepairedCopy]]:
    """``transfer``; a repair whose copy takes at most ``keep_bytes`` stays in memory, its
    ``RepairedCopy`` returned by ward (to be written by ``write_local``), the others written."""
    t0 = time.perf_counter()
    ex = _Exchange(group, local, budget_bytes, keep_bytes, fault_ahead)
    me = ex.rank
    outgoing = [ex.open_source(t, source) for t in transfers if t.src == me]
    incoming = [ex.open_destination(t) for t in transfers if t.dst == me]
    exchanged = False
    try:
        told = ex.exchange_headers(outgoing, incoming)
        ex.exchange_masks(outgoing, incoming, told)
        rounds = ex.agree_rounds(transfers, outgoing, incoming)
        ex.exchange_rounds(outgoing, incoming, rounds)
        for inc in incoming:
            if inc.t in rounds.into and rounds.agreed[inc.t] < len(rounds.into[inc.t]):
                inc.error = inc.error or Damage(f"rank {inc.t.src} sent fewer chunks than asked")
            if not _deferred(inc):
                ex.commit(inc)
        exchanged = True
    finally:
        for o in outgoing:
            if o.lease is not None:
                o.lease.release()
        for inc in incoming:
            if not (exchanged and _deferred(inc)):
                _release(inc)
    outcomes = ex.agree_outcomes(transfers, outgoing, incoming)
    ex.stats.seconds = time.perf_counter() - t0
    return outcomes, ex.stats, _kept_copies(ex, incoming, outcomes)


def _kept_copies(
    ex: _Exchange, incoming: list[_Incoming], outcomes: dict[Transfer, str | None]
) -> dict[int, RepairedCopy]:
    """The repairs held in memory whose transfer every rank agreed went well, by ward; one
    that failed elsewhere lets its lease go, written nowhere."""
    out: dict[int, RepairedCopy] = {}
    for inc in incoming:
        if not _deferred(inc):
            continue
        if outcomes[inc.t] is not None:
            _release(inc)
            continue
        assert inc.index is not None and inc.kept is not None and inc.decoded is not None
        out[inc.t.ward] = RepairedCopy(
            ward=inc.t.ward,
            step=inc.t.step,
            manifest=inc.decoded,
            index=inc.index,
            index_bytes=inc.index_bytes,
            metadata=inc.metadata[1] if inc.metadata is not None else None,
            chunks=inc.kept,
            _write=lambda inc=inc: ex.write_kept(inc),
        )
    return out


def restore_copies(
    local: LocalTier,
    group: Any,
    step: int,
    attempt: str,
    sources: dict[int, int],
    report: LoadReport,
) -> tuple[dict[Transfer, str | None], dict[int, RepairedCopy]]:
    """A tiered load's repair: each rank ``r`` of ``sources`` gets its own copy of the save back
    from the copy rank ``sources[r]``'s node keeps (every chunk hashed on arrival). Collective
    over ``group`` (a ``RankGroup``) where there is any; each transfer's outcome, and this
    rank's copy where it is held in memory (``TierPolicy.repair_memory_bytes``): the load reads
    it from there and hands it to ``write_behind`` once the tensors are filled (else the copy
    was written and committed before this returned). A receiver's ``report`` gets the time under
    PEER (the bytes count as the load reads the copy), and how many chunks crossed the wire
    or were found on its node."""
    if not sources:
        return {}, {}
    wait_written()  # a copy an earlier load repaired is in the store before this one is
    transfers = [
        Transfer(src, r, r, step, attempt, repair=True) for r, src in sorted(sources.items())
    ]
    fault_ahead = cores_per_rank(group.ranks_on_host()) >= 1
    try:
        outcomes, stats, kept = _run(
            transfers,
            group.group,
            local,
            local.policy.peer_budget_bytes,
            keep_bytes=local.policy.repair_memory_bytes,
            fault_ahead=fault_ahead,
        )
    except Exception as exc:  # noqa: BLE001 - a lost rank, named by the roll call
        group.check("a repair's peer transfer", exc)
        raise
    report.peer_buffer_bytes = max(report.peer_buffer_bytes, stats.buffer_bytes)
    if group.rank in sources:
        report.add(PEER, 0, stats.seconds)
        report.repair_chunks_received += stats.chunks_received
        report.repair_chunks_here += stats.chunks_kept_here + stats.chunks_from_node
    return outcomes, kept
