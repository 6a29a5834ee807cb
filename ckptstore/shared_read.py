"""Read once, broadcast: ranks restoring the same chunks fetch each of them from storage once.

Data-parallel replicas restore the same state; read alone, every replica would GET every chunk
(storage reads = ranks x chunks). Instead the ranks of a process group say which chunks they
need (one ``all_gather_object`` per load), and each chunk that two or more ranks need gets one
owner among them: the owner fetches it, verifies its hash and sends the raw bytes to the other
ranks that need it (which hash them again: a chunk is verified wherever it came from), point to point over the group (gloo here; the exchange buffer lives on the
``device`` given, so the same code runs on NCCL with GPU buffers). Owners are chosen by bytes:
largest chunk first, each to the rank that needs it with the fewest bytes to fetch so far (its
own chunks counted), so the fetches spread over ranks. A rank that shares no chunk reads its own
chunks from storage as before, after that one collective.

Memory: shared chunks are exchanged in rounds, the plan's shared chunks (ordered by digest) cut
into runs of at most ``budget_bytes`` (a larger chunk alone). A rank holds one exchange buffer,
the most bytes of one round it takes part in: at most ``budget_bytes`` plus one chunk (and one
status byte per chunk of the round), however large the state.

Failure: every chunk is sent with a status byte. An owner whose fetch fails (missing, corrupt,
storage) sends that status instead of the bytes; once a rank knows the load failed (its own
error, or a status received), it fetches nothing more and sends its remaining chunks marked
"not read", so every rank finishes the exchange, and each rank that needed the chunk raises an
error of the owner's kind (``CheckpointNotFoundError``, ``CheckpointCorruptError``, else
``CheckpointError``) naming the chunk and the owner. The Checkpointer's agreement then fails or
falls back on every rank alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ckptstore.codec import hash_bytes
from ckptstore.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ckptstore.format import ChunkInfo, RankIndex, chunk_key
from ckptstore.options import DEFAULT_SHARED_READ_BUDGET_BYTES
from ckptstore.pipeline import ChunkFetch, PipelineConfig, chunks_from_store, fetch_chunk
from ckptstore.store import Store

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = DEFAULT_SHARED_READ_BUDGET_BYTES

# The status byte after each chunk in the exchange buffer.
_UNSET, _OK = 0, 1
_KINDS = {2: CheckpointNotFoundError, 3: CheckpointCorruptError, 4: CheckpointError}
_NOT_READ = 8  # added to a kind: the owner did not read this chunk because the load had failed


@dataclass
class ExchangeStats:
    """What one rank's shared read did."""

    fetched: int = 0
    """Shared chunks this rank fetched from storage (for itself and the others)."""
    received: int = 0
    """Shared chunks this rank received from their owner instead of fetching them."""
    sent: int = 0
    """Chunk copies this rank sent to other ranks."""
    rounds: int = 0
    """Rounds of the exchange this rank took part in."""
    buffer_bytes: int = 0
    """The size of its exchange buffer: the most shared-chunk bytes it held at once."""


