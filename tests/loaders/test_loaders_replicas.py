"""Replica choice, failover, benching, deadlines and hedged reads, with faults injected through
the storage layer (``bench.faults``) on real local, memory and S3 stores."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from bench.faults import Faults, Fixed, faults_of, with_faults
from ckptstore import Store
from loaders import (
    LoaderConfig,
    ReadTimeoutError,
    ReplicaConfig,
    ReplicaSet,
    ShardDataset,
    TokenFiles,
)
from loaders.replicas import replica_retry_policy

pytestmark = pytest.mark.timeout(60)

PAYLOAD = bytes(range(256)) * 16


def _replicas(tmp_path, faults: list[Faults | None], **cfg) -> tuple[ReplicaSet, list[Store]]:
    config = ReplicaConfig(**cfg)
    stores = []
    for i, f in enumerate(faults):
        root = tmp_path / f"r{i}"
        root.mkdir()
        (root / "obj").write_bytes(PAYLOAD)
        stores.append(with_faults(Store(str(root), retry=replica_retry_policy(config)), f))
    return ReplicaSet(stores, config=config), stores


def _release(stores):
    for s in stores:
        faults = faults_of(s)
        if faults is not None:
            faults.release()


def test_failover_when_a_replica_errors_and_it_is_benched(tmp_path):
    rs, stores = _replicas(
        tmp_path, [Faults(error_rate=1.0), None], hedge=False, bench_after_errors=2, bench_s=30.0
    )
    for _ in range(20):
        assert rs.read("obj", 10, 20) == PAYLOAD[10:20]
    m = rs.metrics()["replicas"]
    bad, good = m[stores[0].uri], m[stores[1].uri]
    assert bad["errors"] == bad["requests"] == 2
    assert bad["benched"] == 1
    assert good["wins"] == 20
    assert rs.metrics()["reads"]["failovers"] == 2


def test_failover_when_a_replica_hangs_bounded_by_attempt_deadline(tmp_path):
    rs, stores = _replicas(
        tmp_path,
        [Faults(hang_rate=1.0, hang_s=30), None],
        hedge=False,
        attempt_timeout_s=0.2,
        read_deadline_s=10,
    )
    try:
        assert rs.read("obj") == PAYLOAD
        m = rs.metrics()["replicas"]
        hung, good = m[stores[0].uri], m[stores[1].uri]
        assert hung["errors"] == 1
        assert good["wins"] == 1
        # the hung replica answered nothing: no latency to report, not a p99 of 0 that reads
        # as the fastest replica
        assert hung["answered"] == 0
        assert hung["p50_s"] is hung["p99_s"] is hung["max_s"] is None
        assert good["answered"] == 1 and 0 < good["p50_s"] <= good["p99_s"] <= good["max_s"]
    finally:
        _release(stores)


def test_every_replica_hanging_hits_the_overall_deadline(tmp_path):
    hang = [Faults(hang_rate=1.0, hang_s=30), Faults(hang_rate=1.0, hang_s=30)]
    rs, stores = _replicas(
        tmp_path, hang, attempt_timeout_s=5, read_deadline_s=0.3, hedge_initial_delay_s=0.05
    )
    try:
        with pytest.raises(ReadTimeoutError, match=r"obj\[0:8\].*0\.3s.*tried .*r0.*r1|r1.*r0"):
            rs.read("obj", 0, 8)
    finally:
        _release(stores)


def test_hedge_goes_to_another_replica_and_the_loser_is_cancelled(tmp_path):
    slow = Faults(latency=Fixed(2.0))
    rs, stores = _replicas(
        tmp_path, [slow, None], hedge_initial_delay_s=0.02, hedge_min_delay_s=0.01
    )
    try:
        assert rs.read("obj", 0, 100) == PAYLOAD[:100]  # first read goes to r0 (unmeasured)
        m = rs.metrics()
        loser, winner = m["replicas"][stores[0].uri], m["replicas"][stores[1].uri]
        assert m["reads"]["hedges"] == 1
        assert winner["hedges_fired"] == winner["hedges_won"] == 1
        assert loser["wins"] == 0
        assert loser["cancelled"] + loser["discarded"] == 1
    finally:
        _release(stores)


def test_hedge_budget_caps_extra_requests(tmp_path):
    every = [Faults(latency=Fixed(0.01)) for _ in range(3)]
    rs, stores = _replicas(
        tmp_path,
        every,
        hedge_initial_delay_s=0.001,
        hedge_min_delay_s=0.001,
        hedge_budget=0.1,
        hedge_burst=2,
        max_hedges=2,
    )
    reads = 60
    for _ in range(reads):
        rs.read("obj", 0, 64)
    m = rs.metrics()
    hedges = m["reads"]["hedges"]
    assert hedges >= 1
    assert hedges <= 2 + 0.1 * reads
    assert m["reads"]["hedges_refused"] > 0
    assert sum(r["hedges_fired"] for r in m["replicas"].values()) == hedges


def test_a_later_hedge_with_no_replica_left_looks_again_after_a_delay_not_in_a_loop(tmp_path):
    """Both replicas slow: the read's first hedge goes at once, its second has no replica left
    to go to. It looks again once per hedge delay (10 ms over a 200 ms read: ~19 times), not every
    quarter delay (~75 times) for the rest of the read."""
    rs, stores = _replicas(
        tmp_path,
        [Faults(latency=Fixed(0.2)), Faults(latency=Fixed(0.2))],
        hedge_initial_delay_s=0.01,
        hedge_min_delay_s=0.01,
        max_hedges=2,
    )
    assert rs.read("obj", 0, 64) == PAYLOAD[:64]
    m = rs.metrics()["reads"]
    assert m["hedges"] == 1
    assert 2 <= m["hedges_refused"] <= 30


def test_no_hedge_without_budget(tmp_path):
    every = [Faults(latency=Fixed(0.01)) for _ in range(2)]
    rs, _ = _replicas(
        tmp_path,
        every,
        hedge_initial_delay_s=0.001,
        hedge_min_delay_s=0.001,
        hedge_budget=0.0,
        hedge_burst=1,
    )
    for _ in range(10):
        rs.read("obj", 0, 64)
    assert rs.metrics()["reads"]["hedges"] <= 1  # the initial burst only


def test_reads_route_around_a_slow_replica(tmp_path):
    faults = [
        Faults(latency=Fixed(0.05)),
        Faults(latency=Fixed(0.002)),
        Faults(latency=Fixed(0.002)),
    ]
    rs, stores = _replicas(tmp_path, faults, hedge=False, bench_min_samples=2)
    for _ in range(60):
        rs.read("obj", 0, 32)
    m = rs.metrics()["replicas"]
    assert m[stores[0].uri]["requests"] <= 2
    assert m[stores[1].uri]["requests"] + m[stores[2].uri]["requests"] >= 58


def test_benched_replica_is_probed_again(tmp_path):
    faults = Faults(error_rate=1.0)
    rs, stores = _replicas(
        tmp_path,
        [faults, None],
        hedge=False,
        bench_after_errors=1,
        bench_s=0.05,
        probation_share=0.1,
    )
    rs.read("obj")
    faults.error_rate = 0.0  # the replica recovers
    recovered = False
    for _ in range(200):  # bounded: ~10 ms a read
        rs.read("obj")
        if rs.metrics()["replicas"][stores[0].uri]["wins"]:
            recovered = True
            break
        Faults(latency=Fixed(0.005)).inject("get")  # let the bench expire
    assert recovered


def _requests(rs: ReplicaSet, store: Store) -> int:
    return rs.metrics()["replicas"][store.uri]["requests"]


def _read_until_benched(rs: ReplicaSet, store: Store, bound: int) -> int:
    """Reads until ``store``'s replica is benched; how many it took (at most ``bound``)."""
    for n in range(1, bound + 1):
        rs.read("obj", 0, 32)
        if rs.metrics()["replicas"][store.uri]["health"] == "benched":
            return n
    raise AssertionError(f"replica {store.uri} not benched within {bound} reads")


