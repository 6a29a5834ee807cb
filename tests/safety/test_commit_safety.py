"""A step that ``wait()`` reported committed is still there, whatever else ran: gc beside saves,
deletes that land late, exit right after ``save()``, dead writers, ambiguous commits, full disks.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bench.faults import Faults, with_faults
from ckptstore import (
    Checkpointer,
    CheckpointError,
    EncodingOptions,
    RetentionOptions,
    RetryPolicy,
    StorageError,
    StorageOptions,
    Store,
)
from ckptstore.catalog import list_steps
from ckptstore.dcp import StoreWriter
from ckptstore.errors import CommitUnknownError, StorageFullError, StorageTimeoutError
from ckptstore.leases import GC, SAVE, Lease, find_leases
from ckptstore.retention import collect
from ckptstore.store.processes import machine_tag
from tests.helpers.integrity import chunk_files, referenced_chunks, verify_all
from tests.helpers.wait import wait_until

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


# -- gc beside a running save --------------------------------------------------------------------

GC_LOOP = textwrap.dedent(
    """
    import sys, time
    from ckptstore import Store
    from ckptstore.retention import collect
    store, end, runs = Store(sys.argv[1]), time.monotonic() + float(sys.argv[2]), 0
    while time.monotonic() < end:
        collect(store, keep_last=5)
        runs += 1
    print(runs)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["local", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)]
)
def test_gc_in_another_process_never_removes_what_a_save_uses(tmp_path, request, backend):
    """Issue item 1: `gc --keep-last 5` in a loop beside a saver. The saver alternates between
    three contents, so most saves reuse chunks of steps that gc is deleting."""
    if backend == "seaweedfs":
        request.getfixturevalue("seaweed_env")  # the gc subprocess inherits the environment
        uri = request.getfixturevalue("seaweed_uri")
    else:
        uri = str(tmp_path / "store")
    contents = [torch.randn(65536, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ckpt = Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=16 << 10, compression="none"))
    for step in range(30):  # a store with history
        ckpt.save(step, {"u": contents[step % 3]}).wait()
    gc_proc = subprocess.Popen([PY, "-c", GC_LOOP, uri, "8"], stdout=subprocess.PIPE, text=True)
    waited = []
    try:
        step = 30
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            ckpt.save(step, {"u": contents[step % 3]}).wait()
            waited.append(step)
            step += 1
    finally:
        out, _ = gc_proc.communicate(timeout=120)
    ckpt.close()
    assert gc_proc.returncode == 0 and int(out) > 0
    steps = verify_all(uri)
    assert waited and waited[-1] in steps
    target = {"u": torch.zeros(65536)}
    Checkpointer(uri).load(target, step=waited[-1])
    assert torch.equal(target["u"], contents[waited[-1] % 3])


def test_retention_in_two_processes_keeps_every_waited_step(tmp_path):
    """Two writers with keep_last on one store (different step ranges), same contents."""
    uri = str(tmp_path / "store")
    writer = textwrap.dedent(
        """
        import sys, torch, json
        from ckptstore import Checkpointer
        first, count = int(sys.argv[2]), int(sys.argv[3])
        ckpt = Checkpointer(sys.argv[1], keep_last=3, chunk_bytes=16 << 10, compression="none")
        contents = [torch.randn(65536, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        for step in range(first, first + count):
            ckpt.save(step, {"u": contents[step % 3]}).wait()
            print(step, flush=True)
        ckpt.close()
        """
    )
    procs = [
        subprocess.Popen(
            [PY, "-c", writer, uri, str(first), "25"], stdout=subprocess.PIPE, text=True
        )
        for first in (1000, 2000)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    steps = verify_all(uri)
    # Each writer's retention keeps the newest 3 of the whole store: the other writer's last
    # steps (2000s) outrank the 1000s, so only the newest steps overall must be there.
    assert steps[-3:] == sorted(int(s) for out in outs for s in out.split())[-3:]


def test_a_step_number_saved_again_while_retention_drops_it_keeps_its_index(tmp_path, monkeypatch):
    """Reviewer N: another process saved a step number that a retention had just dropped
    (two runs into one store with overlapping steps); the retention's sweep left it out of
    the kept steps by its number and deleted its rank index: wait() had returned, the step
    listed, and it could not be read (nor could any later gc sweep)."""
    import ckptstore.retention as retention

    uri = str(tmp_path / "store")
    first = Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=16 << 10))
    for step in range(3):
        first.save(step, {"w": torch.full((8192,), float(step))}).wait()
    first.close()
    again = {"w": torch.full((8192,), 500.0)}
    drop = retention.drop_step

    def drop_then_save_again(store, step, *attempt):
        drop(store, step, *attempt)
        if step == 0:  # the other run's save lands between the drop and the sweep
            with Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=16 << 10)) as second:
                second.save(0, again).wait()

    monkeypatch.setattr(retention, "drop_step", drop_then_save_again)
    report = collect(Store(uri), keep_last=2)
    assert report.deleted_steps == [0] and report.kept_steps == [0, 1, 2]
    monkeypatch.undo()
    assert verify_all(uri) == [0, 1, 2]
    state = {"w": torch.zeros(8192)}
    assert Checkpointer(uri).load(state, 0) == 0 and torch.equal(state["w"], again["w"])


def test_a_drop_by_a_retention_that_read_an_older_save_of_the_number_keeps_the_new_one(tmp_path):
    """Two retentions read step 0; the first dropped it and a writer saved 0 again; the second
    deleted the new save's commit by its number (wait() had returned)."""
    from ckptstore.catalog import load_manifest
    from ckptstore.retention import drop_step

    uri = str(tmp_path / "store")
    store = Store(uri)
    with Checkpointer(uri) as ckpt:
        ckpt.save(0, {"w": torch.zeros(8)}).wait()
    old = load_manifest(store, 0).attempt
    drop_step(store, 0, old)  # the first retention
    with Checkpointer(uri) as ckpt:
        ckpt.save(0, {"w": torch.ones(8)}).wait()
    drop_step(store, 0, old)  # the second, late: it read the first save
    assert list_steps(store) == [0] and load_manifest(store, 0).attempt != old
    drop_step(store, 0, load_manifest(store, 0).attempt)  # the save it read: dropped
    assert list_steps(store) == []


