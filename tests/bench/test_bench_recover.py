"""``ckptbench recover``: a small run of 4 gloo ranks as 2 nodes restores the wiped node from
its peers without a durable chunk read, every rank's state equal to the saved one, side by side
with DCP's load; the bench fails when a state differs; bad layouts are usage errors.
``--frontend dcp``: 2 ranks as 2 nodes save with dcp.async_save and load through
ckptstore.dcp with tiers (one peer copy) and without, beside DCP's own writer and reader; the
wiped node's rank restores from its peer's copy, the other from its local copy, with no
durable chunk read, every state bit for bit equal."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import recover
from tests.helpers import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ckptbench")
    recover.add_parser(parser.add_subparsers())
    return parser.parse_args(["recover", *argv])


def _run(capsys, *argv: str) -> dict:
    args = _args(*argv, "--json")
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def _small_run(capsys, tmp_path: Path, *extra: str) -> dict:
    durable, local = tmp_path / "durable", tmp_path / "local"
    durable.mkdir()
    local.mkdir()
    result = _run(
        capsys, "--ranks", "4", "--ranks-per-node", "2", "--size", "8MiB", "--repeat", "1",
        "--local-root", str(local), "--timeout", "200", *extra,
    )  # fmt: skip
    assert not list(local.iterdir())  # the nodes' directories are removed
    return result


@pytest.mark.slow
def test_a_wiped_node_restores_from_its_peers_with_no_durable_chunk_read(capsys, tmp_path):
    durable = tmp_path / "durable"
    result = _small_run(capsys, tmp_path, "--durable", str(durable))
    assert not list(durable.iterdir())  # the bench's workspace is removed
    cfg = result["config"]
    assert (cfg["nodes"], cfg["wiped_node"], cfg["wiped_ranks"]) == (2, 1, [2, 3])
    assert cfg["bytes_per_rank"] == 2 * 2**20 and cfg["size_bytes"] == 8 * 2**20
    assert result["equal"]
    tiers, dcp = result["restore"]["tiers"], result["restore"]["dcp"]
    assert tiers["equal"] and dcp["equal"]
    assert tiers["steps"] == [1]  # the step saved, on every rank
    # node 0 reads its own copies, node 1 (wiped) its peers'; durable storage gives no chunk
    assert tiers["sources"] == ["local", "local", "peer", "peer"]
    assert tiers["durable_chunk_bytes"] == 0 and tiers["durable_chunk_requests"] == 0
    assert result["targets"]["zero_durable_chunk_bytes"]
    by_source = tiers["bytes_by_source"]
    assert by_source["local"] > 0 and by_source["peer"] > 0 and "durable" not in by_source
    # the durable store was asked for what steps it holds, nothing more than metadata
    reads = tiers["durable_reads"][0]
    assert reads["chunk_requests"] == {} and reads["other_bytes"] == sum(reads["bytes"].values())
    # both timings, per rank and for the job, and the ratio between them
    for method in (tiers, dcp):
        assert method["seconds"] > 0 and len(method["per_rank_s"]) == 4
        assert all(s > 0 for s in method["per_rank_s"])
    assert result["restore"]["dcp_over_tiers"] > 0
    # the wiped ranks' restore as a rate, beside the group's point-to-point bandwidth
    assert tiers["p2p_bytes_per_s"] > 0 and tiers["peer_restore_bytes_per_s"] > 0
    assert tiers["peer_restore_over_p2p"] == pytest.approx(
        tiers["peer_restore_bytes_per_s"] / tiers["p2p_bytes_per_s"]
    )
    save = result["save"]
    for name in ("tiers", "plain"):
        assert save[name]["blocked_s"] > 0
        assert save[name]["committed_s"] >= save[name]["blocked_s"]
    assert save["tiers"]["durable_s"] >= save["tiers"]["committed_s"]
    assert save["tiers_over_plain"] > 0 and save["dcp_save_s"] > 0
    peer = result["peer_copy"]
    assert peer["failed"] == [] and peer["sent_bytes_per_save"] > 0
    # two round buffers per transfer a rank takes part in (its own copy out, a ward's in)
    assert 0 < peer["buffer_bytes_peak"] <= 2 * cfg["bytes_per_rank"] + 2 * 64
    assert set(result["targets"]) == {
        "restore_5x_faster_than_dcp",
        "zero_durable_chunk_bytes",
        "save_blocking_within_1_1x",
    }
    # the table renders the same report, in the Checkpointer's words
    out = io.StringIO()
    recover.print_table(result, out=out)
    text = out.getvalue()
    assert text.startswith("ckptbench recover  ") and "rank 3 (node 1)" in text
    assert "DCP / tiers" in text and "no tiers" not in text and "wait() returned" in text
    assert "the others from their own, no durable chunk read (every round): yes" in text
    assert "peer copy: peak round buffer" in text and "0 durable chunk bytes met" in text
    assert "the group's point to point: " in text


@pytest.mark.slow
def test_dcp_frontend_restores_the_wiped_node_from_its_peer_with_no_durable_chunk_read(
    capsys, tmp_path
):
    durable, local = tmp_path / "durable", tmp_path / "local"
    durable.mkdir()
    local.mkdir()
    result = _run(
        capsys, "--frontend", "dcp", "--ranks", "2", "--ranks-per-node", "1", "--size", "4MiB",
        "--repeat", "2", "--durable", str(durable), "--local-root", str(local),
        "--timeout", "200",
    )  # fmt: skip
    assert not list(durable.iterdir()) and not list(local.iterdir())  # all removed
    cfg = result["config"]
    assert cfg["frontend"] == "dcp" and cfg["peer_copies"] == 1 and cfg["durable_every"] == 1
    assert cfg["peer_budget_bytes"] == 64 * 2**20
    assert (cfg["nodes"], cfg["wiped_node"], cfg["wiped_ranks"]) == (2, 1, [1])
    assert cfg["bytes_per_rank"] == 2 * 2**20
    assert all(cfg["stored_bytes"][name] > 0 for name in ("durable", "plain", "dcp"))
    restore = result["restore"]
    tiers, plain, dcp = restore["tiers"], restore["plain"], restore["dcp"]
    # every rank's state bit for bit equal to the saved one, by every method, every round
    assert result["equal"] and tiers["equal"] and plain["equal"] and dcp["equal"]
    assert all(rnd[m]["equal"] for r in result["ranks"] for rnd in r["restore"] for m in rnd)
    # the newest timed step, not the warm-up save's step 0
    assert tiers["steps"] == [2] and plain["steps"] == [2]
    # rank 0 reads its local copy, rank 1 (wiped) restores its copy from rank 0's node: no
    # durable chunk read in any round
    assert tiers["sources"] == ["local", "peer"] and tiers["as_expected"]
    assert tiers["durable_chunk_bytes"] == 0 and tiers["durable_chunk_requests"] == 0
    assert tiers["durable_chunk_gets"] == 0
    assert result["targets"]["zero_durable_chunk_bytes"]
    for reads in tiers["durable_reads"]:  # asked only what steps it holds
        assert reads["chunk_requests"] == {} and reads["chunk_bytes"] == 0
    by_source = tiers["bytes_by_source"]
    assert "durable" not in by_source and by_source["local"] > 0
    assert 0.5 * cfg["bytes_per_rank"] < by_source["peer"] <= 1.1 * cfg["bytes_per_rank"]
    assert len(tiers["bytes_by_source_rounds"]) == 2
    first = [r["restore"][0]["tiers"] for r in result["ranks"]]
    assert set(first[0]["sources"]) == {"local"}
    assert first[1]["source"] == "peer" and "durable" not in first[1]["sources"]
    assert first[1]["sources"]["peer"]["chunks"] >= 1
    assert all(f["durable"]["chunk_bytes"] == 0 for f in first)
    # without tiers every chunk of the step comes from durable storage: the stored bytes of
    # what each rank took from its source tier
    taken = first[0]["sources"]["local"]["bytes"] + first[1]["sources"]["peer"]["bytes"]
    assert plain["durable_chunk_bytes"] == taken
    assert plain["durable_chunk_gets"] >= 2
    for method in (tiers, plain, dcp):
        assert method["seconds"] > 0 and len(method["per_rank_s"]) == 2
        assert all(s > 0 for s in method["per_rank_s"])
    assert all(restore[k] > 0 for k in ("dcp_over_tiers", "dcp_over_plain", "plain_over_tiers"))
    save = result["save"]
    for name in ("tiers", "plain"):
        s = save[name]
        assert 0 < s["blocked_s"] <= s["blocked_slowest_s"]
        assert len(s["blocked_slowest_rounds_s"]) == 2
        # committed (result() returned) is after async_save returned, for the slowest rank too
        assert s["committed_s"] >= s["blocked_slowest_s"] and "durable_s" not in s
        assert save[f"{name}_over_dcp_save"] > 0
    assert save["tiers_over_plain"] > 0 and save["tiers_over_plain_committed"] > 0
    assert save["dcp_save_s"] > 0
    # the warm-up save allocated each writer's staging buffer; no timed save allocated one
    assert save["staging_allocations_warm"] == [{"tiers": 1, "plain": 1}] * 2
    assert save["staging_allocated_in_timed_saves"] is False
    saves = [s for r in result["ranks"] for s in r["saves"]]
    assert len(saves) == 2 * 2 * 2  # ranks x steps x methods
    assert all(s["saved_step"] == s["step"] and s["step"] in (1, 2) for s in saves)
    assert all(s["committed_s"] >= s["blocked_s"] > 0 for s in saves)
    assert set(result["targets"]) == {
        "restore_5x_faster_than_dcp",
        "zero_durable_chunk_bytes",
        "save_blocking_within_1_1x",
    }
    assert not any("not 0" in note for note in result["notes"])
    # the table renders the same report
    out = io.StringIO()
    recover.print_table(result, out=out)
    text = out.getvalue()
    assert "rank 1 (node 1)" in text and "DCP / no tiers" in text and "committed" in text
    assert "dcp.async_save" in text and "peer_copies=1" in text
    assert "the others from their own, no durable chunk read (every round): yes" in text
    assert "0 durable chunk bytes met" in text
    assert "no peer copies" not in text


@pytest.mark.slow
@pytest.mark.s3
def test_on_moto(capsys, tmp_path):
    result = _small_run(capsys, tmp_path, "--moto", "--durable", "s3://recover-test/run")
    assert result["config"]["store"] == "moto"
    assert result["equal"]
    assert result["restore"]["tiers"]["durable_chunk_bytes"] == 0
    assert result["restore"]["tiers"]["sources"] == ["local", "local", "peer", "peer"]


@pytest.mark.parametrize(
    ("frontend", "wrong"), [("checkpointer", "tiers"), ("dcp", "tiers"), ("dcp", "plain")]
)
def test_a_restored_state_that_differs_fails_the_run(capsys, monkeypatch, frontend, wrong):
    """The ranks check their states; the run prints its report, then one error line, exit 1."""
    names = ("tiers", "dcp") if frontend == "checkpointer" else ("tiers", "plain", "dcp")
    rounds = [{name: {"equal": True} for name in names}]
    bad = [{name: {"equal": name != wrong} for name in names}]
    report = {
        "equal": False,
        "ranks": [{"rank": 0, "restore": rounds}, {"rank": 1, "restore": bad}],
    }
    monkeypatch.setattr(recover.cli, "run_recover", lambda **_: report)
    args = _args("--json", "--frontend", frontend)
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["equal"] is False
    assert err.strip().splitlines() == [
        f"ckptbench recover: error: restored state differs from the saved one: rank 1 ({wrong})"
    ]


def test_a_tiered_load_that_missed_its_tier_fails_the_run(capsys, monkeypatch):
    """Resource reviewer: with a full --local-root no save reached the local tier, every rank
    loaded from durable storage, and the run printed its tiers-vs-DCP table and exited 0."""
    report = {
        "equal": True,
        "ranks": [],
        "restore": {"tiers": {"as_expected": False, "sources": ["durable", "durable"]}},
    }
    monkeypatch.setattr(recover.cli, "run_recover", lambda **_: report)
    args = _args("--json")
    assert args.func(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not read where the scenario put the copies" in err[0]
    assert "sources by rank: durable, durable" in err[0]


def test_a_failing_rank_is_one_error_naming_it(tmp_path):
    plan = recover.RecoverPlan(
        durable_uri=str(tmp_path / "durable"), plain_uri=str(tmp_path / "plain"),
        dcp_path=str(tmp_path / "dcp"), dcp_is_local=True, local_root=str(tmp_path / "local"),
        ranks_per_node=1, nodes=2, bytes_per_rank=1024, tensors=0, repeat=1,
        peer_budget_bytes=2**20,
    )  # fmt: skip
    with pytest.raises(recover.RankFailed, match=r"the save job: rank \d failed: ZeroDivision"):
        recover.run_job(plan, 2, "save", timeout_s=100)


def test_durable_reads_count_chunks_apart(tmp_path):
    """The restores' durable store: its StoreCounters count every request, a second store's on
    the same backend the chunk objects' apart."""
    from bench.recover.counting import durable_reads, open_counted

    store = open_counted(str(tmp_path), timeout_s=30)
    store.put("chunks/ab/abcd", b"x" * 100)
    store.put("manifests/1.json", b"{}")
    assert bytes(store.get_view("chunks/ab/abcd", 0, 101)) == b"x" * 100
    assert store.get("manifests/1.json") == b"{}" and store.size("chunks/ab/abcd") == 100
    assert store.list("chunks/") == ["chunks/ab/abcd"]
    reads = durable_reads(store)
    assert reads["chunk_requests"] == {"get": 1, "size": 1} and reads["chunk_bytes"] == 100
    assert reads["other_requests"] == {"get": 1, "list": 1, "put": 2} and reads["other_bytes"] == 2
    assert reads["requests"] == {"get": 2, "list": 1, "put": 2, "size": 1}
    assert reads["bytes"] == {"get": 102, "put": 102}


