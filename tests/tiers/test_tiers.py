"""Tiers: every save to a node-local directory, copies on peer nodes over gloo, durable storage
every M saves; restore from the fastest tier that verifies (ckptstore.tiers)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, StorageOptions, TierOptions, telemetry
from ckptstore.catalog import list_steps
from ckptstore.errors import CheckpointError, CheckpointNotFoundError
from ckptstore.leases import GC, Lease
from ckptstore.store import Store
from ckptstore.tiers.group import RankGroup
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.policy import Topology
from ckptstore.tiers.restore import DURABLE, LOCAL, PEER, plan_sources
from tests.helpers import ROOT
from tests.helpers.counting import CountingBackend, Tally
from tests.helpers.dist import gathered, run_ranks
from tests.helpers.integrity import chunk_files, referenced_chunks
from tests.helpers.tiers import (
    ENCODING,
    blank_state,
    copies_dir,
    index_doc,
    rank_state,
    save_steps,
    tier_checkpointer,
)


def _load(rank: int, world: int, root: str, out: str, kw: dict) -> None:
    fallback = kw.pop("fallback", False)
    healthy = kw.pop("healthy", False)
    tally = Tally()
    store = Store(str(Path(root) / "durable"))
    store.backend = CountingBackend(store.backend, tally)
    ckpt = tier_checkpointer(Path(root), rank, store=store, **kw)
    state = blank_state()
    step = ckpt.load(state, fallback=fallback, healthy=healthy)
    expected = rank_state(rank, step)
    ok = torch.equal(state["w"], expected["w"]) and torch.equal(state["shared"], expected["shared"])
    report = {
        "rank": rank,
        "step": step,
        "state_step": state["step"],
        "equal": ok,
        "source": ckpt.last_load.source,
        "sources": {k: v.bytes for k, v in ckpt.last_load.sources.items()},
        "durable_chunk_gets": tally.chunks["get"],
    }
    reports = gathered(report)
    ckpt.close()
    if rank == 0:
        Path(out).write_text(json.dumps(reports))


def _run_load(tmp_path: Path, **kw) -> list[dict]:
    out = tmp_path / "reports.json"
    run_ranks(_load, 4, str(tmp_path), str(out), kw, timeout_s=150)
    return json.loads(out.read_text())


def test_all_ranks_killed_restore_from_their_local_copies(tmp_path):
    kw = {"peer_copies": 1, "durable_every": 2, "abandon": True}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20, 30], kw, timeout_s=150)
    assert list_steps(Store(str(tmp_path / "durable"))) == [10, 30]
    reports = _run_load(tmp_path, peer_copies=1, durable_every=2)
    assert [r["step"] for r in reports] == [30] * 4
    assert all(r["equal"] and r["state_step"] == 30 for r in reports)
    assert [r["source"] for r in reports] == [LOCAL] * 4
    assert all(r["durable_chunk_gets"] == 0 for r in reports)


def test_a_wiped_node_restores_from_its_peers_without_durable_reads(tmp_path):
    kw = {"peer_copies": 1, "durable_every": 3}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    assert list_steps(Store(str(tmp_path / "durable"))) == [10]
    shutil.rmtree(tmp_path / "node1")  # ranks 2 and 3: a replaced node
    reports = _run_load(tmp_path, peer_copies=1, durable_every=3)
    assert [r["step"] for r in reports] == [20] * 4  # 20 exists only on local tiers
    assert all(r["equal"] for r in reports)
    assert [r["source"] for r in reports] == [LOCAL, LOCAL, PEER, PEER]
    assert reports[2]["sources"][PEER] > 0
    assert sum(r["durable_chunk_gets"] for r in reports) == 0
    # The node's tier holds the step again, from which the next restore reads locally.
    assert (copies_dir(tmp_path / "node1", 2) / "commits").is_dir()


def test_a_healthy_load_with_a_node_replaced_judges_the_peer_copy_it_takes(tmp_path):
    """A reviewer: ``load(fallback=True, healthy=True)`` (examples/train_gpt.py) with a node
    replaced failed "no healthy step ... health unknown": health was read from each rank's own
    store only, and the wiped ranks had none, though their holders' copies record it."""
    kw = {"peer_copies": 1, "durable_every": 3}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    shutil.rmtree(tmp_path / "node1")
    reports = _run_load(tmp_path, peer_copies=1, durable_every=3, fallback=True, healthy=True)
    assert [r["step"] for r in reports] == [20] * 4 and all(r["equal"] for r in reports)
    assert [r["source"] for r in reports] == [LOCAL, LOCAL, PEER, PEER], reports


def test_ls_describes_a_step_held_only_in_local_dirs_from_its_copies(tmp_path, capsys):
    """A reviewer: a step only the local tiers held was a row of dashes, its time, size and
    health unknown to an operator choosing a step. The copies describe it; its bytes only where
    the copies listed cover every rank."""
    from ckptstore.cli import main

    kw = {"peer_copies": 0, "durable_every": 3}
    began = time.time()
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    ended = time.time()
    durable, nodes = tmp_path / "durable", [str(tmp_path / "node0"), str(tmp_path / "node1")]

    def rows(*dirs):
        args = ["ls", str(durable), *[a for d in dirs for a in ("--local-dir", d)], "--json"]
        assert main(args) == 0
        return {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}

    both = rows(*nodes)
    whole, local_only = both[10], both[20]
    assert local_only["tiers"] == {"durable": False, "local": {nodes[0]: [0, 1], nodes[1]: [2, 3]}}
    assert (local_only["kind"], local_only["world_size"]) == ("state", 4)
    assert local_only["health"] == whole["health"] == "healthy"
    assert began <= local_only["created_at"] <= ended  # its first copy's local commit
    assert local_only["raw_bytes"] == whole["raw_bytes"]  # the same shapes on every rank
    assert local_only["user"] == {}
    half = rows(nodes[0])[20]
    assert half["world_size"] == 4 and half["raw_bytes"] is None and half["created"]
    assert main(["ls", str(durable), "--local-dir", nodes[0]]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[0] == "20")
    assert "state" in line and "healthy" in line and half["created"] in line


