"""The tiered save's walk (issue 31): after its local commit, a rank's peer copy and drain take
its copy as that commit wrote it (manifest, index, DCP metadata in memory) instead of reading it
back from its local store, and the peer copy is sent under the local commit's lease, not one
of its own. Counted at the rank's own local store for both front-ends; and at the store the
rank keeps of its ward (the holder's side of the peer copy): one save lease per copy, one
listing of its steps and one read of its newest copy's manifest and index, no save protocol."""

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
    """Requests to a rank's own local store (``own``), and to the stores of the wards whose
    peer copies it holds (``held``): while its peer copy (``peer``; its holder's retention
    after a copy: ``retain``) or its drain runs, and the rest (``other``)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.seen: list[tuple[str, str, str, str]] = []

    def tally(self, whose: str):
        phases = self

        class _Tally:
            def add(self, kind: str, path: str) -> None:
                phases.seen.append((whose, phases.phase or "other", kind, path))

        return _Tally()

    def report(self, whose: str = "own") -> dict:
        out: dict = {}
        for owner, phase, kind, path in self.seen:
            if owner != whose:
                continue
            where = "other"
            if "/chunks/" in path:
                where = "chunk"
            elif "/leases/save/" in path:
                where = "lease"
            elif "/leases/" in path:
                where = "other lease"
            elif path.endswith("/commits") or "/commits/" in path:
                where = "copy" if whose == "own" else "manifest"
            elif "/indexes/" in path or "/steps/" in path:
                where = "copy" if whose == "own" else "index"  # an index, DCP metadata
            key = f"{phase} {kind} {where}"
            out[key] = out.get(key, 0) + 1
        return out


def _counted(phases: _Phases) -> None:
    """In this rank's process: count its local stores' requests by phase."""
    import ckptstore.tiers.drain as drain
    from ckptstore.tiers.local import LocalTier
    from ckptstore.tiers.saving import TierSaver
    from tests.helpers.counting import CountingBackend

    store_of = LocalTier.store

    def store(self, ward):
        s = store_of(self, ward)
        if not isinstance(s.backend, CountingBackend):
            whose = "own" if ward == self.rank else "held"
            s.backend = CountingBackend(s.backend, phases.tally(whose))
        return s

    def in_phase(name, fn):
        def run(*args, **kwargs):
            before, phases.phase = phases.phase, name
            try:
                return fn(*args, **kwargs)
            finally:
                phases.phase = before

        return run

    LocalTier.store = store
    LocalTier.retain = in_phase("retain", LocalTier.retain)
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
    reports = gathered((phases.report(), phases.report("held")))
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
    reports = gathered((phases.report(), phases.report("held")))
    if rank == 0:
        Path(out).write_text(json.dumps(reports))


def _assert_nothing_read_back(reports: list[list[dict]]) -> None:
    for rank, (seen, held) in enumerate(reports):
        _assert_one_lease_at_the_holder(rank, held)
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


def _assert_one_lease_at_the_holder(rank: int, held: dict) -> None:
    """The holder's side of the two peer copies this rank received (its ward's steps 1 and 2):
    one save lease of the ward's store per copy, taken and released; one listing of its steps
    per copy, and the newest copy's manifest and index read once (only step 2's copy has one,
    step 1's); each copy's index and manifest put once. Nothing else is read of a copy: no
    listing or manifest read of a save protocol (its gc wait lists gc leases only)."""
    assert held.get("peer put lease", 0) == 2, (rank, held)
    assert held.get("peer delete lease", 0) == 2, (rank, held)
    assert held.get("peer list other lease", 0) == 2, (rank, held)  # the gc wait, once a copy
    assert held.get("peer list manifest", 0) == 2, (rank, held)
    assert held.get("peer get manifest", 0) == 1, (rank, held)
    assert held.get("peer get index", 0) == 1, (rank, held)
    assert held.get("peer put manifest", 0) == 2, (rank, held)
    assert held.get("peer put chunk", 0) > 0, (rank, held)
    allowed = {
        "peer put lease",
        "peer delete lease",
        "peer list other lease",
        "peer list manifest",
        "peer get manifest",
        "peer get index",
        "peer put index",  # the index, and a DCP copy's metadata
        "peer put manifest",
    }
    extra = {k for k in held if k.startswith("peer ") and not k.endswith(" chunk")} - allowed
    assert not extra, (rank, extra, held)
    # Retention after each copy runs its own protocol (its gc lease, its listings).
    assert held.get("retain put other lease", 0) >= 2, (rank, held)
    assert "drain put lease" not in held and "other put lease" not in held, (rank, held)


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
