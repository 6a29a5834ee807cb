"""Draining a local copy to durable storage: one rank's part of a durable save of a step that
every rank already committed to its local tier.

The chunks are copied as they are stored (no second encode), each decoded and hashed first, so
a byte that went bad on a node never reaches durable storage, where later saves would reuse it;
a chunk the durable save knows stored (``SaveSession.learn``) costs no request. The rank's
durable index holds the same entries and tree as its local one, under its rank in the job. The
front-end gathers every rank's ``RankWritten`` and commits as for any save.
"""

from __future__ import annotations

from ckptstore.catalog import load_manifest, read_rank_index
from ckptstore.codec import decode
from ckptstore.errors import CheckpointCorruptError, CheckpointError, ObjectExistsError
from ckptstore.format import ChunkInfo, chunk_key
from ckptstore.leases import SAVE, Lease
from ckptstore.pipeline import release_free_memory
from ckptstore.save.session import RankWritten, SaveSession
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import TIER_KEY


def drain_rank(session: SaveSession, local: LocalTier, rank: int) -> tuple[RankWritten, dict]:
    """Copy ``rank``'s local copy of ``session``'s step and attempt into ``session``'s store,
    and put its index there; what it wrote, and the user metadata of the save."""
    store = local.store(rank)
    step, attempt = session.step, session.attempt
    lease = Lease(
        store,
        SAVE,
        f"{step:020d}-{attempt}-drain",
        ttl_s=local.engine.lease_ttl_s,
        info={"step": step, "attempt": attempt, "drain": True},
    ).acquire()
    try:
        manifest = load_manifest(store, step)
        if manifest.attempt != attempt or not local.belongs(manifest, rank):
            raise CheckpointError(
                f"{store.uri}: step {step} is another save ({manifest.attempt}) than the one "
                f"to drain ({attempt})"
            )
        index = read_rank_index(store, manifest.ranks[0])
        known = session.known if session.known is not None else {}
        durable = session.store

        def copy(item: tuple[str, ChunkInfo]) -> tuple[str, ChunkInfo]:
            digest, info = item
            if digest in known:
                return digest, known[digest]
            key = chunk_key(digest)
            data = store.get_view(key, 0, info.stored + 1)
            if len(data) != info.stored:
                raise CheckpointError(
                    f"chunk {store.url(key)}: {len(data)} bytes stored, the index says {info.stored}"
                )
            try:
                decode(data, expected_hash=digest, name=store.url(key), raw_len=info.raw)
            except CheckpointCorruptError:
                local.forget_bad_chunk(digest)
                raise
            try:
                durable.put(key, data, hedged=session.engine.hedge_uploads)
            except ObjectExistsError:  # another rank or save stored it, maybe encoded otherwise
                return digest, ChunkInfo(info.raw, durable.size(key))
            return digest, info

        try:
            chunks = dict(
                durable.map(
                    copy,
                    sorted(index.chunks.items()),
                    max_concurrency=session.engine.config.encode_threads,
                    drain=True,
                )
            )
        finally:
            release_free_memory()
        written = session.put_index(rank, index.tensors, chunks, tree=index.tree, items=index.items)
        user = {k: v for k, v in manifest.user.items() if k != TIER_KEY}
        return written, user
    finally:
        lease.release()
