"""``ckptbench plan``: the checkpoint-interval model against closed forms and hand computations."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench import plan, request_floor, storage
from tests.helpers import ROOT


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ckptbench")
    plan.add_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def _run_json(capsys, *argv: str) -> dict:
    args = _parse(*argv, "--json")
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_young_and_daly_on_textbook_inputs():
    # 5 minutes to checkpoint, a failure a day: Young gives sqrt(2 * 300 * 86400) = 2 hours;
    # Daly with delta / 2M = 1/576: 7200 * (1 + 1/72 + 1/5184) - 300 = 7001 + 7/18 seconds.
    assert plan.young_interval_s(300, 86400) == pytest.approx(7200)
    assert plan.daly_interval_s(300, 86400) == pytest.approx(7001 + 7 / 18)
    # Beyond delta >= 2M Daly's interval is the MTBF itself.
    assert plan.daly_interval_s(500, 200) == 200
    with pytest.raises(ValueError):
        plan.young_interval_s(0, 100)


def _textbook_inputs(**overrides) -> plan.PlanInputs:
    """One node, 2 GB of state staged at 2e9/300 B/s: 300 s blocked, MTBF one day."""
    values = dict(
        params=1e9, weight_bytes_per_param=2, optimizer_bytes_per_param=0, accelerators=8,
        ranks_per_node=8, mtbf_s=86400, staging_bw_bytes_s=2e9 / 300, write_bw_bytes_s=1e9,
        read_bw_bytes_s=1e9, node_storage_bw_bytes_s=1e12, peer_bw_bytes_s=1e9,
    )  # fmt: skip
    values.update(overrides)
    return plan.PlanInputs(**values)


def test_planner_interval_is_dalys_closed_form():
    result = plan.plan(_textbook_inputs())
    assert result["blocked_s"] == pytest.approx(300)
    assert result["young_interval_s"] == pytest.approx(7200)
    assert result["daly_interval_s"] == pytest.approx(7001 + 7 / 18)
    assert result["interval_s"] == result["daly_interval_s"]
    assert result["interval_source"] == "daly" and result["persist_fits"]


def test_lost_work_restore_and_goodput_by_hand():
    # 2 GB; blocked 300 s staging; write 2 s; MTBF 86400 s; interval given 9700 s.
    result = plan.plan(_textbook_inputs(interval_s=9700, restart_s=98))
    period = 10_000
    persist = 300 + 2
    assert result["period_s"] == pytest.approx(period)
    assert result["persist_s"] == pytest.approx(persist)
    assert result["lost_work_per_failure_s"] == pytest.approx(period / 2 + persist)
    restore = 2 + 300  # read 2 GB at 1 GB/s, then copy back to the device at the staging rate
    assert result["restore_from_storage_s"] == pytest.approx(restore)
    expected = 0.97 * (1 - (period / 2 + persist + restore + 98) / 86400)
    assert result["goodput"] == pytest.approx(expected)
    assert result["checkpoints_per_day"] == pytest.approx(8.64)


def test_interval_is_raised_when_persist_does_not_fit():
    # Writing 2 GB at 100 kB/s takes 20,000 s, longer than Daly's ~7,000 s interval.
    result = plan.plan(_textbook_inputs(write_bw_bytes_s=1e5))
    assert not result["persist_fits"]
    assert result["interval_source"] == "persist"
    assert result["period_s"] == pytest.approx(result["persist_s"])
    assert result["period_s"] > result["daly_interval_s"]


def test_write_duty_cap_raises_the_interval():
    result = plan.plan(_textbook_inputs(write_bw_bytes_s=1e6, max_write_duty=0.1))
    assert result["interval_source"] == "duty"
    assert result["storage_write_duty"] == pytest.approx(0.1)


def test_failure_rate_scales_llama3_with_the_accelerator_count():
    full = plan.plan(plan.PlanInputs())
    assert full["mtbf_s"] == pytest.approx(54 * 86400 / 419)  # ~3.09 h on 16,384 GPUs
    half = plan.plan(plan.PlanInputs(accelerators=8192))
    assert half["mtbf_s"] == pytest.approx(2 * full["mtbf_s"])


def test_llama3_405b_defaults_are_sane():
    r = plan.plan(plan.PlanInputs())
    assert r["checkpoint_bytes"] == pytest.approx(405e9 * 14)
    assert r["nodes"] == 2048
    assert r["write_s"] == pytest.approx(405e9 * 14 / 2e12)  # aggregate-limited, ~2.8 s
    assert r["persist_fits"]
    assert 0.98 < r["goodput"] < 0.99  # 150 s per restart costs 1.35% of a 3.09 h MTBF
    assert 0.99 < plan.plan(plan.PlanInputs(restart_s=0))["goodput"] < 1.0


def test_restart_time_defaults_to_a_published_figure_and_says_so(capsys):
    """No free restarts by default: 150 s, the source named in --help, the table and docs."""
    r = _run_json(capsys)
    free = _run_json(capsys, "--restart-s", "0")
    assert r["inputs"]["restart_s"] == 150 and r["sources"]["restart_s"] == "default"
    assert free["goodput"] - r["goodput"] == pytest.approx(
        r["checkpoint_efficiency"] * 150 / r["mtbf_s"]
    )
    help_text = " ".join(_ckptbench("plan", "--help").stdout.split())
    assert "default 150: FlashRecovery, arXiv 2509.03047" in help_text
    args = _parse()
    assert args.func(args) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "restart per" in line]
    assert "2.5 min" in row and "FlashRecovery, arXiv 2509.03047" in row
    docs = (ROOT / "docs" / "plan.md").read_text()
    assert "arXiv 2509.03047" in docs


def test_peer_restore_is_faster_than_storage_restore_at_scale():
    r = plan.plan(plan.PlanInputs())
    assert r["restore_from_peer_s"] < r["restore_from_storage_s"]


def test_sync_saves_block_until_durable():
    r = plan.plan(_textbook_inputs(sync=True))
    assert r["blocked_s"] == pytest.approx(r["persist_s"])


def test_cli_flags_and_sources(capsys):
    r = _run_json(
        capsys, "--params", "70B", "--weight-bytes-per-param", "4", "--optimizer-bytes-per-param",
        "8", "--accelerators", "1856", "--write-bw", "500GB/s", "--staging-bw", "4.6GB/s",
    )  # fmt: skip
    assert r["checkpoint_bytes"] == pytest.approx(70e9 * 12)
    assert r["nodes"] == 232
    assert r["inputs"]["write_bw_bytes_s"] == 500e9
    assert r["sources"]["write_bw_bytes_s"] == "flag"
    assert r["sources"]["read_bw_bytes_s"] == "default"
    assert r["blocked_s"] == pytest.approx(70e9 * 12 / 232 / 4.6e9)


def test_table_output(capsys):
    args = _parse("--params", "7B")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "interval (Daly)" in out and "goodput" in out


def test_bandwidth_from_a_real_storage_run(capsys, tmp_path):
    sargs = argparse.ArgumentParser()
    storage.add_parser(sargs.add_subparsers())
    bench_args = sargs.parse_args(
        ["storage", "--uri", f"memory://plan-{uuid.uuid4().hex[:8]}", "--sizes", "64KiB",
         "--count", "200", "--json"]
    )  # fmt: skip
    assert bench_args.func(bench_args) == 0
    measured = json.loads(capsys.readouterr().out)
    path = tmp_path / "storage.json"
    path.write_text(json.dumps(measured))
    r = _run_json(capsys, "--from-storage", str(path))
    assert r["inputs"]["write_bw_bytes_s"] == pytest.approx(measured["put"]["throughput_bytes_s"])
    assert r["inputs"]["read_bw_bytes_s"] == pytest.approx(measured["get"]["throughput_bytes_s"])
    assert r["sources"]["write_bw_bytes_s"] == str(path)
    # A flag given as well wins over the file.
    r = _run_json(capsys, "--from-storage", str(path), "--read-bw", "1TB/s")
    assert r["inputs"]["read_bw_bytes_s"] == 1e12


def test_burst_json_gives_write_bandwidth_only(tmp_path, capsys):
    path = tmp_path / "burst.json"
    path.write_text(json.dumps({
        "bench": "storage", "mode": "burst", "put": {"throughput_bytes_s": 1.0},
        "get": {"throughput_bytes_s": 5.0}, "burst": {"write_throughput_bytes_s": 3e9},
    }))  # fmt: skip
    r = _run_json(capsys, "--from-storage", str(path))
    assert r["inputs"]["write_bw_bytes_s"] == 3e9
    assert r["sources"]["read_bw_bytes_s"] == "default"


def _plan_warnings(capsys, tmp_path, measured: dict, *argv: str) -> list[str]:
    """The warnings of a plan from ``measured``, checked alike on stderr and in the JSON."""
    path = tmp_path / "storage.json"
    path.write_text(json.dumps({"bench": "storage"} | measured))
    args = _parse("--from-storage", str(path), "--accelerators", "64", *argv, "--json")
    assert args.func(args) == 0
    captured = capsys.readouterr()
    warnings = json.loads(captured.out)["warnings"]
    assert captured.err.splitlines() == [f"warning: {w}" for w in warnings]
    assert all(w.startswith(f"--from-storage {path}: ") for w in warnings)
    return warnings


def test_figures_from_memory_or_the_page_cache_are_warned_of(capsys, tmp_path):
    """A reviewer: a memory:// run's 2 GB/s, and a local run's gets from the page cache (a run
    that said so itself), became the storage bandwidth of a 1,000-GPU plan without a word."""
    figures = {"put": {"throughput_bytes_s": 6e8}, "get": {"throughput_bytes_s": 2e9}}
    memory = _plan_warnings(capsys, tmp_path, {"uri": "memory://x"} | figures)
    assert "a memory:// run: its write and read figures are this process's memory" in memory[0]
    local = figures | {"uri": "/mnt/x", "gets_from_page_cache": True}
    cached = _plan_warnings(capsys, tmp_path, local)
    assert "from the page cache: its read figure is memory speed" in cached[0]
    assert not any(
        "page cache" in w for w in _plan_warnings(capsys, tmp_path, local, "--read-bw", "1TB/s")
    )
    older = figures | {"uri": "/mnt/x"}  # output from before the field: a local store's gets
    assert "page cache" in _plan_warnings(capsys, tmp_path, older)[0]
    s3 = figures | {"uri": "s3://b/x", "gets_from_page_cache": False}
    assert len(_plan_warnings(capsys, tmp_path, s3)) == 1  # the clients' line only


def test_a_single_clients_figures_are_said_to_be_taken_as_the_jobs_aggregate(capsys, tmp_path):
    """A reviewer: one client's figure became the aggregate bandwidth of a 1,000-GPU job, and
    the plan never said the input was one client."""
    figures = {"uri": "s3://b/x", "writers": 8, "readers": 1}
    burst = figures | {"burst": {"write_throughput_bytes_s": 3e9}}
    [line] = _plan_warnings(capsys, tmp_path, burst)
    assert "one process's figures (write by 8 writers, one host) taken as the aggregate " in line
    assert "of all 8 nodes, not scaled with them" in line
    steady = figures | {"put": {"throughput_bytes_s": 1e9}, "get": {"throughput_bytes_s": 2e9}}
    [line] = _plan_warnings(capsys, tmp_path, steady)
    assert "(write by 8 writers, read by 1 reader, one host)" in line
    flags = ("--write-bw", "1TB/s", "--read-bw", "1TB/s")
    assert _plan_warnings(capsys, tmp_path, steady, *flags) == []  # nothing taken from the file


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "lots"], "bad --params"),
        (["--params=-5B"], "bad --params"),
        (["--accelerators", "10"], "not a multiple of --ranks-per-node"),
        (["--write-bw", "fast"], "bad --write-bw"),
        (["--staging-bw", "0GB/s"], "bad --staging-bw"),
        (["--mtbf-s", "-1"], "--mtbf-s must be positive"),
        (["--max-write-duty", "1.5"], "--max-write-duty"),
        (["--from-storage", "/nonexistent/storage.json"], "cannot read --from-storage"),
    ],
)
def test_bad_input_is_one_clear_error(argv, message):
    args = _parse(*argv)
    with pytest.raises(ValueError, match=message) as info:
        args.func(args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flag, bench", [("--from-storage", "storage"), ("--scale-json", "scale")])
def test_input_json_of_another_bench_is_refused(tmp_path, flag, bench):
    path = tmp_path / "x.json"
    path.write_text('{"bench": "save"}')
    args = _parse(flag, str(path))
    with pytest.raises(ValueError, match=f"is not `ckptbench {bench} --json` output"):
        args.func(args)


def test_goodput_is_maximal_near_the_chosen_interval():
    base = _textbook_inputs()
    best = plan.plan(base)
    for factor in (0.5, 2.0):
        other = plan.plan(_textbook_inputs(interval_s=best["interval_s"] * factor))
        assert other["goodput"] < best["goodput"]
    assert math.isfinite(best["goodput"])


# -- as a real process ---------------------------------------------------------------------------


def _ckptbench(*argv: str, stdout: Any = subprocess.PIPE, unbuffered: bool = True):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "bench.cli", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [[], ["--json"]], ids=["table", "json"])
def test_reader_of_stdout_gone_is_a_normal_end(argv, unbuffered):
    """`ckptbench plan | head -1`: with the read end of stdout closed before the command
    writes (deterministically what head does after its line), exit 0 and say nothing."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = _ckptbench("plan", *argv, stdout=write_end, unbuffered=unbuffered)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--accelerators", "abc"], "argument --accelerators: invalid int value: 'abc'"),
        (["plan", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["storage"], "the following arguments are required: --uri"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, message):
    done = _ckptbench(*argv)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"ckptbench {argv[0]}: error: ") and message in line