@dataclass(frozen=True)
class ExchangePlan:
    """Who fetches each shared chunk and in which round; the same on every rank."""

    rank: int
    needers: dict[str, list[int]]
    """Each shared digest -> the group ranks that need it (ascending): two or more, or one
    that does not hold it when another rank does."""
    owners: dict[str, int]
    sizes: dict[str, ChunkInfo]
    rounds: list[list[str]]

    @classmethod
    def build(
        cls,
        rank: int,
        needs: list[dict[str, ChunkInfo]],
        budget_bytes: int,
        holds: list[set[str]] | None = None,
    ) -> ExchangePlan:
        """The plan of ranks needing ``needs[r]`` (digest -> sizes from its index). A digest
        whose sizes differ between indexes is not shared: each rank reads and checks it.

        ``holds[r]``: the digests rank r reads from a copy of its own (a local tier) rather
        than from shared storage. A chunk that a rank needs and does not hold, while another
        rank holds it, is fetched by a holder (one that needs it too, if any) and sent."""
        holders: dict[str, list[int]] = {}
        for r, held in enumerate(holds or []):
            for digest in held:
                holders.setdefault(digest, []).append(r)
        needers: dict[str, list[int]] = {}
        sizes: dict[str, ChunkInfo] = {}
        disputed: set[str] = set()
        for r, chunks in enumerate(needs):
            for digest, info in chunks.items():
                needers.setdefault(digest, []).append(r)
                if sizes.setdefault(digest, info) != info:
                    disputed.add(digest)
        shared = {
            d
            for d, rs in needers.items()
            if d not in disputed and (len(rs) > 1 or (d in holders and rs[0] not in holders[d]))
        }
        load = [
            sum(info.stored for d, info in chunks.items() if d not in shared) for chunks in needs
        ]
        owners: dict[str, int] = {}
        if budget_bytes > 0:
            for digest in sorted(shared, key=lambda d: (-sizes[d].stored, d)):
                held_by = holders.get(digest, [])
                candidates = [r for r in needers[digest] if r in held_by] or held_by
                owner = min(candidates or needers[digest], key=lambda r: (load[r], r))
                owners[digest] = owner
                load[owner] += sizes[digest].stored
        rounds = cut_rounds([(d, sizes[d].raw + 1) for d in sorted(owners)], budget_bytes)
        return cls(
            rank=rank,
            needers={d: needers[d] for d in owners},
            owners=owners,
            sizes={d: sizes[d] for d in owners},
            rounds=rounds,
        )

    def mine(self, digests: list[str]) -> list[str]:
        """Those of ``digests`` this rank takes part in exchanging (needs or sends)."""
        return [d for d in digests if self.rank in self.needers[d] or self.owners[d] == self.rank]


def cut_rounds(items: list[tuple[str, int]], budget_bytes: int) -> list[list[str]]:
    """``(digest, bytes)`` in order, cut into runs of at most ``budget_bytes`` (an item larger
    than the budget alone)."""
    rounds: list[list[str]] = []
    total = 0
    for digest, nbytes in items:
        if not rounds or total + nbytes > budget_bytes:
            rounds.append([])
            total = 0
        rounds[-1].append(digest)
        total += nbytes
    return rounds


def needed_chunks(index: RankIndex, tensors: Iterable[int]) -> dict[str, ChunkInfo]:
    """The chunks (digest -> sizes) that hold ``tensors`` of ``index``."""
    return {
        seg.chunk: index.chunks[seg.chunk] for i in tensors for seg in index.tensors[i].segments
    }


