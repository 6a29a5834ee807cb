"""The tiered save's walk (issue 31): after its local commit, a rank's peer copy and drain take
its copy as that commit wrote it (manifest, index, DCP metadata in memory) instead of reading it
back from its local store, and the peer copy is sent under the local commit's lease, not one
of its own. Counted at the rank's own local store for both front-ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from ckptstore.catalog import list_steps
from ckptstore.store import Store
from tests.helpers.dist import gathered, run_ranks

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


class _Phases:
    """Requests to a rank's own local store: while its peer copy or its drain runs, and the
    rest (``other``)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.seen: list[tuple[str, str, str]] = []

    def add(self, kind: str, path: str) -> None:
        self.seen.append((self.phase or "other", kind, path))

    def report(self) -> dict:
        out: dict = {}
        for phase, kind, path in self.seen:
            where = "other"
            if "/chunks/" in path:
                where = "chunk"
            elif "/leases/save/" in path:
                where = "lease"
            elif "/leases/" in path:
                where = "other lease"
            elif "/commits/" in path or "/indexes/" in path or "/steps/" in path:
                where = "copy"  # a manifest, an index, DCP metadata
            key = f"{phase} {kind} {where}"
            out[key] = out.get(key, 0) + 1
        return out


def _counted(phases: _Phases) -> None:
    """In this rank's process: count its own local store's requests by phase."""
    import ckptstore.tiers.drain as drain
    from ckptstore.tiers.local import LocalTier
    from ckptstore.tiers.saving import TierSaver
    from tests.helpers.counting import CountingBackend

    store_of = LocalTier.store

    def store(self, ward):
        s = store_of(self, ward)
        if ward == self.rank and not isinstance(s.backend, CountingBackend):
            s.backend = CountingBackend(s.backend, phases)
        return s

    def in_phase(name, fn):
        def run(*args, **kwargs):
            phases.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                phases.phase = None

        return run

    LocalTier.store = store
    TierSaver.copy_to_peers = in_phase("peer", TierSaver.copy_to_peers)
    drain.drain_rank = in_phase("drain", drain.drain_rank)


def _checkpointer_saves(rank: int, world: int, root: str, out: str) -> None:
    from ckptstore import Checkpointer, TierOptions
    from tests.helpers.tiers import ENCODING, rank_state

    phases = _Phases()
    _counted(phases)
    tiers = TierOptions(
        local_dir=Path(root) / f"node{rank}", node_rank=rank, peer_copies=1, durable_every=1
    )
    with Checkpointer(Path(root) / "durable", tiers=tiers, encoding=ENCODING) as ckpt:
        for step in (1, 2):
            ckpt.save(step, rank_state(rank, step)).wait()
            ckpt.wait()  # its drain, before the next save's peer copy
    reports = gathered(phases.report())
    if rank == 0:
        Path(out).write_text(json.dumps(reports))


def _dcp_saves(rank: int, world: int, root: str, out: str) -> None:
    from tests.helpers.dcp_tiers import step_state, tier_writer

    phases = _Phases()
    _counted(phases)
    writer = tier_writer(
        str(Path(root) / "durable"),
        str(Path(root) / f"node{rank}"),
        durable_every=1,
        peer_copies=1,
        node_rank=rank,
    )
    for step in (1, 2):
        dcp.save(step_state(step), storage_writer=writer, checkpoint_id=step)
        writer.wait()  # its drain, before the next save's peer copy
    writer.close()
    reports = gathered(phases.report())
    if rank == 0:
        Path(out).write_text(json.dumps(reports))


def _assert_nothing_read_back(reports: list[dict]) -> None:
    for rank, seen in enumerate(reports):
        # One save lease of the local store per save (2 saves), the local commit's, held
        # through the peer copy and the drain, which releases it.
        assert seen.get("other put lease", 0) == 2, (rank, seen)
        assert "peer put lease" not in seen and "drain put lease" not in seen, (rank, seen)
        assert "peer delete lease" not in seen, (rank, seen)
        assert seen.get("drain delete lease", 0) == 2, (rank, seen)
        # The peer copy reads the chunks it sends, and no manifest or index back.
        assert seen.get("peer get chunk", 0) > 0, (rank, seen)
        assert "peer get copy" not in seen, (rank, seen)
        # The drain reads the chunks, the copy's manifest and index from memory.
        assert seen.get("drain get chunk", 0) > 0, (rank, seen)
        assert "drain get copy" not in seen, (rank, seen)


@pytest.mark.dist
def test_a_checkpointer_peer_copy_and_drain_read_no_copy_back(tmp_path):
    out = tmp_path / "seen.json"
    run_ranks(_checkpointer_saves, 2, str(tmp_path), str(out), timeout_s=150)
    _assert_nothing_read_back(json.loads(out.read_text()))
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 2]
    for rank in range(2):  # each node holds its own copy and its peer's
        for ward in range(2):
            (found,) = (tmp_path / f"node{rank}").glob(f"job-*/rank-{ward:05d}")
            assert list_steps(Store(str(found))) == [1, 2], (rank, ward)


@pytest.mark.dist
def test_a_dcp_peer_copy_and_drain_read_no_copy_back(tmp_path):
    out = tmp_path / "seen.json"
    run_ranks(_dcp_saves, 2, str(tmp_path), str(out), timeout_s=150)
    _assert_nothing_read_back(json.loads(out.read_text()))
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 2]
    for rank in range(2):
        for ward in range(2):
            (found,) = (tmp_path / f"node{rank}").glob(f"job-*/rank-{ward:05d}")
            assert list_steps(Store(str(found))) == [1, 2], (rank, ward)
