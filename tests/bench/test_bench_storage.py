"""``ckptbench storage``: run through its own argparse parser against real stores."""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import sys
import uuid

import pytest

from bench import storage
from bench.report import format_bytes, format_seconds, parse_bytes, rounds
from bench.storage.config import apportion
from bench.storage.stats import _Timeline, failed_requests
from ckptstore.store import Store
from ckptstore.telemetry import LatencyHistogram
from tests.helpers import ROOT


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ckptbench")
    storage.add_parser(parser.add_subparsers())
    return parser.parse_args(["storage", *argv])


def _run_json(capsys, *argv: str, err: list[str] | None = None) -> tuple[int, dict]:
    args = _parse(*argv, "--json")
    rc = args.func(args)
    captured = capsys.readouterr()
    if err is not None:
        err.append(captured.err)
    out = captured.out.strip().splitlines()
    assert len(out) == 1, out
    return rc, json.loads(out[0])


def _memory_uri() -> str:
    return f"memory://bench-{uuid.uuid4().hex[:12]}"


def _left_under(uri: str, prefix: str) -> list[str]:
    return Store(uri).list(prefix)


# -- histogram ---------------------------------------------------------------------------------


def _exact_percentile(sorted_samples: list[float], q: float) -> float:
    """Nearest rank, the definition HdrHistogram uses."""
    rank = max(1, round(q / 100 * len(sorted_samples)))
    return sorted_samples[rank - 1]


def test_histogram_percentiles_match_exact_ones_within_three_digits():
    rng = random.Random(7)
    samples = [rng.lognormvariate(-6, 1.5) for _ in range(10_000)]  # ~2.5 ms median, long tail
    hist = LatencyHistogram()
    for s in samples:
        hist.record(s)
    ordered = sorted(samples)
    for q in (50, 90, 99, 99.9, 100):
        exact = _exact_percentile(ordered, q)
        # 3 significant digits, and values are kept in whole microseconds.
        assert hist.percentile_s(q) == pytest.approx(exact, rel=1e-3, abs=1e-6), q


def test_histogram_mean_is_the_mean_of_what_was_recorded_also_after_a_merge():
    rng = random.Random(11)
    first = [rng.lognormvariate(-5, 1) for _ in range(3000)]
    second = [rng.uniform(0.1, 0.3) for _ in range(1000)]
    a, b = LatencyHistogram(), LatencyHistogram()
    for s in first:
        a.record(s)
    for s in second:
        b.record(s)
    assert a.summary()["mean_s"] == pytest.approx(sum(first) / len(first), abs=1e-6)
    a.merge(b)
    both = first + second
    assert a.summary()["mean_s"] == pytest.approx(sum(both) / len(both), abs=1e-6)
    assert a.summary()["count"] == len(both)


def test_op_stats_merge_reports_percentiles_of_all_workers():
    rng = random.Random(3)
    a, b = storage._OpStats(), storage._OpStats()
    samples = []
    for stats, scale in ((a, 1e-3), (b, 1e-1)):  # a fast worker and a slow one
        for _ in range(1000):
            s = rng.uniform(0.5, 1.5) * scale
            samples.append(s)
            stats.hist.record(s)
            stats.ops += 1
            stats.bytes += 100
    a.errors["StorageError"] += 2
    total = storage._OpStats()
    total.merge(a)
    total.merge(b)
    report = total.to_dict(elapsed_s=2.0)
    ordered = sorted(samples)
    assert report["ops"] == 2000
    assert report["ops_s"] == 1000
    assert report["throughput_bytes_s"] == 100_000
    assert report["errors"] == 2
    assert report["errors_by_type"] == {"StorageError": 2}
    for key, q in (("p50_s", 50), ("p90_s", 90), ("p99_s", 99), ("p999_s", 99.9)):
        assert report[key] == pytest.approx(_exact_percentile(ordered, q), rel=1e-3, abs=1e-6)
    assert report["max_s"] == pytest.approx(ordered[-1], rel=1e-3)


# -- parsing -----------------------------------------------------------------------------------