def test_missing_command_is_one_line_exit_2():
    done = _ckptbench()
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ckptbench: error: ")


# -- the request-bound floor ---------------------------------------------------------------------


def _floor_of_10_chunks_on_1000_ranks(limits: request_floor.Limits) -> dict:
    counts = request_floor.RequestCounts()
    return request_floor.floor(
        counts, limits, ranks=1000, state_bytes=1000 * 10 * 2**20, chunk_bytes=2**20
    )


def test_request_floor_by_hand():
    """1,000 ranks, 10 chunks each. Save: 10,000 chunk puts over 256 prefixes take
    10,000 / (256 * 3,500) s, the floor; the 1,000 index puts spread over 256 prefixes as well
    (format version 2) and the coordinator's 3 writes (lease, its delete, the manifest) share
    one. Restore: 10,000 chunk gets over 256 prefixes; 1,000 index reads, 2 on one prefix (one
    listing, the manifest read once). A version 1 store (indexes under one prefix) is bound by
    its 1,000 index puts: 1,000 / 3,500 = 0.2857 s."""
    floor = _floor_of_10_chunks_on_1000_ranks(request_floor.Limits())
    assert floor["chunks"] == 10_000
    save, restore = floor["save"], floor["restore"]
    assert save["other_requests"] == {"write": 1003, "read": 1003}
    assert save["bounds_s"]["indexes (write)"] == pytest.approx(1000 / (256 * 3500))
    assert save["bounds_s"]["other (write)"] == pytest.approx(3 / 3500)
    assert save["floor_s"] == pytest.approx(10_000 / (256 * 3500))
    assert save["bound_by"] == "chunks (write)"
    assert restore["other_requests"] == {"write": 0, "read": 1002}
    assert restore["floor_s"] == pytest.approx(10_000 / (256 * 5500))
    assert restore["bound_by"] == "chunks (read)"
    v1 = _floor_of_10_chunks_on_1000_ranks(request_floor.Limits(index_prefixes=1))
    assert v1["save"]["floor_s"] == pytest.approx(1000 / 3500)
    assert v1["save"]["bound_by"] == "indexes (write)"
    assert v1["restore"]["floor_s"] == pytest.approx(1000 / 5500)