def test_persistently_slow_replica_is_benched_within_bounded_reads(tmp_path):
    # 6x slower: by speed alone it would still get about 1 first attempt in 13
    faults = [Faults(latency=Fixed(0.024)), Faults(latency=Fixed(0.004)), None]
    faults[2] = Faults(latency=Fixed(0.004))
    rs, stores = _replicas(tmp_path, faults, hedge=False, bench_s=60.0, bench_min_samples=4)
    _read_until_benched(rs, stores[0], bound=300)
    before = _requests(rs, stores[0])
    for _ in range(100):
        rs.read("obj", 0, 32)
    assert _requests(rs, stores[0]) - before == 0
    m = rs.metrics()["replicas"]
    assert m[stores[0].uri]["benched"] == 1
    assert m[stores[1].uri]["health"] == m[stores[2].uri]["health"] == "healthy"


def test_recovered_replica_gets_traffic_back_within_bounded_reads(tmp_path):
    slow = Faults(latency=Fixed(0.024))
    faults = [slow, Faults(latency=Fixed(0.004)), Faults(latency=Fixed(0.004))]
    rs, stores = _replicas(
        tmp_path,
        faults,
        hedge=False,
        bench_s=0.05,
        probation_share=0.1,
        recover_after=3,
        bench_min_samples=4,
    )
    _read_until_benched(rs, stores[0], bound=300)
    slow.latency = Fixed(0.004)  # the replica recovers
    for _ in range(300):  # bench (~13 reads of 4 ms), then 3 probation reads 1 in 10
        rs.read("obj", 0, 32)
        if rs.metrics()["replicas"][stores[0].uri]["health"] == "healthy":
            break
    else:
        raise AssertionError("the recovered replica was not restored within 300 reads")
    before = _requests(rs, stores[0])
    for _ in range(150):
        rs.read("obj", 0, 32)
    assert _requests(rs, stores[0]) - before >= 20  # a third expected