def test_sizes_parse_units_and_normalise_weights():
    assert storage.parse_sizes("4KiB:0.7,1MiB:0.25,16MiB:0.05") == [
        (4096, pytest.approx(0.7)),
        (2**20, pytest.approx(0.25)),
        (16 * 2**20, pytest.approx(0.05)),
    ]
    assert storage.parse_sizes("1kB:1,2kB:3") == [(1000, 0.25), (2000, 0.75)]
    assert storage.parse_sizes("512") == [(512, 1.0)]
    assert parse_bytes("1.5GB") == 1_500_000_000


def test_sizes_times_and_counts_read_as_numbers_never_in_exponent_form():
    """Reviewer U: 1023.5 KiB to three figures printed as "1.02e+03 KiB"."""
    assert format_bytes(1023.5 * 1024) == "1024 KiB"
    assert format_bytes(999.4 * 1024) == "999 KiB"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB"
    assert format_seconds(0.99996) == "1000 ms"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(119.9) == "120 s"
    assert rounds(1) == "1 round" and rounds(3) == "3 rounds"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "4KB:abc"], "bad weight"),
        (["--sizes", "0B"], "at least one byte"),
        (["--sizes", "4XB"], "not a size"),
        (["--sizes", "4KiB:-1"], "must be > 0"),
        (["--count", "0"], "--count must be >= 1"),
        (["--duration-s", "-1"], r"--duration-s must be > 0, got -1"),  # as for 0, one rule
        (["--duration-s", "inf"], r"--duration-s must be > 0, got inf"),
        (["--mode", "burst", "--count", "5"], "does not apply to burst"),
        (["--writers", "0", "--readers", "0"], "at least one writer or reader"),
        (["--latency", "gaussian:1"], "bad latency spec"),
        (["--error-rate", "2"], "--error-rate must be within 0 and 1"),
        (["--checkpoint-bytes", "lots"], "--checkpoint-bytes"),
    ],
)
def test_bad_flags_give_one_clear_line(argv, message):
    args = _parse("--uri", _memory_uri(), *argv)
    with pytest.raises(ValueError, match=message) as info:
        args.func(args)
    assert "\n" not in str(info.value)


def test_unknown_scheme_is_one_clear_error():
    args = _parse("--uri", "nosuchscheme://bucket/x")
    with pytest.raises(ValueError, match="cannot open store") as info:
        args.func(args)
    assert "\n" not in str(info.value)


def test_a_local_uri_that_does_not_exist_is_said_and_removed_after(tmp_path, capsys):
    """A new user of stop 78: a mistyped mount point was made silently, the disk it landed on
    measured, and the directories left behind. The run says so, and removes them."""
    typo = tmp_path / "typo_mnt" / "nvme"
    err: list[str] = []
    code, _ = _run_json(capsys, "--uri", str(typo), "--count", "5", err=err)
    assert code == 0 and "does not exist: made for this run" in err[0], err
    assert not (tmp_path / "typo_mnt").exists()


def test_a_mistyped_scheme_is_refused_before_any_note_of_a_directory_made(
    capsys, tmp_path, monkeypatch
):
    """A reviewer: `--uri s3:/bench/x` said "does not exist: made for this run", then refused."""
    from bench.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["storage", "--uri", "s3:/bench/x", "--count", "5"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "ckptbench storage: error: cannot open store 's3:/bench/x': it reads as a local path; "
        "did you mean s3://bench/x?"
    ]
    assert not os.listdir(tmp_path)


