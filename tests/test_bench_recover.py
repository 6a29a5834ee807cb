"""``ckptbench recover``: a small run of 4 gloo ranks as 2 nodes restores the wiped node from
its peers without a durable chunk read, every rank's state equal to the saved one, side by side
with DCP's load; the bench fails when a state differs; bad layouts are usage errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import recover

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = Path(__file__).resolve().parents[1]


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
    save = result["save"]
    for name in ("tiers", "plain"):
        assert save[name]["blocked_s"] > 0
        assert save[name]["committed_s"] >= save[name]["blocked_s"]
    assert save["tiers"]["durable_s"] >= save["tiers"]["committed_s"]
    assert save["tiers_over_plain"] > 0 and save["dcp_save_s"] > 0
    peer = result["peer_copy"]
    assert peer["failed"] == [] and peer["sent_bytes_per_save"] > 0
    # one round buffer per transfer a rank takes part in (its own copy out, a ward's in)
    assert 0 < peer["buffer_bytes_peak"] <= 2 * cfg["bytes_per_rank"] + 2 * 64
    assert set(result["targets"]) == {
        "restore_5x_faster_than_dcp",
        "zero_durable_chunk_bytes",
        "save_blocking_within_1_1x",
    }


@pytest.mark.slow
@pytest.mark.s3
def test_on_moto(capsys, tmp_path):
    result = _small_run(capsys, tmp_path, "--moto", "--durable", "s3://recover-test/run")
    assert result["config"]["store"] == "moto"
    assert result["equal"]
    assert result["restore"]["tiers"]["durable_chunk_bytes"] == 0
    assert result["restore"]["tiers"]["sources"] == ["local", "local", "peer", "peer"]


def test_a_restored_state_that_differs_fails_the_run(capsys, monkeypatch):
    """The ranks check their states; the run prints its report, then one error line, exit 1."""
    rounds = [{"tiers": {"equal": True}, "dcp": {"equal": True}}]
    bad = [{"tiers": {"equal": False}, "dcp": {"equal": True}}]
    report = {
        "equal": False,
        "ranks": [{"rank": 0, "restore": rounds}, {"rank": 1, "restore": bad}],
    }
    monkeypatch.setattr(recover, "run_recover", lambda **_: report)
    args = _args("--json")
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["equal"] is False
    assert err.strip().splitlines() == [
        "ckptbench recover: error: restored state differs from the saved one: rank 1 (tiers)"
    ]


def test_a_failing_rank_is_one_error_naming_it(tmp_path):
    plan = recover.RecoverPlan(
        durable_uri=str(tmp_path / "durable"), plain_uri=str(tmp_path / "plain"),
        dcp_path=str(tmp_path / "dcp"), dcp_is_local=True, local_root=str(tmp_path / "local"),
        ranks_per_node=1, nodes=2, bytes_per_rank=1024, tensors=0, repeat=1,
        peer_budget_bytes=2**20,
    )  # fmt: skip
    with pytest.raises(recover.RankFailed, match=r"the save job: rank \d failed: ZeroDivision"):
        recover.run_job(plan, 2, "save", timeout_s=100)


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
    assert tiers["bytes_by_source"] == {"local": 20}
    # every rank's saves: tiers 0.1, 0.3, 0.5, 0.1 -> 0.2; plain 0.2, 0.2, 0.1, 0.6 -> 0.2
    assert out["save"]["tiers"]["blocked_s"] == pytest.approx(0.2)
    assert out["save"]["plain"]["blocked_s"] == pytest.approx(0.2)
    assert out["save"]["tiers_over_plain"] == pytest.approx(1.0)
    # per save the slowest rank: tiers 0.5, 0.3 -> 0.4; plain 0.2, 0.6 -> 0.4
    assert out["save"]["tiers"]["blocked_slowest_s"] == pytest.approx(0.4)
    assert out["save"]["plain"]["blocked_slowest_rounds_s"] == [0.2, 0.6]
    assert out["targets"]["save_blocking_within_1_1x"]
    assert out["save"]["dcp_save_s"] == 5.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "2", "--ranks-per-node", "2"], "is one node"),
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