def test_a_store_made_again_gets_its_peer_copies_over_the_old_instances(tmp_path):
    """The durable store deleted and made again, the nodes' local dirs kept: the job saves the
    same step numbers again. Its own copies and the copies it sends to holders unlist the old
    instance's copies of those steps (never loaded) instead of failing over them, so a wiped
    node restores the new step from its peers."""
    kw = {"peer_copies": 1, "durable_every": 3}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    shutil.rmtree(tmp_path / "durable")
    (tmp_path / "durable").mkdir()
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    assert list_steps(Store(str(tmp_path / "durable"))) == [10]
    shutil.rmtree(tmp_path / "node1")
    reports = _run_load(tmp_path, peer_copies=1, durable_every=3)
    assert [r["step"] for r in reports] == [20] * 4 and all(r["equal"] for r in reports)
    assert [r["source"] for r in reports] == [LOCAL, LOCAL, PEER, PEER], reports


def _flip_a_chunk(store_dir: Path) -> None:
    chunks = sorted(p for p in (store_dir / "chunks").rglob("*") if p.is_file())
    target = max(chunks, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))


def test_a_corrupt_peer_copy_falls_back_to_durable_for_the_same_step(tmp_path, caplog):
    kw = {"peer_copies": 1, "durable_every": 1}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    shutil.rmtree(tmp_path / "node1")
    _flip_a_chunk(copies_dir(tmp_path / "node0", 2))  # node 0 keeps rank 2's copies
    reports = _run_load(tmp_path, peer_copies=1, durable_every=1)
    assert [r["step"] for r in reports] == [20] * 4
    assert all(r["equal"] for r in reports)
    assert [r["source"] for r in reports] == [LOCAL, LOCAL, DURABLE, PEER]
    assert reports[2]["durable_chunk_gets"] > 0 and reports[3]["durable_chunk_gets"] == 0


def test_with_no_durable_copy_a_corrupt_peer_copy_means_an_older_step(tmp_path):
    kw = {"peer_copies": 1, "durable_every": 2}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    shutil.rmtree(tmp_path / "node1")
    # Step 20 of rank 2 lives only in node 0's copy: spoil a chunk only it has.
    held = copies_dir(tmp_path / "node0", 2)
    index, older = (index_doc(held, step) for step in (20, 10))
    fresh = sorted(set(index["chunks"]) - set(older["chunks"]))
    path = held / "chunks" / fresh[0][:2] / fresh[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    reports = _run_load(tmp_path, peer_copies=1, durable_every=2, fallback=True)
    assert [r["step"] for r in reports] == [10] * 4  # every rank agrees on the older save
    assert all(r["equal"] for r in reports)


def test_local_tier_and_durable_every_in_one_process(tmp_path):
    root = tmp_path
    with Checkpointer(
        root / "durable", tiers=TierOptions(local_dir=root / "local", durable_every=2)
    ) as ckpt:
        handles = [ckpt.save(step, rank_state(0, step)) for step in (1, 2, 3, 4, 5)]
        for h in handles:
            h.wait()
        ckpt.wait()
        assert [h.durable is not None for h in handles] == [True, False, True, False, True]
        assert all(h.durable.result(timeout=60) is None for h in handles if h.durable)
    assert list_steps(Store(str(root / "durable"))) == [1, 3, 5]
    assert list_steps(Store(str(copies_dir(root / "local", 0)))) == [4, 5]  # local_keep_last=2
    loads_before = telemetry.tier_loads_total.value(tier=LOCAL)
    bytes_before = telemetry.tier_load_bytes_total.value(tier=LOCAL)
    with Checkpointer(
        root / "durable", tiers=TierOptions(local_dir=root / "local", durable_every=2)
    ) as ckpt:
        state = blank_state()
        assert ckpt.load(state) == 5 and ckpt.last_load.source == LOCAL
        assert torch.equal(state["w"], rank_state(0, 5)["w"])
        assert ckpt.last_load.sources[LOCAL].bytes > 0
    assert telemetry.tier_loads_total.value(tier=LOCAL) == loads_before + 1
    read = telemetry.tier_load_bytes_total.value(tier=LOCAL) - bytes_before
    assert read == ckpt.last_load.sources[LOCAL].bytes
    shutil.rmtree(root / "local")
    with Checkpointer(
        root / "durable", tiers=TierOptions(local_dir=root / "local", durable_every=2)
    ) as ckpt:
        state = blank_state()
        assert ckpt.load(state) == 5 and ckpt.last_load.source == DURABLE
        assert torch.equal(state["w"], rank_state(0, 5)["w"])


def test_metadata_of_a_step_the_local_tier_alone_holds_is_read_from_its_copy(tmp_path):
    """Stop 83's fix adversary: ``step = load(); metadata(step)`` failed ("not committed")
    for a step committed to the local tier alone."""
    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=2)
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ckpt:
        for step in (1, 2):
            ckpt.save(step, rank_state(0, step), metadata={"epoch": step}).wait()
        ckpt.wait()
        assert ckpt.metadata(1) == {"epoch": 1}  # from the durable store
        assert ckpt.metadata(2) == {"epoch": 2}  # this rank's local copy
        with pytest.raises(CheckpointNotFoundError, match="nor does this rank's local tier"):
            ckpt.metadata(3)