def test_replica_still_slow_on_probation_is_benched_again_for_longer(tmp_path):
    faults = [Faults(latency=Fixed(0.024)), Faults(latency=Fixed(0.004)), None]
    faults[2] = Faults(latency=Fixed(0.004))
    rs, stores = _replicas(
        tmp_path, faults, hedge=False, bench_s=0.05, probation_share=0.5, bench_min_samples=4
    )
    _read_until_benched(rs, stores[0], bound=300)
    for _ in range(300):
        rs.read("obj", 0, 32)
        if rs.metrics()["replicas"][stores[0].uri]["benched"] >= 2:
            break
    else:
        raise AssertionError("a replica still slow on probation was not benched again")
    r0 = next(r for r in rs._replicas if r.store is stores[0])
    assert r0.bench_s >= 0.2  # served 0.05, then 0.1 (at least), next 0.2 (at least)


def test_all_healthy_replicas_share_traffic(tmp_path):
    rs, stores = _replicas(tmp_path, [Faults(latency=Fixed(0.003)) for _ in range(3)], hedge=False)
    for _ in range(150):
        rs.read("obj", 0, 32)
    m = rs.metrics()["replicas"]
    for s in stores:
        assert m[s.uri]["requests"] >= 20  # 50 expected
        assert m[s.uri]["health"] == "healthy" and m[s.uri]["benched"] == 0


def test_dataset_over_s3_and_local_replicas_with_a_failing_replica(tmp_path, s3_uri):
    tokens = np.arange(4000, dtype=np.uint16)
    (tmp_path / "t.bin").write_bytes(tokens.tobytes())
    Store(s3_uri).put("t.bin", tokens.tobytes())
    mem = f"memory://loaders-{uuid.uuid4().hex[:8]}"
    Store(mem).put("t.bin", tokens.tobytes())
    config = ReplicaConfig(bench_after_errors=2)
    broken = with_faults(Store(mem, retry=replica_retry_policy(config)), Faults(error_rate=1.0))
    ds = ShardDataset(
        [broken, s3_uri, str(tmp_path)],
        TokenFiles(sample_tokens=100, read_bytes=1000),
        config=LoaderConfig(shuffle=False),
        replica_config=config,
    )
    got = np.concatenate([s["tokens"] for s in ds])
    np.testing.assert_array_equal(got, tokens)
    m = ds.metrics()["replicas"]
    assert m[broken.uri]["bytes"] == 0 and m[broken.uri]["errors"] >= 1
    assert m[s3_uri]["bytes"] + m[str(tmp_path)]["bytes"] >= tokens.nbytes


def test_replica_config_rejects_bad_values():
    with pytest.raises(ValueError, match="hedge_quantile"):
        ReplicaConfig(hedge_quantile=100)
    with pytest.raises(ValueError, match="hedge_budget"):
        ReplicaConfig(hedge_budget=-1)
    with pytest.raises(ValueError, match="bench_slow_factor"):
        ReplicaConfig(bench_slow_factor=1.0)
    with pytest.raises(ValueError, match="probation_share"):
        ReplicaConfig(probation_share=0)
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaSet([])


def test_a_replica_whose_reads_hedges_always_win_is_judged_before_any_deadline(tmp_path):
    """Reviewer H: a replica that answered no data read (each won by a hedge on the other)
    was counted only when a later read gave its attempt up at the attempt deadline (10 s): a
    pass shorter than that (a DataLoader worker's) ended with it "healthy", taking first
    attempts and hedges all along. An attempt still running when one started after it answered
    is a bound below its replica's latency: measured, it keeps hedges away at once, and a few
    in a row bench it as slow."""
    rs, stores = _replicas(
        tmp_path,
        [Faults(hang_rate=1.0, hang_s=30, ops=frozenset({"get"})), None],
        hedge_initial_delay_s=0.02,
        hedge_min_delay_s=0.001,
        attempt_timeout_s=20,
        read_deadline_s=10,
    )
    hung, good = rs._replicas
    try:
        assert rs.read("obj", 0, 64) == PAYLOAD[:64]  # the first read goes to r0: a hedge won
        assert hung.samples == 1 and hung.latency >= 0.02 and good.samples == 1
        for _ in range(4):  # first attempts on r0, each outrun by the hedge on r1
            assert rs._health.choose([good], first=True) is hung
            rs._health.outrun(hung, 0.05)
        m = rs.metrics()["replicas"]
        assert m[stores[0].uri]["health"] == "benched" and m[stores[0].uri]["errors"] == 0
        assert m[stores[1].uri]["health"] == "healthy"
        for _ in range(30):
            assert rs.read("obj", 0, 64) == PAYLOAD[:64]
        assert rs.metrics()["replicas"][stores[0].uri]["hedges_fired"] == 0
    finally:
        _release(stores)


