"""Soak: saves with retention, a gc loop, kill -9 of the writer and injected faults, together for a
bounded time; then every committed step verifies, the newest steps whose ``wait()`` returned are
there, and once the dead writers' leases expire one gc leaves exactly the referenced chunks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ckptstore import Store
from ckptstore.leases import find_leases
from ckptstore.retention import collect
from tests.helpers.integrity import chunk_files, referenced_chunks, verify_all
from tests.helpers.wait import wait_until

KEEP = 4
TTL_S = 2.0

WRITER = textwrap.dedent(
    f"""
    import sys, torch
    from ckptstore import (
        Checkpointer, CheckpointError, EncodingOptions, RetentionOptions, RetryPolicy,
        StorageOptions, Store,
    )
    from bench.faults import Faults, with_faults
    faults = Faults(error_rate=0.03, hang_rate=0.02, hang_s=1.0, seed=int(sys.argv[2]))
    store = with_faults(Store(sys.argv[1],
                              retry=RetryPolicy(attempts=6, timeout_s=0.3, base_delay_s=0.01,
                                                max_delay_s=0.05)),
                        faults)
    ckpt = Checkpointer(sys.argv[1], storage=StorageOptions(store=store), keep_last={KEEP},
                        encoding=EncodingOptions(chunk_bytes=16 << 10, compression="none"),
                        retention=RetentionOptions(lease_ttl_s={TTL_S}))
    contents = [torch.randn(32768, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    step = (ckpt.latest() or 0) + 1
    print("ready", flush=True)
    while True:
        try:
            ckpt.save(step, {{"u": contents[step % 3], "step": step}}).wait()
            print(step, flush=True)
        except CheckpointError as exc:
            print("failed", step, exc, file=sys.stderr, flush=True)
            try:
                ckpt.wait()
            except CheckpointError:
                pass
        step += 1
    """
)

GC_LOOP = textwrap.dedent(
    f"""
    import os, sys, time
    from ckptstore import CheckpointError, Store
    from ckptstore.retention import collect
    store, stop = Store(sys.argv[1]), sys.argv[2]
    end = time.monotonic() + 300
    while time.monotonic() < end and not os.path.exists(stop):
        try:
            collect(store, keep_last={KEEP}, lease_ttl_s={TTL_S})
        except CheckpointError as exc:
            print("gc failed:", exc, file=sys.stderr, flush=True)
        time.sleep(0.05)
    """
)


@pytest.mark.slow
def test_soak_saves_gc_kills_and_faults(tmp_path):
    uri = str(tmp_path / "store")
    rng = random.Random(7)
    # At least 20 s of kills, and on until 10 saves were waited for (a kill while the writer's
    # retention deletes holds the next writer back until those deletes may have ended), at
    # most 120 s.
    start = time.monotonic()
    end, hard_end = start + 20.0, start + 120.0
    stop = tmp_path / "stop-gc"
    gc_proc = subprocess.Popen(
        [sys.executable, "-c", GC_LOOP, uri, str(stop)], stderr=subprocess.DEVNULL
    )
    waited: list[int] = []
    rounds = 0
    try:
        while time.monotonic() < end or (len(waited) < 10 and time.monotonic() < hard_end):
            rounds += 1
            writer = subprocess.Popen(
                [sys.executable, "-c", WRITER, uri, str(rounds)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            # Killed 1.5-4 s after it is ready to save (its start-up, torch's import, varies with
            # the machine's load and is not what the soak is about).
            lifetime_s = rng.uniform(1.5, 4.0)
            kill_at = time.monotonic() + 60
            try:
                os.set_blocking(writer.stdout.fileno(), False)
                while time.monotonic() < min(kill_at, hard_end) and writer.poll() is None:
                    line = writer.stdout.readline()
                    if line.strip() == "ready":
                        kill_at = time.monotonic() + lifetime_s
                    elif line.strip().isdigit():
                        waited.append(int(line))
                    elif not line:
                        time.sleep(0.02)
            finally:
                writer.send_signal(signal.SIGKILL)
                writer.wait(timeout=30)
            rest = writer.stdout.read() or ""
            waited += [int(x) for x in rest.split() if x.isdigit()]
    finally:
        stop.touch()
        gc_proc.wait(timeout=120)
    assert rounds >= 3 and len(waited) >= 10
    steps = verify_all(uri)
    # Retention keeps the newest KEEP committed steps, some perhaps committed by a writer
    # killed before it printed them: every waited step at least as new is there.
    assert len(steps) >= KEEP and max(waited) in steps
    assert {s for s in waited if s >= steps[-KEEP]} <= set(steps)

    # Dead writers' leases go stale: a save's after TTL_S, a gc's killed while deleting once its
    # deletes may have ended (TTL_S / 2 + the writer's request budget, about 3 s). A writer
    # killed mid-put leaves a temporary the gc loop could not sweep while another writer's save
    # was live (the last one's is younger than TTL_S): gone once a sweep finds it that old.
    def swept_with_no_lease_left() -> bool:
        swept = collect(Store(uri), keep_last=KEEP, lease_ttl_s=TTL_S).swept
        temporaries = Store(uri).stale_temporaries(older_than_s=0)
        return swept and find_leases(Store(uri)) == [] and temporaries == []

    assert wait_until(swept_with_no_lease_left, timeout_s=60, interval_s=0.5)
    assert chunk_files(tmp_path / "store") == referenced_chunks(uri)
    assert find_leases(Store(uri)) == []
    assert verify_all(uri) == steps[-KEEP:]