def test_stores_of_ranks_no_longer_here_go_once_retention_would_drop_their_copies(tmp_path):
    """Stores a node's job directory holds for ranks that run elsewhere now (a restart placed
    them on other nodes, or the world shrank) go once their newest copy is older than every
    copy local retention keeps, unless a live lease is held in them; a link is never
    followed."""
    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=3)  # local_keep_last=2
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ckpt:
        for step in (1, 2):
            ckpt.save(step, rank_state(0, step)).wait()
        ckpt.wait()  # step 1 drained: its copy's lease gone, not copied below as a live one
        own = copies_dir(tmp_path / "local", 0)
        left = {r: own.parent / f"rank-{r:05d}" for r in (1, 2)}
        for path in left.values():  # world size 1: no rank but 0 runs here
            shutil.copytree(own, path)
        Lease(Store(str(left[2])), GC, "other-process", ttl_s=600).acquire()  # never released
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(own, elsewhere)
        (own.parent / "rank-00003").symlink_to(elsewhere)
        ckpt.save(3, rank_state(0, 3)).wait()  # kept: steps 2-3; rank 1's newest is step 2
        assert left[1].is_dir()
        ckpt.save(4, rank_state(0, 4)).wait()  # kept: 3-4
    assert not left[1].exists()
    assert list_steps(Store(str(left[2]))) == [1, 2]  # a live lease: left in place
    assert list_steps(Store(str(elsewhere))) == [1, 2]
    assert list_steps(Store(str(own))) == [3, 4]


def test_with_local_keep_last_1_a_left_behind_store_outlives_the_step_before_the_newest(
    tmp_path,
):
    """Reviewer of stop 59: with ``local_keep_last=1`` a left-behind store (after a restart
    moved the wards, the only copy of the last step whose peer copies are done) was removed as
    the next step committed, before that step's peer copies and drain: a node lost then lost
    three steps. It now stays until the step before the newest is newer than its copies."""
    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=5, local_keep_last=1)
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ckpt:
        for step in (1, 2):
            ckpt.save(step, rank_state(0, step)).wait()
        own = copies_dir(tmp_path / "local", 0)
        left = own.parent / "rank-00001"
        shutil.copytree(own, left)  # its newest: step 2 (step 1 too while its drain runs)
        ckpt.save(3, rank_state(0, 3)).wait()
        assert list_steps(Store(str(left)))[-1] == 2
        ckpt.save(4, rank_state(0, 4)).wait()
        assert not left.exists()


def test_a_token_that_is_not_a_plain_file_turns_the_removal_off_without_hanging(tmp_path, caplog):
    """A FIFO planted as the job directory's token blocked the open of the tiers for ever."""
    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=5)
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ckpt:
        ckpt.save(1, rank_state(0, 1)).wait()
    own = copies_dir(tmp_path / "local", 0)
    (own.parent / "dir-token").unlink()
    os.mkfifo(own.parent / "dir-token")
    left = own.parent / "rank-00001"
    shutil.copytree(own, left)
    with caplog.at_level(logging.WARNING, logger="ckptstore.tiers.local"):
        with Checkpointer(tmp_path / "durable", tiers=tiers) as ckpt:
            for step in (2, 3, 4, 5):
                ckpt.save(step, rank_state(0, step)).wait()
    said = [r.getMessage() for r in caplog.records]
    assert any("are not removed" in m and "not a plain file" in m for m in said), said
    assert list_steps(Store(str(left))) == [1] and list_steps(Store(str(own)))[-2:] == [4, 5]


@pytest.mark.parametrize("token", ["", "a" * 31, "not a token at all, 32 chars..."])
def test_a_token_that_is_not_32_hex_digits_is_no_token(tmp_path, caplog, token):
    """Reviewer of stop 61: a token file emptied by a power loss (on every node that lost it)
    or planted read as a token, so nodes holding the same text counted as one directory, and a
    rank whose own store was gone passed over its peer copy on the other node."""
    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=5)
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ckpt:
        ckpt.save(1, rank_state(0, 1)).wait()
    own = copies_dir(tmp_path / "local", 0)
    (own.parent / "dir-token").write_text(token)
    local = LocalTier.open(
        tiers.policy(),
        None,
        Store(str(tmp_path / "durable")),
        RankGroup(None, 10.0),
        create=False,
        timeout_s=10,
    )
    with caplog.at_level(logging.WARNING, logger="ckptstore.tiers.local"):
        assert local.dir_token() is None
    assert any("does not hold a token" in r.getMessage() for r in caplog.records)


def test_a_local_tier_that_cannot_be_written_falls_back_to_durable(tmp_path, caplog):
    local = tmp_path / "local"
    local.write_text("not a directory")  # every local write fails
    caplog.set_level(logging.WARNING, logger="ckptstore")
    with Checkpointer(
        tmp_path / "durable", tiers=TierOptions(local_dir=local, durable_every=5)
    ) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, rank_state(0, step)).wait()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 2, 3]  # every save, not 1 in 5
    warnings = [r for r in caplog.records if "not committed to the local tier" in r.message]
    assert len(warnings) == 1


def test_a_local_copy_of_another_job_is_never_loaded(tmp_path):
    with Checkpointer(tmp_path / "a", tiers=TierOptions(local_dir=tmp_path / "local")) as ckpt:
        ckpt.save(7, rank_state(0, 7)).wait()
    with Checkpointer(tmp_path / "b", tiers=TierOptions(local_dir=tmp_path / "local")) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match="no tier holds"):
            ckpt.load(blank_state())


def test_a_resumed_job_never_mixes_two_saves_of_one_step(tmp_path):
    """Rank 0's node kept step 20 of a save the job never finished; the job resumed from 10
    and saved 20 again, durably: the old local 20 is another attempt, never loaded."""
    held = [
        {0: {10: "a", 20: "old"}},
        {1: {10: "a"}},
    ]
    plan = plan_sources(held, [10, 20], lambda s: {10: "a", 20: "new"}[s])
    assert [(c.step, c.attempt) for c in plan] == [(20, "new"), (10, "a")]
    assert plan[0].sources == [[_src(DURABLE)], [_src(DURABLE)]]
    assert [s.tier for s in plan[1].sources[0]] == [LOCAL, DURABLE]