def test_a_stall_several_reads_in_flight_saw_does_not_bench_a_healthy_replica(tmp_path):
    """Reviewer I: a 60 ms stall of a 5 ms replica seen by three reads in flight (each won by a
    hedge) benched it at once: an outrun counted as an error in a row. Outruns are latency
    samples: three among ten normal ones leave its median where it was."""
    rs, stores = _replicas(tmp_path, [None, None], bench_after_errors=3)
    one, other = rs._replicas
    other.measured(0.005)
    for _ in range(10):
        rs._health.choose([other], first=True)
        rs._health.finished(one, 0.005, 64, None, read=True)
    for _ in range(3):
        rs._health.outrun(one, 0.06)
    assert not one.benched


def test_outruns_never_bench_past_max_benched_slow(tmp_path):
    """Reviewer I: the outrun rule benched replicas past ``max_benched_slow`` (0: never for
    latency)."""
    rs, stores = _replicas(tmp_path, [None, None], max_benched_slow=0.0)
    one, other = rs._replicas
    other.measured(0.005)
    for _ in range(10):
        rs._health.outrun(one, 0.5)
    assert not one.benched


def test_a_read_started_before_the_delay_is_learnt_hedges_once_it_is(tmp_path):
    """The first read goes to r0, which hangs. The initial guess of the hedge delay (10 s) is
    past the read's deadline (5 s); reads that complete meanwhile on r1 teach the delay, and the
    hung read hedges at it instead of failing at its deadline."""
    rs, stores = _replicas(
        tmp_path,
        [Faults(hang_rate=1.0, hang_s=30), None],
        hedge_initial_delay_s=10.0,
        hedge_min_delay_s=0.001,
        hedge_min_samples=5,
        attempt_timeout_s=20,
        read_deadline_s=5,
    )
    result: dict[str, object] = {}

    def first_read() -> None:
        try:
            result["data"] = rs.read("obj", 0, 64)
        except ReadTimeoutError as exc:  # reported by the assertion below
            result["error"] = exc

    reader = threading.Thread(target=first_read)
    try:
        reader.start()
        for _ in range(500):  # the first read has picked r0
            if rs.metrics()["replicas"][stores[0].uri]["requests"]:
                break
            threading.Event().wait(0.01)
        for _ in range(10):
            assert rs.read("obj", 0, 64) == PAYLOAD[:64]
        reader.join(30)
        assert not reader.is_alive()
        assert result.get("data") == PAYLOAD[:64], result.get("error")
        m = rs.metrics()
        assert m["replicas"][stores[1].uri]["hedges_won"] == 1
        assert m["replicas"][stores[0].uri]["wins"] == 0
    finally:
        _release(stores)


def test_a_few_slow_reads_never_bench_a_healthy_replica(tmp_path):
    """Every store has a tail: 10% of each replica's reads 30x slow. Hedging is for those; a
    replica is benched for what a typical read costs, so none of the three is."""
    faults = [Faults(latency=Fixed(0.002), slow_rate=0.1, slow_s=0.06, seed=s) for s in range(3)]
    rs, stores = _replicas(tmp_path, faults, hedge=False)
    for _ in range(300):
        assert rs.read("obj", 0, 32) == PAYLOAD[:32]
    m = rs.metrics()["replicas"]
    assert sum(faults_of(s).counts["slow"] for s in stores) >= 15  # the tail was there
    assert [m[s.uri]["benched"] for s in stores] == [0, 0, 0]


def test_of_three_replicas_two_stay_to_hedge_between(tmp_path):
    """Two of three replicas slow: only one is benched for latency at a time, so reads keep a
    second healthy replica to hedge to."""
    faults = [Faults(latency=Fixed(0.024)), Faults(latency=Fixed(0.024))]
    faults.append(Faults(latency=Fixed(0.004)))
    rs, stores = _replicas(tmp_path, faults, hedge=False, bench_s=60.0, bench_min_samples=4)
    for _ in range(300):
        rs.read("obj", 0, 32)
    health = [rs.metrics()["replicas"][s.uri]["health"] for s in stores]
    assert sorted(health[:2]) == ["benched", "healthy"] and health[2] == "healthy"