def test_summary_by_hand():
    """Times are the job's (first start to last end), medians over rounds; blocking is the
    slowest rank per save, median over saves."""

    def restore(start, end, step=3, chunk_bytes=0):
        durable = {"requests": {"list": 1}, "bytes": {}, "chunk_requests": {}, "chunk_bytes": 0}
        durable |= {"other_requests": {"list": 1}, "other_bytes": 0}
        durable["chunk_bytes"] = chunk_bytes
        tiers = {"start": start, "end": end, "seconds": end - start, "step": step}
        tiers |= {"source": "local", "sources": {"local": {"bytes": 10}}, "durable": durable}
        tiers["equal"] = True
        dcp = {"start": start, "end": end * 10, "seconds": end * 10 - start, "equal": True}
        return {"tiers": tiers, "dcp": dcp}

    restored = [
        {"rank": 0, "node": 0, "rounds": [restore(0, 1), restore(0, 2)]},
        {"rank": 1, "node": 1, "rounds": [restore(0.5, 3), restore(0, 1, chunk_bytes=7)]},
    ]
    restored[1]["p2p_bytes_per_s"] = 100.0
    restored[1]["rounds"][0]["tiers"]["sources"] = {"peer": {"bytes": 50}}  # over 2.5 s
    restored[1]["rounds"][1]["tiers"]["sources"] = {"peer": {"bytes": 10}}  # over 1 s

    def save(method, step, blocked):
        return {"method": method, "step": step, "blocked_s": blocked, "committed_s": 1.0}

    saved = [
        {"saves": [save("tiers", 1, 0.1), save("plain", 1, 0.2), save("tiers", 2, 0.3),
                   save("plain", 2, 0.2)], "dcp_save_s": 5.0},
        {"saves": [save("tiers", 1, 0.5), save("plain", 1, 0.1), save("tiers", 2, 0.1),
                   save("plain", 2, 0.6)], "dcp_save_s": 4.0},
    ]  # fmt: skip
    for r in saved:
        for s in r["saves"]:
            s["durable_s"] = 2.0
    out = recover.summarize(saved, restored)
    tiers = out["restore"]["tiers"]
    assert tiers["rounds_s"] == [3, 2] and tiers["seconds"] == 2.5
    assert tiers["per_rank_s"] == [1.5, 1.75]
    assert out["restore"]["dcp"]["rounds_s"] == [30, 20]
    assert out["restore"]["dcp_over_tiers"] == pytest.approx(10)
    assert tiers["durable_chunk_bytes"] == 7 and not out["targets"]["zero_durable_chunk_bytes"]
    assert tiers["bytes_by_source"] == {"local": 10, "peer": 50}
    # the wiped rank (node 1): peer bytes over its load, median of 20 and 10 B/s
    assert tiers["peer_restore_bytes_per_s"] == 15 and tiers["p2p_bytes_per_s"] == 100
    assert tiers["peer_restore_over_p2p"] == pytest.approx(0.15)
    # every rank's saves: tiers 0.1, 0.3, 0.5, 0.1 -> 0.2; plain 0.2, 0.2, 0.1, 0.6 -> 0.2
    assert out["save"]["tiers"]["blocked_s"] == pytest.approx(0.2)
    assert out["save"]["plain"]["blocked_s"] == pytest.approx(0.2)
    assert out["save"]["tiers_over_plain"] == pytest.approx(1.0)
    # per save the slowest rank: tiers 0.5, 0.3 -> 0.4; plain 0.2, 0.6 -> 0.4
    assert out["save"]["tiers"]["blocked_slowest_s"] == pytest.approx(0.4)
    assert out["save"]["plain"]["blocked_slowest_rounds_s"] == [0.2, 0.6]
    assert out["targets"]["save_blocking_within_1_1x"]
    assert out["save"]["dcp_save_s"] == 5.0