def test_a_kept_step_saved_again_before_the_sweep_keeps_its_index(tmp_path, monkeypatch):
    """Reviewer P: a gc read step 2 and kept it; before its sweep another job's retention
    dropped 2 and a third job saved 2 again (wait() returned). The sweep protected the save
    it had read, not the new one: the new index and chunks were swept, step 2 listed, unread."""
    import ckptstore.retention as retention

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in range(3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    look = retention.quarantine_objects  # called between the gc's reads and its sweep
    again = {"w": torch.full((4096,), 222.0)}

    def others_run(store):
        monkeypatch.setattr(retention, "quarantine_objects", look)
        with Checkpointer(uri, keep_last=2) as job1:  # its retention drops 0..2
            for step in (3, 4):
                job1.save(step, {"w": torch.full((4096,), float(step))}).wait()
        with Checkpointer(uri) as job2:
            job2.save(2, again).wait()
        return look(store)

    monkeypatch.setattr(retention, "quarantine_objects", others_run)
    report = collect(Store(uri), keep_last=5)
    assert report.kept_steps == [2, 3, 4]
    assert verify_all(uri) == [2, 3, 4]
    state = {"w": torch.zeros(4096)}
    assert Checkpointer(uri).load(state, 2) == 2 and torch.equal(state["w"], again["w"])


def test_remove_corrupt_leaves_a_good_save_of_the_corrupt_steps_number(tmp_path, monkeypatch):
    """Reviewer P: gc --remove-corrupt read step 5 as corrupt (a truncated chunk); meanwhile a
    job's fallback load quarantined 5 and it saved 5 again (wait() returned); the gc then
    deleted the new step 5 by its number."""
    import ckptstore.retention as retention
    from ckptstore.catalog import load_manifest, load_rank_indexes
    from ckptstore.format import chunk_key

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in range(6):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    store = Store(uri)
    (index,) = load_rank_indexes(store, load_manifest(store, 5))
    chunk = tmp_path / "store" / chunk_key(next(iter(index.chunks)))
    chunk.write_bytes(chunk.read_bytes()[:-7])
    drop = retention.drop_step
    again = {"w": torch.full((4096,), 55.0)}

    def job_first(store, step, *attempt):
        if step == 5:
            monkeypatch.setattr(retention, "drop_step", drop)
            with Checkpointer(uri) as job:
                assert job.load({"w": torch.zeros(4096)}, fallback=True) == 4  # quarantines 5
                job.save(5, again).wait()
        drop(store, step, *attempt)

    monkeypatch.setattr(retention, "drop_step", job_first)
    report = collect(store, keep_last=10, remove_corrupt=True, check_chunks=True)
    assert report.removed_corrupt == [5] and list_steps(store) == [0, 1, 2, 3, 4, 5]
    state = {"w": torch.zeros(4096)}
    assert Checkpointer(uri).load(state, 5) == 5 and torch.equal(state["w"], again["w"])


def _saver(front: str, uri: str):
    """save(step, state) through ``front`` with keep_last=2, returning once it committed."""
    if front == "checkpointer":
        ckpt = Checkpointer(uri, keep_last=2)
        return lambda step, state: ckpt.save(step, state).wait()
    writer = StoreWriter(uri, keep_last=2)
    return lambda step, state: dcp.save(
        state, storage_writer=writer, checkpoint_id=step, no_dist=True
    )


@pytest.mark.parametrize("front", ["checkpointer", "dcp"])
def test_a_step_committed_below_the_newest_keep_last_is_there_when_the_save_returns(
    tmp_path, caplog, front
):
    """A second run into the same store without resuming: its first save is numbered below
    the first run's newest keep_last steps. Retention kept them and deleted the step the save
    had just committed, with an INFO line; it is kept now, with a warning naming why."""
    uri = str(tmp_path / "store")
    first = _saver(front, uri)
    for step in (100, 101):
        first(step, {"w": torch.full((8,), float(step))})
    second = _saver(front, uri)
    with caplog.at_level("WARNING", logger="ckptstore"):
        second(5, {"w": torch.full((8,), 5.0)})
    assert list_steps(Store(uri)) == [5, 100, 101]
    assert "step 5 committed" in caplog.text and "below the newest 2 steps" in caplog.text
    second(6, {"w": torch.full((8,), 6.0)})
    assert list_steps(Store(uri)) == [6, 100, 101]  # keep_last counts by number, as documented


# -- a delete that timed out lands later ---------------------------------------------------------


@pytest.mark.slow  # 8-18 s each on 2 cores
@pytest.mark.parametrize("seed", range(6))
def test_a_delete_abandoned_at_its_deadline_cannot_remove_a_newer_commit(tmp_path, seed):
    """Issue item 2: deletes hang 2 s half of the time, attempts time out after 0.3 s. Step 1
    (A) is collected after step 2 (B); step 3 saves A again, reusing or rewriting A's chunks
    while deletes of them may still be running."""
    faults = Faults(ops=frozenset({"delete"}), hang_rate=0.5, hang_s=2.0, seed=seed)
    store = with_faults(Store(tmp_path, retry=RetryPolicy(attempts=8, timeout_s=0.3)), faults)
    ckpt = Checkpointer(
        tmp_path,
        storage=StorageOptions(store=store),
        keep_last=1,
        encoding=EncodingOptions(compression="none"),
    )
    a, b = torch.randn(50_000), torch.randn(50_000)
    ckpt.save(1, {"w": a}).wait()
    ckpt.save(2, {"w": b}).wait()
    ckpt.save(3, {"w": a}).wait()
    ckpt.close()  # its retention after step 3 has run
    assert store.settle(30.0)  # every delete abandoned at its deadline has ended
    assert verify_all(str(tmp_path)) == [3]
    target = {"w": torch.zeros(50_000)}
    assert Checkpointer(tmp_path).load(target) == 3 and torch.equal(target["w"], a)


def test_settle_waits_for_an_abandoned_delete(tmp_path):
    faults = Faults(ops=frozenset({"delete"}), hang_rate=1.0, hang_s=1.0)
    store = with_faults(Store(tmp_path, retry=RetryPolicy(attempts=1, timeout_s=0.1)), faults)
    plain = Store(tmp_path)  # the other requests are not under test: no 0.1 s deadline on them
    plain.put("x", b"1")
    with pytest.raises(StorageError):
        store.delete("x")
    assert plain.exists("x")  # the abandoned delete has not landed yet
    assert store.settle(10.0)
    assert not plain.exists("x")


# -- exit right after save() ---------------------------------------------------------------------


@pytest.mark.s3
def test_a_save_at_interpreter_exit_is_committed_on_s3(s3_uri):
    """Issue item 3: the script's last act is save(); nothing waits for it."""
    code = (
        "import torch; from ckptstore import Checkpointer; "
        f"Checkpointer({s3_uri!r}).save(7, {{'w': torch.arange(16.)}})"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cannot schedule" not in proc.stderr
    target = {"w": torch.zeros(16)}
    assert Checkpointer(s3_uri).load(target) == 7 and torch.equal(target["w"], torch.arange(16.0))


# -- dead writers --------------------------------------------------------------------------------

SLOW_WRITER = textwrap.dedent(
    """
    import sys, torch
    from ckptstore import Checkpointer, Store
    from bench.faults import Faults, Fixed, with_faults
    store = with_faults(Store(sys.argv[1]), Faults(ops=frozenset({"put"}), latency=Fixed(0.05)))
    ckpt = Checkpointer(sys.argv[1], store=store, chunk_bytes=4096, compression="none",
                        lease_ttl_s=2.0)
    ckpt.save(int(sys.argv[2]), {"w": torch.randn(200_000)})
    print("staged", flush=True)
    ckpt.wait()
    """
)


@pytest.mark.parametrize("reaped", [True, False])
def test_a_killed_writer_is_seen_dead_and_swept(tmp_path, capsys, reaped):
    """Issue item 7: a kill -9 mid-save leaves a lease. On the same machine its dead pid shows
    at once: `ls` reports it stale and gc sweeps what the dead save wrote. Not reaped yet by
    its parent (a zombie, which ``kill(pid, 0)`` still finds): dead too (stop 82's operator:
    it was a "save in flight", the sweep skipped, until the lease's ttl)."""
    from ckptstore.cli import main

    uri = str(tmp_path)
    Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=4096)).save(
        1, {"w": torch.ones(1000)}
    ).wait()
    proc = subprocess.Popen([PY, "-c", SLOW_WRITER, uri, "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "staged"
        deadline = time.monotonic() + 60
        while len(chunk_files(tmp_path)) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)  # let it write some chunks
        os.kill(proc.pid, signal.SIGKILL)
        if reaped:
            proc.wait(timeout=60)
        else:
            deadline = time.monotonic() + 60  # every thread ended, the process not reaped
            while b") Z" not in Path(f"/proc/{proc.pid}/stat").read_bytes() or (
                len(os.listdir(f"/proc/{proc.pid}/task")) > 1
            ):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert main(["ls", uri, "--json"]) == 0
        pending = json.loads(capsys.readouterr().out)["pending"]
        assert [(p["step"], p["stale"]) for p in pending] == [(2, True)]
        assert main(["ls", uri]) == 0
        assert "stale (dead writer" in capsys.readouterr().out
        report = collect(Store(uri), keep_last=5)
        assert report.swept and report.deleted_chunks > 0
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert chunk_files(tmp_path) == referenced_chunks(uri)
    assert find_leases(Store(uri)) == [] and verify_all(uri) == [1]


def test_a_process_whose_main_thread_alone_exited_is_alive_until_it_is_killed():
    """The fix adversary of stop 82: a process whose main thread has exited while its other
    threads run shows as a zombie (``Z``) in ``/proc/<pid>/stat``; taken for dead, its lease
    could be taken over. It is alive; killed and not yet reaped, it is gone."""
    from ckptstore.store.processes import pid_gone

    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(120,)).start()\n"
        "print('up', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 60
        while b") Z" not in Path(f"/proc/{proc.pid}/stat").read_bytes():  # its leader exited
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not pid_gone(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        while len(os.listdir(f"/proc/{proc.pid}/task")) > 1:  # every thread ended, unreaped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert pid_gone(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_a_writer_on_another_host_is_dead_once_its_lease_expires(tmp_path, capsys):
    """A lease from another machine can only expire: in flight until its ttl has passed without
    a renewal, then stale, and gc sweeps."""
    from ckptstore.cli import main

    uri = str(tmp_path)
    Checkpointer(uri).save(1, {"w": torch.ones(10)}).wait()
    store = Store(uri)
    doc = {
        "kind": "save",
        "renewed_at": time.time(),
        "ttl_s": 2.0,
        "host": "node-17",
        "pid": 1,
        "step": 2,
        "attempt": "a",
        "rank": 3,
    }
    lease = "leases/save/x/000000000000.json"
    store.put(lease, json.dumps(doc).encode())
    store.put("chunks/00/00" + "0" * 30, b"written by the save on node-17")
    assert main(["ls", uri]) == 0
    assert "step 2 rank 3 attempt a: save in flight" in capsys.readouterr().out
    assert collect(store, keep_last=5).swept is False
    # node-17 renews no more: a minute later by the store's clock (which alone ages leases),
    # the store's stamp on the lease is a minute old.
    stamped = time.time() - 60
    os.utime(tmp_path / lease, (stamped, stamped))
    assert main(["ls", uri]) == 0
    assert "stale (dead writer" in capsys.readouterr().out
    assert collect(store, keep_last=5).swept
    assert chunk_files(tmp_path) == referenced_chunks(uri) and find_leases(store) == []


def test_a_save_waits_while_gc_holds_the_store(tmp_path):
    store = Store(tmp_path)
    gc_lease = Lease(store, GC, "other-gc", ttl_s=30).acquire()
    ckpt = Checkpointer(tmp_path, retention=RetentionOptions(gc_wait_s=0.5))
    with pytest.raises(StorageError, match="garbage collection .* has held"):
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    gc_lease.release()
    ckpt.save(3, {"w": torch.ones(3)}).wait()  # the error was raised once, by wait()
    assert ckpt.steps() == [3]
    ckpt.close()


def test_gc_does_not_sweep_under_a_live_save_lease(tmp_path):
    uri = str(tmp_path)
    ckpt = Checkpointer(uri, keep_last=1)
    ckpt.save(1, {"w": torch.randn(1000)}).wait()
    ckpt.save(2, {"w": torch.randn(1000)}).wait()
    store = Store(uri)
    lease = Lease(store, SAVE, "someone", ttl_s=30, info={"attempt": "x"}).acquire()
    orphan = store.list("chunks")
    store.put("chunks/00/00" + "0" * 30, b"orphan of a save in flight")
    report = collect(store, keep_last=1)
    assert not report.swept and report.blocked_by == [lease.key]
    assert set(orphan) < set(store.list("chunks"))
    lease.release()
    assert collect(store, keep_last=1).swept
    assert set(store.list("chunks")) == {f"chunks/{d[:2]}/{d}" for d in referenced_chunks(uri)}
    ckpt.close()


def test_a_save_whose_lease_lapsed_is_not_committed(tmp_path):
    """If the lease could not be renewed for ttl/2 (the store unreachable for its renewals),
    gc elsewhere may think the writer dead and sweep: the save must not commit."""
    from bench.faults import Fixed

    store = with_faults(Store(tmp_path), Faults(ops=frozenset({"put"}), latency=Fixed(0.05)))
    ckpt = Checkpointer(
        tmp_path,
        storage=StorageOptions(store=store),
        retention=RetentionOptions(lease_ttl_s=0.4),
        encoding=EncodingOptions(chunk_bytes=4096),
    )
    original = store.put

    def put(key, data, **kw):  # every renewal of a lease fails
        if key.startswith("leases/") and not key.endswith("000000000000.json"):
            raise StorageError(f"put {key}: unreachable")
        return original(key, data, **kw)

    store.put = put
    handle = ckpt.save(1, {"w": torch.randn(50 * 1024)})  # 50 chunks x 50 ms
    with pytest.raises(StorageError, match="not renewed"):
        handle.wait()
    ckpt.close()  # reported once, by wait()
    assert list_steps(store) == []


# -- ambiguous commits ---------------------------------------------------------------------------


def test_wait_tells_the_truth_about_each_commit_under_errors(tmp_path):
    """Issue item 10: with 70% of requests failing, wait() raising means the step is not
    committed (or says the outcome is unknown); wait() returning means it is."""
    faults = Faults(error_rate=0.7, seed=11)
    store = with_faults(Store(tmp_path, retry=RetryPolicy(attempts=3, base_delay_s=0.001)), faults)
    ckpt = Checkpointer(
        tmp_path,
        storage=StorageOptions(store=store),
        encoding=EncodingOptions(compression="none"),
        retention=RetentionOptions(lease_ttl_s=600),
    )
    outcomes = {}
    for step in range(40):
        try:
            ckpt.save(step, {"w": torch.full((100,), float(step))}).wait()
            outcomes[step] = "ok"
        except CommitUnknownError:
            outcomes[step] = "unknown"
        except CheckpointError:
            outcomes[step] = "failed"
            ckpt.wait()  # the error was reported once, by the handle's wait()
    faults.error_rate = 0.0
    committed = set(list_steps(store))
    assert {s for s, o in outcomes.items() if o == "ok"} <= committed
    assert not {s for s, o in outcomes.items() if o == "failed"} & committed
    assert "ok" in outcomes.values() and "failed" in outcomes.values()
    ckpt.close()


# -- full disks ----------------------------------------------------------------------------------


def test_a_full_disk_leaves_no_temporaries_and_the_next_save_says_what_failed(small_disk):
    """Issue item 11."""
    uri = str(small_disk / "store")
    ckpt = Checkpointer(uri, encoding=EncodingOptions(compression="none", chunk_bytes=256 << 10))
    ckpt.save(1, {"w": torch.randn(1000)}).wait()
    handle = ckpt.save(2, {"w": torch.randn(2 << 20)})  # 8 MiB on a 4 MiB disk
    with pytest.raises(StorageError, match="no space left"):
        handle.wait(timeout_s=120)
    assert not [p for p in small_disk.rglob("*") if ".tmp-" in p.name]
    report = collect(Store(uri), keep_last=1)
    assert report.swept
    assert chunk_files(small_disk / "store") == referenced_chunks(uri)
    ckpt.save(4, {"w": torch.randn(1000)}).wait()  # the disk has room again
    assert list_steps(Store(uri)) == [1, 4]
    ckpt.close()


def test_wait_names_the_step_a_full_disk_failed(small_disk):
    """Left alone by stop 86: ``Checkpointer.wait()`` raised the bare store error, naming an
    object ("put .../chunks/0b/0b73...: no space left on device") but not the step lost."""
    encoding = EncodingOptions(compression="none", chunk_bytes=256 << 10)
    with Checkpointer(str(small_disk / "store"), encoding=encoding) as ckpt:
        ckpt.save(2, {"w": torch.randn(2 << 20)})  # 8 MiB on a 4 MiB disk
        with pytest.raises(StorageFullError, match=r"^The save of step 2 failed: put .* no space"):
            ckpt.wait()


def test_a_save_failing_on_a_full_store_sweeps_what_failed_saves_left(small_disk, caplog):
    """A full-disk reviewer: another process filled the disk while saves ran; each failed
    save left its chunks, and once that space was freed the store stayed full of them, every
    later save failing, until someone ran ``ckptstore gc``. A save that fails on a full store
    now sweeps them (keep_last set: a job that deletes)."""
    uri = str(small_disk / "store")
    encoding = EncodingOptions(compression="none", chunk_bytes=256 << 10)
    caplog.set_level("WARNING", logger="ckptstore")
    with Checkpointer(uri, keep_last=1, encoding=encoding) as ckpt:
        ckpt.save(1, {"w": torch.randn(1 << 17)}).wait()  # 0.5 MiB
        filler = small_disk / "filler"
        filler.write_bytes(b"\0" * (1 << 20))  # another process's 1 MiB
        for step in (2, 3):  # 3 MiB each: both fail, filling the disk
            with pytest.raises(StorageError, match="no space left"):
                ckpt.save(step, {"w": torch.randn(3 << 18)}).wait(timeout_s=120)
        filler.unlink()  # the other process is done: 1 MiB free, and what failed saves left
        ckpt.save(4, {"w": torch.randn(1 << 19)}).wait(timeout_s=120)  # 2 MiB
    assert "chunk(s) of failed saves" in caplog.text
    assert list_steps(Store(uri)) == [4]
    assert chunk_files(small_disk / "store") == referenced_chunks(uri)


class _Quota:
    """A local backend whose chunk puts fail "disk quota exceeded" after ``room`` of them."""

    def __init__(self, inner, room: int) -> None:
        self._inner, self.room = inner, room

    def put_once(self, path: str, data) -> None:
        if "/chunks/" in f"/{path}":
            if self.room <= 0:
                raise OSError(errno.EDQUOT, "Disk quota exceeded", path)
            self.room -= 1
        return self._inner.put_once(path, data)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_a_save_over_its_quota_is_a_full_store_and_sweeps_what_it_left(tmp_path, caplog):
    """Adversary of stop 75: a save failing "disk quota exceeded" (EDQUOT) was a plain
    storage error, so the chunks it had written stayed until a manual gc. It is a full store,
    named so, and a job with ``keep_last`` sweeps them as for a full disk."""
    uri = str(tmp_path / "store")
    encoding = EncodingOptions(compression="none", chunk_bytes=64 << 10)
    caplog.set_level("WARNING", logger="ckptstore")
    store = Store(uri, retry=RetryPolicy(attempts=1))
    quota = _Quota(store.backend, room=4)
    store.backend = quota
    with Checkpointer(
        uri, keep_last=1, encoding=encoding, storage=StorageOptions(store=store)
    ) as ckpt:
        ckpt.save(1, {"w": torch.randn(1 << 15)}).wait()  # 2 chunks
        with pytest.raises(StorageFullError, match="disk quota exceeded"):
            ckpt.save(2, {"w": torch.randn(1 << 17)}).wait(timeout_s=120)  # 8 chunks, 2 land
        assert "chunk(s) of failed saves" in caplog.text
        assert chunk_files(tmp_path / "store") == referenced_chunks(uri)
        quota.room = 100
        ckpt.save(3, {"w": torch.randn(1 << 15)}).wait()
    assert list_steps(Store(uri)) == [3]


def test_a_dcp_save_failing_on_a_full_store_sweeps_what_failed_saves_left(small_disk, caplog):
    """The same through DCP (left undone in stop 74): a ``StoreWriter`` with ``keep_last``
    whose save fails on a full store sweeps the chunks failed saves left, so the next save
    finds room once what filled the store is gone."""
    from torch.distributed.checkpoint.api import CheckpointException

    uri = str(small_disk / "store")
    writer = StoreWriter(
        uri, keep_last=1, encoding=EncodingOptions(compression="none", chunk_bytes=256 << 10)
    )
    caplog.set_level("WARNING", logger="ckptstore")
    dcp.save({"w": torch.randn(1 << 17)}, storage_writer=writer)  # 0.5 MiB
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (1 << 20))  # another process's 1 MiB
    for _ in range(2):  # 3 MiB each: both fail, filling the disk
        with pytest.raises(CheckpointException, match="no space left"):
            dcp.save({"w": torch.randn(3 << 18)}, storage_writer=writer)
    filler.unlink()  # the other process is done: 1 MiB free, and what failed saves left
    dcp.save({"w": torch.randn(1 << 19)}, storage_writer=writer)  # 2 MiB
    assert "chunk(s) of failed saves" in caplog.text
    assert len(list_steps(Store(uri))) == 1
    assert chunk_files(small_disk / "store") == referenced_chunks(uri)
    verify_all(uri)