def _scale_json(tmp_path) -> Path:
    """What `ckptbench scale --json` reports for 4 chunks per rank at 1 and 4 ranks: per save
    4 chunk puts and an index per rank, a lease put, its delete and the manifest; a read of
    the latest index per rank, the manifest and 2 listings."""
    runs = []
    for n in (1, 4):
        save = {"put": 4 * n + n + 2, "delete": 1, "get": n + 1, "list": 2}
        restore = {"get": 4 * n + 2 * n, "list": 1}
        runs.append({"ranks": n, "save_requests": save, "restore": {"requests": restore}})
    path = tmp_path / "scale.json"
    path.write_text(json.dumps({"bench": "scale", "chunks_per_rank": 4, "runs": runs}))
    return path


def test_request_counts_fitted_from_a_scale_run(tmp_path, capsys):
    counts = request_floor.counts_from_scale(
        json.loads(_scale_json(tmp_path).read_text()), source="x"
    )
    assert counts.save_fixed == pytest.approx({"write": 3, "read": 3})
    assert counts.save_per_rank == pytest.approx({"write": 1, "read": 1})
    assert counts.restore_fixed == pytest.approx({"write": 0, "read": 1})
    assert counts.restore_per_rank == pytest.approx({"write": 0, "read": 2})
    r = _run_json(capsys, "--scale-json", str(_scale_json(tmp_path)), "--chunk-bytes", "32MiB")
    floor = r["request_floor"]
    assert floor["ranks"] == 16384 and floor["counts"]["source"] == str(_scale_json(tmp_path))
    assert floor["save"]["bounds_s"]["indexes (write)"] == pytest.approx(16384 / (256 * 3500))
    assert floor["save"]["bounds_s"]["other (write)"] == pytest.approx(3 / 3500)


