"""One writer per distinct chunk: ranks that hold the same bytes (data-parallel replicas) agree,
before any is encoded, on which of them puts each chunk; the others reference it without a
request. Used by a Checkpointer's save to durable storage (``write_chunks_once``) and by the
drains of local copies into it, for both front-ends (``tiers.drain``). Why it is safe:
docs/FORMAT.md, "One writer per distinct chunk".

Every rank calls each exchange, with its error if it failed before it: a rank that fails fails
the save on every rank, before any index names a chunk it was to write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ckptstore.codec import hash_bytes
from ckptstore.errors import CheckpointError
from ckptstore.format import ChunkInfo
from ckptstore.health import ChunkScan
from ckptstore.pipeline import (
    ChunkLayout,
    ChunkSpan,
    CompressionGovernor,
    PipelineConfig,
    Rechecks,
    clear_suspect,
    write_chunks,
)
from ckptstore.store import Store


def assign_writers(holdings: list[list[tuple[str, int]]]) -> dict[str, int]:
    """Which rank writes each distinct chunk: ``holdings[r]`` is rank r's ``(digest, raw
    size)`` of chunks no rank knows stored. Each chunk goes to one of its holders, the one with
    the fewest bytes assigned so far (ties turn with the digest), in digest order: the same
    holdings give the same answer on every rank and after a restart."""
    holders: dict[str, list[int]] = defaultdict(list)
    sizes: dict[str, int] = {}
    for rank, held in enumerate(holdings):
        for digest, raw in held:
            if not holders[digest] or holders[digest][-1] != rank:
                holders[digest].append(rank)
            sizes[digest] = raw
    assigned = [0] * len(holdings)
    writer: dict[str, int] = {}
    for digest in sorted(holders):
        ranks = holders[digest]
        turn = int(digest[:8], 16) % len(ranks)
        rank = min(ranks, key=lambda r: (assigned[r], (ranks.index(r) - turn) % len(ranks)))
        writer[digest] = rank
        assigned[rank] += sizes[digest]
    return writer


def share_out(
    group: Any,
    held: Iterable[tuple[str, int]],
    known: dict[str, ChunkInfo],
    error: BaseException | None = None,
    *,
    save: str | None = None,
    recheck: Rechecks | None = None,
) -> set[str]:
    """The chunks of ``held`` (digest, raw size) this rank is to put: ranks exchange what they
    hold (with the stored size of those they know stored, which then every rank knows) and
    agree on one writer per other distinct chunk. ``known`` grows by the chunks other ranks
    know. ``error``: this rank failed before; it is raised here, every rank having heard it.
    ``save``: the save's attempt; ranks that reached this exchange in different saves (two
    overlapping saves met in another order) all fail, before any writer is chosen.
    ``recheck``: which known chunks are read back (``pipeline.put_chunk``); one holder each,
    chosen as a writer is, is given them too."""
    mine = {
        digest: (raw, known[digest].stored if digest in known else None) for digest, raw in held
    }
    suspect = sorted(recheck.suspect) if recheck is not None else []
    heard = group.agree(error, (save, sorted(mine.items()), *([suspect] if suspect else [])))
    _raise(heard, error, "preparing its chunks", save)
    # Which chunks need a writer is judged from what every rank heard alone (never from a
    # rank's own knowledge), so that every rank assigns the same writers.
    stored: set[str] = set()
    suspects: set[str] = set()
    for _, payload, *theirs in heard.payloads:
        for d, (raw, size) in payload:
            if size is not None:
                stored.add(d)
                known[d] = ChunkInfo(raw, size)
        if theirs:  # a chunk a load found damaged on some rank: read back, whoever holds it
            suspects.update(theirs[0])
    if recheck is not None:
        recheck.suspect |= suspects

    def ours(digest: str) -> bool:  # to put, or to read back
        turn = recheck is not None and recheck.by_turn(digest)
        return digest not in stored or digest in suspects or turn

    writers = assign_writers(
        [[(d, raw) for d, (raw, _) in payload if ours(d)] for _, payload, *_ in heard.payloads]
    )
    return {digest for digest, rank in writers.items() if rank == group.rank}


def gather_stored(
    group: Any,
    written: dict[str, ChunkInfo],
    known: dict[str, ChunkInfo],
    error: BaseException | None = None,
    *,
    save: str | None = None,
) -> None:
    """Every rank's ``written`` chunks into ``known`` (each index records each chunk's stored
    size as its writer stored it); ``error`` and ``save``: as for :func:`share_out`."""
    heard = group.agree(error, (save, {d: (c.raw, c.stored) for d, c in written.items()}))
    _raise(heard, error, "writing its chunks", save)
    for _, payload in heard.payloads:
        known.update({d: ChunkInfo(raw, stored) for d, (raw, stored) in payload.items()})


def _raise(heard: Any, mine: BaseException | None, doing: str, save: str | None) -> None:
    """This rank's own error as it is; else the first other rank's, named; else, when the
    ranks were not all in the same save, an error naming the saves they were in."""
    if mine is not None:
        raise mine
    if heard.failures:
        rank, message, _ = heard.failures[0]
        raise CheckpointError(f"rank {rank} failed {doing}: {message}")
    saves = [payload[0] for payload in heard.payloads]
    if any(s != save for s in saves):
        raise CheckpointError(
            f"ranks exchanged the chunks of different saves (attempts by rank: {saves}): "
            "overlapping saves reached their exchange in another order; none is written"
        )


class OneRound:
    """``group`` for one save of a rank that writes one buffer through
    :func:`write_chunks_once`, several, or none (a DCP rank with no items, or whose items
    failed before): the first write given it takes part in the round of exchanges; later ones
    write alone (``active`` is then False). :meth:`finish` takes part with nothing held, or
    with this rank's error, if no write did: every rank joins the round exactly once."""

    def __init__(self, group: Any, save: str) -> None:
        self._group = group
        self.save = save
        self.rank = group.rank
        self.world_size = group.world_size
        self._exchanges = 0

    @property
    def active(self) -> bool:
        return self._exchanges == 0 and self._group.active

    def agree(self, error: BaseException | None, payload: Any = None) -> Any:
        self._exchanges += 1
        return self._group.agree(error, payload)

    def finish(self, error: BaseException | None = None) -> None:
        """Join the round if no write did (``error``: this rank's, raised here once every
        rank heard it); else nothing."""
        if self._exchanges or not self._group.active:
            return
        share_out(self, [], {}, error, save=self.save)
        gather_stored(self, {}, {}, None, save=self.save)


