"""A kept repair's receive buffers, touched ahead of their rounds by a thread where the host has
a core per rank (issue 36), and the count of ranks on a host that decides it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ckptstore.tiers import transfer
from ckptstore.tiers.group import RankGroup
from tests.helpers.dist import run_ranks


def test_buffers_come_in_order_sized_and_at_most_two_ahead():
    sizes = [3 * 4096 + 5, 1, 64 << 10, 7]
    ahead = transfer._FaultAhead(sizes, ahead=2)
    got = [ahead.take(i) for i in range(len(sizes))]
    assert [b.numel() for b in got] == sizes
    assert all(b.dtype == torch.uint8 for b in got)
    assert len({b.data_ptr() for b in got}) == len(sizes)  # each a buffer of its own
    # The thread made at most two buffers that no round had taken yet.
    held = transfer._FaultAhead([16] * 6, ahead=2)
    held.take(0)
    for _ in range(200):
        if held._futures[2].done():
            break
        threading.Event().wait(0.01)
    assert held._futures[2].done() and not held._futures[3].done()
    held.cancel()


def test_an_exchange_that_ends_early_makes_no_more_buffers():
    ahead = transfer._FaultAhead([32] * 8, ahead=2)
    ahead.take(0)
    ahead.cancel()
    threads = [t for t in threading.enumerate() if t.name == "ckptstore-repair-buffers"]
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    assert sum(f.cancelled() for f in ahead._futures) >= 8 - 3  # never made


def test_a_buffer_that_cannot_be_made_fails_the_round_that_takes_it():
    ahead = transfer._FaultAhead([16, -1, 16], ahead=2)
    assert ahead.take(0).numel() == 16
    with pytest.raises(RuntimeError):
        ahead.take(1)
    assert ahead.take(2).numel() == 16


@pytest.mark.parametrize(
    "cpus, mine, ranks, want",
    [(16, 16, 8, 2.0), (2, 2, 4, 0.5), (2, 2, 2, 1.0), (64, 4, 8, 4)],
    ids=["shared", "more-ranks-than-cores", "a-core-each", "bound-to-its-own"],
)
def test_cores_per_rank(monkeypatch, cpus, mine, ranks, want):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(mine)), raising=False)
    assert transfer.cores_per_rank(ranks) == want


def _on_host(rank: int, world: int) -> None:
    group = RankGroup(None, timeout_s=60)
    exchanges = []
    gather = group.gather
    group.gather = lambda value: exchanges.append(value) or gather(value)
    assert group.ranks_on_host() == world  # every rank of this test runs here
    assert group.ranks_on_host() == world
    assert len(exchanges) == 1  # remembered: one exchange
    assert gather(rank) == list(range(world))  # and the group's exchanges stay aligned


@pytest.mark.dist
def test_ranks_on_a_host_are_counted_once():
    run_ranks(_on_host, 3, timeout_s=90)


def test_one_process_is_one_rank_on_its_host():
    assert RankGroup(None, timeout_s=5, no_dist=True).ranks_on_host() == 1
