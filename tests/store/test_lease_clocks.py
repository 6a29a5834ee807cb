"""Issue 21 items 2 and 3: leases judged by the store's clock, and a dead gc over only once its
last delete is.

- A gc killed with a chunk's delete in flight at the storage (it lands seconds later, after the
  gc process is gone): a save that starts then must not reuse the chunk before the delete lands.
- A writer whose clock is 300 s behind: its live lease looks 300 s old by its own `renewed_at`,
  but the store stamped it just now, so gc sweeps nothing under it; a lease the store stamped
  longer than its ttl ago is stale whatever its `renewed_at` says."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptstore import Checkpointer, EncodingOptions, Store
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.cli import main
from ckptstore.errors import StorageError
from ckptstore.format import commit_key
from ckptstore.leases import (
    DEFAULT_TTL_S,
    PROBES,
    SAVE,
    Lease,
    LeaseInfo,
    find_leases,
    wait_for_gc,
)
from ckptstore.pipeline import fetch_chunk
from ckptstore.retention import collect
from ckptstore.store import backends
from tests.helpers.wait import wait_until

PY = sys.executable


def verify_all(uri: str) -> list[int]:
    """Every committed step's manifest, indexes and chunks are present and intact."""
    store = Store(uri)
    for step in list_steps(store):
        manifest = load_manifest(store, step)
        for rank in range(manifest.world_size):
            for digest, info in load_rank_index(store, manifest, rank).chunks.items():
                fetch_chunk(store, digest, info)
    return list_steps(store)


# -- item 2: a gc that dies with a delete in flight ----------------------------------------------

# A gc whose chunk deletes reach the storage at once and take effect LATE_S later: a process of
# its own session applies each one, so the kill of the gc does not stop it (a request in flight
# at the server). Requests end within 6 s (the gc's lease records it), the lease ttl is 1 s.
DYING_GC = textwrap.dedent(
    """
    import subprocess, sys, time
    from ckptstore import RetryPolicy, Store
    from ckptstore.retention import collect
    LATE_S = 4.0
    APPLY = (
        "import os, sys, time; time.sleep(max(0.0, float(sys.argv[2]) - time.time())); "
        "os.unlink(sys.argv[1]); open(sys.argv[3], 'w').close()"
    )
    uri, landed = sys.argv[1], sys.argv[2]
    store = Store(uri, retry=RetryPolicy(attempts=1, timeout_s=6.0, total_s=6.0))
    delete = store.backend.delete

    def delete_late(path):
        if "/chunks/" not in path:
            return delete(path)
        at = str(time.time() + LATE_S)
        subprocess.Popen([sys.executable, "-c", APPLY, path, at, landed], start_new_session=True)
        print("delete in flight", flush=True)
        time.sleep(3600)  # the answer never comes: the gc is killed first

    store.backend.delete = delete_late
    collect(store, keep_last=None, lease_ttl_s=1.0)
    """
)


@pytest.mark.slow
def test_a_save_after_a_gc_killed_with_a_delete_in_flight_waits_for_that_delete(
    tmp_path, monkeypatch
):
    # The directory stands for a network file system, whose server may apply a killed
    # client's delete later (the gc's late delete is its own process; on a disk of this
    # machine no request outlives the process that made it).
    monkeypatch.setattr(backends, "on_local_disk", lambda path: False)
    uri, landed = str(tmp_path / "store"), tmp_path / "delete-landed"
    a, b = torch.randn(50_000), torch.randn(50_000)
    ckpt = Checkpointer(uri, encoding=EncodingOptions(compression="none"))
    ckpt.save(1, {"w": a}).wait()
    ckpt.save(2, {"w": b}).wait()
    Store(uri).delete(commit_key(1))  # step 1 dropped: the gc sweeps the chunk of `a`
    gc = subprocess.Popen([PY, "-c", DYING_GC, uri, str(landed)], stdout=subprocess.PIPE, text=True)
    try:
        assert gc.stdout.readline().strip() == "delete in flight"
    finally:
        os.kill(gc.pid, signal.SIGKILL)
        gc.wait(timeout=60)
    assert not landed.exists()
    # Saving `a` again reuses its chunk only if it is still there once the save may look.
    ckpt.save(3, {"w": a}).wait()
    waited = landed.exists()  # the save waited until the dead gc's delete had landed
    assert wait_until(landed.exists, timeout_s=30)
    assert verify_all(uri) == [2, 3]
    assert waited
    target = {"w": torch.zeros(50_000)}
    assert Checkpointer(uri).load(target, step=3) == 3 and torch.equal(target["w"], a)
    ckpt.close()