def test_a_slower_replica_takes_the_bench_from_one_a_stall_benched(tmp_path):
    """r1 is benched for a burst of slow reads (a stall of the process at start, say), using
    the one bench for latency that three replicas allow; then r0 turns slow on every read. r0
    takes r1's place on the bench and r1 goes back to full traffic, instead of r0 serving its
    share of reads for the length of r1's bench."""
    faults = [Faults(latency=Fixed(0.002)), Faults(latency=Fixed(0.03))]
    faults.append(Faults(latency=Fixed(0.002)))
    rs, stores = _replicas(
        tmp_path, faults, hedge=False, bench_s=60.0, bench_min_samples=4, latency_window=5
    )
    _read_until_benched(rs, stores[1], bound=600)
    faults[1].latency = Fixed(0.002)
    faults[0].latency = Fixed(0.1)
    _read_until_benched(rs, stores[0], bound=300)
    health = [rs.metrics()["replicas"][s.uri]["health"] for s in stores]
    assert health == ["benched", "healthy", "healthy"]
    before = _requests(rs, stores[1])
    for _ in range(50):
        rs.read("obj", 0, 32)
    assert _requests(rs, stores[1]) > before  # back in use, not left out as unmeasured
    assert rs.metrics()["replicas"][stores[0].uri]["health"] == "benched"


def test_a_replica_benched_for_latency_keeps_its_place_against_a_faster_one(tmp_path):
    """The other way round: with r0 benched for being very slow, r1 turning a little slow
    (over the bench threshold, but faster than r0) does not take r0's place: the slowest stays benched."""
    faults = [Faults(latency=Fixed(0.04)), Faults(latency=Fixed(0.002))]
    faults.append(Faults(latency=Fixed(0.002)))
    rs, stores = _replicas(
        tmp_path, faults, hedge=False, bench_s=60.0, bench_min_samples=4, latency_window=5
    )
    _read_until_benched(rs, stores[0], bound=600)
    faults[1].latency = Fixed(0.015)  # benchable (7x and 13 ms slower), but faster than r0
    for _ in range(100):
        rs.read("obj", 0, 32)
    health = [rs.metrics()["replicas"][s.uri]["health"] for s in stores]
    assert health == ["benched", "healthy", "healthy"]


def test_an_attempt_given_up_at_its_deadline_is_counted_once_when_it_ends(tmp_path):
    """Data reads run in the replica's thread without a deadline of the store's own; the read
    gives a slow attempt up at the store's deadline (an error of that replica, failover), and
    the attempt's late answer is neither counted again nor returned."""
    rs, stores = _replicas(
        tmp_path,
        [Faults(latency=Fixed(0.6)), None],
        hedge=False,
        attempt_timeout_s=0.1,
        read_deadline_s=10,
    )
    assert rs.read("obj", 0, 16) == PAYLOAD[:16]  # the first read goes to r0, unmeasured
    r0 = next(r for r in rs._replicas if r.store is stores[0])
    for _ in range(300):  # r0's attempt ends after 0.6 s
        if faults_of(stores[0]).counts["requests"] == 1 and r0.inflight == 0:
            threading.Event().wait(0.7)
            break
        threading.Event().wait(0.01)
    m = rs.metrics()
    assert m["replicas"][stores[0].uri]["errors"] == 1
    assert m["replicas"][stores[0].uri]["wins"] == 0 and r0.samples == 0
    assert m["replicas"][stores[1].uri]["wins"] == 1
    assert r0.inflight == 0 and m["reads"]["failovers"] == 1


def test_a_hung_loser_of_a_hedged_read_is_still_given_up_at_its_deadline(tmp_path):
    """r0 starts hanging on every read; hedges to r1 win them. The losers keep running after
    their reads return; later reads give them up at their deadline, so each counts as r0's
    error (r0 is benched) and none keeps holding a slot in flight."""
    hang = Faults(hang_s=30, ops=frozenset({"get"}))
    rs, stores = _replicas(
        tmp_path,
        [hang, None],
        hedge_initial_delay_s=0.02,
        hedge_min_delay_s=0.005,
        attempt_timeout_s=0.2,
        read_deadline_s=10,
        bench_s=60,
    )
    r0 = next(r for r in rs._replicas if r.store is stores[0])
    try:
        for _ in range(50):
            assert rs.read("obj", 0, 16) == PAYLOAD[:16]
        hang.hang_rate = 1.0
        for _ in range(2000):  # bounded: about 0.2 s of hung reads are enough
            assert rs.read("obj", 0, 16) == PAYLOAD[:16]
            if r0.benched and r0.inflight == 0:
                break
            threading.Event().wait(0.002)
        m = rs.metrics()["replicas"][stores[0].uri]
        assert r0.benched and m["benched"] == 1, m
        assert r0.inflight == 0 and m["errors"] >= 3  # bench_after_errors
    finally:
        _release(stores)