@pytest.mark.s3
def test_nonexistent_bucket_is_one_clear_error(s3_endpoint):
    args = _parse("--uri", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", "--count", "10")
    with pytest.raises(OSError, match="not usable.*bucket") as info:
        args.func(args)
    assert "\n" not in str(info.value)


# -- modes -------------------------------------------------------------------------------------


def test_steady_on_memory_reports_every_field_and_cleans_up(capsys):
    uri = _memory_uri()
    rc, result = _run_json(
        capsys, "--uri", uri, "--sizes", "4KiB:0.8,64KiB:0.2", "--count", "400", "--seed", "1"
    )
    assert rc == 0
    assert result["mode"] == "steady" and result["stop_reason"] == "count"
    assert result["put"]["ops"] + result["get"]["ops"] == 400
    for op in ("put", "get"):
        r = result[op]
        for key in ("ops", "throughput_bytes_s", "p50_s", "p90_s", "p99_s", "p999_s", "max_s",
                    "errors"):  # fmt: skip
            assert key in r
        assert r["ops"] > 0 and r["errors"] == 0 and r["retries"] == 0
        assert 0 < r["p50_s"] <= r["p90_s"] <= r["p99_s"] <= r["p999_s"] <= r["max_s"]
        assert r["throughput_bytes_s"] > 0
    assert result["cleanup"]["left"] == 0 and result["cleanup"]["deleted"] > 0
    assert _left_under(uri, result["prefix"]) == []


def test_seeded_objects_follow_the_weights_of_the_size_mix():
    """A reviewer: the objects steady mode seeds for its readers were a uniform pick among the
    sizes (6 x 4KiB, 8 x 1MiB, 2 x 16MiB for a 70/25/5 mix): its gets read 1.3-3x larger
    objects than the mix it stated."""
    mix = storage.parse_sizes("4KiB:0.7,1MiB:0.25,16MiB:0.05")
    for count in (16, 20, 100):
        sizes = apportion(mix, count)
        assert len(sizes) == count
        for size, weight in mix:  # each size's share off by less than one object
            assert abs(sizes.count(size) - count * weight) < 1
    assert apportion([(1, 0.5), (2, 0.5)], 3) in ([2, 1, 1], [2, 2, 1])


def test_steady_gets_read_the_stated_size_mix(capsys):
    mix = "1KiB:0.7,8KiB:0.25,64KiB:0.05"
    rc, result = _run_json(
        capsys, "--uri", _memory_uri(), "--sizes", mix, "--writers", "0", "--readers", "1",
        "--count", "400", "--seed", "1",
    )  # fmt: skip
    assert rc == 0 and result["get"]["ops"] == 400
    seeded = apportion(storage.parse_sizes(mix), 16)  # 11 x 1KiB, 4 x 8KiB, 1 x 64KiB
    assert [seeded.count(s) for s in (1024, 8192, 65536)] == [11, 4, 1]
    mean = result["get"]["bytes"] / result["get"]["ops"]
    assert mean == pytest.approx(sum(seeded) / len(seeded), rel=0.25)


def test_write_budget_stops_the_run(capsys):
    uri = _memory_uri()
    rc, result = _run_json(
        capsys, "--uri", uri, "--sizes", "4KiB", "--readers", "0", "--max-write-bytes", "64KiB"
    )
    assert rc == 0
    assert result["stop_reason"] == "max_write_bytes"
    assert result["put"]["ops"] == 16 and result["put"]["bytes"] == 64 * 1024
    assert _left_under(uri, result["prefix"]) == []


def test_bench_deletes_only_its_own_keys(capsys):
    uri = _memory_uri()
    other = Store(uri)
    other.put("ckptbench-not-mine/a", b"x")
    other.put("data/b", b"y")
    rc, result = _run_json(capsys, "--uri", uri, "--sizes", "1KiB", "--count", "50")
    assert rc == 0
    assert other.list("") == ["ckptbench-not-mine/a", "data/b"]


def test_injected_errors_are_counted_not_fatal(capsys):
    uri = _memory_uri()
    rc, result = _run_json(
        capsys, "--uri", uri, "--sizes", "4KiB", "--count", "400", "--error-rate", "0.3",
        "--attempts", "2", "--seed", "5",
    )  # fmt: skip
    assert rc == 0
    put, get = result["put"], result["get"]
    assert put["errors"] > 0 and put["retries"] > 0
    assert set(put["errors_by_type"]) == {"StorageError(InjectedFaultError)"}
    assert put["ops"] + get["ops"] + put["errors"] + get["errors"] == 400
    # Every injected fault is one failed attempt: either retried or the last attempt of a
    # request that failed.
    failed_attempts = put["retries"] + get["retries"] + put["errors"] + get["errors"]
    assert result["faults"]["injected"]["errors"] == failed_attempts
    assert _left_under(uri, result["prefix"]) == []


def test_hung_requests_time_out_and_are_retried(capsys):
    uri = _memory_uri()
    rc, result = _run_json(
        capsys, "--uri", uri, "--sizes", "1KiB", "--count", "100", "--hang-rate", "0.05",
        "--timeout-s", "0.2", "--attempts", "3", "--seed", "2", "--writers", "2",
        "--readers", "2",
    )  # fmt: skip
    assert rc == 0
    assert result["faults"]["injected"]["hangs"] > 0
    assert result["put"]["retries"] + result["get"]["retries"] > 0
    assert result["put"]["max_s"] >= 0.2 or result["get"]["max_s"] >= 0.2
    assert result["cleanup"]["left"] == 0


def test_burst_measures_reads_around_the_burst_and_cleans_up(capsys, tmp_path):
    uri = str(tmp_path / "store")
    rc, result = _run_json(
        capsys, "--uri", uri, "--mode", "burst", "--writers", "3", "--checkpoint-bytes", "1MiB",
        "--sizes", "128KiB", "--queue-depth", "2", "--baseline-s", "0.2", "--after-s", "0.2",
        "--read-interval-s", "0.001", "--latency", "fixed:0.01", "--fault-ops", "put",
    )  # fmt: skip
    assert rc == 0
    burst = result["burst"]
    assert burst["bytes_written"] == 3 * 2**20 and not burst["truncated"]
    assert result["put"]["ops"] == 3 * 8
    assert burst["end_s"] > burst["start_s"] > 0
    for phase in ("before", "during", "after"):
        assert burst["read"][phase]["count"] > 0, phase
    assert sum(burst["read"][p]["count"] for p in burst["read"]) == result["get"]["ops"]
    files = [f for _, _, fs in os.walk(uri) for f in fs]
    assert files == []
    # Reviewer U: the headline ratio read as a measurement from 2 reads during the burst.
    from bench.storage.report import print_table

    for during, caveat in ((2, True), (500, False)):
        burst["read"]["before"]["count"], burst["read"]["during"]["count"] = 500, during
        text = io.StringIO()
        print_table(result, out=text)
        (line,) = [x for x in text.getvalue().splitlines() if x.startswith("read p99 during")]
        assert ("from as few as 2 reads in a phase: too few for a p99" in line) == caveat, line


def test_a_burst_whose_puts_partly_fail_fails_the_run(capsys, tmp_path, monkeypatch):
    """Resource reviewer: on a disk that filled mid-burst 57 of 64 puts failed, and the run
    printed a write throughput of the 7 that landed and exited 0."""
    import errno
    import itertools

    from ckptstore.store import backends

    put, count = backends.LocalBackend.put_once, itertools.count()

    def filling(self, path, data):
        if "/rank" in path and next(count) % 2:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return put(self, path, data)

    monkeypatch.setattr(backends.LocalBackend, "put_once", filling)
    err: list[str] = []
    rc, result = _run_json(
        capsys, "--uri", str(tmp_path), "--mode", "burst", "--writers", "2",
        "--checkpoint-bytes", "512KiB", "--sizes", "128KiB", "--baseline-s", "0",
        "--after-s", "0", err=err,
    )  # fmt: skip
    assert rc == 1 and 0 < result["put"]["errors"] < 8 and result["put"]["ops"] > 0
    (line,) = err[0].strip().splitlines()
    assert f"{result['put']['errors']} of 8 puts failed" in line
    assert "no space left on device" in line


def test_burst_is_bounded_by_its_duration(capsys):
    uri = _memory_uri()
    rc, result = _run_json(
        capsys, "--uri", uri, "--mode", "burst", "--writers", "2", "--checkpoint-bytes",
        "64MiB", "--sizes", "1MiB", "--queue-depth", "1", "--latency", "fixed:0.05",
        "--fault-ops", "put", "--duration-s", "0.3", "--baseline-s", "0", "--after-s", "0",
    )  # fmt: skip
    assert rc == 0
    assert result["stop_reason"] == "duration"
    assert result["burst"]["truncated"]
    assert 0 < result["burst"]["bytes_written"] < 2 * 64 * 2**20
    assert _left_under(uri, result["prefix"]) == []


def test_read_mode_reads_ranges_of_existing_objects_and_leaves_them(capsys):
    uri = _memory_uri()
    data = Store(uri)
    for i in range(4):
        data.put(f"dataset/shard-{i}", os.urandom(64 * 1024))
    rc, result = _run_json(
        capsys, "--uri", uri, "--mode", "read", "--read-prefix", "dataset", "--read-bytes",
        "1KiB", "--count", "50",
    )  # fmt: skip
    assert rc == 0
    assert result["objects"] == 4
    assert result["get"]["ops"] == 50 and result["get"]["bytes"] == 50 * 1024
    assert "put" not in result
    assert data.list("") == [f"dataset/shard-{i}" for i in range(4)]


def test_read_mode_writes_its_own_objects_by_default(capsys):
    uri = _memory_uri()
    rc, result = _run_json(
        capsys, "--uri", uri, "--mode", "read", "--objects", "3", "--sizes", "256KiB",
        "--read-bytes", "100KiB", "--count", "30",
    )  # fmt: skip
    assert rc == 0
    assert result["get"]["bytes"] == 30 * 100 * 1024
    assert Store(uri).list("") == []


def test_table_output(capsys):
    args = _parse("--uri", _memory_uri(), "--sizes", "1KiB", "--count", "40")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "p99.9" in out and "put" in out and "cleanup: deleted" in out


@pytest.mark.s3
def test_steady_on_s3(capsys, s3_uri):
    rc, result = _run_json(
        capsys, "--uri", s3_uri, "--sizes", "4KiB:0.8,64KiB:0.2", "--count", "60",
        "--writers", "2", "--readers", "2",
    )  # fmt: skip
    assert rc == 0
    assert result["put"]["ops"] > 0 and result["get"]["ops"] > 0
    assert result["put"]["errors"] == result["get"]["errors"] == 0
    assert result["cleanup"]["left"] == 0
    assert Store(s3_uri).list(result["prefix"]) == []


# -- plots -------------------------------------------------------------------------------------


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = _parse("--uri", _memory_uri(), "--count", "5", "--plot", str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="--plot needs matplotlib"):
        args.func(args)


def test_burst_plot_is_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "burst.png"
    rc, result = _run_json(
        capsys, "--uri", _memory_uri(), "--mode", "burst", "--writers", "2",
        "--checkpoint-bytes", "512KiB", "--sizes", "64KiB", "--baseline-s", "0.1",
        "--after-s", "0.1", "--latency", "fixed:0.005", "--fault-ops", "put", "--plot", str(png),
    )  # fmt: skip
    assert rc == 0 and result["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- output paths and cleanup of a local run -----------------------------------------------------


@pytest.mark.parametrize(
    "plot, message",
    [
        (
            "/nonexistent/x.png",
            "--plot /nonexistent/x.png: the directory /nonexistent does not exist",
        ),
        (".", "--plot .: is a directory; give a file name"),
    ],
)
def test_unwritable_plot_fails_before_the_run(monkeypatch, capsys, plot, message):
    from bench.cli import main

    def must_not_run(self):
        raise AssertionError("the bench ran before its --plot path was checked")

    monkeypatch.setattr(storage.StorageBench, "run", must_not_run)
    assert main(["storage", "--uri", _memory_uri(), "--count", "5", "--plot", plot]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"ckptbench storage: error: {message}"


def test_unwritable_plot_exits_2_as_a_process():
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "bench.cli", "storage", "--uri", _memory_uri(),
         "--count", "5", "--plot", "/nonexistent/x.png"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ckptbench storage: error: --plot /nonexistent/x.png")


def test_local_run_leaves_nothing_behind(capsys, tmp_path):
    rc, result = _run_json(capsys, "--uri", str(tmp_path), "--count", "10", "--seed", "1")
    assert rc == 0 and result["cleanup"]["left"] == 0
    assert os.listdir(tmp_path) == []  # not even the empty ckptbench-<random>/ directory


def test_local_run_with_keep_keeps_its_directory(capsys, tmp_path):
    rc, result = _run_json(capsys, "--uri", str(tmp_path), "--count", "10", "--keep")
    assert rc == 0 and os.listdir(tmp_path) == [result["prefix"]]


def _burst_timeline() -> _Timeline:
    """Dense 1 ms reads before and after a burst from 2 s to 4 s, in which 4 reads start, each
    taking 400 ms: each lies alone in its window (about 83 ms wide)."""
    timeline = _Timeline()
    samples = [(i * 0.002, 0.001) for i in range(1000)]
    samples += [(2.25 + i * 0.5, 0.4) for i in range(4)]
    samples += [(4.0 + i * 0.002, 0.001) for i in range(1000)]
    for t, latency in samples:
        timeline.t_s.append(t)
        timeline.latency_s.append(latency)
    return timeline


def test_burst_plot_draws_the_sparse_slow_windows_of_the_burst(monkeypatch, tmp_path):
    """The p99 line rises through the burst the table reports, and marks its sparse windows."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from bench.storage.report import plot

    saved: list[Figure] = []
    real_savefig = Figure.savefig

    def keep_figure(fig, *args, **kwargs):
        saved.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_figure)
    burst = {"start_s": 2.0, "end_s": 4.0, "writers": 8, "read_bytes": 4096}
    timeline = _burst_timeline()
    phases = {name: LatencyHistogram() for name in ("before", "during", "after")}
    for t, latency in zip(timeline.t_s, timeline.latency_s):
        phase = "before" if t < 2.0 else "during" if t < 4.0 else "after"
        phases[phase].record(latency)
    bench = argparse.Namespace(_merged_stats={}, _phases=phases, _timeline=timeline)
    plot(bench, {"mode": "burst", "uri": "memory://x", "burst": burst}, str(tmp_path / "b.png"))

    timeline_axes = saved[0].axes[1]
    lines = {line.get_label(): line for line in timeline_axes.get_lines()}
    (p99_label,) = [label for label in lines if label.startswith("p99 per")]
    p99_in_burst = [
        y for x, y in zip(*lines[p99_label].get_data()) if burst["start_s"] <= x <= burst["end_s"]
    ]
    assert p99_in_burst and min(p99_in_burst) == pytest.approx(0.4)
    (sparse_label,) = [label for label in lines if label.startswith("sparse window")]
    sparse_x = lines[sparse_label].get_xdata()
    assert len(sparse_x) == 4 and all(2.0 <= x <= 4.0 for x in sparse_x)
    assert sparse_label in [t.get_text() for t in timeline_axes.get_legend().get_texts()]


def test_requests_still_hung_at_the_end_count_as_errors_not_answers(capsys):
    """A local store does not time requests out: gets hung until the run's end never
    answered, and a kind of request that never succeeded fails the run."""
    rc, result = _run_json(
        capsys, "--uri", _memory_uri(), "--sizes", "4KiB", "--count", "40", "--hang-rate", "1.0",
        "--hang-s", "3", "--attempts", "1", "--fault-ops", "get", err=(err := []),
    )  # fmt: skip
    assert rc == 1
    assert result["get"]["ops"] == 0
    assert result["get"]["errors"] == result["faults"]["injected"]["hangs"] > 0
    assert "every get failed, first: " in err[0] and "abandoned" in err[0], err


def test_a_burst_whose_every_put_failed_fails_the_run(capsys, tmp_path):
    rc, result = _run_json(
        capsys, "--uri", str(tmp_path / "store"), "--mode", "burst", "--writers", "2",
        "--checkpoint-bytes", "256KiB", "--sizes", "64KiB", "--baseline-s", "0.1",
        "--after-s", "0.1", "--error-rate", "1.0", "--attempts", "1", "--fault-ops", "put",
        err=(err := []),
    )  # fmt: skip
    assert rc == 1
    assert result["put"]["ops"] == 0 and result["put"]["errors"] > 0
    assert "every put failed, first: " in err[0], err


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_local_stores_get_figures_are_said_to_come_from_the_page_cache(capsys, tmp_path, where):
    """A reviewer: a local run's gets (objects it had just written) printed 2.5-7 GiB/s as the
    store's read speed, without a word of the page cache."""
    uri = str(tmp_path / "st") if where == "local" else _memory_uri()
    args = _parse("--uri", uri, "--sizes", "4KiB", "--count", "100")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert ("from the page cache" in out) == (where == "local"), out
    _, result = _run_json(capsys, "--uri", uri, "--sizes", "4KiB", "--count", "100")
    assert result["gets_from_page_cache"] == (where == "local")  # for plan --from-storage


def test_a_cleanup_the_store_does_not_answer_says_the_runs_objects_may_be_left(
    capsys, tmp_path, monkeypatch
):
    """A reviewer: with the server stopped as the run ended, its cleanup's listing timed out and
    the error said only that; 164 objects stayed, the user never told."""
    from bench.storage.run import StorageBench
    from ckptstore.errors import StorageError, StorageTimeoutError

    def unanswered(self):
        raise StorageTimeoutError(f"list {self.admin.url(self.prefix)}: no answer within 30.0s")

    monkeypatch.setattr(StorageBench, "cleanup", unanswered)
    args = _parse("--uri", str(tmp_path / "st"), "--sizes", "4KiB", "--count", "20")
    with pytest.raises(StorageError, match="may be left; delete them once the store"):
        args.func(args)


def test_a_store_that_dies_mid_run_is_said_to_have_failed_from_then_not_only_at_cleanup(
    capsys, tmp_path, monkeypatch
):
    """A reviewer: moto killed 4 s into a steady run; the run said only that its cleanup's
    listing failed, nothing of its own puts and gets failing from 4 s on."""
    import itertools

    from bench.storage.run import StorageBench
    from ckptstore.errors import StorageError, StorageTimeoutError
    from ckptstore.store import backends

    answered = itertools.count()
    real_put, real_get = backends.LocalBackend.put_once, backends.LocalBackend.get

    def dying(real):
        def request(self, *args, **kwargs):
            if next(answered) >= 28:  # the check's 2, the 16 objects seeded, 10 of the run
                raise ConnectionError("connection refused")
            return real(self, *args, **kwargs)

        return request

    def unanswered(self):
        raise StorageTimeoutError(f"list {self.admin.url(self.prefix)}: no answer within 30.0s")

    monkeypatch.setattr(backends.LocalBackend, "put_once", dying(real_put))
    monkeypatch.setattr(backends.LocalBackend, "get", dying(real_get))
    monkeypatch.setattr(StorageBench, "cleanup", unanswered)
    args = _parse(
        "--uri", str(tmp_path / "st"), "--sizes", "4KiB", "--count", "60", "--attempts", "1",
        "--seed", "1",
    )  # fmt: skip
    with pytest.raises(StorageError) as info:
        args.func(args)
    message = str(info.value)
    assert re.match(r"\d+ of \d+ (put|get)s failed from t=\d+\.\d s", message), message
    assert "(first: " in message and "connection refused" in message.lower(), message
    assert "; then list " in message and "may be left; delete them once the store" in message
    both = {
        "put": {"ops": 9, "errors": 3, "first_error": "put refused", "first_error_s": 4.12},
        "get": {"ops": 1, "errors": 2, "first_error": "get refused", "first_error_s": 4.05},
    }
    assert failed_requests(both) == (
        "3 of 12 puts failed from t=4.1 s, 2 of 3 gets from t=4.0 s (first: get refused)"
    )
    assert failed_requests({"put": {"ops": 3, "errors": 0}}) is None