def write_chunks_once(
    store: Store,
    buffer: np.ndarray,
    layout: ChunkLayout,
    cfg: PipelineConfig,
    group: Any,
    *,
    hedged: bool = False,
    governor: CompressionGovernor | None = None,
    known: dict[str, ChunkInfo],
    scan: ChunkScan | None = None,
    save: str | None = None,
    recheck: Rechecks | None = None,
) -> tuple[list[str], dict[str, ChunkInfo]]:
    """``pipeline.write_chunks`` over the ranks of ``group`` (a ``tiers.group.RankGroup``,
    every rank calling): each rank hashes its chunks (xxh3-128 of the raw bytes, the chunk's
    key: every rank must, for its index to name its own bytes; ~0.05 s/GiB, against ~1.9 s/GiB
    to encode), the ranks agree on one writer per distinct chunk (:func:`share_out`), each
    encodes and puts its share without hashing it again, and every rank learns what the
    writers stored (:func:`gather_stored`). ``known`` (``SaveSession.learn``) grows by every
    chunk of the save. ``scan``: the health scan of the tensors in ``buffer``, taken as each
    chunk is hashed (here, before the exchange). ``save``: the save's attempt, which every
    rank's exchange must name. ``recheck``: see :func:`share_out`."""
    chunks = layout.chunks

    def digest_of(span: ChunkSpan) -> str:
        raw = buffer[span.start : span.end]
        return scan.hash(span.start, raw) if scan is not None else hash_bytes(raw)

    error: BaseException | None = None
    digests: list[str] = []
    try:
        digests = list(store.map(digest_of, chunks, max_concurrency=cfg.encode_threads))
    except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
        error = exc
    held = [(d, span.end - span.start) for d, span in zip(digests, chunks)]
    mine = share_out(group, held, known, error, save=save, recheck=recheck)
    # Each of this rank's share once (a digest it holds twice is put once), with its digest:
    # the writer does not hash it again.
    share = {d: span for d, span in zip(digests, chunks) if d in mine}

    written: dict[str, ChunkInfo] = {}
    try:
        _, written = write_chunks(
            store,
            buffer,
            layout,
            cfg,
            hedged=hedged,
            governor=governor,
            known=known,
            spans=[(span, d) for d, span in share.items()],
            recheck=recheck,
        )
    except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
        error = exc
    gather_stored(group, written, known, error, save=save)
    if recheck is not None:  # its writer read each back (or wrote it again) in this save
        for digest in recheck.suspect.intersection(digests):
            clear_suspect(store, digest)
    unwritten = [d for d in digests if d not in known]
    if unwritten:  # never a manifest naming a chunk nobody wrote
        raise CheckpointError(
            f"{len(unwritten)} chunk(s) of this rank were given no writer (e.g. {unwritten[0]}): "
            "the ranks judged the save's chunks differently; nothing is committed"
        )
    return digests, {d: known[d] for d in digests}