def test_max_benched_slow_zero_never_benches_for_latency(tmp_path):
    faults = [Faults(latency=Fixed(0.024)), Faults(latency=Fixed(0.004))]
    rs, stores = _replicas(tmp_path, faults, hedge=False, bench_min_samples=4, max_benched_slow=0)
    for _ in range(100):
        rs.read("obj", 0, 32)
    assert rs.metrics()["replicas"][stores[0].uri]["benched"] == 0


@pytest.mark.parametrize("other", ["{root}/", "file://{root}", "{root}/../{name}"])
def test_one_directory_given_twice_is_not_two_replicas(tmp_path, other):
    root = tmp_path / "data"
    root.mkdir()
    again = other.format(root=root, name=root.name)
    with pytest.raises(ValueError, match="replica URIs repeat"):
        ReplicaSet([str(root), again])


def test_one_bucket_and_prefix_on_two_endpoints_is_two_replicas():
    """Reviewer H: mirrors on two S3 providers under the same bucket name were refused as "the
    same place twice"; the same bucket on the same endpoint still is."""

    def at(port: int, spelled: str = "http://127.0.0.1:{}") -> Store:
        options = {"endpoint_url": spelled.format(port), "key": "k", "secret": "s"}
        return Store("s3://data/ds", storage_options=options)

    assert len(ReplicaSet([at(9), at(10)]).metrics()["replicas"]) == 2
    with pytest.raises(ValueError, match="replica URIs repeat"):
        ReplicaSet([at(9), at(9)])
    with pytest.raises(ValueError, match="replica URIs repeat"):  # one endpoint spelled twice
        ReplicaSet([at(9), at(9, "HTTP://127.0.0.1:{}/")])


class _CutHeads(Store):
    """A replica whose answer to a file's 12-byte head read is cut in half."""

    def get(self, key, start=None, end=None, **kwargs):
        data = super().get(key, start, end, **kwargs)
        return data[: len(data) // 2] if (start, end) == (0, 12) else data


def test_a_cut_answer_to_a_token_files_head_read_fails_over_to_another_replica(tmp_path):
    """The open reads a headerless token file's first 12 bytes (an llm.c header would be read
    as tokens): a replica answering 6 of them raised numpy's "buffer size must be a multiple
    of element size" on about half the opens, the replica picked at random."""
    tokens = np.arange(4000, dtype=np.uint16)
    for name in ("good", "cut"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "t.bin").write_bytes(tokens.tobytes())
    config = ReplicaConfig()
    for _ in range(8):
        cut = _CutHeads(str(tmp_path / "cut"), retry=replica_retry_policy(config))
        ds = ShardDataset(
            [cut, str(tmp_path / "good")],
            TokenFiles(sample_tokens=100),
            config=LoaderConfig(shuffle=False),
            replica_config=config,
        )
        np.testing.assert_array_equal(np.concatenate([s["tokens"] for s in ds]), tokens)


def test_a_bad_llmc_header_on_one_replica_is_read_from_another(tmp_path):
    """A reviewer's: the header checked after its read, outside the failover, failed the open
    whenever the damaged replica was the one asked (listed second, about every time)."""
    from loaders import TokenWriter

    roots = [tmp_path / "a", tmp_path / "b"]
    tokens = np.arange(64 * 40, dtype=np.uint16)
    with TokenWriter([str(r) for r in roots], header="llmc", file_tokens=64 * 20) as writer:
        writer.write(tokens)
    with open(roots[0] / "tokens.00000.bin", "r+b") as fh:
        fh.write(np.array([20240801, 7], "<i4").tobytes())  # a uint32 file's magic
    fmt = TokenFiles(sample_tokens=64, header="llmc", manifest="manifest.txt")
    for order in (roots, roots[::-1]):
        ds = ShardDataset([str(r) for r in order], fmt, config=LoaderConfig(shuffle=False))
        np.testing.assert_array_equal(np.concatenate([s["tokens"] for s in ds]), tokens)
    (roots[1] / "tokens.00000.bin").write_bytes((roots[0] / "tokens.00000.bin").read_bytes())
    with pytest.raises(Exception, match=r"no replica holds bytes that verify.*llm.c header magic"):
        ShardDataset([str(r) for r in roots], fmt)


class _Asked:
    """A backend recording the path of every request made of it into ``asked``."""

    def __init__(self, inner, asked: list[str]) -> None:
        self._inner, self._asked = inner, asked

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args, **kwargs):
            if args and isinstance(args[0], str):
                self._asked.append(args[0])
            return attr(*args, **kwargs)

        return call