def plan_shared_read(
    store: Store,
    needs: dict[str, ChunkInfo],
    cfg: PipelineConfig,
    *,
    group: dist.ProcessGroup,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    device: torch.device | str = "cpu",
) -> SharedChunks | None:
    """Collective over ``group``, one ``all_gather_object``: every rank of it calls this with
    the chunks it needs (empty when it reads nothing). Returns the ``ChunkSource`` this rank
    reads ``needs`` through, or None when it shares no chunk with another rank (then it reads
    from storage as before, without further collectives). ``budget_bytes`` bounds the bytes
    exchanged per round (0 on any rank: nothing is shared)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (budget_bytes, needs), group=group)
    budget = min(b for b, _ in gathered)
    return shared_source(
        store, needs, [n for _, n in gathered], cfg, group=group, budget_bytes=budget, device=device
    )


def shared_source(
    store: Store,
    needs: dict[str, ChunkInfo],
    every_need: list[dict[str, ChunkInfo]],
    cfg: PipelineConfig,
    *,
    group: dist.ProcessGroup,
    budget_bytes: int,
    device: torch.device | str = "cpu",
    holds: list[set[str]] | None = None,
    fetch: ChunkFetch | None = None,
) -> SharedChunks | None:
    """``plan_shared_read`` for a caller that gathered the ranks' needs itself (in a collective
    that carries more, such as its ranks' failures): ``every_need[r]`` is what group rank r
    needs, ``needs`` this rank's, ``budget_bytes`` the same on every rank. No collective here;
    the source returned, if any, exchanges over ``group`` when run."""
    plan = ExchangePlan.build(dist.get_rank(group), every_need, budget_bytes, holds)
    if not any(plan.mine(round_) for round_ in plan.rounds):
        return None
    return SharedChunks(
        store, needs, plan, cfg, group=group, device=torch.device(device), fetch=fetch
    )


class SharedChunks:
    """A ``ChunkSource`` for one rank's read: its chunks of the plan through the exchange, the
    rest from storage. Every rank of the plan's group must run its source to the end (the
    others wait for its sends): it does, even when closed early or failing. A rank that fails
    before it runs its source (or may have) calls :meth:`finish` instead."""

    def __init__(
        self,
        store: Store,
        chunks: dict[str, ChunkInfo],
        plan: ExchangePlan,
        cfg: PipelineConfig,
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        fetch: ChunkFetch | None = None,
    ) -> None:
        self.store = store
        self._from_store = fetch is None
        self.fetch = fetch or (lambda digest, info: fetch_chunk(store, digest, info, scratch=True))
        self.chunks = chunks
        self.plan = plan
        self.cfg = cfg
        self.group = group
        self.device = device
        self.stats = ExchangeStats()
        rounds = [plan.mine(round_) for round_ in plan.rounds]
        self._rounds = [r for r in rounds if r]
        self._tags = {d: t for t, d in enumerate(sorted(plan.owners))}
        sizes = [sum(plan.sizes[d].raw + 1 for d in r) for r in self._rounds]
        self.stats.buffer_bytes = max(sizes, default=0)
        self._started = 0  # rounds this rank has begun

    def __call__(
        self, digests: list[str], deliver: Callable[[str, np.ndarray], int]
    ) -> Iterator[int]:
        return self._run(digests, deliver, None)

    def finish(self, error: BaseException) -> None:
        """Take part in the rounds this source has not run, reading nothing: for a rank whose
        load failed with ``error`` before it ran the source, or after a run of it ended (closed
        or failed: nothing is left then). Its chunks are sent marked "not read" (of
        ``error``'s kind), so the ranks that need them fail alike; what it receives is dropped."""
        try:
            for _ in self._run([], lambda digest, raw: 0, error):
                pass
        except BaseException as exc:
            if exc is not error:
                raise

    def _run(
        self,
        digests: list[str],
        deliver: Callable[[str, np.ndarray], int],
        failure: BaseException | None,
    ) -> Iterator[int]:
        wanted = set(digests)
        size = self.stats.buffer_bytes if self._started < len(self._rounds) else 0
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        while self._started < len(self._rounds):
            round_ = self._rounds[self._started]
            self._started += 1
            delivered: list[int] = []
            try:
                failure = self._exchange(round_, buffer, failure)
                if failure is None:
                    for digest, raw in self._slots(round_, buffer):
                        if digest in wanted:
                            delivered.append(deliver(digest, raw))
            except BaseException as exc:  # noqa: BLE001 - the other ranks still wait for ours
                failure = failure or exc
            if failure is None:
                try:
                    yield from delivered
                except BaseException as exc:  # noqa: BLE001 - closed: finish the exchange
                    failure = exc
        if failure is not None:
            raise failure
        shared = set(self.plan.owners)
        rest = [d for d in digests if d not in shared]
        yield from chunks_from_store(self.store, self.chunks, self.cfg, self.fetch)(rest, deliver)

    def _slots(self, round_: list[str], buffer: torch.Tensor) -> Iterator[tuple[str, np.ndarray]]:
        """Each chunk of ``round_`` with its bytes, as numpy on the host; one received from
        another rank is hashed again (a chunk is verified wherever it came from)."""
        for digest, slot in self._layout(round_, buffer):
            data = (slot[:-1] if self.device.type == "cpu" else slot[:-1].cpu()).numpy()
            owner = self.plan.owners[digest]
            if owner != self.plan.rank and hash_bytes(data) != digest:
                raise CheckpointCorruptError(
                    f"chunk {self.store.url(chunk_key(digest))} as received from rank {owner} "
                    "does not match its xxh3: the exchange corrupted it"
                )
            yield digest, data

    def _layout(self, round_: list[str], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Where each chunk of ``round_`` sits in ``buffer``: its raw bytes, then its status."""
        out, position = [], 0
        for digest in round_:
            n = self.plan.sizes[digest].raw + 1
            out.append((digest, buffer[position : position + n]))
            position += n
        return out

    def _exchange(
        self, round_: list[str], buffer: torch.Tensor, failure: BaseException | None
    ) -> BaseException | None:
        """One round: this rank's owned chunks fetched into ``buffer`` (unless the load has
        failed), sent to the ranks that need them, the others received. Returns the failure
        this rank knows of afterwards."""
        plan, me = self.plan, self.plan.rank
        layout = self._layout(round_, buffer)
        owned = [(d, slot) for d, slot in layout if plan.owners[d] == me]
        for _, slot in owned:
            slot[-1] = _UNSET
        if failure is None:
            failure = self._fetch(owned)
        for _, slot in owned:
            if int(slot[-1]) == _UNSET:
                slot[-1] = _kind(failure) + _NOT_READ
        self.stats.rounds += 1
        ops = []
        for digest, slot in layout:
            owner, tag = plan.owners[digest], self._tags[digest]
            if owner == me:
                for peer in plan.needers[digest]:
                    if peer != me:
                        ops.append(
                            dist.P2POp(dist.isend, slot, group=self.group, group_peer=peer, tag=tag)
                        )
                        self.stats.sent += 1
            else:
                ops.append(
                    dist.P2POp(dist.irecv, slot, group=self.group, group_peer=owner, tag=tag)
                )
                self.stats.received += 1
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for digest, slot in layout:
            status = int(slot[-1])
            if failure is None and status != _OK:
                failure = self._error(digest, status)
        return failure

    def _fetch(self, owned: list[tuple[str, torch.Tensor]]) -> BaseException | None:
        """Fetch and verify the owned chunks into their slots; the first error, if any (the
        fetches still running end first: nothing writes into the buffer once it is sent)."""

        def fetch(item: tuple[str, torch.Tensor]) -> None:
            digest, slot = item
            try:
                raw = self.fetch(digest, self.plan.sizes[digest])
            except BaseException as exc:
                slot[-1] = _kind(exc)  # this chunk's own failure; the others are "not read"
                raise
            if self.device.type == "cpu":
                slot[:-1].numpy()[:] = raw
            else:
                slot[:-1].copy_(torch.from_numpy(raw if raw.flags.writeable else raw.copy()))
            slot[-1] = _OK

        try:
            for _ in self.store.map(
                fetch, owned, max_concurrency=self.cfg.read_concurrency, drain=True
            ):
                self.stats.fetched += 1
        except BaseException as exc:  # noqa: BLE001 - sent as the chunks' status
            return exc
        return None

    def _error(self, digest: str, status: int) -> CheckpointError:
        """The error of a rank that needed ``digest`` and was sent ``status`` for it."""
        owner = self.plan.owners[digest]
        # With a fetch of its own (tiers) the owner read it from where it keeps it.
        url = self.store.url(chunk_key(digest)) if self._from_store else digest
        kind = _KINDS.get(status % _NOT_READ, CheckpointError)
        if status >= _NOT_READ:
            why = f"rank {owner} did not read chunk {url} for this rank: the load failed there"
        elif kind is CheckpointNotFoundError:
            why = f"chunk {url} is missing (rank {owner} read it for this rank)"
        elif kind is CheckpointCorruptError:
            why = f"chunk {url} is corrupt (rank {owner} read it for this rank)"
        else:
            why = f"chunk {url} could not be read by rank {owner}, which reads it for this rank"
        return kind(why)


def _kind(error: BaseException | None) -> int:
    """The status byte that tells the ranks waiting for a chunk how its read failed."""
    if isinstance(error, CheckpointNotFoundError):
        return 2
    if isinstance(error, CheckpointCorruptError):
        return 3
    return 4