def test_a_job_directory_is_one_source_and_never_a_peer_of_its_own_ranks():
    """Reviewer of stop 61: every rank of a node reports its directory's copies, so rank 2's
    plan was [local, peer rank 3 (its own directory), peer rank 0, peer rank 1 (one
    directory)]: a transient local error sent it to repair its intact copy from itself, which
    unlisted the copy first (a committed step lost), and a bad peer copy was sent twice."""
    node_a = {0: {5: "s"}, 1: {5: "s"}, 2: {5: "s"}, 3: {5: "s"}}  # own copies and wards'
    node_b = {2: {5: "s"}, 3: {5: "s"}, 0: {5: "s"}, 1: {5: "s"}}
    held = [node_a, node_a, node_b, node_b]
    plan = plan_sources(held, [], lambda s: None, places=["A", "A", "B", "B"])
    assert [str(src) for src in plan[0].sources[2]] == ["local", "peer rank 0"]
    assert [str(src) for src in plan[0].sources[1]] == ["local", "peer rank 2"]
    unknown = plan_sources(held, [], lambda s: None)  # without places: as before
    assert len(unknown[0].sources[2]) == 4


def test_a_resume_is_never_timed_before_one_recorded_and_its_token_outlives_a_failed_put():
    """Reviewer of stop 61: a restart whose rank 0 clock ran behind the last restart's timed
    its resume earlier, and one whose record could not be put gave its copies no token: either
    way the next load passed over that run's own newest copies."""
    from ckptstore.errors import StorageError
    from ckptstore.tiers.resumes import left_by, made_under, record_resume, resumes

    store = Store("memory://resumes-order")
    ahead = int((time.time() + 120) * 1000)  # an earlier restart whose clock ran ahead
    store.put(f"resumes/{4:020d}-{ahead:016d}-0123abcd", b"")
    token = record_resume(store, 7, 0)
    assert made_under({"resume": token}) > ahead / 1000
    assert left_by(8, made_under({"resume": token}), resumes(store)) is None

    def refuse(key: str, data: bytes) -> None:
        raise StorageError("put refused")

    store.put = refuse
    failed = record_resume(store, 9, 0)  # not stored, still newer than every record
    assert left_by(10, made_under({"resume": failed}), resumes(store)) is None
    assert [r.step for r in resumes(store)] == [4, 7]


def _src(tier):
    from ckptstore.tiers.restore import Source

    return Source(tier)


def test_holders_are_on_other_nodes():
    topo = Topology.build([0, 0, 1, 1, 2, 2], peer_copies=2)
    assert topo.holders(0) == [2, 4] and topo.holders(3) == [5, 1]
    assert topo.wards(0) == [2, 4]
    with pytest.raises(ValueError, match="at least 3 nodes"):
        Topology.build([0, 0, 1, 1], peer_copies=2)