def test_dcp_summary_by_hand():
    """--frontend dcp: the wiped node's ranks are expected to restore from peers with no durable
    chunk read; a durable chunk read misses the target and the expectation. Blocked and
    committed are the async saves' medians; a staging allocation after the warm-up shows."""

    def durable(chunk_bytes=0):
        reads = {"requests": {"list": 1}, "bytes": {}, "chunk_requests": {}}
        reads |= {"chunk_bytes": chunk_bytes, "other_requests": {"list": 1}, "other_bytes": 0}
        if chunk_bytes:
            reads["chunk_requests"] = {"get": 1}
        return reads

    def rnd(source, sources, chunk_bytes=0):
        tiers = {"start": 0.0, "end": 1.0, "seconds": 1.0, "step": 2, "source": source}
        tiers |= {"sources": {t: {"bytes": n} for t, n in sources.items()}, "equal": True}
        tiers["durable"] = durable(chunk_bytes)
        plain = {"start": 0.0, "end": 2.0, "seconds": 2.0, "step": 2, "equal": True}
        plain["durable"] = durable(10)
        dcp = {"start": 0.0, "end": 6.0, "seconds": 6.0, "equal": True}
        return {"tiers": tiers, "plain": plain, "dcp": dcp}

    def saves(blocked, committed, allocations=1):
        return [
            {"method": m, "step": 1, "blocked_s": b, "committed_s": c, "staging_allocations": a}
            for m, b, c, a in (
                ("tiers", blocked, committed, allocations), ("plain", 0.1, 0.5, 1)
            )
        ]  # fmt: skip

    warm = {"tiers": 1, "plain": 1}
    saved = [
        {"saves": saves(0.1, 1.0), "staging_allocations_warm": warm, "dcp_save_s": 0.5},
        {"saves": saves(0.1, 2.0), "staging_allocations_warm": warm, "dcp_save_s": 0.4},
    ]
    restored = [
        {"rank": 0, "node": 0, "rounds": [rnd("local", {"local": 10})]},
        {"rank": 1, "node": 1, "rounds": [rnd("peer", {"peer": 10})]},
    ]
    out = recover.summarize(saved, restored, "dcp")
    tiers = out["restore"]["tiers"]
    assert tiers["as_expected"] and out["targets"]["zero_durable_chunk_bytes"]
    assert tiers["sources"] == ["local", "peer"] and tiers["bytes_by_source"] == {
        "local": 10,
        "peer": 10,
    }
    assert out["restore"]["dcp_over_tiers"] == pytest.approx(6)
    assert out["restore"]["plain"]["durable_chunk_bytes"] == 20
    save = out["save"]
    assert save["tiers"]["blocked_s"] == pytest.approx(0.1)
    assert save["tiers"]["committed_s"] == pytest.approx(2.0)  # the slowest rank
    assert save["tiers_over_plain"] == pytest.approx(1.0)
    assert save["tiers_over_plain_committed"] == pytest.approx(4.0)
    assert save["tiers_over_dcp_save"] == pytest.approx(4.0)
    assert out["targets"]["save_blocking_within_1_1x"]
    assert save["staging_allocated_in_timed_saves"] is False

    # the wiped rank read a chunk from durable storage; a timed save allocated staging
    restored[1]["rounds"] = [rnd("peer", {"peer": 5, "durable": 5}, chunk_bytes=5)]
    saved[0]["saves"] = saves(0.3, 1.0, allocations=2)
    out = recover.summarize(saved, restored, "dcp")
    assert not out["restore"]["tiers"]["as_expected"]
    assert not out["targets"]["zero_durable_chunk_bytes"]
    assert out["restore"]["tiers"]["durable_chunk_bytes"] == 5
    assert out["save"]["staging_allocated_in_timed_saves"] is True
    assert out["save"]["tiers_over_plain"] == pytest.approx(2.0)  # 0.1, 0.3 -> 0.2 over 0.1
    assert not out["targets"]["save_blocking_within_1_1x"]
    # a kept rank that took a peer's copy is not as expected either
    restored[1]["rounds"] = [rnd("peer", {"peer": 10})]
    restored[0]["rounds"] = [rnd("peer", {"peer": 10})]
    assert not recover.summarize(saved, restored, "dcp")["restore"]["tiers"]["as_expected"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("frontend", "ranks", "per_node", "size", "damaged"),
    [("checkpointer", "4", "2", "256MiB", [2, 3]), ("dcp", "2", "1", "64MiB", [1])],
)
def test_one_bad_chunk_per_copy_is_read_alone_from_durable_storage(
    capsys, tmp_path, frontend, ranks, per_node, size, damaged
):
    """``--damage chunk`` (issue 36, each chunk from the nearest holder that verifies): one
    byte flipped in one chunk of each copy of the last node, every round (the chunk the last
    round's load removed put back first); each damaged rank still loads its own copy and reads
    that one chunk from durable storage, every state bit for bit equal."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    durable.mkdir()
    local.mkdir()
    result = _run(
        capsys, "--frontend", frontend, "--ranks", ranks, "--ranks-per-node", per_node,
        "--size", size, "--repeat", "2", "--damage", "chunk", "--durable", str(durable),
        "--local-root", str(local), "--timeout", "200",
    )  # fmt: skip
    cfg, tiers = result["config"], result["restore"]["tiers"]
    assert cfg["damage"] == "chunk" and cfg["wiped_ranks"] == damaged
    assert result["equal"] and tiers["sources"] == ["local"] * int(ranks)
    per_rank = cfg["bytes_per_rank"]
    for rnd in result["ranks"][damaged[0]]["restore"]:
        read = rnd["tiers"]["sources"]
        assert read["durable"]["chunks"] == 1 and 0 < read["durable"]["bytes"] < per_rank
        assert read["local"]["bytes"] > 0 and set(read) == {"local", "durable"}
    for rnd in result["ranks"][0]["restore"]:
        assert set(rnd["tiers"]["sources"]) == {"local"}
    assert [r["chunk_requests"].get("get", 0) for r in tiers["durable_reads"]] == [len(damaged)] * 2
    assert tiers["as_expected"] and result["targets"]["only_the_bad_chunks_from_durable"]
    assert "zero_durable_chunk_bytes" not in result["targets"] and "p2p_bytes_per_s" not in tiers
    out = io.StringIO()
    recover.print_table(result, out=out)
    text = out.getvalue()
    assert "copies with one byte flipped in one chunk each" in text
    assert "each damaged rank one chunk from durable storage (every round): yes" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "2", "--ranks-per-node", "2"], "is one node"),
        (["--frontend", "dcp", "--ranks", "2", "--ranks-per-node", "2"], "is one node"),
        (["--frontend", "orbax"], "invalid choice"),
        (["--damage", "disk"], "invalid choice"),
        (["--ranks", "4", "--ranks-per-node", "3"], "must divide --ranks 4"),
        (["--ranks", "64"], "within 2..16"),
        (["--size", "1x"], "bad --size"),
        (["--moto", "--durable", "/tmp/x"], "--moto serves S3"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "recover", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptbench recover: error: ")
    assert message in lines[0]