# -- item 3: a writer's clock 300 s behind -------------------------------------------------------

BEHIND_WRITER = textwrap.dedent(
    """
    import os, sys, time
    real = time.time
    time.time = lambda: real() - 300.0  # this host's clock is 5 minutes behind
    import torch
    from ckptstore import Checkpointer, Store
    uri, gate = sys.argv[1], sys.argv[2]
    store = Store(uri)
    put = store.put

    def put_when_let(key, data, **kw):  # the manifest waits for the test's gc to have run
        if key.startswith("commits/"):
            print("committing", flush=True)
            end = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.02)
        return put(key, data, **kw)

    store.put = put_when_let
    with Checkpointer(uri, store=store, compression="none") as ckpt:
        ckpt.save(2, {"w": torch.arange(50_000.0)}).wait()
    print("committed", flush=True)
    """
)


def test_gc_sweeps_nothing_under_a_live_save_whose_clock_is_300s_behind(tmp_path):
    uri, gate = str(tmp_path / "store"), tmp_path / "gate"
    Checkpointer(uri, encoding=EncodingOptions(compression="none")).save(
        1, {"w": torch.arange(50_000.0)}
    ).wait()
    Store(uri).delete(commit_key(1))  # its chunk is unreferenced until step 2 commits
    writer = subprocess.Popen(
        [PY, "-c", BEHIND_WRITER, uri, str(gate)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "committing"  # it reused step 1's chunk
        report = collect(Store(uri), keep_last=None)
        gate.touch()
        assert writer.stdout.readline().strip() == "committed"
    finally:
        gate.touch()
        writer.wait(timeout=120)
    assert not report.swept and len(report.blocked_by) == 1
    assert verify_all(uri) == [2]


def put_lease(store: Store, holder: str, renewed_at: float, ttl_s: float) -> str:
    """A save lease of a writer on another host (so only its age can say it is dead)."""
    key = f"leases/save/{holder}/000000000000.json"
    doc = {"kind": "save", "holder": holder, "renewed_at": renewed_at, "ttl_s": ttl_s}
    doc |= {"host": "node-17", "pid": 1, "step": 9, "attempt": holder, "rank": 0}
    store.put(key, json.dumps(doc).encode())
    return key


def test_lease_age_is_the_stores_not_the_writers_clock(tmp_path):
    uri = str(tmp_path)
    Checkpointer(uri).save(1, {"w": torch.ones(10)}).wait()
    store = Store(uri)
    orphan = "chunks/00/00" + "0" * 30
    store.put(orphan, b"written by the save on node-17")
    behind = put_lease(store, "behind", time.time() - 300, ttl_s=60)
    report = collect(store, keep_last=5)
    assert not report.swept and report.blocked_by == [behind] and store.exists(orphan)
    # The store stamped it two minutes ago (ttl 60 s): stale, whatever renewed_at says.
    old = time.time() - 120
    os.utime(tmp_path / behind, (old, old))
    ahead = put_lease(store, "ahead", time.time() + 300, ttl_s=60)
    probe = "leases/clock/of-a-reader-that-died"  # gc removes it once older than a ttl
    store.put(probe, b"")
    for key in (ahead, probe):
        os.utime(tmp_path / key, (old, old))
    report = collect(store, keep_last=5)
    assert report.swept and report.blocked_by == []
    assert not store.exists(orphan) and store.list("leases") == []
    assert verify_all(uri) == [1]


@pytest.mark.s3
def test_on_s3_a_lease_ages_by_last_modified(s3_uri):
    store = Store(s3_uri)
    key = put_lease(store, "behind", time.time() - 300, ttl_s=1.0)
    [lease] = find_leases(store, SAVE)
    assert lease.live and lease.age_s < 2  # LastModified has whole seconds
    # It goes stale as the server's clock passes the ttl plus that second: real time under test.

    def stale() -> LeaseInfo | None:
        [lease] = find_leases(store, SAVE)
        return None if lease.live else lease

    lease = wait_until(stale, timeout_s=30, interval_s=0.25)
    assert lease is not None and lease.age_s >= 2
    assert store.list("leases") == [key]  # the reader's probes are gone


DEAD_GC = """
import os, sys
from ckptstore import Store
from ckptstore.leases import GC, Lease
lease = Lease(Store(sys.argv[1]), GC, "dead-gc", ttl_s=600).acquire()
if sys.argv[2] == "deleting":
    lease.mark_deleting()
os._exit(0)  # dies holding the lease
"""


@pytest.mark.parametrize("disk", ["network", "local"])
@pytest.mark.parametrize("phase", ["looking", "deleting"])
def test_a_dead_gc_holds_saves_back_only_if_it_had_started_deleting(
    tmp_path, phase, disk, monkeypatch, capsys, caplog
):
    """A gc killed before its first delete cannot have a delete in flight: saves go on at
    once. One killed after ``mark_deleting`` holds them back for its ``settle_s``, unless the
    store is a disk of this machine (its deletes ended with its process: a survivor of a
    killed job waited ~50 s on its local tier before)."""
    # The directory stands for a network file system or a disk of this machine.
    monkeypatch.setattr(backends, "on_local_disk", lambda path: disk == "local")
    assert Store(tmp_path).backend.requests_end_with_process is (disk == "local")
    subprocess.run([PY, "-c", DEAD_GC, str(tmp_path), phase], check=True, timeout=120)
    [lease] = find_leases(Store(tmp_path), "gc")
    assert lease.doc["deleting"] is (phase == "deleting")
    assert lease.live is (phase == "deleting" and disk == "network")
    if lease.live:
        assert 0 < lease.expires_in_s <= lease.doc["settle_s"] + 1
        # Saves waiting on it, and ls, say why a dead gc still holds the store, and how long.
        assert lease.holder_dead and "whose process is gone" in lease.describe()
        assert main(["ls", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "pending: gc settling (its process is gone; deletes it sent may still land" in out
        # Reviewer Y: a save stalled ~90 s on S3 behind a killed gc said so only at INFO
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            with pytest.raises(StorageError, match="garbage collection by .* has held"):
                wait_for_gc(Store(tmp_path), timeout_s=0.3, what="step 7")
        said = [r for r in caplog.records if "step 7 waits for garbage collection" in r.message]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert "whose process is gone" in said[0].message
        assert (
            "goes on by itself then (a restart of the job does not make it sooner)"
            in said[0].message
        )


def test_a_disk_of_this_machine_is_told_from_a_network_file_system(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:50 / /mnt/shared rw,relatime shared:20 - nfs4 server:/export rw\n"
        "41 40 8:2 / /mnt/shared/scratch rw shared:21 - xfs /dev/sdb1 rw\n"
        "42 22 8:3 / /mnt/my\\040disk rw shared:22 - xfs /dev/sdc1 rw\n"
        "43 22 0:60 / /mnt/lustre rw shared:23 - lustre 10.0.0.1@tcp:/fs rw\n"
    )

    def local(path: str) -> bool:
        return backends.on_local_disk(path, str(mountinfo))

    assert local("/")
    assert not local("/mnt/shared/ckpt")  # the nfs mount, not the root's ext4
    assert local("/mnt/shared/scratch/ckpt")  # the deepest mount holding the path
    assert local("/mnt/sharedx")  # a sibling whose name shares a prefix: the root's ext4
    assert local("/mnt/my disk/ckpt")
    assert not local("/mnt/lustre/run42")
    assert not backends.on_local_disk("/", str(tmp_path / "no-mountinfo"))


def test_a_lease_whose_put_landed_but_failed_is_not_left_holding_gc_back(tmp_path, monkeypatch):
    """Reviewer P: a lease put that wrote the object and then raised (a permanent error) left
    a lease no save held: every gc skipped its sweep while the process lived."""
    from ckptstore.errors import StorageAccessError

    store = Store(tmp_path)
    put = store.put

    def put_then_fail(key, data, **kwargs):
        put(key, data, **kwargs)
        raise StorageAccessError(f"put {store.url(key)}: denied after it landed")

    monkeypatch.setattr(store, "put", put_then_fail)
    with pytest.raises(StorageAccessError, match="denied after it landed"):
        Lease(store, SAVE, "landed", ttl_s=60).acquire()
    assert wait_until(lambda: find_leases(Store(tmp_path)) == [], timeout_s=30)


def test_a_failed_lease_put_raises_without_waiting_for_its_cleanup(tmp_path, monkeypatch):
    """A hung-network reviewer: a black-holed save took twice ``timeout_s``, the lease put
    timing out and then the delete that cleans up after it; the delete runs aside now."""
    import threading

    from ckptstore.errors import StorageTimeoutError

    store = Store(tmp_path)
    hung = threading.Event()

    def put_times_out(key, data, **kwargs):
        raise StorageTimeoutError(f"put {store.url(key)}: no answer within 5.0s")

    def delete_hangs(key, **kwargs):
        hung.wait(timeout=30)

    monkeypatch.setattr(store, "put", put_times_out)
    monkeypatch.setattr(store, "delete", delete_hangs)
    with pytest.raises(StorageTimeoutError):
        Lease(store, SAVE, "hung", ttl_s=60).acquire()  # returns while the delete still hangs
    assert not hung.is_set()
    hung.set()


def test_a_live_holders_lease_dated_ahead_of_the_store_still_holds_gc_back(tmp_path):
    """Reviewer P: on a file system whose mtimes come from the writer's clock, a writer a day
    fast dated its save lease a day ahead; that counted as crafted, so stale: gc swept under
    the live save, and a step its wait() called committed could not be loaded. A lease whose
    holder is a live process of this machine is live however it is dated."""
    store = Store(tmp_path)
    Checkpointer(tmp_path).save(1, {"w": torch.ones(10)}).wait()
    orphan = "chunks/00/00" + "0" * 30
    store.put(orphan, b"what the live save may yet reference")
    lease = Lease(store, SAVE, "fast-clock", ttl_s=60).acquire()
    ahead = time.time() + 86400
    os.utime(tmp_path / lease.key, (ahead, ahead))
    [found] = find_leases(store, SAVE)
    assert found.live
    report = collect(store, keep_last=5)
    assert not report.swept and store.exists(orphan)
    lease.release()
    assert collect(store, keep_last=5).swept and not store.exists(orphan)


@pytest.mark.parametrize("craft", ["ttl-1e12", "malformed", "dated-2100", "huge"])
def test_a_crafted_lease_blocks_no_store_for_ever(tmp_path, craft):
    """Adversary: one file under leases/ counted as a live holder for ever (a ttl of 1e12 s
    trusted as written, an unreadable object always live, a file dated in 2100, a 600 MB object
    read whole): every later save waited out gc_wait_s and failed to reach the store. Now a
    lease claiming more than MAX_LEASE_S, or unreadable, lives only as long as an unrenewed
    holder's would; one dated ahead of the store's clock by more than its lifetime is stale."""
    uri = str(tmp_path)
    Checkpointer(uri).save(1, {"w": torch.ones(10)}).wait()
    store = Store(uri)
    orphan = "chunks/00/00" + "0" * 30
    store.put(orphan, b"left by a dead writer")
    if craft == "ttl-1e12":
        key = put_lease(store, "forever", time.time(), ttl_s=1e12)
    else:
        key = "leases/save/crafted/000000000001.json"
        body = {"malformed": b"{", "huge": b" " * (1 << 20) + b"{}"}.get(craft)
        store.put(key, body or json.dumps({"kind": "save", "ttl_s": 60}).encode())
    if craft == "dated-2100":
        future = time.mktime((2100, 1, 1, 0, 0, 0, 0, 0, 0))
        os.utime(tmp_path / key, (future, future))
    else:  # young: judged live, the safe side, as any holder's lease
        assert collect(store, keep_last=5).blocked_by == [key] and store.exists(orphan)
        old = time.time() - 2 * DEFAULT_TTL_S
        os.utime(tmp_path / key, (old, old))
    report = collect(store, keep_last=5)
    assert report.swept and report.blocked_by == [] and not store.exists(orphan)


def test_a_sweep_takes_one_clock_probe_for_every_age_it_judges(monkeypatch):
    """Each clock probe is a put, a read and a delete (three requests on S3): a sweep took one
    for the put temporaries that no object store leaves and another for the gc leases."""
    uri = f"memory://one-probe-{os.getpid()}-{time.monotonic_ns()}"
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
        ckpt.save(2, {"w": torch.zeros(3)}).wait()
    probes = []
    put = Store.put

    def counted(self, key, *args, **kwargs):
        if key.startswith(PROBES):
            probes.append(key)
        return put(self, key, *args, **kwargs)

    monkeypatch.setattr(Store, "put", counted)
    report = collect(Store(uri), keep_last=1)
    assert report.swept and report.deleted_steps == [1]
    assert len(probes) == 1