def test_ls_shows_which_tiers_hold_each_step(tmp_path, capsys):
    from ckptstore.cli import main

    durable, local = tmp_path / "durable", tmp_path / "local"
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=2)) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, rank_state(0, step))
    with Checkpointer(tmp_path / "other", tiers=TierOptions(local_dir=local / "x")) as ckpt:
        ckpt.save(9, rank_state(0, 9))  # another job's copies: not this store's
    assert main(["ls", f"file://{durable}/", "--local-dir", str(local), "--json"]) == 0
    rows = {r["step"]: r["tiers"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows == {
        1: {"durable": True, "local": {}},
        3: {"durable": True, "local": {str(local): [0]}},
        4: {"durable": False, "local": {str(local): [0]}},
    }
    assert main(["ls", str(durable), "--local-dir", str(tmp_path / "missing")]) == 1
    assert "no local tier directory" in capsys.readouterr().err
    manifest = copies_dir(local, 0) / "commits" / f"{4:020d}.json"
    manifest.write_bytes(manifest.read_bytes()[:40])  # a local copy gone bad is not hidden
    assert main(["ls", str(durable), "--local-dir", str(local)]) == 1
    out, err = capsys.readouterr()
    assert "local copy unreadable: " in out and "step 4 of rank 0" in out
    assert "unreadable manifest" in err
    hint = f"ckptstore inspect {copies_dir(local, 0)} --step 3"  # a copy this directory holds
    assert hint in out
    assert main(hint.split()[1:]) == 0


def incompressible(step: int, n: int = 384 * 1024) -> dict:
    """A state of ``n`` int32 the codec cannot shrink, by ``step``."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randint(0, 2**31, (n,), generator=g, dtype=torch.int32)}


def test_a_local_tier_too_small_for_its_copies_keeps_no_chunk_of_a_failed_one(
    tmp_path, small_disk, caplog
):
    """Resource reviewer: a tier with room for fewer than local_keep_last + 1 copies failed at
    every save after the first warning, at INFO level, and each failed copy's chunks stayed
    (3 MiB of 12), so even a short-lived shortage became for good."""
    caplog.set_level(logging.INFO, logger="ckptstore")

    big = incompressible  # 1.5 MiB each: two fit on the 4 MiB disk

    with Checkpointer(
        tmp_path / "durable",
        tiers=TierOptions(local_dir=small_disk, durable_every=100, local_keep_last=2),
        encoding=EncodingOptions(compression="none", chunk_bytes=256 * 1024),
    ) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, big(step)).wait()
            if step == 1:
                ckpt.wait()  # drained: the one copy a full tier may let go
            copies = copies_dir(small_disk, 0)
            assert chunk_files(copies) == referenced_chunks(str(copies)), step
    failed = [r for r in caplog.records if "not committed to the local tier" in r.message]
    # Step 3 fails; the full tier then keeps one drained copy fewer (step 1's goes, with one
    # warning), so step 4 fits beside step 2, which only the tier holds
    assert [r.levelno for r in failed] == [logging.WARNING], caplog.text
    assert "is full: it keeps 1 copy" in caplog.text
    assert list_steps(Store(str(copies_dir(small_disk, 0)))) == [2, 4]


def test_a_full_local_disk_is_left_no_token_temporary(tmp_path, small_disk):
    """Resource reviewer: each tiered open on a full local_dir left a .dir-token.tmp-<uuid>
    (its removal covered the link, not the write that failed)."""
    with open(small_disk / "filler", "wb") as out:  # every byte of the disk taken
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
    for _ in range(2):
        with Checkpointer(tmp_path / "durable", tiers=TierOptions(local_dir=small_disk)) as ckpt:
            ckpt.save(len(list_steps(Store(str(tmp_path / "durable")))) + 1, {"w": torch.ones(4)})
    assert not list(small_disk.rglob(".dir-token.tmp-*"))


def test_a_full_local_disk_sends_saves_to_durable_and_loses_nothing(tmp_path, small_disk, caplog):
    caplog.set_level(logging.WARNING, logger="ckptstore")
    durable = tmp_path / "durable"

    big = incompressible  # 1.5 MiB each: two fit on the 4 MiB disk

    with Checkpointer(
        durable,
        tiers=TierOptions(local_dir=small_disk, durable_every=100, local_keep_last=5),
        encoding=EncodingOptions(compression="none"),
    ) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, big(step)).wait()
    local_steps = list_steps(Store(str(copies_dir(small_disk, 0))))
    durable_steps = list_steps(Store(str(durable)))
    assert local_steps and durable_steps[0] == 1  # the first save is durable
    assert sorted(set(local_steps) | set(durable_steps)) == [1, 2, 3, 4, 5]
    # Warned of once, or twice where the full tier let step 1's drained copy go (it keeps
    # fewer): the next save fits, the one after is the first in a row again
    said = [r for r in caplog.records if "not committed to the local tier" in r.message]
    assert len(said) in (1, 2), caplog.text
    for step in range(1, 6):  # every step committed somewhere loads, bit for bit
        state = {"w": torch.zeros(384 * 1024, dtype=torch.int32)}
        with Checkpointer(durable, tiers=TierOptions(local_dir=small_disk)) as ckpt:
            assert ckpt.load(state, step=step) == step
        assert torch.equal(state["w"], big(step)["w"])


def test_a_local_tier_full_of_its_copies_keeps_fewer_and_takes_the_next_saves(
    tmp_path, small_disk, caplog
):
    """A full-disk reviewer: a local_dir with room for exactly local_keep_last copies failed
    the third, and local retention, which runs after a local commit, never ran again: the
    tier kept its two oldest copies for good and every later save bypassed it."""
    caplog.set_level(logging.WARNING, logger="ckptstore")
    durable = tmp_path / "durable"

    big = incompressible  # 1.5 MiB each: two fit on the 4 MiB disk

    local = []
    with Checkpointer(
        durable,
        tiers=TierOptions(local_dir=small_disk, local_keep_last=2),
        encoding=EncodingOptions(compression="none"),
    ) as ckpt:
        for step in range(1, 8):
            ckpt.save(step, big(step)).wait()
            ckpt.wait()  # drained: no copy kept for its drain
            local.append(list_steps(Store(str(copies_dir(small_disk, 0)))))
    assert local[-1] == [7] and all(steps[-1] == s for s, steps in enumerate(local, 1) if s > 3)
    said = [r.message for r in caplog.records if "is full: it keeps 1 copy" in r.message]
    assert len(said) == 1, caplog.text
    assert list_steps(Store(str(durable)))[-1] == 7


def test_a_drain_that_skips_an_unhealthy_step_leaves_its_copy_the_only_one_kept(tmp_path):
    """An adversary: a drain whose durable commit skipped the step (a norm jump, which only
    the durable commit judges) marked the local copy drained, so a tier found full later
    would let the only copy of the step go."""
    from ckptstore import HealthPolicy

    durable, local = tmp_path / "durable", tmp_path / "local"
    health = HealthPolicy(on_unhealthy="skip", norm_jump=10.0)
    with Checkpointer(durable, tiers=TierOptions(local_dir=local), health=health) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)}).wait()
        ckpt.wait()
        ckpt.save(2, {"w": torch.ones(1000) * 1000}).wait()
        ckpt.wait()
        assert list_steps(Store(str(durable))) == [1]
        assert sorted(ckpt._local._drained) == [1]  # step 2's copy is the only one: kept


def test_retention_of_each_tier_under_a_concurrent_gc(tmp_path):
    import threading

    from ckptstore.retention import collect

    durable, local = tmp_path / "durable", tmp_path / "local"
    stop = threading.Event()
    errors: list[BaseException] = []

    def gc_loop(root: Path) -> None:
        while not stop.is_set():
            try:
                if (root / "commits").is_dir():
                    collect(Store(str(root)), keep_last=1)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

    with Checkpointer(
        durable, tiers=TierOptions(local_dir=local, durable_every=2, local_keep_last=2), keep_last=2
    ) as ckpt:
        ckpt.save(0, rank_state(0, 0)).wait()
        threads = [
            threading.Thread(target=gc_loop, args=(root,), daemon=True)
            for root in (durable, copies_dir(local, 0))
        ]
        for t in threads:
            t.start()
        try:
            for step in range(1, 9):
                ckpt.save(step, rank_state(0, step)).wait()
            try:
                ckpt.wait()
            except CheckpointError as exc:
                # The outside gc (keep_last=1) may drop a local step before its drain reads it:
                # that drain fails, named, and nothing committed elsewhere is touched.
                assert "committed to the local tiers but not to durable storage" in str(exc)
                assert "is not committed in" in str(exc)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert not errors
    for root in (durable, copies_dir(local, 0)):
        steps = list_steps(Store(str(root)))
        assert steps, root
        for step in steps:  # what each tier kept is whole
            state = blank_state()
            with Checkpointer(root) as ckpt:
                ckpt.load(state, step=step)
            assert torch.equal(state["w"], rank_state(0, step)["w"])
    assert 8 in list_steps(Store(str(copies_dir(local, 0))))


def test_peer_copies_hold_at_most_their_budget_and_send_only_new_chunks(tmp_path):
    budget = 150_000  # a round: one 64 KiB chunk and its status byte (at most half of it)
    out = tmp_path / "copies.json"
    encoding = dataclasses.replace(ENCODING, compression="none")
    kw = {"peer_copies": 1, "peer_budget_bytes": budget, "report": str(out), "encoding": encoding}
    run_ranks(save_steps, 4, str(tmp_path), [10, 20], kw, timeout_s=150)
    for rank, copies in enumerate(json.loads(out.read_text())):
        (first, sent1, held1, node1, flying1), (second, sent2, held2, node2, _) = copies
        # One transfer out and one in per rank; the one in holds two rounds of one chunk each
        # at once (one crossing while the other is checked), within the budget. The sender
        # holds no buffer: it sends from its chunks' mapped pages.
        chunk = ENCODING.chunk_bytes
        assert flying1 == 2, (rank, copies)
        assert 2 * chunk < max(first, second) <= budget, (rank, copies)  # chunks + headers
        # "frozen" is held by the holder after the first save: not sent, not copied again.
        assert held1 == 0 and held2 > 0 and node2 < node1, (rank, copies)
        # Only the rank's private weights cross the wire: what every rank holds alike is taken
        # from the copies on the holder's node.
        assert sent1 == sent2 == 4, (rank, copies)


PREEMPTED_LOOP = """
import sys, time
import torch
from ckptstore import Checkpointer, PreemptionOptions, TierOptions
durable, local = sys.argv[1], sys.argv[2]
ckpt = Checkpointer(
    durable,
    tiers=TierOptions(local_dir=local, durable_every=1000),
    preemption=PreemptionOptions(handle_sigterm=True),
)
step = 0
while step < 3000:
    step += 1
    state = {"w": torch.full((4096,), float(step))}
    preempted = ckpt.preempted  # read once: the step it leaves at is saved after SIGTERM
    if step % 5 == 0 or preempted:
        ckpt.save(step, state)
    if step == 10:
        print("training", flush=True)
    if preempted:
        print(f"left at step {step}", flush=True)
        break
    time.sleep(0.01)
"""


def test_after_sigterm_a_save_reaches_durable_storage_before_the_process_ends(tmp_path):
    import signal
    import subprocess
    import sys

    durable, local = tmp_path / "durable", tmp_path / "local"
    proc = subprocess.Popen(
        [sys.executable, "-c", PREEMPTED_LOOP, str(durable), str(local)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "training"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode in (-signal.SIGTERM, 143), err
    left = int(out.split("left at step ")[1].split()[0])
    steps = list_steps(Store(str(durable)))
    assert steps[0] == 5 and steps[-1] == left  # the first save, and the one after SIGTERM
    assert len(steps) == 2
    state = {"w": torch.zeros(4096)}
    with Checkpointer(durable) as ckpt:
        assert ckpt.load(state) == left
    assert torch.equal(state["w"], torch.full((4096,), float(left)))


def test_two_jobs_share_a_local_dir_without_getting_in_each_others_way(tmp_path):
    local = tmp_path / "shm"
    for job in ("a", "b"):  # the same step numbers, one RAM disk
        with Checkpointer(
            tmp_path / job, tiers=TierOptions(local_dir=local, durable_every=100)
        ) as ckpt:
            for step in (10, 20):
                ckpt.save(step, rank_state(0, step + ord(job))).wait()
    for job in ("a", "b"):
        assert list_steps(Store(str(tmp_path / job))) == [10]  # 20 went to the local tier only
        with Checkpointer(tmp_path / job, tiers=TierOptions(local_dir=local)) as ckpt:
            state = blank_state()
            assert ckpt.load(state) == 20 and ckpt.last_load.source == LOCAL
            assert torch.equal(state["w"], rank_state(0, 20 + ord(job))["w"])
    assert len(list(local.glob("job-*/rank-00000"))) == 2


def test_a_failed_drain_is_raised_once_by_wait_and_the_local_copy_stays(tmp_path):
    from bench.faults import Faults, with_faults

    faults = Faults(error_rate=1.0, ops=frozenset({"put"}))
    durable = with_faults(Store(str(tmp_path / "durable")), faults)
    with Checkpointer(
        tmp_path / "durable",
        storage=StorageOptions(store=durable, timeout_s=2.0),
        tiers=TierOptions(local_dir=tmp_path / "local"),
    ) as ckpt:
        handle = ckpt.save(1, rank_state(0, 1))
        handle.wait()  # committed to the local tier
        with pytest.raises(CheckpointError, match="step.s. 1 committed to the local tiers but not"):
            ckpt.wait()
        ckpt.wait()  # reported once
        assert handle.durable.exception(timeout=60) is not None
    assert list_steps(Store(str(copies_dir(tmp_path / "local", 0)))) == [1]
    assert list_steps(Store(str(tmp_path / "durable"))) == []


def test_drains_that_fall_behind_saves_drain_the_newest_step_and_let_the_rest_go(tmp_path):
    from bench.faults import Faults, with_faults
    from ckptstore.errors import DrainSupersededError
    from tests.helpers.wait import wait_until

    faults = Faults(hang_rate=1.0, ops=frozenset({"put"}))  # the first drain waits for release
    durable = with_faults(Store(str(tmp_path / "durable")), faults)
    local = tmp_path / "local"
    with Checkpointer(
        tmp_path / "durable",
        storage=StorageOptions(store=durable, timeout_s=60.0),
        tiers=TierOptions(local_dir=local, local_keep_last=1),
    ) as ckpt:
        handles = [ckpt.save(step, rank_state(0, step)) for step in range(1, 6)]
        for handle in handles:
            handle.wait()  # every step committed locally; step 1's drain hangs
        assert wait_until(lambda: ckpt._drains.queued() == 4, timeout_s=60)
        # Protected until drained: every step is still in the local tier.
        assert list_steps(Store(str(copies_dir(local, 0)))) == [1, 2, 3, 4, 5]
        faults.release()
        ckpt.wait()  # the newest drain: no error from the steps let go
        assert handles[0].durable.exception(timeout=60) is None
        for handle in handles[1:4]:
            error = handle.durable.exception(timeout=60)
            assert isinstance(error, DrainSupersededError) and "step 5" in str(error), error
        assert handles[4].durable.exception(timeout=60) is None
        ckpt.save(6, rank_state(0, 6)).wait()
        ckpt.wait()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 5, 6]
    # local_keep_last=1 applies again once nothing is held for a drain.
    assert list_steps(Store(str(copies_dir(local, 0)))) == [6]
    with Checkpointer(tmp_path / "durable") as ckpt:
        state = blank_state()
        assert ckpt.load(state) == 6 and torch.equal(state["w"], rank_state(0, 6)["w"])


def test_a_load_reads_only_the_durable_manifests_it_considers(tmp_path):
    with Checkpointer(
        tmp_path / "durable", tiers=TierOptions(local_dir=tmp_path / "local")
    ) as ckpt:
        for step in range(1, 7):  # every save durable
            ckpt.save(step, rank_state(0, step)).wait()
    tally = Tally()
    store = Store(str(tmp_path / "durable"))
    store.backend = CountingBackend(store.backend, tally)
    with Checkpointer(
        tmp_path / "durable",
        tiers=TierOptions(local_dir=tmp_path / "local"),
        storage=StorageOptions(store=store),
    ) as ckpt:
        assert ckpt.load(blank_state()) == 6 and ckpt.last_load.source == LOCAL
    assert tally.others["get"] == 2  # identity.json at open, step 6's manifest (not all six)
    assert tally.chunks.total() == 0


def test_a_local_tier_request_that_times_out_is_not_tried_again():
    """A hung local disk costs one attempt's deadline, then the next tier is tried: the
    local stores' whole request budget is one attempt (issue 32: a hung local manifest cost
    62 s, three attempts and backoff, under the durable store's policy)."""
    from ckptstore.tiers.local import local_retry

    for timeout_s in (2.0, 30.0, 1200.0):
        policy = local_retry(timeout_s)
        assert policy.budget_s() == policy.timeout_s == min(10.0, timeout_s)


_FAILED_SAVE_THEN_SAVE = """
import sys, torch
from ckptstore import Checkpointer, TierOptions
from ckptstore.tiers.saving import TierSaver

commit_local = TierSaver.commit_local

def lost(self, **kw):  # what a lost rank's gloo error does to the local commit
    if kw["step"] == 1:
        raise RuntimeError("Connection closed by peer")
    return commit_local(self, **kw)

TierSaver.commit_local = lost
ckpt = Checkpointer(sys.argv[1], tiers=TierOptions(local_dir=sys.argv[2]))
state = {"w": torch.arange(65536.0)}
try:
    ckpt.save(1, state).wait()
    raise SystemExit("step 1 did not fail")
except RuntimeError as exc:
    print("step 1 failed:", exc, flush=True)
ckpt.save(2, state).wait()  # blocked forever in staging while step 1 held the only buffer
ckpt.close()
print("step 2 saved", flush=True)
"""


def test_a_failed_tiered_save_gives_its_staging_buffer_back(tmp_path):
    """Issue 32, item 2: a tiered save that failed after staging (the local commit's exchange
    raised, as a lost rank makes it) gave its buffer back, so the next save does not wait for it
    forever (a real process, bounded)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FAILED_SAVE_THEN_SAVE, str(tmp_path / "d"), str(tmp_path / "l")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0 and "step 2 saved" in proc.stdout, proc.stderr[-2000:]


def test_a_rank_lost_while_drains_agree_fails_each_queued_drain_and_wait_returns():
    """The fault trial (issue 32) lost a node while a drain's ranks agreed on the newest step:
    that exchange raised outside the drain's own error handling, the drain thread died, and
    ``wait()`` / ``close()`` blocked for good. Now each queued drain fails with the loss."""
    import concurrent.futures

    from ckptstore.errors import RankLostError
    from ckptstore.format import KIND_STATE
    from ckptstore.tiers.drain import DrainJob, DrainQueue

    class LostGroup:
        rank = 0

        def gather(self, value):
            raise RankLostError("rank 1 lost: an exchange failed and its heartbeat stopped", [1])

    class Local:
        protected: set[int] = set()

        def protect(self, step):
            self.protected.add(step)

        def unprotect(self, step):
            self.protected.discard(step)

    local = Local()
    drains = DrainQueue(local=local, group=LostGroup(), store=Store("memory://lost-drains"))
    futures = [concurrent.futures.Future() for _ in range(3)]
    for step, future in enumerate(futures, 1):
        drains.put(DrainJob(step, f"a{step}", KIND_STATE, future))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pool.submit(drains.close).result(timeout=30)  # returned: every job was taken
    finally:
        pool.shutdown(wait=False)
    for future in futures:
        assert isinstance(future.exception(timeout=0), RankLostError)
    assert local.protected == set()
    with pytest.raises(CheckpointError, match=r"step\(s\) 1, 2, 3 committed to the local tiers"):
        drains.raise_failures()


@pytest.mark.parametrize("kind", ["unknown", "full"])
def test_a_failed_drain_is_raised_as_the_kind_of_failure_it_was(kind):
    """Stop 83's fourth fix adversary: a drain whose manifest put's outcome was unknown (it
    landed later) was raised by ``wait()`` as "committed to the local tiers but not to durable
    storage", a plain failure, on the rank that could not tell, while another rank read the
    manifest and returned committed. It stays ``CommitUnknownError``. Disk-full reviewer of
    stop 84: a drain to a full durable store was a plain ``CheckpointError`` (an untiered save
    raises ``StorageFullError``): ``except StorageFullError`` missed it."""
    import concurrent.futures

    from ckptstore.errors import CommitUnknownError, StorageFullError
    from ckptstore.format import KIND_STATE
    from ckptstore.tiers.drain import DrainJob, DrainQueue

    class UnknownGroup:
        rank = 0

        def gather(self, value):
            if kind == "full":
                raise StorageFullError("put /d/chunks/ab: no space left on device")
            raise CommitUnknownError("step 1: the manifest put's answer was lost")

    class Local:
        def protect(self, step):
            pass

        def unprotect(self, step):
            pass

    drains = DrainQueue(local=Local(), group=UnknownGroup(), store=Store("memory://unknown"))
    future = concurrent.futures.Future()
    drains.put(DrainJob(1, "a1", KIND_STATE, future))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pool.submit(drains.close).result(timeout=30)
    finally:
        pool.shutdown(wait=False)
    if kind == "full":
        with pytest.raises(StorageFullError, match=r"^step\(s\) 1 .* not to durable .* space"):
            drains.raise_failures()
        return
    with pytest.raises(
        CommitUnknownError, match=r"whether they reached durable storage .* unknown"
    ):
        drains.raise_failures()


def test_ls_sets_apart_the_copies_a_load_passes_over_as_a_run_the_job_left(tmp_path, capsys):
    """A node away during a rollback keeps copies of the run the job left (stop 61): every load
    passes over them; ``ls --local-dir`` listed them as loadable copies."""
    from ckptstore.cli import main
    from ckptstore.store import Store
    from ckptstore.tiers.resumes import record_resume

    durable, local = tmp_path / "durable", tmp_path / "local"
    with Checkpointer(durable, tiers=TierOptions(local_dir=local, durable_every=2)) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, rank_state(0, step))
    record_resume(Store(str(durable)), 1, 0)  # the job went back to step 1 while this node was away
    assert main(["ls", str(durable), "--local-dir", str(local), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r["tiers"] for r in doc["steps"]}
    assert rows == {
        1: {"durable": True, "local": {}},
        3: {"durable": True, "local": {}},  # durable storage holds the step the job kept
    }
    left = doc["local_dirs"][str(local)]["left"]
    assert left == [{"step": s, "ranks": [0], "resumed_from": 1} for s in (3, 4)], left
    assert main(["ls", str(durable), "--local-dir", str(local)]) == 0
    out = capsys.readouterr().out
    assert "step 4 (rank 0) is of the run the job left when it resumed from step 1" in out, out
    with Checkpointer(durable, tiers=TierOptions(local_dir=local)) as ckpt:
        assert ckpt.load(rank_state(0, 0)) == 3  # as ls says: the durable step 3, not the copy 4


def test_an_old_incarnation_still_running_never_commits_a_step_its_restart_saved(tmp_path):
    """A durability reviewer: incarnation B of a tiered job (restarted, resumed from step 3)
    saved steps 4 and 5 while the old A still ran; A's save of 5 met B's local copy
    (``StepExistsError``), was taken for a full local disk and sent to durable storage, where
    step 5 was not yet: both saves reported committed, and a later load returned A's state."""
    from ckptstore.errors import StepExistsError

    durable, local = tmp_path / "durable", tmp_path / "local"
    tiers = TierOptions(local_dir=local, durable_every=2)
    a = Checkpointer(durable, keep_last=2, tiers=tiers)
    for step in range(4):
        a.save(step, rank_state(0, step)).wait()
    b = Checkpointer(durable, keep_last=2, tiers=tiers)
    assert b.load(rank_state(0, 0), fallback=True) == 3
    mine = {s: {**rank_state(0, s), "w": rank_state(0, s)["w"] + 1000} for s in (4, 5)}
    for step in (4, 5):
        b.save(step, mine[step]).wait()
    b.wait()
    for step in (4, 5):
        with pytest.raises(StepExistsError):
            a.save(step, rank_state(0, step)).wait()
    a.close()
    b.close()
    target = rank_state(0, 0)
    with Checkpointer(durable, tiers=tiers) as ckpt:
        assert ckpt.load(target, fallback=True) == 5
    assert torch.equal(target["w"], mine[5]["w"])


def test_a_resume_removes_the_records_it_makes_redundant_and_no_other():
    """Stop 64's list: resumes/ records were never removed, one per restart: a job crash-looping
    at one step piled up a record per restart, each listed by every tiered load."""
    from ckptstore.tiers.resumes import left_by, made_under, record_resume, resumes

    store = Store("memory://resumes-prune")
    first = record_resume(store, 5, 0)
    for _ in range(3):  # restarts from step 9, again and again
        again = record_resume(store, 9, 0)
    assert [r.step for r in resumes(store)] == [5, 9]
    # a copy of step 12 made under the first resume is still passed over, one of step 7 made
    # before it too; one of step 7 made under it is that run's own
    assert left_by(12, made_under({"resume": first}), resumes(store)) is not None
    assert left_by(7, made_under({}), resumes(store)) is not None
    assert left_by(7, made_under({"resume": first}), resumes(store)) is None
    assert left_by(12, made_under({"resume": again}), resumes(store)) is None
    back = record_resume(store, 3, 0)  # back to step 3: the records of 5 and 9 add nothing
    assert [r.step for r in resumes(store)] == [3]
    assert left_by(6, made_under({"resume": again}), resumes(store)) is not None
    assert left_by(6, made_under({"resume": back}), resumes(store)) is None


def test_a_local_tier_found_full_once_does_not_keep_every_copy_it_never_drained(
    tmp_path, small_disk, caplog
):
    """Adversary of stop 75: once a full disk had made the tier keep fewer drained copies, it
    kept every copy never drained for good (with ``durable_every=2``, every other step's), so
    once what filled the disk was gone the tier filled with its own old copies and each later
    save bypassed it until the process restarted. A copy only the tier holds stays only among
    the newest ``local_keep_last``."""
    caplog.set_level(logging.WARNING, logger="ckptstore")

    def big(step: int) -> dict:  # 0.75 MiB each
        return incompressible(step, 192 * 1024)

    with Checkpointer(
        tmp_path / "durable",
        tiers=TierOptions(local_dir=small_disk, durable_every=2, local_keep_last=2),
        encoding=EncodingOptions(compression="none", chunk_bytes=256 * 1024),
    ) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, big(step)).wait()
        ckpt.wait()  # step 3 drained: a copy a full tier may let go
        hog = small_disk / "hog"
        with open(hog, "wb") as out:  # another process takes every byte left
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError:
                pass
        ckpt.save(5, big(5)).wait()  # to durable storage: the tier is full
        assert "is full: it keeps 1 copy" in caplog.text
        hog.unlink()
        caplog.clear()
        for step in range(6, 16):
            ckpt.save(step, big(step)).wait()
            ckpt.wait()
    said = [r.message for r in caplog.records if "not committed to the local tier" in r.message]
    assert not said, said
    assert list_steps(Store(str(copies_dir(small_disk, 0)))) == [14, 15]