def test_gc_removes_temporaries_of_dead_writers(tmp_path):
    store = Store(tmp_path)
    Checkpointer(tmp_path).save(1, {"w": torch.ones(10)}).wait()
    (tmp_path / "chunks" / "ab").mkdir(parents=True, exist_ok=True)
    old = tmp_path / "chunks" / "ab" / f"abcd.tmp-{'0' * 32}"
    fresh = tmp_path / "chunks" / "ab" / f"abce.tmp-{'4' * 32}"
    mine = tmp_path / "notes.tmp-1"  # a user's file of another shape: not a put's
    for path in (old, fresh, mine):
        path.write_bytes(b"x" * 100)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(mine, (time.time() - 3600, time.time() - 3600))
    # Reviewer of stop 60: a writer killed mid-put on this machine left temporaries the next
    # gc kept for lease_ttl_s (2 min), 8-29 MiB each; its pid in their names tells it is gone.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    dead = tmp_path / "chunks" / "ab" / f"abcf.tmp-{machine_tag()}-{gone}-{'5' * 32}"
    live = tmp_path / "chunks" / "ab" / f"abd0.tmp-{machine_tag()}-{os.getpid()}-{'6' * 32}"
    elsewhere = tmp_path / "chunks" / "ab" / f"abd1.tmp-{'f' * 8}-{gone}-{'7' * 32}"
    for path in (dead, live, elsewhere):
        path.write_bytes(b"x" * 100)
    collect(store, keep_last=1)
    assert not old.exists() and fresh.exists()  # fresh: a live writer's put in progress
    assert mine.exists()
    assert not dead.exists() and live.exists()
    assert elsewhere.exists()  # another machine's writer: judged by age only