def test_a_replica_that_never_answers_the_open_is_benched_not_asked_again(tmp_path):
    """A reviewer's: a replica hanging from the start cost the open one attempt deadline at its
    manifest, one at its survey and one at each header until errors benched it (50 s with the
    defaults); what the open learnt did not steer its next requests."""
    from loaders import TokenWriter

    roots = [tmp_path / "a", tmp_path / "b"]
    with TokenWriter([str(r) for r in roots], header="llmc", file_tokens=64 * 5) as writer:
        writer.write(np.arange(64 * 40, dtype=np.uint16))
    config = ReplicaConfig(attempt_timeout_s=0.3, bench_s=30)
    hang = Faults(hang_rate=1.0, hang_s=30)
    hung = with_faults(Store(str(roots[1]), retry=replica_retry_policy(config)), hang)
    asked: list[str] = []
    hung.backend = _Asked(hung.backend, asked)
    try:
        ds = ShardDataset(
            [str(roots[0]), hung],
            TokenFiles(sample_tokens=64, header="llmc", manifest="manifest.txt"),
            config=LoaderConfig(shuffle=False),
            replica_config=config,
        )
        m = ds.metrics()["replicas"][hung.uri]
        # its manifest alone was asked of it: no listing or size (the survey), no header
        assert asked and {path.rsplit("/", 1)[-1] for path in asked} == {"manifest.txt"}, asked
        assert m["benched"] == 1 and m["errors"] == 1 and m["health"] == "benched"
        assert m["requests"] == 1  # loader adversary of stop 78: an error of no request (0)
        assert len(list(ds)) == 40
    finally:
        hang.release()


def test_a_replicas_wins_and_latencies_are_of_reads_not_of_header_requests(tmp_path):
    """A reviewer's: each file's header request at open counted as a replica's win and fed its
    p50/p99 (wins summed to twice the reads over 100 llm.c files)."""
    from loaders import TokenWriter

    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with TokenWriter(roots, header="llmc", file_tokens=64 * 2) as writer:
        writer.write(np.arange(64 * 40, dtype=np.uint16))
    fmt = TokenFiles(sample_tokens=64, header="llmc", manifest="manifest.txt", read_bytes=128)
    ds = ShardDataset(roots, fmt, config=LoaderConfig(shuffle=False))
    opened = ds.metrics()
    replicas = opened["replicas"].values()
    assert sum(r["requests"] for r in replicas) >= 20  # the 20 files' headers were asked
    assert sum(r["wins"] for r in replicas) == opened["reads"]["reads"]  # the manifest's read
    assert sum(r["answered"] for r in replicas) <= 2
    assert len(list(ds)) == 40
    read = ds.metrics()
    assert sum(r["wins"] for r in read["replicas"].values()) == read["reads"]["reads"] >= 21


def test_a_hung_s3_replica_leaves_the_replica_beside_it_on_its_endpoint_alone(s3_endpoint):
    """Reviewer Q: two replicas in two buckets of one endpoint shared one filesystem (fsspec
    hands one instance to equal arguments), so the hung replica's requests, abandoned at their
    deadline but still holding pooled connections, left none for the healthy one: its reads
    timed out too and a DataLoader run failed."""
    import boto3

    from tests.helpers.s3proxy import Fault, s3_relay

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    tag = uuid.uuid4().hex[:8]
    hung, good = f"hung-{tag}", f"good-{tag}"
    for bucket in (hung, good):
        s3.create_bucket(Bucket=bucket)
        for i in range(24):
            s3.put_object(Bucket=bucket, Key=f"ds/obj{i}", Body=PAYLOAD)
    with s3_relay(s3_endpoint) as relay:
        relay.faults.append(Fault("GET", f"/{hung}/", "hang", times=10**6))
        config = ReplicaConfig(hedge=False, attempt_timeout_s=3.0, read_deadline_s=30)
        rs = ReplicaSet(
            [f"s3://{hung}/ds", f"s3://{good}/ds"],
            config=config,
            storage_options={"endpoint_url": relay.endpoint},
        )
        # Reads in flight at once (a worker's prefetch), each tried on the hung replica first.
        got = [None] * 24
        threads = [
            threading.Thread(target=lambda i=i: got.__setitem__(i, rs.read(f"obj{i}")))
            for i in range(24)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=40)
        assert got == [PAYLOAD] * 24
        assert rs.metrics()["replicas"][f"s3://{good}/ds"]["errors"] == 0