def test_request_floor_in_the_table(capsys):
    args = _parse("--hot-prefixes", "64")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "request-bound floor on S3: 16,384 ranks" in out and "the rest over 64" in out
    assert "indexes over 256" in out


def test_goodput_with_and_without_tiers_by_hand():
    # One node, 2 GB at 2e9/300 B/s staging: 300 s blocked per save. A save every 1,000 s, one
    # in 4 durable; restores: local 10 s, peer 40 s, durable 200 s; restarts 60 s.
    result = plan.plan(
        _textbook_inputs(
            save_every_s=1000, durable_every=4, local_restore_s=10, peer_restore_s=40,
            durable_restore_s=200, restart_s=60,
        )
    )  # fmt: skip
    t = result["tiers"]
    assert (t["save_every_s"], t["durable_interval_s"]) == (1000, 4000)
    assert t["restore_s"] == {"local": 10, "peer": 40, "durable": 200}
    llama, cluster, own = t["rates"]  # the plan's own MTBF differs from both: a third row
    assert llama["mtbf_s"] == pytest.approx(54 * 86400 / 419 * 16384 / 8)
    assert cluster["mtbf_s"] == pytest.approx(1.8 * 3600 * 16384 / 8)
    assert own["mtbf_s"] == 86400 and own["failure_rate"] == "this plan's MTBF"
    # persist: durable = staging + the write, local = staging + the peer copy (capped at T)
    durable_p, local_p = result["persist_s"], min(result["stage_s"] + 2e9 / 1e9, 1000)
    assert t["persist_s"] == pytest.approx({"durable": durable_p, "local": local_p})
    # without tiers: every 4,000 s to durable storage, restored from it
    without = (1 - 300 / 4000) * (1 - (4000 / 2 + durable_p + 200 + 60) / 86400)
    # with tiers: every 1,000 s; the replaced node reads its peer's copy (40 s > 10 s)
    peer = (1 - 300 / 1000) * (1 - (1000 / 2 + local_p + 40 + 60) / 86400)
    local = (1 - 300 / 1000) * (1 - (1000 / 2 + local_p + 10 + 60) / 86400)
    assert own["without_tiers"]["goodput"] == pytest.approx(without)
    assert own["with_tiers"]["goodput"] == pytest.approx(peer)
    assert own["with_tiers_local"]["goodput"] == pytest.approx(local)
    assert own["without_tiers"]["lost_s"] == pytest.approx(2000 + durable_p + 200)
    assert own["with_tiers"]["lost_s"] == pytest.approx(500 + local_p + 40)
    assert own["gain"] == pytest.approx(peer - without)
    assert llama["with_tiers"]["goodput"] == pytest.approx(
        (1 - 300 / 1000) * (1 - (600 + local_p) / llama["mtbf_s"])
    )