def test_gc_ages_temporaries_by_the_stores_clock_not_its_hosts(tmp_path, monkeypatch):
    """Reviewer P: gc judged another writer's put temporary by its own host's clock; a gc host
    a day ahead of the file server deleted a live save's temporary (its lease put then failed
    with ObjectNotFoundError)."""
    store = Store(tmp_path)
    Checkpointer(tmp_path).save(1, {"w": torch.ones(10)}).wait()
    (tmp_path / "chunks" / "ab").mkdir(parents=True, exist_ok=True)
    writing = tmp_path / "chunks" / "ab" / f"abd1.tmp-{'f' * 8}-4242-{'7' * 32}"
    writing.write_bytes(b"x" * 100)  # another machine's writer, mid-put
    ahead = time.time() + 86400
    monkeypatch.setattr(time, "time", lambda: ahead)
    collect(store, keep_last=1)
    assert writing.exists()


def test_gc_deletes_only_keys_of_the_format_s_own_shapes(tmp_path):
    """A store directory may hold files ckptstore never wrote (a mistyped path, notes beside
    the steps): gc sweeps chunks, indexes and metadata by their shapes, never a stranger's."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(10)}).wait()
        ckpt.save(2, {"w": torch.zeros(10)}).wait()
    strangers = [
        tmp_path / "chunks" / "notes.txt",
        tmp_path / "chunks" / "ab" / "not-a-digest",
        tmp_path / "steps" / "README",
        tmp_path / "steps" / "run7" / "x" / "y.json",
        tmp_path / "indexes" / "zz" / f"{1:020d}" / "a1" / "rank-00000.json",
    ]
    for path in strangers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("mine")
    report = collect(Store(tmp_path), keep_last=1)
    assert report.deleted_chunks == 1 and report.deleted_steps == [1]
    assert all(path.read_text() == "mine" for path in strangers)


# -- found in review: lease reads racing renewals, lapses, lost answers, stale caches ------------


def test_a_lease_read_while_its_holder_renews_it_is_still_live(tmp_path):
    store = Store(tmp_path)
    lease = Lease(store, SAVE, "holder", ttl_s=60).acquire()
    reader = Store(tmp_path)
    get = reader.get
    renewed = []

    def get_after_a_renewal(key, *args, **kwargs):  # listed seq N; the holder writes N+1 now
        if key.startswith("leases/") and not renewed:
            renewed.append(key)
            lease.renew()
        return get(key, *args, **kwargs)

    reader.get = get_after_a_renewal
    [found] = find_leases(reader, SAVE)
    assert renewed and found.live and found.key != renewed[0]
    lease.release()


def test_a_lease_that_lapsed_stays_lost_after_renewals_recover(tmp_path):
    store = Store(tmp_path)
    lease = Lease(store, SAVE, "holder", ttl_s=0.1).acquire()
    lease._stop.set()  # no background renewals: this test renews by hand
    # The lapse under test is one of the holder's own clock: just over ttl/2 without a
    # renewal (gc elsewhere may have swept meanwhile).
    time.sleep(0.06)
    lease._stop.clear()
    lease.renew()
    with pytest.raises(StorageError, match="went unrenewed"):
        lease.check()
    lease.release()


def test_a_renewal_whose_answer_was_lost_moves_on(tmp_path):
    """An abandoned renewal put that landed makes the retry find the object: the lease must
    advance past it, not retry the same sequence for ever."""
    store = Store(tmp_path)
    lease = Lease(store, SAVE, "holder", ttl_s=60).acquire()
    lease._stop.set()
    store.put("leases/save/holder/000000000001.json", lease._body())  # the late landing
    lease._stop.clear()
    lease.renew()
    lease.renew()
    assert lease.key.endswith("000000000002.json") and store.exists(lease.key)
    lease.check()
    lease.release()


@pytest.mark.s3
def test_a_chunk_deleted_by_another_process_is_not_taken_as_stored(s3_uri):
    """s3fs answers size() from its listing cache: a chunk gc deleted elsewhere must be
    written again, not referenced."""
    a, b = torch.randn(4096), torch.randn(4096)
    ckpt = Checkpointer(s3_uri, encoding=EncodingOptions(compression="none"))
    ckpt.save(0, {"w": a}).wait()
    ckpt.save(1, {"w": b}).wait()
    ckpt.store.list("chunks")  # fills the listing cache with step 0's chunk
    gc = subprocess.run(
        [PY, "-m", "ckptstore.cli", "gc", s3_uri, "--keep-last", "1", "--grace-s", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gc.returncode == 0 and "deleted 1 unreferenced chunk" in gc.stdout, gc.stdout + gc.stderr
    ckpt.save(2, {"w": a}).wait()
    ckpt.verify(2)
    ckpt.close()


def _answers_lost(store: Store, part: str) -> list[str]:
    """``store``'s puts of keys holding ``part`` are written, then answered with a reset once
    each (a 500 or a dropped connection after S3 wrote the object); the keys so treated."""
    put_once, lost = store.backend.put_once, []

    def put_then_reset(path, data):
        put_once(path, data)
        if part in path and path not in lost:
            lost.append(path)
            raise ConnectionResetError(f"answer to {path} lost")

    store.backend.put_once = put_then_reset
    return lost


@pytest.mark.parametrize("part", ["leases/save/", "indexes/", "commits/", "chunks/"])
def test_a_save_whose_put_landed_but_lost_its_answer_commits(tmp_path, part):
    """The retry finds the object its first attempt wrote (the same bytes): done, not a
    write-once conflict (a save lease or an index failed the save so, its lease left behind)."""
    ckpt = Checkpointer(tmp_path / "s")
    lost = _answers_lost(ckpt.store, part)
    ckpt.save(1, {"w": torch.arange(1000.0)}).wait()
    assert lost and ckpt.steps() == [1]
    state = {"w": torch.zeros(1000)}
    ckpt.load(state)
    assert torch.equal(state["w"], torch.arange(1000.0))
    ckpt.close()
    assert find_leases(Store(tmp_path / "s"), SAVE) == []


def test_gc_whose_lease_put_lost_its_answer_runs(tmp_path):
    with Checkpointer(tmp_path / "s") as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.arange(1000.0) + step}).wait()
    store = Store(tmp_path / "s")
    lost = _answers_lost(store, "leases/gc/")
    report = collect(store, keep_last=1)
    assert lost and report.deleted_steps == [1] and report.swept and list_steps(store) == [2]
    assert find_leases(store, GC) == []


def test_a_gc_lease_is_not_held_by_a_save_put_stuck_on_a_hung_connection(tmp_path):
    """A put abandoned at its deadline that never ends (a connection the server stopped
    answering) cannot undo a sweep: the gc lease is released; a save lease, which guards a
    manifest put that may still land, is kept until it ends."""
    store = Store(tmp_path / "s", retry=RetryPolicy(timeout_s=0.2, total_s=0.5, attempts=1))
    put_once, unstuck = store.backend.put_once, threading.Event()

    def hung(path, data):
        if "chunks/" in path:
            unstuck.wait(60)
        put_once(path, data)

    store.backend.put_once = hung
    with pytest.raises(StorageTimeoutError):
        store.put("chunks/ab/stuck", b"x")
    gc = Lease(store, GC, "gc-holder", ttl_s=60).acquire()
    save = Lease(store, SAVE, "save-holder", ttl_s=60).acquire()
    gc.release_when_settled(0.0)
    save.release_when_settled(0.0)
    assert not store.exists(gc.key) and store.exists(save.key)
    unstuck.set()
    wait_until(lambda: not store.exists(save.key), timeout_s=30)


def test_gc_refuses_to_judge_steps_by_a_listing_that_misses_chunks_the_store_holds(
    tmp_path, monkeypatch
):
    """Reviewer of stop 60: a store opened as ``s3:///b/run`` listed its keys with the bucket in
    front, so gc's listing of chunks/ found none of them, every step was "missing" chunks and
    ``gc --remove-corrupt`` deleted every good step. A chunk the listing lacks is asked for by
    its key first: there, it is the listing that is wrong, and gc stops, deleting nothing."""
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((1000,), float(step))}).wait()
    real = Store.list_sizes

    def blind(self, prefix, *args, **kwargs):
        return {} if prefix == "chunks" else real(self, prefix, *args, **kwargs)

    monkeypatch.setattr(Store, "list_sizes", blind)
    with pytest.raises(StorageError, match="the store's listing does not match its keys"):
        collect(Store(tmp_path), keep_last=None, check_chunks=True, remove_corrupt=True)
    monkeypatch.undo()
    assert list_steps(Store(tmp_path)) == [1, 2]
    chunk = next((tmp_path / "chunks").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    chunk.unlink()  # truly missing: the step that referenced it is corrupt, as before
    report = collect(Store(tmp_path), keep_last=None, check_chunks=True)
    assert len(report.unreadable_steps) >= 1


def test_a_commit_beaten_by_another_writer_whose_step_was_retained_away_is_step_exists(tmp_path):
    """Reviewer P's three writers on one store: a save whose commit found the step committed
    by another writer, then gone when read back (that writer's keep_last removed it), failed
    as a StorageError 'not committed: ... already exists', not the StepExistsError a writer
    of overlapping steps catches."""
    from ckptstore.catalog import commit_manifest
    from ckptstore.errors import StepExistsError
    from ckptstore.retention import drop_step

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as other:
        other.save(7, {"w": torch.zeros(8)}).wait()
    store = Store(uri)
    ours = b"{}"  # never written: the step is taken
    settle = store.settle

    def retention_in_between(timeout_s):
        drop_step(store, 7)  # the other writer's keep_last, between our put and its read-back
        return settle(timeout_s)

    store.settle = retention_in_between
    with pytest.raises(StepExistsError, match="committed first by another writer"):
        commit_manifest(store, 7, ours)
    assert list_steps(store) == []


def test_a_full_disk_at_the_commit_is_a_storage_full_error(tmp_path):
    """A chaos reviewer: a disk that filled at a chunk's write was ``StorageFullError``, at the
    manifest's write a plain ``StorageError`` ("step 13 not committed: ... no space left"),
    which a handler of full disks missed."""
    from ckptstore.catalog import commit_manifest
    from ckptstore.errors import StorageFullError

    store = Store(str(tmp_path / "store"))

    def full(key, data):
        raise StorageFullError(f"put {store.url(key)}: no space left on device")

    store.put = full
    with pytest.raises(StorageFullError, match="step 13 not committed: .*no space left"):
        commit_manifest(store, 13, b"{}")
    assert list_steps(store) == []


def test_gc_counts_only_the_chunks_it_deleted(tmp_path):
    """A chaos reviewer: a gc beside another one said 'deleted 18 unreferenced chunk(s) (0 B)':
    it counted the chunks the other gc had deleted first."""
    uri = str(tmp_path / "store")
    with Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=4096, compression="none")) as c:
        for step in (1, 2):  # 4 distinct chunks each
            c.save(step, {"w": torch.arange(4096, dtype=torch.float32) + 4096 * step}).wait()
    store = Store(uri)
    size = store.size
    gone: list[str] = []

    def another_gc_first(key):
        if not gone:  # the other gc deletes the first chunk this one would
            gone.append(key)
            store.delete(key)
        return size(key)

    store.size = another_gc_first
    report = collect(store, keep_last=1)
    assert report.deleted_steps == [1] and len(gone) == 1
    sizes = [size(k) for k in store.list("chunks")]  # step 2's, kept
    assert report.deleted_chunks == 3 and report.deleted_chunk_bytes == sum(sizes[:3])


@pytest.mark.parametrize("stop", ["a delete raises", "the wait is interrupted"])
def test_a_sweep_stopped_mid_way_ends_its_running_deletes_before_its_lease_goes(tmp_path, stop):
    """Durability adversary of stop 79: a gc stopped mid-sweep (SIGTERM raises SystemExit in
    it) released its lease while the deletes already running went on: a save starting then
    could find a chunk stored that one of them deleted a moment later. The lease goes only
    once they have ended, the one whose answer the sweep was waiting for included (the fix's
    adversary: Store.map took it off its list before the wait)."""
    uri = str(tmp_path / "store")
    with Checkpointer(uri, encoding=EncodingOptions(chunk_bytes=4096, compression="none")) as c:
        for step in (1, 2):  # 4 distinct chunks each
            c.save(step, {"w": torch.arange(4096, dtype=torch.float32) + 4096 * step}).wait()
    store = Store(uri)
    delete, release = store.delete, Lease.release
    events: list[str] = []
    running, go = threading.Event(), threading.Event()

    def slow_or_stopped(key):
        if not key.startswith("chunks/"):
            return delete(key)
        if not running.is_set():  # the first chunk's delete runs on while the sweep stops
            running.set()
            assert go.wait(60)
            delete(key)
            events.append("delete ended")
            return None
        if stop == "the wait is interrupted":
            return delete(key)  # the others end: only the oldest runs when the signal comes
        assert running.wait(60)
        threading.Timer(0.3, go.set).start()
        raise SystemExit("SIGTERM")

    def noted_release(self):
        if self.kind == GC:
            events.append("gc lease released")
        release(self)

    def sigterm(*_):
        threading.Timer(0.3, go.set).start()
        raise SystemExit("SIGTERM")

    store.delete = slow_or_stopped
    Lease.release = noted_release
    previous = signal.signal(signal.SIGALRM, sigterm)
    if stop == "the wait is interrupted":  # in the main thread, waiting for the oldest delete
        signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(SystemExit):
            collect(store, keep_last=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        Lease.release = release
        go.set()
    assert events == ["delete ended", "gc lease released"], events


def test_a_saves_retention_on_a_listing_that_lags_deletes_nothing(tmp_path, monkeypatch, caplog):
    """A listing adversary of stop 80 (HIGH): commits/ and indexes/ listed empty for a while
    (a store whose listings lag its writes), a save's keep_last=2 retention took every older
    step's chunks for unreferenced and deleted them, the kept step 3's too: its manifest
    stayed, listed healthy, and it never loaded. The listing lacks the step this job
    committed a save ago: retention says so and deletes nothing (the next save's retries;
    checking the step just committed instead, the fix's adversary showed, made retention never
    run beside a listing that lags by less than a save's interval)."""
    uri = str(tmp_path / "s")
    with Checkpointer(uri, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
        before = chunk_files(tmp_path / "s")
        real = Store.list

        def lagging(self, prefix="", *args, **kwargs):
            return [] if prefix in ("commits", "indexes") else real(self, prefix, *args, **kwargs)

        monkeypatch.setattr(Store, "list", lagging)
        with caplog.at_level("WARNING", logger="ckptstore"):
            ckpt.save(4, {"w": torch.full((4096,), 4.0)}).wait()
        monkeypatch.undo()
        said = [r.getMessage() for r in caplog.records if "retention in" in r.getMessage()]
        assert len(said) == 1 and "lacks step 3, committed a save ago" in said[0], said
        assert before <= chunk_files(tmp_path / "s")
        assert list_steps(Store(uri)) == [2, 3, 4]
        ckpt.save(5, {"w": torch.full((4096,), 5.0)}).wait()  # the listing caught up
    assert list_steps(Store(uri)) == [4, 5] and verify_all(uri) == [4, 5]


def test_gc_asks_for_each_steps_missing_chunk_before_calling_a_step_corrupt(tmp_path, monkeypatch):
    """A listing adversary of stop 80 (HIGH): step 1 had really lost its chunk, and the
    listing of chunks/ also left out step 3's (there when read by its key); gc asked for the
    first chunk missing only, found it gone, believed the rest, and ``--remove-corrupt``
    deleted the intact newest step. Each step's first chunk the listing lacks is asked for
    (64 at most: every missing chunk, the fix's adversary showed, cost a request per chunk of
    a store that lost thousands, on every gc)."""
    from ckptstore.format import chunk_key
    from ckptstore.steps import StepView

    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    store = Store(uri)
    (lost,) = StepView.open(store, 1).indexes()[0].chunks
    (hidden,) = StepView.open(store, 3).indexes()[0].chunks
    os.unlink(tmp_path / "s" / chunk_key(lost))
    real = Store.list_sizes

    def hiding(self, prefix="", *args, **kwargs):
        found = real(self, prefix, *args, **kwargs)
        return {k: v for k, v in found.items() if k != chunk_key(hidden)}

    monkeypatch.setattr(Store, "list_sizes", hiding)
    with pytest.raises(StorageError, match="lacks chunks/.*which is there when read by its key"):
        collect(Store(uri), keep_last=None, check_chunks=True, remove_corrupt=True)
    monkeypatch.undo()
    assert list_steps(store) == [1, 2, 3]
    report = collect(Store(uri), keep_last=None, check_chunks=True, remove_corrupt=True)
    assert report.removed_corrupt == [1] and list_steps(store) == [2, 3]


def test_a_listing_that_lags_by_less_than_a_save_lets_retention_run(tmp_path, monkeypatch):
    """The fix's adversary (HIGH): a retention that required the step just committed to be
    listed never ran beside a listing lagging by a second, saves 1.5 s apart: every save
    warned, none deleted, and the store grew until full. The step a save before must be."""
    real = Store.list

    def lagging(self, prefix="", *args, **kwargs):
        keys = real(self, prefix, *args, **kwargs)
        return keys[:-1] if prefix == "commits" else keys  # the newest commit not listed yet

    monkeypatch.setattr(Store, "list", lagging)
    uri = str(tmp_path / "s")
    with Checkpointer(uri, keep_last=2) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    monkeypatch.undo()
    assert list_steps(Store(uri)) == [5, 6] and verify_all(uri) == [5, 6]