def test_a_replica_benched_for_latency_is_named_with_its_measured_latency(tmp_path, caplog):
    """Reviewer Q: every such warning said 'latency inf ms is infx the best healthy
    replica's' (the bench forgot the latency before the message was written)."""
    rs, stores = _replicas(tmp_path, [None, None, None], hedge=False, bench_min_samples=4)
    for _ in range(8):
        rs.read("obj", 0, 32)  # both measured: local reads of well under 100 ms
    slow = rs._replicas[0]
    with caplog.at_level("WARNING", logger="loaders"):
        for _ in range(6):
            rs._health.outrun(slow, 0.5)  # still running 500 ms in, beaten by the other
    (said,) = [r.getMessage() for r in caplog.records if "benched for" in r.getMessage()]
    assert stores[0].uri in said and "inf" not in said, said
    assert float(said.split("latency ")[1].split(" ms")[0]) >= 100, said  # measured, finite


def test_a_failed_reads_error_names_each_reason_once(tmp_path):
    """Reviewer Q: the same reason from every attempt (no credentials, say) was repeated three
    times in the one line."""
    from loaders.errors import ReadFailedError

    faults = [Faults(error_rate=1.0), Faults(error_rate=1.0)]
    rs, stores = _replicas(tmp_path, faults, hedge=False, bench_after_errors=100)
    with pytest.raises(ReadFailedError, match="failed after 6 attempts") as failed:
        rs.read("obj")
    said = str(failed.value)
    assert [said.count(f"{s.uri}: ") for s in stores] == [1, 1], said


def test_the_loser_of_a_hedged_read_is_not_decoded_after_the_read_returned(tmp_path):
    """Dataset adversary of stop 75: every answer was decoded, the losers' too, after their
    read had returned (or failed): a slow replica's late answers took a core each for
    nothing. Not decoded, its answer is not judged good either (a corrupt replica's errors
    would be forgotten): it is let go as a cancelled attempt is."""
    slow = Faults(latency=Fixed(0.3))
    rs, stores = _replicas(
        tmp_path, [slow, None], hedge_initial_delay_s=0.02, hedge_min_delay_s=0.01
    )
    decoded: list[str] = []

    def decode(data, replica):
        decoded.append(replica)
        return bytes(data)

    try:
        assert rs.read("obj", 0, 100, decode=decode) == PAYLOAD[:100]  # r0 first: unmeasured
        r0 = next(r for r in rs._replicas if r.store is stores[0])
        for _ in range(500):  # bounded: its answer comes after 0.3 s
            if r0.inflight == 0:
                break
            threading.Event().wait(0.02)
        assert r0.inflight == 0
        threading.Event().wait(0.1)  # a decode started by its answer would have been recorded
        assert decoded == [stores[1].uri]
        loser = rs.metrics()["replicas"][stores[0].uri]
        assert loser["answered"] == 0 and loser["errors"] == 0  # neither good nor bad
    finally:
        _release(stores)


def test_an_attempt_whose_deadline_passed_while_the_process_stalled_is_not_charged(tmp_path):
    """Loader adversary: an attempt past its deadline because this process did not run (a
    swapping host, a stopped job) was charged to its replica: "no answer" warnings, a healthy
    replica benched, six such attempts failing a read. This process is stopped (SIGSTOP) for
    0.8 s while an attempt of 0.5 s runs: the attempt gets its time again and answers."""
    import os
    import signal
    import subprocess
    import sys

    rs, stores = _replicas(
        tmp_path, [Faults(latency=Fixed(1.2)), None], hedge=False, attempt_timeout_s=0.5,
        read_deadline_s=10,
    )  # fmt: skip
    got = []
    reader = threading.Thread(target=lambda: got.append(rs.read("obj", 0, 16)))
    reader.start()
    threading.Event().wait(0.1)  # the attempt is on its way
    resume = f"import os, signal, time; time.sleep(0.8); os.kill({os.getpid()}, signal.SIGCONT)"
    waker = subprocess.Popen([sys.executable, "-c", resume])
    try:
        os.kill(os.getpid(), signal.SIGSTOP)
    finally:
        waker.wait(timeout=30)
    reader.join(timeout=30)
    assert got == [PAYLOAD[:16]]
    m = rs.metrics()["replicas"]
    assert m[stores[0].uri]["errors"] == 0 and m[stores[0].uri]["wins"] == 1, m
    assert rs.metrics()["reads"]["failovers"] == 0