def test_tier_defaults_follow_the_plan(capsys):
    r = _run_json(capsys)
    t = r["tiers"]
    # Every save durable, at the plan's period and MTBF: "without tiers" is the plan's goodput.
    assert t["rates"][0]["mtbf_s"] == pytest.approx(r["mtbf_s"])
    assert t["rates"][0]["without_tiers"]["goodput"] == pytest.approx(r["goodput"])
    assert t["save_every_s"] == pytest.approx(r["period_s"])
    assert t["durable_every"] == 1 and t["save_every_source"] == "the plan's period"
    assert t["restore_s"]["durable"] == pytest.approx(r["restore_from_storage_s"])
    assert t["restore_s"]["peer"] == pytest.approx(r["restore_from_peer_s"])
    assert t["restore_s"]["local"] == pytest.approx(r["bytes_per_node"] / 100e9)
    # Llama 3's rate at 16,384 GPUs is the plan's own: two rows, no third
    assert [x["mtbf_s"] for x in t["rates"]] == [pytest.approx(r["mtbf_s"]), 1.8 * 3600]
    # every save durable: tiers change only the restore, which is faster
    assert all(x["gain"] > 0 for x in t["rates"])
    flags = _run_json(capsys, "--save-every-min", "1", "--durable-every", "30")
    assert flags["tiers"]["durable_interval_s"] == pytest.approx(1800)
    assert flags["sources"]["save_every_s"] == "flag"
    assert flags["sources"]["durable_every"] == "flag"
    args = _parse("--save-every-min", "1", "--durable-every", "30")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "one in 30 to durable storage" in out
    assert "Llama 3: 419 in 54 d on 16,384" in out and "MTTF 1.8 h at 16,384" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--durable-every", "0"], "--durable-every must be 1 or more"),
        (["--save-every-min", "-1"], "--save-every-min must be positive"),
        (["--peer-restore-s", "-2"], "--peer-restore-s must be >= 0"),
        (["--save-every-min", "0.0001"], "give a longer --save-every-min"),
    ],
)
def test_bad_tier_input_is_one_line_exit_2(argv, message):
    proc = _ckptbench("plan", *argv)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr


def test_replicas_send_the_distinct_bytes_once_against_every_replica_writing():
    # 2 GB of state on 4 nodes in 2 replica groups: a node holds 1 GB (half the state) and writes
    # half of that; every replica writing would send 4 GB.
    inputs = dict(accelerators=32, replicas=2, staging_bw_bytes_s=1e12)
    aggregate = plan.plan(_textbook_inputs(**inputs))  # the 1 GB/s aggregate limits
    assert aggregate["bytes_sent_per_save"] == pytest.approx(2e9)
    assert aggregate["bytes_per_node"] == pytest.approx(1e9)
    assert aggregate["write_s"] == pytest.approx(2)
    every = aggregate["every_replica_writes"]
    assert every["bytes_sent_per_save"] == pytest.approx(4e9) and every["write_s"] == pytest.approx(
        4
    )
    links = plan.plan(_textbook_inputs(node_storage_bw_bytes_s=1e8, **inputs))  # 100 MB/s each
    assert links["write_s"] == pytest.approx(5)  # 0.5 GB per node
    assert links["every_replica_writes"]["write_s"] == pytest.approx(10)  # 1 GB per node
    with pytest.raises(ValueError, match="--replicas 3 must be 1 or more and divide the 4 nodes"):
        _textbook_inputs(accelerators=32, replicas=3)
