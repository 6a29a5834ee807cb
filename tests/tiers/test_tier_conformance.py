"""Tier conformance: every tier scenario, written once, run against each front-end.

A front-end is an adapter (save a step, wait for its drains, load a state and say how, make a
new instance as a restarted job would). ``Checkpointer`` and the DCP ``StoreWriter`` /
``StoreReader`` pair pass the same suite; the tier policy below them (``ckptstore.tiers``) is
one, so a behaviour that users of both would expect is tested here once, as fsspec's abstract
suites are run against every file system. One process (``no_dist``): the scenarios that need
several nodes live in the front-ends' own multi-process tests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ckptstore import (
    Checkpointer,
    EncodingOptions,
    HealthPolicy,
    PreemptionOptions,
    StorageOptions,
    TierOptions,
    telemetry,
)
from ckptstore.catalog import list_steps, load_manifest, quarantined, read_rank_index
from ckptstore.codec import hash_bytes
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.dcp import resume as dcp_resume
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DrainSupersededError,
    NoHealthyStepError,
    NoLoadableStepError,
    StepExistsError,
    StorageError,
)
from ckptstore.format import chunk_key, commit_key
from ckptstore.store import Store
from ckptstore.tiers import ahead as tier_ahead
from ckptstore.tiers import transfer as tier_transfer
from ckptstore.tiers.identity import IDENTITY_KEY, copy_claims, read_identity, store_identity
from ckptstore.tiers.local import tier_copies
from ckptstore.tiers.policy import TIER_KEY, rank_dir
from ckptstore.tiers.restore import SourceStats
from ckptstore.tiers.transfer import wait_written
from tests.helpers.dcp_tiers import log_records
from tests.helpers.dist import run_ranks, run_ranks_losing

CHUNK = 64 * 1024
ENCODING = EncodingOptions(chunk_bytes=CHUNK, compression="none")
BOUND_S = 60.0  # every wait in this module


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3 * CHUNK // 4, generator=g),
        "b": torch.randn(1000, generator=g),
    }


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(3 * CHUNK // 4), "b": torch.zeros(1000)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


class _Gate:
    """A store backend whose chunk puts wait until the gate opens (a slow durable store)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.open = threading.Event()

    def put_once(self, path: str, data: Any) -> None:
        if "/chunks/" in f"/{path}":
            assert self.open.wait(BOUND_S), "the gate was never opened"
        return self._inner.put_once(path, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Front:
    """What a scenario needs of a front-end."""

    name = ""
    no_dist = True  # one process; False: every rank of the default group takes part
    health = HealthPolicy()
    encoding = ENCODING

    def __init__(self, root: Path, tiers: TierOptions, storage: StorageOptions) -> None:
        self.root, self.tiers, self.storage = root, tiers, storage

    def save(self, step: int, state: dict) -> None: ...
    def durable(self, step: int) -> concurrent.futures.Future | None: ...
    def wait_durable(self) -> None: ...
    def load(self, state: dict, step: int | str = "latest") -> tuple[int, Any]: ...
    def local_store_uri(self) -> str: ...
    def last_save(self) -> Any: ...
    def last_peer_copy(self) -> Any: ...
    def close(self) -> None: ...

    def durable_next(self) -> None: ...

    def resume(self, state: dict, *, healthy: bool = False) -> int | None:
        """A job's first load as the front-end's README shows it: the step resumed from, or
        None where the front-end says there is nothing to resume (the job starts over)."""

    def latest(self) -> int | None:
        """The step a load of the latest step takes, None where there is nothing to resume."""

    def restart(self) -> Front:
        """The same job started again (a new process would make a new instance)."""
        self.close()
        return type(self)(self.root, self.tiers, self.storage)


class CheckpointerFront(Front):
    name = "checkpointer"
    preemption = PreemptionOptions()

    def __init__(self, root: Path, tiers: TierOptions, storage: StorageOptions) -> None:
        super().__init__(root, tiers, storage)
        self.ckpt = Checkpointer(
            root,
            tiers=tiers,
            encoding=self.encoding,
            storage=self.storage,
            preemption=self.preemption,
            health=self.health,
        )
        self.handles: dict[int, Any] = {}

    def save(self, step: int, state: dict) -> None:
        handle = self.ckpt.save(step, state)
        handle.wait(timeout_s=BOUND_S)
        self.handles[step] = handle

    def durable(self, step: int) -> concurrent.futures.Future | None:
        return self.handles[step].durable

    def wait_durable(self) -> None:
        self.ckpt.wait()

    def durable_next(self) -> None:
        self.ckpt.durable_next()

    def load(self, state: dict, step: int | str = "latest") -> tuple[int, Any]:
        return self.ckpt.load(state, step), self.ckpt.last_load

    def resume(self, state: dict, *, healthy: bool = False) -> int | None:
        if self.ckpt.latest(healthy=healthy) is None:
            return None
        return self.ckpt.load(state, fallback=True, healthy=healthy)

    def latest(self) -> int | None:
        return self.ckpt.latest()

    def local_store_uri(self) -> str:
        return self.ckpt._local.store(0).uri

    def last_save(self) -> Any:
        return self.ckpt.last_save

    def last_peer_copy(self) -> Any:
        return self.ckpt.last_peer_copy

    def close(self) -> None:
        self.ckpt.close()


class DCPFront(Front):
    name = "dcp"

    def __init__(self, root: Path, tiers: TierOptions, storage: StorageOptions) -> None:
        super().__init__(root, tiers, storage)
        self.writer = StoreWriter(
            root, tiers=tiers, encoding=self.encoding, storage=self.storage, health=self.health
        )

    def save(self, step: int, state: dict) -> None:
        pool = concurrent.futures.ThreadPoolExecutor(1)  # a save that hangs fails the test
        done = pool.submit(
            dcp.save, state, storage_writer=self.writer, checkpoint_id=step, no_dist=self.no_dist
        )
        try:
            done.result(timeout=BOUND_S)
        finally:
            pool.shutdown(wait=False)

    def durable(self, step: int) -> concurrent.futures.Future | None:
        return self.writer.durable(step)

    def wait_durable(self) -> None:
        self.writer.wait()

    def durable_next(self) -> None:
        self.writer.durable_next()

    def load(self, state: dict, step: int | str = "latest") -> tuple[int, Any]:
        reader = StoreReader(self.root, step=step, tiers=self.tiers, storage=self.storage)
        dcp.load(state, storage_reader=reader, no_dist=self.no_dist)
        return reader.last_load.step, reader.last_load

    def resume(self, state: dict, *, healthy: bool = False) -> int | None:
        reader = StoreReader(self.root, tiers=self.tiers, storage=self.storage, healthy=healthy)
        return dcp_resume(state, reader, no_dist=self.no_dist)

    def latest(self) -> int | None:
        return StoreReader(self.root, tiers=self.tiers, storage=self.storage).latest()

    def local_store_uri(self) -> str:
        return self.writer._local.store(0).uri

    def last_save(self) -> Any:
        return self.writer.last_save

    def last_peer_copy(self) -> Any:
        return self.writer.last_peer_copy

    def close(self) -> None:
        self.writer.close()


FRONTS: dict[str, type[Front]] = {"checkpointer": CheckpointerFront, "dcp": DCPFront}


@pytest.fixture(params=[CheckpointerFront, DCPFront], ids=lambda f: f.name)
def front_type(request):
    return request.param


@pytest.fixture
def make(front_type, tmp_path):
    made: list[Front] = []

    def make_front(
        store: Store | None = None, nice: int = 0, timeout_s: float = 30.0, **tiers: Any
    ) -> Front:
        tiers.setdefault("local_dir", tmp_path / "local")
        storage = StorageOptions(store=store, background_nice=nice, timeout_s=timeout_s)
        front = front_type(tmp_path / "durable", TierOptions(**tiers), storage)
        made.append(front)
        return front

    yield make_front
    for front in made:
        try:
            front.close()
        except Exception:  # noqa: BLE001 - a scenario may leave a failed drain behind
            pass


@pytest.fixture
def refusing(front_type, request, monkeypatch):
    """Front-ends of this test made with ``HealthPolicy(on_unhealthy=<the param>)``."""
    monkeypatch.setattr(front_type, "health", HealthPolicy(on_unhealthy=request.param))
    return request.param


def _local_copies(tmp_path: Path) -> list[int]:
    durable = store_identity(Store(str(tmp_path / "durable")))
    return sorted(tier_copies(tmp_path / "local", durable).copies)


# -- scenarios ---------------------------------------------------------------------------------


def test_saves_go_local_first_and_every_mth_durably(make, tmp_path):
    front = make(durable_every=2)
    for step in (1, 2, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 3]
    assert _local_copies(tmp_path) == [3, 4]  # local_keep_last=2
    target = _blank()
    step, report = front.restart().load(target)
    assert step == 4 and report.source == "local" and _same(target, _state(4))


def test_durable_next_commits_the_next_save_durably_whatever_the_cadence(make, tmp_path):
    """A new user: with durable_every=M a job's last save stayed in the local tiers alone,
    which go with the nodes at the end of the job; only the torchtitan manager made it durable.
    ``durable_next()`` (both front-ends) sends the next save there too; the cadence goes on."""
    front = make(durable_every=10)
    front.durable_next()  # before the first save, which goes there anyway
    for step in (1, 2):
        front.save(step, _state(step))
    front.durable_next()
    for step in (3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 3]
    shutil.rmtree(tmp_path / "local")
    target = _blank()
    assert front.restart().load(target)[0] == 3 and _same(target, _state(3))


def test_closing_after_a_local_only_last_save_warns_naming_it(make, tmp_path, caplog):
    """New user of stop 78: the example's job ended with its last save in the local tiers alone
    (``durable_every``), and nothing said so. Closing the writer says it (rank 0, one line),
    on both front-ends; not after ``durable_next()`` made the last save durable."""
    front = make(durable_every=10)
    for step in (1, 2):
        front.save(step, _state(step))
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        front.close()
    warned = [r.getMessage() for r in caplog.records if "newest step saved" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 2, the newest step saved, is held"), (
        warned
    )
    assert "durable_next()" in warned[0] and str(tmp_path / "local") in warned[0]
    caplog.clear()
    front = front.restart()
    front.save(3, _state(3))
    front.durable_next()
    front.save(4, _state(4))
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        front.close()
    assert not [r for r in caplog.records if "newest step saved" in r.getMessage()], caplog.text
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 3, 4]


@pytest.mark.parametrize("refusing", ["skip"], indirect=True)
def test_closing_names_the_newest_step_stored_not_a_save_skipped(make, refusing, tmp_path, caplog):
    """Adversary of stop 78: the close warning named what a save planned, not where it went: a
    save skipped as unhealthy (stored nowhere) was named local only, and one asked durable
    but skipped hid the local-only step before it. It names the newest step stored."""
    front = make(durable_every=10)
    front.save(1, _state(1))
    bad = _state(2)
    bad["w"][5] = float("nan")
    front.save(2, bad)
    assert not front.last_save().committed
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        front.close()
    assert not [r for r in caplog.records if "newest step saved" in r.getMessage()], caplog.text
    front = front.restart()
    front.save(3, _state(3))  # durable: a writer's first save
    front.save(4, _state(4))
    front.durable_next()
    front.save(5, bad)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        front.close()
    warned = [r.getMessage() for r in caplog.records if "newest step saved" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 4,"), warned


def test_closing_after_saves_sent_to_durable_storage_by_a_failed_local_tier_is_quiet(
    make, tmp_path, caplog
):
    """Adversary of stop 78: with a local_dir that cannot be written every save went to
    durable storage, yet close() said the last one was held in the local tiers alone."""
    (tmp_path / "local").write_bytes(b"a file where the directory should be")
    front = make(durable_every=10)
    for step in (1, 2):
        front.save(step, _state(step))
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        front.close()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 2]
    assert not [r for r in caplog.records if "newest step saved" in r.getMessage()], caplog.text


def test_latest_names_the_step_a_load_takes_a_local_only_one_included(make, tmp_path):
    """A reviewer: the Checkpointer's ``latest()`` listed durable steps alone, so the README's
    resume (``if ckpt.latest() is not None: load``) started a tiered job over when its saves were
    in the local tier only, and later saved over them; DCP's ``reader.latest()`` already took
    every tier. Both name the step a load takes now."""
    front = make(durable_every=10)
    assert front.latest() is None
    for step in (1, 2):
        front.save(step, _state(step))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1]
    front = front.restart()
    assert front.latest() == 2
    target = _blank()
    assert front.resume(target) == 2 and _same(target, _state(2))
    front.close()
    shutil.rmtree(tmp_path / "local")
    front = front.restart()
    assert front.latest() == 1
    assert front.resume(target) == 1 and _same(target, _state(1))


def _durable_only(make: Any, tmp_path: Path) -> Front:
    """Steps 1 and 2 saved to both tiers, the front closed, the node's local tier wiped."""
    front = _two_saved(make, durable_every=1)
    shutil.rmtree(tmp_path / "local")
    return front


def _two_saved(make: Any, **tiers: Any) -> Front:
    """Steps 1 and 2 saved (and drained as ``tiers`` say), the front closed."""
    front = make(**tiers)
    for step in (1, 2):
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    return front


@pytest.mark.parametrize("healthy", [False, True])
def test_a_local_only_step_whose_copy_is_damaged_is_passed_over_by_the_resume(
    make, tmp_path, healthy
):
    """Drift adversary: the rank index of a step only the local tier holds cut short. The
    Checkpointer's resume loaded the step before; DCP's raised at every restart ("a copy cannot
    be read"), a plain CheckpointError its resume does not skip. Both load step 1 now."""
    _two_saved(make, durable_every=5)  # step 1 durable, step 2 in the local tier only
    (index,) = (tmp_path / "local").rglob(f"indexes/*/{2:020d}/*/rank-*.json")
    index.chmod(0o644)
    index.write_bytes(index.read_bytes()[:20])
    front = make(durable_every=5)
    target = _blank()
    assert front.resume(target, healthy=healthy) == 1 and _same(target, _state(1))


def test_a_step_no_tier_can_load_is_skipped_and_quarantined_by_the_resume(make, tmp_path):
    """A corrupt newest step (its durable copy damaged, the node's copies gone) never blocks a
    job: the resume of each front-end (``load(fallback=True)``, ``ckptstore.dcp.resume``) loads
    the step before and quarantines it, and the job saves that step number again."""
    front = _durable_only(make, tmp_path)
    durable = Store(str(tmp_path / "durable"))
    older = set(read_rank_index(durable, load_manifest(durable, 1).ranks[0]).chunks)
    for digest in sorted(
        set(read_rank_index(durable, load_manifest(durable, 2).ranks[0]).chunks) - older
    ):
        path = tmp_path / "durable" / chunk_key(digest)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    front = front.restart()
    target = _blank()
    assert front.resume(target) == 1 and _same(target, _state(1))
    assert list_steps(durable) == [1]
    front.save(2, _state(22))
    front.wait_durable()
    target = _blank()
    assert front.restart().resume(target) == 2 and _same(target, _state(22))


@pytest.mark.parametrize("healthy", [False, True])
def test_a_step_whose_durable_manifest_cannot_be_read_is_quarantined_by_the_resume(
    make, tmp_path, healthy
):
    """The plan left a durable step whose manifest does not decode (and no node holding its
    copies) out of the candidates: nothing skipped it, so nothing quarantined it, and each
    front-end's resume loaded step 1 and then failed with StepExistsError saving step 2 again
    (with and without healthy=True), as the durable front-end no longer does."""
    front = _durable_only(make, tmp_path)
    manifest = tmp_path / "durable" / commit_key(2)
    manifest.chmod(0o644)
    manifest.write_bytes(b"not a manifest")
    front = front.restart()
    with pytest.raises((CheckpointError, CheckpointException), match="not valid JSON"):
        front.load(_blank())  # without fallback: as without tiers, not step 1 unasked
    target = _blank()
    assert front.resume(target, healthy=healthy) == 1 and _same(target, _state(1))
    assert list(quarantined(Store(str(tmp_path / "durable"))).values()) == [2]
    front.save(2, _state(22))
    front.wait_durable()
    target = _blank()
    assert front.restart().resume(target, healthy=healthy) == 2 and _same(target, _state(22))


class _RacingRead:
    """A store backend whose first chunk read first runs ``race`` (another process's save)."""

    def __init__(self, inner: Any, race: Any) -> None:
        self._inner, self._race, self.raced = inner, race, False

    def _first(self, path: str) -> None:
        if "/chunks/" in f"/{path}" and not self.raced:
            self.raced = True
            self._race()

    def get(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        self._first(path)
        return self._inner.get(path, *args, **kwargs)

    def get_view(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._first(path)
        return self._inner.get_view(path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_latest_load_whose_durable_step_is_removed_meanwhile_loads_the_newer_one(
    front_type, make, tmp_path
):
    """A wiped node resuming while another process of the job saves with keep_last=1: the
    durable step its load planned is removed as it reads it. Each front-end plans again and
    loads the newest step (the Checkpointer did; a tiered DCP load failed, a chunk missing)."""
    _durable_only(make, tmp_path)

    def another_job_saves() -> None:
        if front_type is CheckpointerFront:
            other = Checkpointer(tmp_path / "durable", keep_last=1, encoding=ENCODING)
            try:
                other.save(3, _state(3)).wait(timeout_s=BOUND_S)
            finally:
                other.close()
            return
        writer = StoreWriter(tmp_path / "durable", keep_last=1, encoding=ENCODING)
        dcp.save(_state(3), storage_writer=writer, checkpoint_id=3, no_dist=True)

    racing_store = Store(str(tmp_path / "durable"))
    racing = _RacingRead(racing_store.backend, another_job_saves)
    racing_store.backend = racing
    front = make(store=racing_store)
    target = _blank()
    step, report = front.load(target)
    assert racing.raced and list_steps(Store(str(tmp_path / "durable"))) == [3]
    assert step == 3 and report.source == "durable" and _same(target, _state(3))


class _IdentityDown(Store):
    """A durable store whose identity.json cannot be read while ``down`` (a store not
    answering as the job starts)."""

    down = True

    def _check(self, key: str) -> None:
        if key.endswith(IDENTITY_KEY) and self.down:
            raise StorageError(f"{self.url(key)}: connection refused")

    def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._check(key)
        return super().get(key, *args, **kwargs)

    def get_view(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._check(key)
        return super().get_view(key, *args, **kwargs)


def test_an_identity_that_cannot_be_read_fails_the_open_and_loses_no_local_step(make, tmp_path):
    """Drift adversary: an identity.json read that failed (the store not answering as the job
    started) was taken for a store without one. The job's copies then looked like another
    instance's: the Checkpointer resumed from the older durable step, and the copies each front
    end saved recorded no id, so the next start passed over them for good. Now the open fails,
    naming the store, and once it answers the newest local-only step loads."""
    _two_saved(make, durable_every=5)  # step 1 durable, step 2 in the local tier only
    down = _IdentityDown(str(tmp_path / "durable"))
    with pytest.raises((CheckpointError, CheckpointException), match="cannot read the identity"):
        make(store=down, durable_every=5).save(3, _state(3))
    down.down = False
    front = make(store=down, durable_every=5)
    target = _blank()
    assert front.load(target)[0] == 2 and _same(target, _state(2))
    for step in (3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    target = _blank()
    assert front.restart().load(target)[0] == 4 and _same(target, _state(4))


@pytest.mark.parametrize("step", ["abc", -5, "2x"])
def test_a_step_named_wrongly_is_one_clear_error(make, tmp_path, step):
    """Tiers reviewer: ``load(step='abc')`` with tiers was ``int()``'s own ValueError ("invalid
    literal for int() with base 10"), where the untiered load names what a step may be."""
    front = _two_saved(make, durable_every=1).restart()
    with pytest.raises((ValueError, CheckpointException), match=r"step must be an int"):
        front.load(_blank(), step)


@pytest.mark.parametrize("inside", ["", "local"])
def test_a_local_dir_inside_the_durable_store_is_refused(make, tmp_path, inside):
    """Tiers reviewer: a local_dir equal to or inside a local durable store was taken, and the
    node-local copies went among the durable objects, on the same disk."""
    with pytest.raises((ValueError, CheckpointException), match="is inside the durable store"):
        make(local_dir=tmp_path / "durable" / inside).save(1, _state(1))
    assert list_steps(Store(str(tmp_path / "durable"))) == []


def test_copies_made_before_the_store_moved_are_named_not_loaded(
    front_type, make, tmp_path, caplog, capsys
):
    """Reviewer G: a durable store moved (or mounted at another path on a new node) after a
    job was killed with its newest step in the local tier only: the restart resumed from the
    older durable step in silence, and ``ls --local-dir`` said "none of this store's job". A
    copy belongs to the store's path, so it is not loaded; the load and ``ls`` name it."""
    from ckptstore.cli import main
    from ckptstore.tiers import plan as tier_plan

    front = _two_saved(make, durable_every=10)
    moved = tmp_path / "moved"
    os.rename(tmp_path / "durable", moved)
    caplog.set_level(logging.WARNING, logger="ckptstore")
    tier_plan._named_elsewhere.clear()
    again = front_type(moved, front.tiers, front.storage)
    try:
        target = _blank()
        assert again.load(target)[0] == 1 and _same(target, _state(1))
    finally:
        again.close()
    said = [r.getMessage() for r in caplog.records if "made while it was at" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "durable") in said[0] and "step(s) 1, 2" in said[0]
    capsys.readouterr()
    assert main(["ls", str(moved), "--local-dir", str(tmp_path / "local"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (listing,) = doc["local_dirs"].values()
    assert listing["under_other_paths"] == {str(tmp_path / "durable"): [1, 2]}


def test_a_wiped_local_dir_loads_from_durable_storage(make, tmp_path):
    front = _durable_only(make, tmp_path)
    target = _blank()
    step, report = front.restart().load(target)
    assert step == 2 and report.source == "durable" and _same(target, _state(2))


def test_a_corrupt_local_chunk_is_read_from_durable_storage(make, tmp_path):
    front = make(durable_every=1)
    front.save(1, _state(1))
    front.wait_durable()
    front.close()
    chunks = [p for p in (tmp_path / "local").rglob("chunks/*/*") if p.is_file()]
    assert chunks
    for path in chunks:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    target = _blank()
    step, report = front.restart().load(target)
    assert step == 1 and _same(target, _state(1))
    assert report.sources["durable"].chunks > 0  # the durable tier served them
    assert report.source == "durable"  # every byte did: not named after the copy it tried
    assert report.sources.get("local") is None or report.sources["local"].bytes == 0
    # ... and wrote them back into the copy, verified: the next load reads them locally.
    target = _blank()
    step, report = front.restart().load(target)
    assert step == 1 and _same(target, _state(1))
    assert report.source == "local" and "durable" not in report.sources


def _flip_one_chunk(copy: Path, step: int, delete: bool = False) -> int:
    """One byte flipped in (or ``delete``: the file of) one chunk of ``step`` in the copy (a
    rank directory) at ``copy``; how many chunks that step's index names."""
    store = Store(str(copy))
    index = read_rank_index(store, load_manifest(store, step).ranks[0])
    digests = sorted(index.chunks)
    assert len(digests) >= 2, digests
    path = copy / chunk_key(digests[0])
    if delete:
        path.unlink()
        return len(digests)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return len(digests)


def test_a_bad_chunk_of_a_step_only_the_local_tier_holds_is_not_said_to_be_read_durably(
    make, tmp_path, caplog
):
    """Adversary of stop 79: a bad chunk of step 4, held by the local tier alone, was said to
    be "read from <durable> instead, and put back", and to have failed its hash check (a
    decode error too): nothing was read there. The next load falls back to step 3."""
    front = make(durable_every=2)
    for step in (1, 2, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    (copy,) = (tmp_path / "local").glob("job-*/rank-00000")
    _flip_one_chunk(copy, 4)
    target = _blank()
    front = front.restart()
    caplog.set_level(logging.WARNING, logger="ckptstore")
    with pytest.raises((CheckpointCorruptError, CheckpointException), match="local tiers only"):
        front.load(target)  # the state is partly written: a load fails, as without tiers
    said = [r.getMessage() for r in caplog.records if "of the local tier" in r.getMessage()]
    target = _blank()
    step, _ = front.load(target)
    assert step == 3 and _same(target, _state(3))
    assert said and all("read from" not in s and "put back" not in s for s in said), said
    assert "looked for by its digest in" in said[0] and "(the step is not there)" in said[0]


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_a_local_copy_with_one_bad_chunk_reads_that_chunk_alone_from_durable_storage(
    make, tmp_path, caplog, damage
):
    """Issue 36, each chunk from the nearest holder that verifies: a flipped byte in (or the
    loss of) one chunk of the local copy costs one durable read, the other chunks still come
    from the copy; the bad chunk is removed from the local tier, so the next save of the same
    bytes writes it again instead of referencing it (its copy then loads whole from the local
    tier). The warning says which it was."""
    front = make(durable_every=1)
    front.save(1, _state(1))
    front.wait_durable()
    front.close()
    (copy,) = (tmp_path / "local").glob("job-*/rank-00000")
    n = _flip_one_chunk(copy, 1, delete=damage == "deleted")
    target = _blank()
    front = front.restart()
    caplog.set_level(logging.WARNING, logger="ckptstore")
    step, report = front.load(target)
    said = [r.getMessage() for r in caplog.records if "of the local tier" in r.getMessage()]
    assert len(said) == 1, said
    if damage == "deleted":
        assert "is missing; nothing to remove" in said[0], said
    else:
        assert "failed its check; removed" in said[0], said
    # operator of stop 78: it said "the next save writes it again", though the load put it back
    assert "read from" in said[0] and "put back where it verifies" in said[0], said
    assert step == 1 and _same(target, _state(1))
    assert report.source == "local", report
    assert report.sources["durable"].chunks == 1, report
    assert report.sources["durable"].bytes > 0, report  # the stored bytes it read there
    assert report.sources["local"].chunks == n - 1, report
    front.save(2, _state(1))
    front.wait_durable()
    target = _blank()
    step, report = front.restart().load(target)
    assert step == 2 and _same(target, _state(1))
    assert set(report.sources) == {"local"} and report.sources["local"].chunks == n, report


def test_a_bad_chunk_of_a_local_only_step_is_read_from_durable_storage_by_its_digest(
    make, front_type, tmp_path, monkeypatch
):
    """Reviewer: a chunk damaged in the local copy of a step durable storage held was
    referenced by every later local-only save of the same bytes, and none of those loaded
    (the chunk was read from durable storage only for a step stored there), though durable
    storage held the same bytes from the earlier step's drain. The chunk is looked for there by
    its digest: the local-only step loads, that chunk alone from durable storage. (Rechecks
    off: one may write the chunk again first.)"""
    monkeypatch.setattr(front_type, "encoding", replace(ENCODING, recheck_every=0))
    front = make(durable_every=2)
    front.save(1, _state(1))
    front.wait_durable()
    (copy,) = (tmp_path / "local").glob("job-*/rank-00000")
    n = _flip_one_chunk(copy, 1)
    front.save(2, _state(1))  # the same bytes: the damaged chunk referenced, not written
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1]
    target = _blank()
    step, report = front.restart().load(target)
    assert step == 2 and _same(target, _state(1))
    assert report.sources["durable"].chunks == 1, report
    assert report.sources["local"].chunks == n - 1, report


def test_a_bad_chunk_of_a_local_only_step_durable_storage_lacks_is_still_an_error(make, tmp_path):
    """The look in durable storage by digest finds nothing: the load fails naming the chunk
    (as before), never loads it with a hole, and unlists the bad copy; a resume takes the
    step before. Tiers reviewer: the Checkpointer's load kept the bad copy listed, so its
    ``latest()`` named step 2 at every restart while every load took step 1."""
    front = make(durable_every=2)
    front.save(1, _state(1))
    front.save(2, _state(2))  # local only, its chunks nowhere else
    front.wait_durable()
    (copy,) = (tmp_path / "local").glob("job-*/rank-00000")
    _flip_one_chunk(copy, 2)
    front = front.restart()
    with pytest.raises(BaseException, match="xxh3 mismatch"):
        front.load(_blank())  # DCP wraps it in a CheckpointException, a BaseException
    front = front.restart()
    assert front.latest() == 1
    target = _blank()
    assert front.resume(target) == 1 and _same(target, _state(1))


class _ChunksUnreachable(Store):
    """A durable store whose chunk reads fail as in an outage (its listing still answers)."""

    def get(self, key, *args, **kwargs):
        if key.startswith("chunks/"):
            raise StorageError(f"get {self.url(key)}: connection refused")
        return super().get(key, *args, **kwargs)

    get_view = get


def test_a_bad_chunk_of_a_local_only_step_with_durable_storage_down_is_still_its_own_error(
    make, tmp_path
):
    """Reviewer of this change: durable storage unreachable, the look there by digest raised
    its StorageError, which stood for the local damage; DCP's load never unlisted the bad copy
    and no resume got past it. The local copy's error stands (as with no look), and a resume
    takes the step before."""
    front = make(durable_every=2)
    front.save(1, _state(1))
    front.save(2, _state(2))
    front.wait_durable()
    (copy,) = (tmp_path / "local").glob("job-*/rank-00000")
    _flip_one_chunk(copy, 2)
    front.close()
    down = make(store=_ChunksUnreachable(str(tmp_path / "durable")), durable_every=2)
    with pytest.raises(BaseException, match="xxh3 mismatch"):
        down.load(_blank())
    target = _blank()
    assert down.restart().resume(target) == 1 and _same(target, _state(1))


def test_an_unwritable_local_dir_sends_saves_to_durable_storage(make, tmp_path, caplog):
    (tmp_path / "local").write_bytes(b"a file where the directory should be")
    front = make(durable_every=5)
    caplog.set_level(logging.WARNING, logger="ckptstore")
    for step in (1, 2):
        front.save(step, _state(step))
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 2]  # when save() returned
    warned = [r for r in caplog.records if "not committed to the local tier" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    target = _blank()
    assert front.load(target)[0] == 2 and _same(target, _state(2))


def test_a_rank_directory_linked_elsewhere_is_never_written_through(make, tmp_path, caplog):
    """Adversary: local_dir/job-<j>/rank-<r> replaced by a link to the durable store (planted in
    a shared /dev/shm; the job directory's name is a hash anyone can compute). The tier wrote its
    copies through it and its retention deleted the durable store's committed steps. Now the
    link is refused: saves go to durable storage, with the warning of an unusable local tier."""
    _two_saved(make, durable_every=1)
    durable = tmp_path / "durable"
    linked = rank_dir(tmp_path / "local", store_identity(Store(str(durable))), 0)
    shutil.rmtree(linked)
    linked.symlink_to(durable, target_is_directory=True)
    before = sorted(p.relative_to(durable) for p in durable.rglob("*"))
    caplog.set_level(logging.WARNING, logger="ckptstore")
    front = make(durable_every=5, local_keep_last=1)
    for step in (3, 4, 5):
        front.save(step, _state(step))
    assert list_steps(Store(str(durable))) == [1, 2, 3, 4, 5]
    assert any("a link in the local tier, not used" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    after = {p.relative_to(durable) for p in durable.rglob("*")}
    assert set(before) <= after  # nothing of steps 1 and 2 went
    for step in (1, 5):
        target = _blank()
        assert front.load(target, step)[0] == step and _same(target, _state(step))


def test_durable_every_drains_in_the_background_with_back_pressure(make, tmp_path):
    """Drift 5 of issue 31: a DCP save drained inline (it returned only once durable), the
    Checkpointer's in the background. Now both return once the local copies are committed;
    drains that fall behind drain the newest queued step and let the others go."""
    gate_store = Store(str(tmp_path / "durable"))
    gate = _Gate(gate_store.backend)
    gate_store.backend = gate
    front = make(store=gate_store, durable_every=1, local_keep_last=5)
    for step in (1, 2, 3):
        front.save(step, _state(step))  # returns though no durable chunk can be written
    assert list_steps(Store(str(tmp_path / "durable"))) == []
    assert not front.durable(1).done()
    gate.open.set()
    front.wait_durable()
    assert front.durable(1).exception(timeout=BOUND_S) is None
    assert isinstance(front.durable(2).exception(timeout=BOUND_S), DrainSupersededError)
    assert front.durable(3).exception(timeout=BOUND_S) is None
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 3]


class _Refusing:
    """A store backend that refuses puts of ``part`` (chunks, commits) while ``refuse`` is set
    (a bucket policy)."""

    def __init__(self, inner: Any, part: str = "chunks") -> None:
        self._inner = inner
        self.part = f"/{part}/"
        self.refuse = threading.Event()

    def put_once(self, path: str, data: Any) -> None:
        if self.refuse.is_set() and self.part in f"/{path}":
            raise PermissionError(13, "Access Denied", path)
        return self._inner.put_once(path, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_save_bound_for_durable_storage_that_fails_there_passes_it_to_the_next(make, tmp_path):
    """A reviewer: with ``durable_every=10``, a save bound for durable storage whose drain
    failed left the job with no new durable step for nine more saves (a node lost meanwhile
    lost them all). The next save goes there instead, then the cadence goes on."""
    store = Store(str(tmp_path / "durable"))
    refusing = _Refusing(store.backend)
    store.backend = refusing
    front = make(store=store, durable_every=10, local_keep_last=5)
    refusing.refuse.set()
    front.save(1, _state(1))
    assert isinstance(front.durable(1).exception(timeout=BOUND_S), PermissionError)
    with pytest.raises(CheckpointError, match="step.s. 1 committed to the local tiers but not"):
        front.wait_durable()
    refusing.refuse.clear()
    for step in (2, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [2]
    target = _blank()
    assert front.restart().load(target)[0] == 4 and _same(target, _state(4))


class _Down:
    """A store backend every request of which is refused while ``down`` is set (an outage)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.down = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down.is_set():
                raise ConnectionRefusedError(111, "Connection refused (an outage)")
            return attr(*args, **kwargs)

        return call


def test_saves_go_on_to_the_local_tier_while_the_durable_store_is_out(make, tmp_path, caplog):
    """A tier adversary of stop 80 (HIGH): a tiered Checkpointer save whose check that the
    durable store does not hold the step failed (the store out for 2 s) raised on rank 0
    before the ranks' vote on the local commit, and the other ranks waited in it for good;
    a tiered DCP save failed on every rank, so no checkpoint was taken for the length of the
    outage. The local tier takes the saves, with one WARNING each; the drains then fail, and
    the first save after the outage drains."""
    store = Store(str(tmp_path / "durable"))
    outage = _Down(store.backend)
    store.backend = outage
    front = make(store=store, durable_every=2, local_keep_last=5, timeout_s=1.0)
    front.save(1, _state(1))
    front.wait_durable()
    outage.down.set()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        for step in (2, 3):
            front.save(step, _state(step))
    said = [r.getMessage() for r in caplog.records if "could not ask" in r.getMessage()]
    assert said and all("saved to the local tier" in line for line in said), said
    # step 2 is not bound for durable storage (durable_every=2): said at INFO, no drain named
    assert all(line.startswith("step 3:") for line in said), said
    assert {2, 3} <= set(_local_copies(tmp_path))
    outage.down.clear()
    with contextlib.suppress(CheckpointError):  # step 3's drain, if it ran in the outage
        front.wait_durable()
    front.durable_next()
    front.save(4, _state(4))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable")))[-1] == 4
    target = _blank()
    assert front.restart().load(target)[0] == 4 and _same(target, _state(4))


def test_a_rolled_back_job_saves_nothing_the_durable_store_cannot_be_asked_about(make, tmp_path):
    """The fourth fix adversary of stop 80 (HIGH): a job that loaded step 2 of a store holding
    steps to 4 saved 3 and 4 during an outage, to the local tier; restarted, every rank
    resumed step 4 of the run it had left (a load prefers the durable save of a step), in
    silence. Until a save has asked the durable store since the load, one that cannot ask is
    refused, saying why; once one has, saves go on to the local tier in an outage."""
    store = Store(str(tmp_path / "durable"))
    outage = _Down(store.backend)
    store.backend = outage
    front = make(store=store, durable_every=1, timeout_s=1.0)
    for step in (1, 2, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    front = front.restart()
    front.load(_blank(), 2)
    outage.down.set()
    with pytest.raises((CheckpointError, CheckpointException)) as refused:
        front.save(3, _state(30))
    said = str(refused.value)  # a StoreWriter reads the store's identity at its first save
    assert "no save has asked it since this job loaded a step" in said or (
        front.name == "dcp" and "cannot read the identity" in said
    ), said
    outage.down.clear()
    front.save(5, _state(5))
    front.wait_durable()
    outage.down.set()
    front.save(6, _state(6))  # asked since the load: the local tier takes it
    outage.down.clear()
    target = _blank()
    assert front.restart().load(target)[0] == 6 and _same(target, _state(6))


def test_a_rolled_back_job_saves_no_step_the_store_held_while_it_cannot_ask(make, tmp_path):
    """The fix adversary of stop 81 (HIGH, in a bound since taken back): once a save had asked
    the durable store since a rollback, a later save of a step the store held, asked while it
    did not answer, went to the local tier and its restart resumed the abandoned run. The first
    save since the load lists the store: a step at or below its newest is refused while the
    store does not answer; a step above it goes to the local tier."""
    store = Store(str(tmp_path / "durable"))
    outage = _Down(store.backend)
    store.backend = outage
    front = make(store=store, durable_every=1, timeout_s=1.0)
    for step in (1, 2, 4):
        front.save(step, _state(step))
    front.wait_durable()
    front = front.restart()
    front.load(_blank(), 1)
    front.save(3, _state(30))  # listed: 1, 2 and 4; not 3
    front.wait_durable()
    outage.down.set()
    with pytest.raises((CheckpointError, CheckpointException)) as refused:
        front.save(4, _state(40))
    assert "held steps up to 4 when this process listed it" in str(refused.value), refused.value
    front.save(5, _state(50))  # above every step listed: taken by the local tier
    outage.down.clear()
    target = _blank()
    assert front.restart().load(target)[0] == 5 and _same(target, _state(50))


class _Lagging:
    """A store backend whose listings leave out the paths ending with one of ``hidden`` (a
    listing that lags behind the store's last commits)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.hidden: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def list(self, base: str) -> list[str]:
        return [p for p in self._inner.list(base) if not p.endswith(tuple(self.hidden))]


def test_a_rolled_back_jobs_first_save_of_a_step_a_lagging_listing_misses_is_refused(
    make, tmp_path
):
    """The fix adversary of stop 82 (MED): the first save since the load trusted the durable
    store's listing for its own step; a listing lagging by the abandoned run's last commit let
    that step be committed to the local tier (refused only by its drain, the local copy made).
    The store is asked for the step itself too."""
    store = Store(str(tmp_path / "durable"))
    lagging = _Lagging(store.backend)
    store.backend = lagging
    front = make(store=store, durable_every=1)
    for step in (1, 2, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    front = front.restart()
    front.load(_blank(), 3)
    lagging.hidden = {commit_key(4)}
    with pytest.raises((StepExistsError, CheckpointException)) as refused:
        front.save(4, _state(40))
    assert "step 4 is already committed" in str(refused.value), refused.value


def test_saves_above_every_step_listed_ask_no_durable_store_that_did_not_answer(
    make, tmp_path, caplog
):
    """An operator of stop 81 (MED): with the durable store hung, each tiered save waited for
    the ask whether the store holds its step up to the store's request bound (30 s). Steps
    above every step listed since the load are asked within ``ASK_S``, and once an ask got no
    answer, saves not bound for durable storage do not ask until one bound for it does."""
    store = Store(str(tmp_path / "durable"))
    outage = _Down(store.backend)
    store.backend = outage
    asked: list[str] = []
    exists = Store.exists

    def counted(self: Store, key: str, **kwargs: Any) -> bool:
        if self.uri == store.uri:  # not the local tier's stores
            asked.append(key)
        return exists(self, key, **kwargs)

    front = make(store=store, durable_every=3, local_keep_last=5, timeout_s=1.0)
    front.save(1, _state(1))  # the first save lists the store
    front.wait_durable()
    outage.down.set()
    with mock.patch.object(Store, "exists", counted), caplog.at_level(logging.INFO, "ckptstore"):
        for step in (2, 3, 4, 5):
            front.save(step, _state(step))
    outage.down.clear()
    commits = [k for k in asked if k.startswith("commits/")]
    assert commits == [commit_key(2), commit_key(4)], commits  # 4: bound for durable storage
    said = [r for r in caplog.records if "could not ask" in r.getMessage()]
    assert [(r.getMessage().split(":")[0], r.levelname) for r in said] == [
        ("step 2", "INFO"),
        ("step 4", "WARNING"),
    ], [r.getMessage() for r in said]
    assert {2, 3, 4, 5} <= set(_local_copies(tmp_path))


def test_a_process_whose_store_never_listed_asks_it_only_for_saves_bound_there(
    make, tmp_path, monkeypatch
):
    """The second fix adversary of stop 82 (MED): a durable store that stopped answering
    before a process's first tiered save (a process that loaded nothing) was listed again by
    every save, each waiting the store's request bound. Once a listing got no answer, only
    saves bound for durable storage list it again (here its listings alone fail)."""
    from ckptstore.tiers import saving

    front = make(durable_every=3, local_keep_last=5)
    listed: list[int] = []

    def listing(of: Store) -> list[int]:
        listed.append(sys._getframe(1).f_locals["step"])  # durable_holds's
        raise StorageError(f"list {of.uri}/commits: no answer (an outage)")

    monkeypatch.setattr(saving, "list_steps", listing)
    for step in (1, 2, 3, 4, 5):
        front.save(step, _state(step))
    assert set(listed) == {1, 4}, listed  # bound for durable storage (DCP asks twice of those)
    assert {1, 2, 3, 4, 5} <= set(_local_copies(tmp_path))


@pytest.fixture
def rechecking(front_type, monkeypatch):
    """Front-ends of this test whose saves read back every chunk they reference unwritten."""
    encoding = EncodingOptions(chunk_bytes=CHUNK, compression="none", recheck_every=1)
    monkeypatch.setattr(front_type, "encoding", encoding)


def test_a_durable_chunk_damaged_since_its_drain_is_written_again_by_the_next(
    make, tmp_path, rechecking
):
    """A reviewer's (HIGH), through the drain: a chunk of durable storage damaged where it lies
    was referenced by every later drained save of the same bytes. The next drain reads it back
    (``recheck_every=1``) and writes it again from the local copy: both durable steps load."""
    front = make(durable_every=1)
    front.save(1, _state(1))
    front.wait_durable()
    durable = Store(str(tmp_path / "durable"))
    for key in durable.list("chunks"):  # every chunk: a bit flipped in its middle
        data = bytearray(durable.get(key))
        data[len(data) // 2] ^= 0x01
        durable.delete(key)
        durable.put(key, bytes(data))
    front.save(2, _state(1))
    front.wait_durable()
    front.close()
    shutil.rmtree(tmp_path / "local")
    for step in (1, 2):
        target = _blank()
        assert front.restart().load(target, step)[0] == step and _same(target, _state(1))


@pytest.mark.parametrize("part", ["chunks", "commits"])
def test_a_save_bound_for_durable_storage_that_fails_everywhere_passes_it_on(make, tmp_path, part):
    """As above, for a save bound for durable storage that failed as a whole (its local tier
    could not be written, durable storage refused its chunks or its commit): the next save
    goes there."""
    store = Store(str(tmp_path / "durable"))
    refusing = _Refusing(store.backend, part)
    store.backend = refusing
    front = make(store=store, durable_every=2, local_keep_last=5)
    for step in (1, 2):
        front.save(step, _state(step))
    front.wait_durable()  # step 1's drain reads the copies moved away below
    (copies,) = (tmp_path / "local").glob("job-*/rank-00000")
    copies.rename(tmp_path / "moved")
    copies.write_bytes(b"a file where the directory should be")
    refusing.refuse.set()
    with pytest.raises((CheckpointError, CheckpointException)):
        front.save(3, _state(3))
    refusing.refuse.clear()
    copies.unlink()
    (tmp_path / "moved").rename(copies)
    front.save(4, _state(4))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 4]


def test_background_nice_reaches_the_local_tiers_threads(make):
    """Drift 1 of issue 31: the DCP writer's local tier ignored ``background_nice``."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if base + 5 > 19:
        pytest.skip("already at the lowest priority")
    front = make(nice=5, durable_every=5)
    front.save(1, _state(1))
    prefix = f"ckptstore-io[{front.local_store_uri()}]"
    nice = [
        os.getpriority(os.PRIO_PROCESS, t.native_id)
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.native_id is not None
    ]
    assert nice, f"no thread of the local tier's store ({prefix}) is alive"
    assert min(nice) >= base + 5, (base, nice)


def test_tier_loads_are_counted_in_telemetry(make):
    """Drift 2 of issue 31: ``ckptstore_tier_loads_total`` counted Checkpointer loads only."""
    front = make(durable_every=1)
    front.save(1, _state(1))
    front.wait_durable()
    loads = telemetry.tier_loads_total.value(tier="local")
    read = telemetry.tier_load_bytes_total.value(tier="local")
    target = _blank()
    front.restart().load(target)
    assert telemetry.tier_loads_total.value(tier="local") == loads + 1
    assert telemetry.tier_load_bytes_total.value(tier="local") > read


def test_a_resumed_job_saves_a_step_again_over_the_copy_it_left(make, tmp_path):
    """One stale-copy rule: a job that resumed from step 3 saves step 4 again; the copy an
    earlier run left of it (local only) is unlisted first, never loaded in its place."""
    front = make(durable_every=2, local_keep_last=4)
    for step in (1, 2, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    front = front.restart()
    target = _blank()
    assert front.load(target, 3)[0] == 3
    front.save(4, _state(104))
    front.wait_durable()
    front = front.restart()
    target = _blank()
    step, report = front.load(target)
    assert step == 4 and _same(target, _state(104)), report.source


def test_an_evaluation_load_of_an_older_step_leaves_the_training_loops_copies(
    make, tmp_path, caplog
):
    """Durability adversary of stop 79: another object's load of an older step (an evaluation
    in the training process) marks the process resumed. The training loop's own object goes
    on saving and keeps its local-only copies; a new object saving after that load is a
    restart within the process that went back: it unlists the copies after the step loaded
    (an adversary of the first fix had the abandoned run's state load), with a warning."""
    front = make(durable_every=10, local_keep_last=10)
    for step in range(1, 7):
        front.save(step, _state(step))
    front.wait_durable()
    evaluation = type(front)(front.root, front.tiers, front.storage)
    assert evaluation.load(_blank(), 3)[0] == 3
    evaluation.close()
    front.save(7, _state(7))
    front.wait_durable()
    for step in (4, 5, 6, 7):
        target = _blank()
        assert front.load(target, step)[0] == step and _same(target, _state(step)), step
    restarted = front.restart()
    assert restarted.load(_blank(), 5)[0] == 5
    caplog.set_level(logging.WARNING, logger="ckptstore")
    restarted.save(9, _state(109))
    restarted.wait_durable()
    said = [r.getMessage() for r in caplog.records if "a run the job left" in r.getMessage()]
    assert said and "6-7" in said[0], said
    restarted = restarted.restart()
    assert restarted.latest() == 9
    target = _blank()
    with pytest.raises((CheckpointError, CheckpointException)):
        restarted.load(target, 6)  # the abandoned run's: gone
    restarted.close()


def test_a_save_of_a_step_the_durable_store_holds_is_refused(make, tmp_path):
    """A rollback (load step 1 of 1..3, train, save 2 and 3 again): the Checkpointer committed
    them to the local tier, wait() returned, and the restart loaded the abandoned run's durable
    step 3 (the planner takes a step's durable save first). Refused, as DCP's writer did."""
    front = make(durable_every=1)
    for step in (1, 2, 3):
        front.save(step, _state(step))
    front.wait_durable()
    front = front.restart()
    assert front.load(_blank(), 1)[0] == 1
    with pytest.raises((StepExistsError, CheckpointException)) as info:
        front.save(2, _state(102))
    assert "step 2 is already committed" in str(info.value)
    target = _blank()
    assert front.restart().load(target)[0] == 3 and _same(target, _state(3))


def test_a_second_process_saving_an_earlier_step_leaves_the_later_copies(make, tmp_path):
    """Only a load makes a process a resumed run: one that loaded nothing (a second process on
    the store, a script that does not resume) saving step 2 leaves the local-only steps 3 and 4
    that another process committed (it unlisted them as a run the job left)."""
    front = make(durable_every=10, local_keep_last=4)
    for step in (1, 3, 4):
        front.save(step, _state(step))
    front.wait_durable()
    other = front.restart()
    other.save(2, _state(102))
    other.wait_durable()
    for step in (4, 3):
        target = _blank()
        assert front.restart().load(target, step)[0] == step
        assert _same(target, _state(step)), step
    target = _blank()
    assert front.restart().load(target)[0] == 4 and _same(target, _state(4))


def test_a_second_process_saving_a_step_only_the_local_tier_holds_is_refused(make, tmp_path):
    """A durability reviewer: the old incarnation of a restarted job, still running, saved a
    step its restart had committed to the local tier only; the local tier refused it, the save
    went to durable storage as if the local disk were full, and both saves reported committed
    (a later load returned the old incarnation's state). Steps are write-once in every tier."""
    front = make(durable_every=10, local_keep_last=4)
    for step in (1, 2, 3):
        front.save(step, _state(step))
    front.wait_durable()
    other = front.restart()
    with pytest.raises((StepExistsError, CheckpointException)) as info:
        other.save(3, _state(103))
        other.wait_durable()
    assert "step 3" in str(info.value) and "already committed" in str(info.value), info.value
    for step in (3, "latest"):
        target = _blank()
        assert front.restart().load(target, step)[0] == 3
        assert _same(target, _state(3)), step


def test_local_copies_of_another_save_of_a_durable_step_are_never_loaded(make, tmp_path):
    """One planner for both front-ends: the durable save of a step is its record. A node's
    local dir put back from before the job resumed holds another save of step 2 than the
    durable one; the durable one loads (the Checkpointer's planner took the local copies, which
    more ranks held, and DCP's the durable save, until the two planners became one)."""
    front = make(durable_every=2, local_keep_last=4)
    for step in (1, 2):  # 1 durable, 2 local only
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    shutil.copytree(tmp_path / "local", tmp_path / "local-before")
    front = make(durable_every=1, local_keep_last=4)
    assert front.load(_blank(), 1)[0] == 1
    front.save(2, _state(102))  # durably this time
    front.wait_durable()
    front.close()
    shutil.rmtree(tmp_path / "local")
    shutil.copytree(tmp_path / "local-before", tmp_path / "local")
    target = _blank()
    step, report = make(durable_every=1).load(target)
    assert step == 2 and _same(target, _state(102)), report.source
    assert report.source == "durable", report


def _hang(path: Path) -> None:
    """``path`` becomes a file that never answers a read: a FIFO, whose open waits for a
    writer (a stalled NVMe or a dead mount used as the local tier)."""
    path.unlink()
    os.mkfifo(path)


def _unhang(paths: list[Path]) -> None:
    for path in paths:  # a writer comes and goes: a reader still waiting reads an empty file
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader left


@pytest.mark.parametrize("part", ["chunks", "commits"])
def test_a_hung_local_disk_falls_back_to_durable_storage(make, tmp_path, part):
    """Issue 32 (3): a local chunk or manifest that never answers costs one request deadline,
    then the load reads durable storage (it raised StorageTimeoutError after 30 s, and a hung
    manifest cost 62 s)."""
    front = make(durable_every=1, timeout_s=2.0)
    front.save(1, _state(1))
    front.wait_durable()
    front.close()
    hung = sorted((tmp_path / "local").rglob(f"{part}/**/*"))
    hung = [p for p in hung if p.is_file()]
    assert hung, f"no local {part}"
    for path in hung:
        _hang(path)
    try:
        target = _blank()
        step, report = front.restart().load(target)
        assert step == 1 and _same(target, _state(1)), report.source
        assert report.sources["durable"].chunks > 0, report
    finally:
        _unhang(hung)


def test_gc_of_the_durable_store_while_drains_run_leaves_every_kept_step_whole(
    make, tmp_path, capsys
):
    """Issue 32, an adversary of the drains: ``ckptstore gc --keep-last 2`` runs on the durable
    store again and again while saves drain into it; every step it keeps loads bit for bit,
    and the newest drained step is among them."""
    from ckptstore.cli import main

    durable = tmp_path / "durable"
    front = make(durable_every=1, local_keep_last=2)
    stop, codes = threading.Event(), []

    def collect() -> None:
        while not stop.is_set() and len(codes) < 500:
            codes.append(main(["gc", str(durable), "--keep-last", "2"]))

    front.save(1, _state(1))
    front.wait_durable()  # gc says "no checkpoints" (exit 1) of a store with none yet
    sweeper = threading.Thread(target=collect, daemon=True)
    sweeper.start()
    try:
        for step in range(2, 9):
            front.save(step, _state(step))
        front.wait_durable()
    finally:
        stop.set()
        sweeper.join(timeout=BOUND_S)
    assert not sweeper.is_alive() and codes and set(codes) == {0}, codes
    capsys.readouterr()
    kept = list_steps(Store(str(durable)))
    assert 8 in kept and len(kept) >= 2, kept
    for step in kept:
        target = _blank()
        assert front.restart().load(target, step)[0] == step
        assert _same(target, _state(step)), step


def test_copies_of_a_deleted_store_are_never_loaded_in_the_one_made_again(make, tmp_path, caplog):
    """Item 1 of issue 32: the durable store deleted and made again at the same path, with the
    same ``local_dir``: the old run's local copies belong to another store instance (its
    identity, not its path): never loaded nor counted, one warning naming both ids; the new
    run's own saves are what it resumes from."""
    front = make(durable_every=1, local_keep_last=3)
    for step in (5, 10):
        front.save(step, _state(step))
    front.wait_durable()
    old = read_identity(Store(str(tmp_path / "durable")))
    assert old is not None and not old.adopted
    front.close()
    shutil.rmtree(tmp_path / "durable")
    (tmp_path / "durable").mkdir()
    caplog.set_level(logging.WARNING, logger="ckptstore")
    front = front.restart()
    target = _blank()
    with pytest.raises(BaseException) as nothing:  # DCP wraps it in a BaseException
        front.load(target)
    assert isinstance(nothing.value, CheckpointNotFoundError) or "no tier holds any step" in repr(
        nothing.value
    ), repr(nothing.value)
    if isinstance(front, CheckpointerFront):
        assert front.ckpt.latest() is None
        with pytest.raises(CheckpointNotFoundError):
            front.ckpt.load(target, fallback=True)
    assert _same(target, _blank())
    warned = [r.getMessage() for r in caplog.records if "another instance" in r.getMessage()]
    assert warned and old.id in warned[0], [r.getMessage() for r in caplog.records]
    for step in (1, 2, 3):  # the README's pattern: nothing to resume from, start fresh
        front.save(step, _state(100 + step))
    front.wait_durable()
    front = front.restart()
    target = _blank()
    step, _ = front.load(target)
    assert step == 3 and _same(target, _state(103))
    if isinstance(front, CheckpointerFront):
        assert front.ckpt.latest() == 3 and front.ckpt.steps() == [1, 2, 3]
        target = _blank()
        assert front.ckpt.load(target, fallback=True) == 3 and _same(target, _state(103))
    new = read_identity(Store(str(tmp_path / "durable")))
    assert new is not None and new.id != old.id


def test_the_store_made_again_saves_the_step_numbers_its_old_copies_hold(make, tmp_path):
    """The durable store deleted and made again, the same ``local_dir``, a job started from
    step 0 again: its saves of the step numbers the old instance's local copies hold (never
    loaded) were refused as another save of the step. Those copies are unlisted instead."""
    front = make(durable_every=2, local_keep_last=3)
    for step in (1, 2, 3):
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    shutil.rmtree(tmp_path / "durable")
    (tmp_path / "durable").mkdir()
    front = front.restart()
    for step in (1, 2, 3):
        front.save(step, _state(100 + step))
    front.wait_durable()
    for step in (3, 2):
        target = _blank()
        assert front.restart().load(target, step)[0] == step and _same(target, _state(100 + step))


def _only_local_copies(make: Any, tmp_path: Path) -> tuple[Front, Path]:
    """Steps 1-3 in the local tier only (the first drain never committed: a job killed), the
    front closed; rank 0's store of copies."""
    front = make(durable_every=10, local_keep_last=4)
    for step in (1, 2, 3):
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    durable = Store(str(tmp_path / "durable"))
    for step in list_steps(durable):
        durable.delete(commit_key(step))
    (copies,) = (tmp_path / "local").glob("job-*/rank-00000")
    return front, copies


def test_a_job_whose_load_finds_nothing_starts_over_past_copies_no_load_takes(make, tmp_path):
    """A reviewer: the job's first drain never committed (killed), and the node's copies are of
    a run no load takes (here of a 2-rank world; a crash between two ranks' manifests or a
    replaced node leave the like). The restart's load found nothing, it started over as
    examples/train_gpt.py does, and its save of step 1 failed on the copy it could not load
    (StepExistsError, at every restart). A load of the latest step that finds none makes the
    next save unlist those copies, as a resume does."""
    from tests.helpers.crafted import manifest_doc, put_manifest

    front, copies = _only_local_copies(make, tmp_path)
    local = Store(str(copies))
    for step in list_steps(local):
        doc = manifest_doc(local, step)
        doc["user"][TIER_KEY]["world_size"] = 2
        put_manifest(local, step, doc)
    front = front.restart()
    with pytest.raises(BaseException) as nothing:  # DCP wraps it in a BaseException
        front.load(_blank())
    assert isinstance(nothing.value, CheckpointNotFoundError) or "no tier holds" in repr(
        nothing.value
    ), repr(nothing.value)
    for step in (1, 2, 3):  # nothing to resume: start over
        front.save(step, _state(100 + step))
    front.wait_durable()
    target = _blank()
    step, _ = front.restart().load(target)
    assert step == 3 and _same(target, _state(103))


@pytest.mark.parametrize("refusing", ["skip"], indirect=True)
def test_a_save_bound_for_durable_storage_skipped_as_unhealthy_passes_it_on(
    make, refusing, tmp_path
):
    """A reviewer: a save due for durable storage that ``on_unhealthy="skip"`` stored nowhere
    left the healthy saves after it in the local tier alone until the next due one."""
    front = make(durable_every=3, local_keep_last=5)
    for step in (1, 2, 3):
        front.save(step, _state(step))
    bad = _state(4)
    bad["w"][5] = float("nan")
    front.save(4, bad)
    assert not front.last_save().committed
    for step in (5, 6):
        front.save(step, _state(step))
    front.wait_durable()
    assert list_steps(Store(str(tmp_path / "durable"))) == [1, 5]


def test_a_resume_whose_every_local_copy_misses_a_chunk_is_no_fresh_start(make, tmp_path):
    """A reviewer: the job's steps were in the local tier alone and each missed a chunk: the
    Checkpointer's load with fallback raised a plain CheckpointNotFoundError, which the README's
    resume took for nothing to resume (no durable step either), and the job started over. Saves
    found that none loads are ``NoLoadableStepError``; DCP's load of the newest fails. (The
    killed drain's chunks go too: a chunk found there by its digest would load step 1.)"""
    front, copies = _only_local_copies(make, tmp_path)
    for path in (copies / "chunks").rglob("*"):
        if path.is_file():
            path.unlink()
    shutil.rmtree(tmp_path / "durable" / "chunks")
    front = front.restart()
    with pytest.raises((NoLoadableStepError, CheckpointException)) as failed:
        front.resume(_blank())
    assert "missing" in str(failed.value) or "missing" in repr(failed.value.__cause__)


def test_a_healthy_resume_finding_only_steps_of_unknown_health_is_no_fresh_start(
    front_type, make, tmp_path, monkeypatch
):
    """A reviewer: with ``HealthPolicy(scan=False)`` every step's health is unknown, and the
    resume of examples/train_gpt.py (``healthy=True``) before the first drain found no healthy
    step, took that for nothing to resume, started over, and its first save failed on the copies
    it passed over. Saves that none is healthy are not nothing: the resume says so."""
    monkeypatch.setattr(front_type, "health", HealthPolicy(scan=False))
    front, _ = _only_local_copies(make, tmp_path)
    front = front.restart()
    with pytest.raises(NoHealthyStepError, match="step 3: health unknown.*without healthy=True"):
        front.resume(_blank(), healthy=True)
    target = _blank()
    assert front.resume(target) == 3 and _same(target, _state(3))


def test_a_healthy_resume_says_where_each_unhealthy_step_it_passes_over_is_held(
    front_type, make, tmp_path, monkeypatch, caplog
):
    """Step 2 (NaN) is held only by the local tiers, step 3 (NaN) is drained: the resume with
    ``healthy=True`` loads step 1 and names each, with where it is held (it named the
    durable store for both)."""
    monkeypatch.setattr(front_type, "health", HealthPolicy(on_unhealthy="save"))
    front = make(durable_every=2)
    for step in (1, 2, 3):
        state = _state(step)
        state["b"][step] = float("nan") if step > 1 else 0.0
        front.save(step, state)
    front.wait_durable()
    durable = Store(str(tmp_path / "durable"))
    assert list_steps(durable) == [1, 3] and {2, 3} <= set(_local_copies(tmp_path))
    caplog.set_level(logging.WARNING, logger="ckptstore")
    assert front.restart().resume(_blank(), healthy=True) == 1
    said = [r.getMessage() for r in caplog.records if "skipped by healthy=True" in r.getMessage()]
    assert len(said) == 2, said
    assert "step 3: unhealthy" in said[0] and f"held in {durable.uri}" in said[0], said
    assert "step 2: unhealthy" in said[1] and "held only by the local tiers" in said[1], said


@pytest.mark.parametrize("why", ["a chunk missing", "a local read failing"])
def test_a_load_that_fails_for_another_reason_never_lets_the_job_start_over(
    make, tmp_path, monkeypatch, why
):
    """A reviewer of the rule above: a load of the latest step that failed on a missing chunk
    (no fallback), or whose local listing met a read error, raised CheckpointNotFoundError
    too, and the next save unlisted loadable copies. Only a plan that found nothing, with every
    copy read and durable storage listed, lets a job start over; here the save is refused."""
    from ckptstore.errors import StorageError
    from ckptstore.tiers.local import LocalTier

    front, copies = _only_local_copies(make, tmp_path)
    if why == "a chunk missing":
        local = Store(str(copies))
        index = read_rank_index(local, load_manifest(local, 3).ranks[0])
        older = read_rank_index(local, load_manifest(local, 2).ranks[0])
        own = sorted(set(index.chunks) - set(older.chunks))
        os.chmod(copies / chunk_key(own[0]), 0o644)
        (copies / chunk_key(own[0])).unlink()
    else:

        def unreadable(self, ward, unread=None):
            raise StorageError(f"{copies}: injected read error")

        monkeypatch.setattr(LocalTier, "copies_made", unreadable)
    front = front.restart()
    with pytest.raises((CheckpointError, CheckpointException)):
        front.load(_blank())
    monkeypatch.undo()
    with pytest.raises((StepExistsError, CheckpointException)):
        front.save(2, _state(102))
    target = _blank()
    assert front.restart().load(target, 2)[0] == 2 and _same(target, _state(2))


def test_a_store_of_an_older_version_adopts_an_identity_and_keeps_its_copies(make, tmp_path):
    """A store written before identities (its ``identity.json`` and the copies' ids removed):
    the first tiered writer records an identity marked adopted, and the unmarked copies of
    that store still load from the local tier."""
    front = make(durable_every=1)
    front.save(1, _state(1))
    front.wait_durable()
    front.close()
    _strip_identity(tmp_path)
    front = front.restart()
    front.save(2, _state(2))
    front.wait_durable()
    assert read_identity(Store(str(tmp_path / "durable"))).adopted
    _strip_identity(tmp_path, keep_store=True)  # step 2's copy unmarked too, as of before
    front = front.restart()
    target = _blank()
    step, report = front.load(target)
    assert step == 2 and report.source == "local" and _same(target, _state(2))


def test_a_store_whose_identity_was_removed_takes_back_the_id_its_copies_record(
    make, tmp_path, caplog
):
    """Adversary of stop 76: with ``identity.json`` deleted (the obvious fix for a damaged
    one), the next start made a new id, so the copies (which record the old one) were another
    instance's: the newest step, held by the local tier alone, was never loaded, and the next
    save unlisted it. The copies of the store's own saves vouch for the old id, which is
    recorded again."""
    front = make(durable_every=3)
    for step in (1, 2):  # 1 durable, 2 in the local tier alone
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    durable = Store(str(tmp_path / "durable"))
    before = read_identity(durable)
    (tmp_path / "durable" / IDENTITY_KEY).unlink()
    caplog.set_level(logging.WARNING)
    front = front.restart()
    target = _blank()
    step, report = front.load(target)
    assert step == 2 and report.source == "local" and _same(target, _state(2))
    front.save(3, _state(3))  # a DCP reader records nothing: the writer does
    after = read_identity(durable)
    assert after is not None and after.id == before.id
    assert not after.adopted  # copies that record no id are no more its own than before
    said = [r.getMessage() for r in caplog.records]
    assert any(f"id {before.id}" in m and "no identity.json" in m for m in said), said
    assert not any("another instance" in m for m in said), said


def test_unreadable_copies_push_no_vouching_copy_out_of_the_claims(make, tmp_path):
    """Adversary of stop 76: a rank's 64 newest entries were read, unreadable ones included,
    so 64 damaged manifests numbered above the copies left none to vouch: a new id."""
    front = make(durable_every=3, local_keep_last=5)
    for step in (1, 2):
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    (copies,) = (tmp_path / "local").glob("job-*/rank-00000")
    for step in range(100, 170):
        (copies / commit_key(step)).write_bytes(b"{not json")
    before = read_identity(Store(str(tmp_path / "durable"))).id
    (tmp_path / "durable" / IDENTITY_KEY).unlink()
    assert [(step, ident) for step, _, ident in copy_claims(copies)] == [(2, before), (1, before)]
    target = _blank()
    assert front.restart().load(target)[0] == 2 and _same(target, _state(2))


def test_copies_of_other_saves_vouch_for_no_id_of_a_store_without_one(make, tmp_path):
    """The same, but the store's steps are other saves than the copies' (the store replaced
    by another job's of the same path): a new id, and the copies are never loaded."""
    front = make(durable_every=3)
    for step in (1, 2):
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    old = read_identity(Store(str(tmp_path / "durable")))
    shutil.rmtree(tmp_path / "durable")
    other = make(local_dir=tmp_path / "other-local", durable_every=1)
    other.save(1, _state(7))
    other.wait_durable()
    other.close()
    (tmp_path / "durable" / IDENTITY_KEY).unlink()  # a store of steps, no identity
    front = front.restart()
    target = _blank()
    step, _ = front.load(target)
    assert step == 1 and _same(target, _state(7))
    front.save(3, _state(3))  # a tiered writer records an identity: not the copies' id
    made = read_identity(Store(str(tmp_path / "durable")))
    assert made is not None and made.id != old.id


def _strip_identity(tmp_path: Path, keep_store: bool = False) -> None:
    """Make the stores as an older version wrote them: no identity, copies without an id."""
    if not keep_store:
        (tmp_path / "durable" / IDENTITY_KEY).unlink()
    for path in (tmp_path / "local").rglob("commits/*.json"):
        doc = json.loads(path.read_bytes())
        doc.pop("checksum")
        doc["user"][TIER_KEY].pop("store_id", None)
        doc["checksum"] = hash_bytes(json.dumps(doc, separators=(",", ":")).encode())
        path.chmod(0o644)
        path.write_bytes(json.dumps(doc, separators=(",", ":")).encode())


# -- scenarios on 4 ranks as 2 nodes -----------------------------------------------------------


def _two_nodes(
    kind: str,
    rank: int,
    root: str,
    base: str,
    storage: StorageOptions | None = None,
    front_type: type[Front] | None = None,
    **tiers: Any,
) -> Front:
    node = rank // 2
    options = TierOptions(local_dir=Path(base) / f"node-{node}", node_rank=node, **tiers)
    front = (front_type or FRONTS[kind])(Path(root), options, storage or StorageOptions())
    front.no_dist = False
    return front


def _ranks_own(rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """Keys of this rank's own (a DCP save writes a replicated plain tensor once)."""
    return {f"{k}{rank}": v for k, v in state.items()}


def _save_two_steps(
    kind: str, rank: int, root: str, base: str, tiers: dict[str, Any], wait_durable: bool = False
) -> None:
    """Steps 1 and 2 saved by every rank of two nodes, each rank's state its own."""
    front = _two_nodes(kind, rank, root, base, **tiers)
    for step in (1, 2):
        front.save(step, _ranks_own(rank, _state(10 * rank + step)))
    if wait_durable:
        front.wait_durable()
    front.close()
    torch.distributed.barrier()


def _durable_next_on_some_ranks(rank: int, world: int, kind: str, root: str, base: str) -> None:
    front = _two_nodes(kind, rank, root, base, durable_every=10)
    for step in (1, 2, 3):
        if step == 3 and rank == world - 1:  # one rank's own reason (its time limit, say)
            front.durable_next()
        front.save(step, _ranks_own(rank, _state(10 * rank + step)))
    front.wait_durable()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ckptstore").addHandler(handler)
    front.close()
    assert list_steps(Store(root)) == [1, 3], list_steps(Store(root))
    # adversary of stop 78: rank 0 said the last save was local only where another rank's
    # durable_next() had sent it to durable storage
    assert not [m for m in said if "newest step saved" in m], said


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_durable_next_on_one_rank_sends_that_save_to_durable_storage(kind, tmp_path):
    """Adversary of stop 77: ``durable_next()`` on a rank other than DCP's coordinator was
    never heard (the Checkpointer's ranks agree on any rank's): the save it asked for stayed in
    the local tiers. Every rank's request now reaches the plan."""
    run_ranks(_durable_next_on_some_ranks, 4, kind, str(tmp_path / "durable"), str(tmp_path))


def _load_twice(kind: str, rank: int, root: str, base: str, tiers: dict, want: int) -> None:
    """Two loads of "latest" in a row, each by a new front-end, both of step ``want``."""
    for _ in range(2):
        target = _ranks_own(rank, _blank())
        step, _ = _two_nodes(kind, rank, root, base, **tiers).load(target)
        assert step == want and _same(target, _ranks_own(rank, _state(10 * rank + want))), rank


def _save_two_then_replace_node_1(
    kind: str, rank: int, root: str, base: str, tiers: dict[str, Any]
) -> None:
    """Steps 1 (durable) and 2 (in the local tiers and their peer copies only) saved by every
    rank of two nodes; then node 1 is replaced: its local dir is gone."""
    _save_two_steps(kind, rank, root, base, tiers)
    if rank == 2:
        shutil.rmtree(Path(base) / "node-1")
    torch.distributed.barrier()


def _peer_repair(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=1, durable_every=5, peer_budget_bytes=8 * CHUNK)
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    target = _ranks_own(rank, _blank())
    step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
    want = _ranks_own(rank, _state(10 * rank + 2))
    assert step == 2 and _same(target, want), (rank, step, report.source)
    if rank >= 2:
        assert report.source == "peer", report
        # Drift 4 of issue 31: a DCP repair moved one chunk per round (its reader's tier
        # policy had peer_budget_bytes=1); both now take the TierOptions given.
        assert report.peer_buffer_bytes >= 2 * CHUNK, report  # several chunks a round


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_replaced_node_restores_from_peer_copies_in_rounds_of_the_budget(kind, tmp_path):
    run_ranks(_peer_repair, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _own_index_damaged(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=1, durable_every=5)
    _save_two_steps(kind, rank, root, base, tiers)
    if rank == 2:
        (own,) = (Path(base) / "node-1").glob("job-*/rank-00002")
        (index,) = own.glob(f"indexes/*/{2:020d}/*/rank-*.json")
        index.write_bytes(index.read_bytes()[:20])
    torch.distributed.barrier()
    _load_twice(kind, rank, root, base, tiers, 2)  # and the next load reads the repaired copy


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_copy_whose_own_index_is_damaged_is_restored_from_its_peer_copy(kind, tmp_path):
    """Reviewer of stop 61: the DCP front-end failed every load of a step whose rank 2 copy had
    a truncated index (only its first source was ever tried), though node 0 kept an intact
    peer copy; the Checkpointer restored it. Both restore it now."""
    run_ranks(_own_index_damaged, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _local_blip(rank: int, world: int, kind: str, root: str, base: str) -> None:
    from ckptstore.errors import StorageError
    from ckptstore.store import core

    tiers = dict(durable_every=5)  # no peer copies: step 2 is held by rank 2's copy alone
    _save_two_steps(kind, rank, root, base, tiers)
    get, get_view = core.Store.get, core.Store.get_view

    def failing(read: Any) -> Any:
        def fail(self: Store, key: str, *args: Any, **kwargs: Any) -> Any:
            if "rank-00002" in self.uri and key.startswith("chunks/"):
                raise StorageError(f"{self.uri}/{key}: EIO")
            return read(self, key, *args, **kwargs)

        return fail

    if rank == 2:
        core.Store.get, core.Store.get_view = failing(get), failing(get_view)
    try:
        with pytest.raises(BaseException, match="EIO"):  # DCP: CheckpointException
            _two_nodes(kind, rank, root, base, **tiers).load(_ranks_own(rank, _blank()))
    finally:
        core.Store.get, core.Store.get_view = get, get_view
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())
    step, _ = _two_nodes(kind, rank, root, base, **tiers).load(target)
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), rank


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_local_read_error_leaves_the_copy_for_the_next_load(kind, tmp_path):
    """Reviewer of stop 61: every rank of a node reported its directory's copies, so rank 2
    "repaired" its copy from rank 3, which reads the same directory; the repair unlisted the
    intact copy first, and after one transient read error the next load resumed from step 1
    (the Checkpointer; DCP kept it). Now a directory is never a peer of its own ranks."""
    run_ranks(_local_blip, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _one_rank_refused(rank: int, world: int, kind: str, root: str, base: str) -> None:
    from ckptstore.store import core

    front = _two_nodes(kind, rank, root, base, durable_every=1)
    front.save(1, _ranks_own(rank, _state(10 * rank + 1)))
    front.wait_durable()
    originals = {name: getattr(core.Store, name) for name in ("get", "get_view", "put")}

    def refusing(call: Any) -> Any:
        def refuse(self: Store, key: str, *args: Any, **kwargs: Any) -> Any:
            if self.uri.rstrip("/").endswith("/durable"):
                raise StorageError(f"{self.uri}/{key}: refused to rank 1 alone")
            return call(self, key, *args, **kwargs)

        return refuse

    if rank == 1:
        for name, call in originals.items():
            setattr(core.Store, name, refusing(call))
    try:
        front.save(2, _ranks_own(rank, _state(10 * rank + 2)))
        with pytest.raises(CheckpointError, match="refused to rank 1 alone"):
            front.wait_durable()  # on every rank: rank 1's own error, not a timeout
    finally:
        for name, call in originals.items():
            setattr(core.Store, name, call)
    torch.distributed.barrier()
    front.save(3, _ranks_own(rank, _state(10 * rank + 3)))
    front.wait_durable()
    assert list_steps(Store(root))[-1] == 3, list_steps(Store(root))
    front.close()


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_drain_one_rank_fails_names_its_error_and_the_next_drains(kind, tmp_path):
    """The fourth fix adversary of stop 80 (HIGH): durable storage refusing one rank's
    requests failed that rank's reading of the newest step's index before the exchanges of
    the drain, so the ranks' collectives no longer paired: every rank failed on a gloo
    timeout naming nothing, and every later drain on "Application timeout caused pair
    closure", until the job restarted. The rank now fails where every rank hears its error,
    and the next drain commits."""
    run_ranks(_one_rank_refused, 2, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


@contextlib.contextmanager
def _chunk_reads(where: str):
    """The chunk reads (``Store.get`` / ``get_view``) of stores under ``where`` that returned
    bytes, by the store's URI and the key (a repair first looks for each chunk in the rank's
    own store: on a wiped node, a read of a missing object)."""
    seen: list[tuple[str, str]] = []
    originals = {name: getattr(Store, name) for name in ("get", "get_view")}

    def counted(original: Any) -> Any:
        def read(self: Store, key: str, *args: Any, **kwargs: Any) -> Any:
            data = original(self, key, *args, **kwargs)
            if self.uri.startswith(where) and "chunks/" in key:
                seen.append((self.uri, key))
            return data

        return read

    for name, original in originals.items():
        setattr(Store, name, counted(original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(Store, name, original)


def _repair_in_memory(
    rank: int, world: int, kind: str, root: str, base: str, bound: int, cores: float
) -> None:
    tiers = dict(peer_copies=1, durable_every=5, repair_memory_bytes=bound)
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    target = _ranks_own(rank, _blank())
    loader = _two_nodes(kind, rank, root, base, **tiers)
    # The host's cores per rank decide whether a kept repair's buffers are touched ahead.
    made: list[list[int]] = []

    class Counted(tier_transfer._FaultAhead):
        def __init__(self, sizes: list[int], ahead: int = 2) -> None:
            made.append(sizes)
            super().__init__(sizes, ahead)

    # ... and whether an intact rank's own copy is verified during the repair: here every
    # chunk before the repair starts (the thread is waited for), so that the load takes all.
    served: list[int] = []  # per VerifiedAhead, the chunks the load took from it

    class Waited(tier_ahead.VerifiedAhead):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._thread.join(timeout=60)
            served.append(0)

        def take(self, digest: str) -> Any:
            raw = super().take(digest)
            served[-1] += raw is not None
            return raw

    patched = {
        tier_transfer: {"cores_per_rank": lambda ranks: cores, "_FaultAhead": Counted},
        tier_ahead: {"cores_per_rank": lambda ranks: cores, "VerifiedAhead": Waited},
    }
    saved = {m: {name: getattr(m, name) for name in names} for m, names in patched.items()}
    for module, names in patched.items():
        for name, value in names.items():
            setattr(module, name, value)
    try:
        with _chunk_reads(str(Path(base) / f"node-{rank // 2}")) as reads:
            step, report = loader.load(target)
    finally:
        for module, names in saved.items():
            for name, value in names.items():
                setattr(module, name, value)
    mine = [key for uri, key in reads if uri.rstrip("/").endswith(f"rank-{rank:05d}")]
    if rank < 2 and cores >= tier_ahead.AHEAD_CORES:  # each own chunk hashed once, ahead
        assert len(served) == 1 and served[0] == len(set(mine)) == len(mine) > 0, (served, mine)
    else:  # a repaired rank has no copy of its own; too few cores per rank: no thread
        assert served == [], served
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), report
    if rank >= 2:
        assert report.source == "peer" and report.sources["peer"].chunks > 0, report
        if bound:  # loaded from the verified bytes in memory: none read back from the copy
            assert mine == [], mine
        else:  # over the bound: written first, then read back, as before
            assert mine, report
        # Buffers touched ahead only for a copy kept in memory, on a core per rank: one per
        # round, each the size of its round.
        if bound and cores >= 1:
            assert len(made) == 1 and len(made[0]) >= 1, made
            assert sum(made[0]) >= report.sources["peer"].bytes, (made, report)
        else:
            assert made == [], made
    else:
        assert made == [], made  # nothing received
    # A save right away (the repaired copy may still be being written: it waits for it).
    loader.save(3, _ranks_own(rank, _state(10 * rank + 3)))
    loader.close()
    torch.distributed.barrier()
    # The repaired copy is complete and committed: a load of it (no wipe) reads every rank's
    # own copy from its local tier, every chunk verified there; the save after it as well.
    for want in (2, 3):
        target = _ranks_own(rank, _blank())
        step, report = _two_nodes(kind, rank, root, base, **tiers).load(target, want)
        assert step == want and report.source == "local", (rank, want, report)
        assert _same(target, _ranks_own(rank, _state(10 * rank + want))), (rank, want)
        assert report.sources["local"].chunks > 0, report


@pytest.mark.dist
@pytest.mark.parametrize(
    "bound, cores",
    [(1 << 30, 4.0), (1 << 30, 1.0), (1 << 30, 0.5), (0, 4.0)],
    ids=["in-memory", "in-memory-a-core-each", "in-memory-more-ranks-than-cores", "over-the-bound"],
)
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_repaired_copy_loads_from_the_verified_bytes_then_is_written(
    kind, bound, cores, tmp_path
):
    """Issue 36: a chunk a wiped node's rank receives from its holder is hashed once and lands
    in the state from memory, its copy written to the local tier after the load (complete and
    committed: the next load reads it there), its receive buffers touched ahead where the host
    has a core per rank, as the intact ranks' own copies are verified meanwhile; above ``repair_memory_bytes`` the copy is written first and read
    back, as before."""
    root = str(tmp_path / "durable")
    run_ranks(_repair_in_memory, 4, kind, root, str(tmp_path), bound, cores, timeout_s=240)


def _repair_write_dies(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=1, durable_every=5)
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    # The repaired copy's write (after the load) dies before its manifest, as a crash would
    # leave it: chunks and index written, nothing listed.
    commit_manifest = tier_transfer.commit_manifest
    tier_transfer.commit_manifest = lambda *a, **k: (_ for _ in ()).throw(OSError("crashed"))
    try:
        target = _ranks_own(rank, _blank())
        loader = _two_nodes(kind, rank, root, base, **tiers)
        step, report = loader.load(target)
        wait_written()
    finally:
        tier_transfer.commit_manifest = commit_manifest
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), report
    if rank >= 2:
        (own,) = (Path(base) / "node-1").glob(f"job-*/rank-{rank:05d}")
        assert list_steps(Store(str(own))) == [], own  # the half-written copy is not listed
        assert any(p.is_file() for p in own.rglob("chunks/*/*")), own
    loader.save(3, _ranks_own(rank, _state(10 * rank + 3)))  # retention and saves go on
    loader.close()
    torch.distributed.barrier()
    for want, where in ((2, "peer"), (2, "local"), (3, "local")):  # repaired again, then held
        target = _ranks_own(rank, _blank())
        step, report = _two_nodes(kind, rank, root, base, **tiers).load(target, want)
        assert step == want and _same(target, _ranks_own(rank, _state(10 * rank + want)))
        assert report.source == (where if rank >= 2 else "local"), (rank, want, report)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_repaired_copy_whose_write_dies_stays_unlisted_and_is_repaired_again(kind, tmp_path):
    """Issue 36: the write of a repaired copy after the load dies before its manifest (a crash
    then): the copy stays invisible, later saves and retention go on, and the next load of
    that step repairs it again from the peer's copy."""
    root = str(tmp_path / "durable")
    run_ranks(_repair_write_dies, 4, kind, root, str(tmp_path), timeout_s=240)


def _repair_lease_left(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=1, durable_every=5)
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    # The holders' leases of this repair stay in their stores, as a holder killed while it
    # sends leaves them.
    release = tier_transfer.Lease.release
    tier_transfer.Lease.release = lambda self, *a, **k: None
    try:
        step, _ = _two_nodes(kind, rank, root, base, **tiers).load(_ranks_own(rank, _blank()))
        wait_written()
    finally:
        tier_transfer.Lease.release = release
    assert step == 2, rank
    torch.distributed.barrier()
    if rank == 2:  # node 1 replaced again: its repaired copy gone
        shutil.rmtree(Path(base) / "node-1")
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())
    step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), report
    assert report.source == ("peer" if rank >= 2 else "local"), (rank, report)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_lease_an_earlier_repair_left_does_not_block_the_next_repair(kind, tmp_path):
    """A holder killed while it sends a copy leaves its lease; the next repair of that step
    from that holder takes a lease of its own (it failed on the leftover, falling back to an
    older step, when the lease's name was the same for every repair)."""
    root = str(tmp_path / "durable")
    run_ranks(_repair_lease_left, 4, kind, root, str(tmp_path), timeout_s=240)


def _shared_local_dir(rank: int, world: int, kind: str, root: str, base: str) -> None:
    node = rank // 2
    tiers = TierOptions(
        local_dir=Path(base) / "shared", node_rank=node, peer_copies=1, durable_every=5
    )

    def front() -> Front:
        made = FRONTS[kind](Path(root), tiers, StorageOptions())
        made.no_dist = False
        return made

    saving = front()
    for step in (1, 2, 3):  # 1 durable, 2 and 3 in the local tiers and their peer copies only
        saving.save(step, _ranks_own(rank, _state(10 * rank + step)))
    saving.close()
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())
    step, report = front().load(target)
    assert step == 3 and _same(target, _ranks_own(rank, _state(10 * rank + 3))), report
    target = _ranks_own(rank, _blank())
    assert front().load(target, 1)[0] == 1
    assert _same(target, _ranks_own(rank, _state(10 * rank + 1))), rank


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_two_nodes_given_the_same_local_dir_save_and_load_unmixed(kind, tmp_path):
    """Issue 32's adversary list: a local_dir on a shared file system given to every node. Each
    rank's copies live under its own rank directory, so a holder's copy of a ward is the ward's
    own copy: saves and loads stay unmixed."""
    run_ranks(_shared_local_dir, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _swapped_nodes(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=0, durable_every=5)
    front = _two_nodes(kind, rank, root, base, **tiers)
    for step in (1, 2):  # 1 durable, 2 in the local tiers only
        front.save(step, _ranks_own(rank, _state(10 * rank + step)))
    front.close()
    torch.distributed.barrier()
    # The restart hands the two hosts out the other way round (torchrun or SLURM numbering
    # the nodes otherwise): ranks 0-1 run where ranks 2-3 ran, and the other way round.
    node = 1 - rank // 2
    options = TierOptions(local_dir=Path(base) / f"node-{node}", node_rank=node, **tiers)
    swapped = FRONTS[kind](Path(root), options, StorageOptions())
    swapped.no_dist = False
    target = _ranks_own(rank, _blank())
    step, report = swapped.load(target)
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), report
    assert report.source == "peer", report
    for step in (3, 4):  # 3 durable (a process's first save is), 4 in the local tiers only
        swapped.save(step, _ranks_own(rank, _state(10 * rank + step)))
        torch.distributed.barrier()
        # The stores the ranks left on the other node stay while retention (local_keep_last
        # 2) would keep a copy of their age, then go: repeated restarts do not fill the disk.
        for n, now_here in ((0, [2, 3]), (1, [0, 1])):
            held = sorted(int(p.name[5:]) for p in (Path(base) / f"node-{n}").glob("job-*/rank-*"))
            assert held == ([0, 1, 2, 3] if step == 3 else now_here), (step, n, held)
    swapped.close()
    torch.distributed.barrier()
    # Node 1 (now ranks 0-1) is replaced: with no peer copies, step 4 is lost for them; the
    # load takes the durable step 3 and says which newer step it passed over and why.
    if rank == 0:
        shutil.rmtree(Path(base) / "node-1")
    torch.distributed.barrier()
    records = log_records("ckptstore.tiers.plan")
    target = _ranks_own(rank, _blank())
    step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
    assert step == 3 and _same(target, _ranks_own(rank, _state(10 * rank + 3))), report
    if rank == 0:
        said = [r.getMessage() for r in records if "passed over" in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].startswith("step 4 passed over") and "ranks 0-1 " in said[0], said
        assert said[0].endswith("loading step 3"), said


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_ranks_restarted_on_each_others_hosts_find_their_copies_there(kind, tmp_path):
    """Reviewer 2 of stop 57: a restart that numbers the nodes the other way round finds each
    rank's newest copy in the other node's local dir (every rank directory of a node's job
    directory is offered to the plan, by both front-ends); a load that must pass over a newer
    step some ranks lack names it."""
    run_ranks(_swapped_nodes, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _rolled_back_on_swapped_nodes(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=0, durable_every=5)

    def state(run: int, step: int) -> dict[str, Any]:
        return _ranks_own(rank, _state(100 * run + 10 * rank + step))

    def placed(node: int) -> Front:
        options = TierOptions(local_dir=Path(base) / f"node-{node}", node_rank=node, **tiers)
        front = FRONTS[kind](Path(root), options, StorageOptions())
        front.no_dist = False
        return front

    first = placed(rank)  # a node per rank
    for step in (1, 2, 3, 4):  # 1 durable, 2-4 in the local tiers only
        first.save(step, state(1, step))
    first.close()
    torch.distributed.barrier()
    second = placed(1 - rank)  # the nodes handed out the other way round; a rollback to 1
    target = _ranks_own(rank, _blank())
    assert second.load(target, 1)[0] == 1
    for step in (2, 3):
        second.save(step, state(2, step))
    second.close()
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())
    step, report = placed(1 - rank).load(target)
    assert step == 3 and _same(target, state(2, 3)), report  # not run 1's abandoned step 4


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_rollback_on_swapped_nodes_never_brings_the_abandoned_run_back(kind, tmp_path):
    """Reviewer of stop 59: the stores a restart left on the other node still held the
    abandoned run's steps 3-4 after a rollback to step 1 (only the ranks' own and wards'
    stores were unlisted), and the next restart loaded step 4 of the run the job left. The
    first save after a load now unlists them in the stores a node no longer keeps too."""
    run_ranks(
        _rolled_back_on_swapped_nodes,
        2,
        kind,
        str(tmp_path / "durable"),
        str(tmp_path),
        timeout_s=240,
    )


def _run_while_a_node_was_away(
    rank: int, world: int, kind: str, root: str, base: str, phase: int
) -> None:
    """Phase 1: steps 1 (durable) to 4 on nodes 0 and 1. Phase 2 (a restart): node 1 away, its
    ranks on node 2, the job rolls back to step 1 and saves 2 and 3 again. Phase 3 (another):
    node 1 back with phase 1's copies, node 2 gone; "latest" must be phase 2's step 3."""
    tiers = dict(peer_copies=1, durable_every=5)

    def state(run: int, step: int) -> dict[str, Any]:
        return _ranks_own(rank, _state(100 * run + 10 * rank + step))

    node = (0, 2 if phase == 2 else 1)[rank // 2]
    options = TierOptions(local_dir=Path(base) / f"node-{node}", node_rank=node, **tiers)
    front = FRONTS[kind](Path(root), options, StorageOptions())
    front.no_dist = False
    if phase == 1:
        for step in (1, 2, 3, 4):  # 1 durable, 2-4 in the local tiers and their peer copies
            front.save(step, state(1, step))
    elif phase == 2:
        assert front.load(_ranks_own(rank, _blank()), 1)[0] == 1
        for step in (2, 3):
            front.save(step, state(2, step))
    else:
        said = log_records("ckptstore.tiers.plan")
        target = _ranks_own(rank, _blank())
        step, report = front.load(target)
        assert step == 3 and _same(target, state(2, 3)), (rank, step, report)  # not run 1's 4
        if rank == 0:
            assert any(
                "copies of steps 3-4 not loaded: a run the job left" in r.getMessage() for r in said
            ), said
    front.close()


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_node_away_during_a_rollback_never_brings_the_abandoned_run_back(kind, tmp_path):
    """Reviewer of stop 61: the copies of steps after the one a job rolled back to were
    unlisted only on the nodes the resumed job ran on; a node that was away came back with
    run 1's steps 3 and 4, and "latest" loaded run 1's step 4 (both front-ends). The resume is
    recorded in the durable store, and copies made before it of later steps are passed over.
    Each phase is a job of its own processes, as a restart is."""
    for phase in (1, 2, 3):
        run_ranks(
            _run_while_a_node_was_away,
            4,
            kind,
            str(tmp_path / "durable"),
            str(tmp_path),
            phase,
            timeout_s=240,
        )


def _reencoded(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=1, durable_every=5)

    def front(compression: str) -> Front:
        encoding = EncodingOptions(chunk_bytes=CHUNK, compression=compression)
        made = type(kind, (FRONTS[kind],), {"encoding": encoding})
        return _two_nodes(made.name, rank, root, base, front_type=made, **tiers)

    def state(step: int) -> dict[str, Any]:  # compressible: zstd stores it otherwise than raw
        return _ranks_own(rank, {k: v.round() for k, v in _state(10 * rank + step).items()})

    first = front("none")
    for step in (1, 2):  # 1 durable; 2 in the local tiers, stored raw, and its peer copies
        first.save(step, state(step))
    first.close()
    torch.distributed.barrier()
    if rank == 0:  # node 0 is replaced: node 1 still holds its ranks' raw step 2 copies
        shutil.rmtree(Path(base) / "node-0")
    torch.distributed.barrier()
    # The job resumes from step 1 and saves step 2 again, the same tensors compressed: node 1
    # unlists its copies of the old step 2, whose raw chunks stay until its next retention.
    second = front("zstd")
    target = state(0)
    assert second.load(target, 1)[0] == 1 and _same(target, state(1))
    second.save(2, state(2))
    assert second.last_peer_copy().failed == {}, second.last_peer_copy()
    second.close()
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(Path(base) / "node-0")
    torch.distributed.barrier()
    target = state(0)
    step, report = front("zstd").load(target)
    assert step == 2 and _same(target, state(2)), report
    if rank < 2:
        assert report.source == "peer", report


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_peer_copy_replaces_a_chunk_an_unlisted_copy_left_encoded_otherwise(kind, tmp_path):
    """Reviewer 2 of stop 57: a resumed job saving a step again with another encoding sent its
    peer copy to a holder still holding that step's old chunks (unlisted, not yet swept); the
    copy failed ("holds chunk ... encoded otherwise") and the step had no peer copy. A chunk
    that no listed copy of the holder names is replaced by the verified bytes."""
    run_ranks(_reencoded, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _lying_holder(rank: int, world: int, kind: str, root: str, base: str, how: str) -> None:
    tiers = dict(peer_copies=1, durable_every=1)
    _save_two_steps(kind, rank, root, base, tiers, wait_durable=True)
    if rank == 2:  # node 1 is replaced, and node 0's copies of its ranks went bad
        shutil.rmtree(Path(base) / "node-1")
        wards = [p for p in (Path(base) / "node-0").glob("job-*/rank-*") if p.name >= "rank-00002"]
        chunks = [c for ward in wards for c in ward.rglob("chunks/*/*")]
        assert chunks, wards
        for path in chunks:
            data = bytearray(path.read_bytes())
            if how == "flipped":
                data[-1] ^= 0x01
            else:  # more bytes than its index declares
                data.extend(bytes(data))
            path.write_bytes(bytes(data))
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())
    step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), report
    if rank >= 2:
        assert report.sources["durable"].chunks > 0, report


@pytest.mark.dist
@pytest.mark.parametrize("how", ["flipped", "longer"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_holder_whose_copy_went_bad_sends_the_replaced_node_to_durable_storage(
    kind, how, tmp_path
):
    """Issue 32's adversary list, a peer that lies: the holder's copy of a wiped node's ranks has
    a flipped byte in every chunk, or more bytes than declared; each arrives checked, fails, and
    those ranks load from durable storage, bit for bit."""
    root = str(tmp_path / "durable")
    run_ranks(_lying_holder, 4, kind, root, str(tmp_path), how, timeout_s=240)


def _bad_only_peer_copy(
    rank: int, world: int, kind: str, root: str, base: str, resume: bool = False
) -> None:
    tiers = dict(peer_copies=1, durable_every=5)  # step 2 in the tiers alone
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    (held,) = (Path(base) / "node-0").glob("job-*/rank-00002")
    if rank == 0:  # the only copy left of rank 2's step 2 has one bad chunk
        (index,) = held.glob(f"indexes/*/{2:020d}/*/rank-*.json")
        digest = sorted(json.loads(index.read_bytes())["chunks"])[0]
        (chunk,) = held.glob(f"chunks/*/{digest}*")
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x01
        chunk.write_bytes(bytes(data))
    torch.distributed.barrier()
    if resume:  # the resume passes over it (DCP's raised a CheckpointError it did not skip)
        target = _ranks_own(rank, _blank())
        assert _two_nodes(kind, rank, root, base, **tiers).resume(target) == 1
        assert _same(target, _ranks_own(rank, _state(10 * rank + 1)))
        return
    with pytest.raises(BaseException, match="step 2 (is held only by the local tiers|failed to)"):
        _two_nodes(kind, rank, root, base, **tiers).load(_ranks_own(rank, _blank()))
    torch.distributed.barrier()
    assert not (held / "commits" / f"{2:020d}.json").exists(), "the bad copy is still listed"
    _load_twice(kind, rank, root, base, tiers, 1)  # step 1: the newest every rank can get


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_bad_chunk_in_the_only_peer_copy_fails_one_load_and_unlists_it(kind, tmp_path):
    """Stop 61's F5: node 1 was replaced and the only copy left of its rank 2's newest step
    (node 0's) had a bad chunk: the repair refused it, but the holder never learned, so every
    later load of "latest" planned on that step and failed (DCP has no fallback). Now the
    holder checks the chunks its destination refused and unlists its copy: one load fails,
    naming it, and the next takes the step before."""
    run_ranks(_bad_only_peer_copy, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_bad_chunk_in_the_only_peer_copy_is_passed_over_by_the_resume(kind, tmp_path):
    """Drift adversary: the same bad only peer copy; each front-end's resume loads step 1 (DCP's
    raised "could not be restored from its peers", a plain CheckpointError it does not skip)."""
    root, base = str(tmp_path / "durable"), str(tmp_path)
    run_ranks(_bad_only_peer_copy, 4, kind, root, base, True, timeout_s=240)


def _full_disk_repair(rank: int, world: int, kind: str, root: str, base: str) -> None:
    import errno

    tiers = dict(peer_copies=1, durable_every=5, repair_memory_bytes=0)  # step 2 tiers only
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    if rank >= 2:  # the replaced node's local disk is full: its repair cannot be written

        def full(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        tier_transfer._put_chunk = full
    with pytest.raises(BaseException, match="No space left on device"):
        _two_nodes(kind, rank, root, base, **tiers).resume(_ranks_own(rank, _blank()))


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_repair_that_cannot_be_written_fails_the_resume_and_skips_no_step(kind, tmp_path):
    """Adversary of stop 77: a replaced node whose disk is full could not write the copies its
    peers sent; both front-ends' resumes took that for damage and loaded step 1 (step 2 intact
    on node 0, then unlisted by the next save). A repair that fails for want of storage fails
    the resume, naming it; only damaged data is passed over."""
    run_ranks(_full_disk_repair, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240)


def _replaced_node_gone_bad(rank: int, world: int, kind: str, root: str, base: str, how: str):
    tiers = dict(peer_copies=1, durable_every=5)  # step 2 in the tiers alone
    _save_two_then_replace_node_1(kind, rank, root, base, tiers)
    if rank == 0 and how == "local_dir_is_a_file":  # the new node's local_dir is unusable
        (Path(base) / "node-1").write_bytes(b"not a directory")
    elif rank == 0:  # a chunk of the only copy left of rank 2's step 2 is a directory now
        (held,) = (Path(base) / "node-0").glob("job-*/rank-00002")
        (index,) = held.glob(f"indexes/*/{2:020d}/*/rank-*.json")
        (chunk,) = held.glob(f"chunks/*/{sorted(json.loads(index.read_bytes())['chunks'])[0]}*")
        chunk.unlink()
        chunk.mkdir()
    torch.distributed.barrier()
    front = _two_nodes(kind, rank, root, base, **tiers)
    target = _ranks_own(rank, _blank())
    if how == "local_dir_is_a_file":  # a disk's failure: no rank leaves the step, none crashes
        with pytest.raises((CheckpointError, CheckpointException), match="Not a directory"):
            front.resume(target)
    else:  # the copy's damage: passed over on the first try
        assert front.resume(target) == 1 and _same(target, _ranks_own(rank, _state(10 * rank + 1)))


@pytest.mark.dist
@pytest.mark.parametrize("how", ["local_dir_is_a_file", "chunk_is_a_directory"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_replaced_node_whose_repair_cannot_be_had_fails_or_passes_over_as_it_should(
    kind, how, tmp_path
):
    """Adversary of stop 77: a replaced node whose local_dir was a file crashed its rank out of
    the exchange (the Checkpointer's other ranks: RanksOutOfStepError; DCP's: a gloo crash);
    now every rank fails the resume naming the path, and passes over no step for a disk's
    failure. A chunk of the only peer copy that is no plain file is the copy's damage: the
    resume loads step 1 at once (it failed the first resume as a storage error)."""
    root = str(tmp_path / "durable")
    run_ranks(_replaced_node_gone_bad, 4, kind, root, str(tmp_path), how, timeout_s=240)


def _peer_beside_durable(rank: int, world: int, kind: str, root: str, base: str) -> None:
    tiers = dict(peer_copies=1, durable_every=1)
    _save_two_steps(kind, rank, root, base, tiers, wait_durable=True)
    if rank == 2:  # node 1 is replaced; node 0 keeps rank 2's copy of step 2, not rank 3's
        shutil.rmtree(Path(base) / "node-1")
        (held,) = (Path(base) / "node-0").glob("job-*/rank-00003")
        (held / "commits" / f"{2:020d}.json").unlink()
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())
    step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
    assert step == 2 and _same(target, _ranks_own(rank, _state(10 * rank + 2))), report
    durable_chunks = report.sources.get("durable", SourceStats()).chunks
    if rank == 2:
        assert report.source == "peer" and durable_chunks == 0, report
    elif rank == 3:
        assert report.source == "durable" and durable_chunks > 0, report
    else:
        assert report.source == "local" and durable_chunks == 0, report


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_rank_with_a_peer_copy_takes_it_though_another_reads_durable_storage(kind, tmp_path):
    """Stop 61's F6: where one rank's only source was durable storage, the DCP front-end read
    every wiped rank from durable storage, though a peer kept its copy; the Checkpointer
    restored it from the peer. Both now take each rank's first source."""
    run_ranks(
        _peer_beside_durable, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240
    )


_SAVE_AND_LEAVE = {
    "checkpointer": "Checkpointer(root, tiers=tiers).save(1, state)",
    "dcp": "dcp.save(state, storage_writer=StoreWriter(root, tiers=tiers), no_dist=True)",
}


@pytest.mark.parametrize("kind", sorted(_SAVE_AND_LEAVE))
def test_a_script_whose_last_act_is_a_tiered_save_leaves_it_durable(kind, tmp_path):
    """Nothing waits for the save nor keeps the front-end: its drain still reaches durable
    storage before the interpreter exits (the front-end's exit hook finishes it)."""
    import subprocess
    import sys

    root, local = tmp_path / "durable", tmp_path / "local"
    code = "\n".join(
        [
            "import sys, torch",
            "import torch.distributed.checkpoint as dcp",
            "from ckptstore import Checkpointer, TierOptions",
            "from ckptstore.dcp import StoreWriter",
            "root = sys.argv[1]",
            "tiers = TierOptions(local_dir=sys.argv[2], durable_every=1)",
            "state = {'w': torch.arange(4096.0)}",
            _SAVE_AND_LEAVE[kind],
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root), str(local)],
        capture_output=True,
        text=True,
        timeout=BOUND_S * 2,
    )
    assert proc.returncode == 0, proc.stderr
    steps = list_steps(Store(str(root)))
    assert len(steps) == 1, (steps, proc.stderr[-2000:])


@pytest.mark.parametrize("refusing", ["skip", "raise"], indirect=True)
@pytest.mark.parametrize("durable_every", [1, 2])
def test_an_unhealthy_step_the_policy_refuses_is_stored_in_no_tier(
    make, refusing, durable_every, tmp_path
):
    front = make(durable_every=durable_every)
    front.save(1, _state(1))
    bad = _state(2)
    bad["w"][5] = float("nan")
    if refusing == "raise":
        with pytest.raises(BaseException, match="(?s)step 2 is unhealthy.*on_unhealthy='raise'"):
            front.save(2, bad)
    else:
        front.save(2, bad)
        assert not front.last_save().committed and front.last_save().nan == 1
    front.wait_durable()
    assert _local_copies(tmp_path) == [1]  # a tier copy would be loaded by a plain load
    assert 2 not in list_steps(Store(str(tmp_path / "durable")))
    front.save(3, _state(3))  # the job goes on
    front.wait_durable()
    state = _blank()
    assert front.restart().load(state)[0] == 3 and _same(state, _state(3))


# -- a lost rank (issue 32, item 2) ------------------------------------------------------------

LOST_S = 8.0  # the bound on a lost rank in these scenarios (StorageOptions.lost_rank_timeout_s)
DEFAULT_PG_S = 10.0  # the default group's timeout: DCP's own exchanges wait up to it
LOST = 3


def _within(limit_s: float, call: Any) -> tuple[float, BaseException | None]:
    """``call()``'s time and error; fails if it takes longer than ``limit_s`` (a hang)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    t0 = time.monotonic()
    try:
        pool.submit(call).result(timeout=limit_s)
        error = None
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"blocked past {limit_s:g}s with a rank lost") from None
    except BaseException as exc:  # noqa: BLE001 - the caller judges it
        error = exc
    finally:
        pool.shutdown(wait=False)
    return time.monotonic() - t0, error


def _lose_a_rank(rank: int, world: int, kind: str, how: str, root: str, base: str) -> None:
    """4 ranks as 2 nodes, peer copies, every step durable. Step 1 is saved by every rank; then
    rank 3 is lost: killed (-9) in the middle of the save of step 2, or SIGTERMed (a spot
    reclaim of its node) with that save pending. The others' saves of steps 2 and 3 and their
    close() each end within the bound (commit, or one error naming rank 3); step 1 stays."""
    storage = StorageOptions(lost_rank_timeout_s=LOST_S)
    if kind == "checkpointer":  # the repro of the issue: every rank handles SIGTERM
        CheckpointerFront.preemption = PreemptionOptions(handle_sigterm=True, sigterm_grace_s=20)
    front = _two_nodes(kind, rank, root, base, storage, peer_copies=1, durable_every=1)
    front.save(1, _ranks_own(rank, _state(10 * rank + 1)))
    front.wait_durable()
    torch.distributed.barrier()
    if rank == LOST:  # the signal comes as the rank starts its local commit of step 2
        from ckptstore.tiers.saving import TierSaver

        commit_local, sig = TierSaver.commit_local, getattr(signal, f"SIG{how.upper()}")

        def signalled(self: TierSaver, **kw: Any) -> Any:
            os.kill(os.getpid(), sig)  # SIGTERM: a Checkpointer's pending save goes on
            return commit_local(self, **kw)

        TierSaver.commit_local = signalled
        front.save(2, _ranks_own(rank, _state(10 * rank + 2)))
        time.sleep(BOUND_S)  # the SIGTERM handler or the kill ends this process before
        raise AssertionError(f"rank {LOST} was not lost")
    # DCP's own exchanges (plan, results) on the default group wait up to its timeout.
    limit = LOST_S + 10 + (2 * DEFAULT_PG_S if kind == "dcp" else 0)
    heard = log_records("ckptstore.tiers.group")
    errors = []
    for step in (2, 3):  # step 3 blocked in staging while step 2's buffer was never given back
        took, error = _within(limit, lambda s=step: front.save(s, _ranks_own(rank, _state(s))))
        errors.append(error)
        if error is None:
            continue
        named = f"rank {LOST}" in str(error)
        if kind == "dcp":  # DCP's own exchange on the default group fails with gloo's error
            named = named or any(f"rank {LOST} lost" in r.getMessage() for r in heard)
        assert named, (rank, step, took, "".join(traceback.format_exception(error)))
    assert errors[-1] is not None, f"rank {rank}: step 3 saved without rank {LOST}"
    # One line naming the rank, without the advice gloo appends to its error.
    noisy = [r.getMessage() for r in heard if "typically caused" in r.getMessage()]
    assert noisy == [], noisy
    _within(limit, front.close)


@pytest.mark.dist
@pytest.mark.parametrize("how", ["kill", "term"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_lost_rank_ends_every_ranks_save_and_close_within_the_bound(kind, how, tmp_path):
    root = tmp_path / "durable"
    run_ranks_losing(
        _lose_a_rank,
        4,
        kind,
        how,
        str(root),
        str(tmp_path),
        lost={LOST},
        timeout_s=240,
        pg_timeout_s=DEFAULT_PG_S,
    )
    from ckptstore.cli import main

    # What was committed before the loss stays whole: every chunk of step 1 re-hashed.
    assert main(["verify", str(root), "--step", "1"]) == 0


def _lose_a_rank_in_a_load(
    rank: int, world: int, kind: str, when: str, root: str, base: str
) -> None:
    """Steps 1 (durable) and 2 (local and peer copies only) saved by 4 ranks as 2 nodes; the
    job restarts and rank 3 is lost before its load begins (its process never comes back) or
    at its first chunk read. Every other rank's load (a Checkpointer's making too) ends within
    the bound, with an error naming rank 3."""
    storage = StorageOptions(lost_rank_timeout_s=LOST_S)
    tiers = dict(peer_copies=1, durable_every=2)
    front = _two_nodes(kind, rank, root, base, storage, **tiers)
    for step in (1, 2, 3):
        front.save(step, _ranks_own(rank, _state(10 * rank + step)))
    front.close()
    torch.distributed.barrier()
    if rank == LOST:
        if when == "before":
            os._exit(0)
        from ckptstore.store import core

        def dies_reading_a_chunk(read: Any) -> Any:
            def wrapped(self: Any, key: str, *args: Any, **kw: Any) -> Any:
                if "/chunks/" in f"/{key}":
                    os._exit(0)
                return read(self, key, *args, **kw)

            return wrapped

        core.Store.get = dies_reading_a_chunk(core.Store.get)
        core.Store.get_view = dies_reading_a_chunk(core.Store.get_view)
    heard = log_records("ckptstore.tiers.group")
    limit = LOST_S + 10 + (2 * DEFAULT_PG_S if kind == "dcp" else 0)
    target = _ranks_own(rank, _blank())
    took, error = _within(
        limit, lambda: _two_nodes(kind, rank, root, base, storage, **tiers).load(target)
    )
    if rank == LOST:
        raise AssertionError(f"rank {LOST} was not lost")
    assert error is not None, f"rank {rank}: a load finished without rank {LOST}"
    named = f"rank {LOST}" in str(error) or any(
        f"rank {LOST} lost" in r.getMessage() for r in heard
    )
    assert named, (rank, took, "".join(traceback.format_exception(error)))
    # Ours in one line, without the advice gloo appends (DCP's own exchange raises gloo's).
    noisy = [r.getMessage() for r in heard if "typically caused" in r.getMessage()]
    assert noisy == [], noisy


@pytest.mark.dist
@pytest.mark.parametrize("when", ["before", "reading"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_rank_lost_in_a_tiered_load_ends_every_ranks_load_within_the_bound(kind, when, tmp_path):
    run_ranks_losing(
        _lose_a_rank_in_a_load,
        4,
        kind,
        when,
        str(tmp_path / "durable"),
        str(tmp_path),
        lost={LOST},
        timeout_s=240,
        pg_timeout_s=DEFAULT_PG_S,
    )


# -- one writer per distinct chunk (issue 36) ----------------------------------------------------


def _replicated(step: int, rank: int, apart: bool = False) -> dict[str, Any]:
    """What a data-parallel rank saves: a model every rank holds alike (four chunks), and a
    tensor of its own (one); ``apart``: the model under a name of each rank's own (identical
    shards DCP's planner cannot tell apart, only their chunks' digests)."""
    g = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"w{rank}" if apart else "w": torch.randn(CHUNK, generator=g),
        f"o{rank}": torch.randn(CHUNK // 4, generator=own),
    }


def _write_once(rank: int, world: int, kind: str, root: str, out: str, tiered: str) -> None:
    from tests.helpers.counting import CountingBackend, Tally

    tally = Tally()
    store = Store(root)
    store.backend = CountingBackend(store.backend, tally)
    tiers = TierOptions()
    apart = tiered == "fallback"
    if tiered == "drained":  # 2 nodes; each step drained to durable storage from the local copies
        node = rank // 2
        tiers = TierOptions(local_dir=Path(out) / f"node-{node}", node_rank=node, durable_every=1)
    elif apart:  # every local tier unusable: each save goes to durable storage from the ranks
        unusable = Path(out) / f"node-{rank}"
        unusable.write_bytes(b"a file where the directory should be")
        tiers = TierOptions(local_dir=unusable, node_rank=rank, durable_every=1)
    front = FRONTS[kind](Path(root), tiers, StorageOptions(store=store))
    front.no_dist = False
    puts = []
    for step in (1, 2):  # the second save changes the state: nothing of it is known stored
        tally.clear()
        front.save(step, _replicated(step, rank, apart))
        front.wait_durable()
        puts.append(tally.chunks["put"])
    exists = store.counters.snapshot()["requests"].get("put", {}).get("exists", 0)
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"puts": puts, "exists": exists}))
    front.close()
    torch.distributed.barrier()
    target = {k: torch.zeros_like(v) for k, v in _replicated(2, rank, apart).items()}
    if kind == "dcp":  # a load without tiers reports no tier
        dcp.load(target, storage_reader=StoreReader(root))
    else:
        assert front.restart().load(target)[0] == 2
    assert _same(target, _replicated(2, rank, apart)), rank


@pytest.mark.dist
@pytest.mark.parametrize("tiered", ["durable", "drained", "fallback"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_chunk_every_rank_holds_is_put_once(kind, tiered, tmp_path):
    """Four data-parallel ranks save the same model and a tensor each, straight to durable
    storage, drained there from local copies, or sent there because no local tier could take
    the save: every distinct chunk is put by one rank (no rank's put answered "exists"), and
    every rank loads its state back. The ranks agree on a writer per chunk (``save.once``);
    DCP's planner already writes a replicated item once, so the fallback names the model
    apart on each rank: only the chunks' digests tell the ranks hold it alike."""
    root, out = tmp_path / "durable", tmp_path / "counts"
    out.mkdir()
    run_ranks(_write_once, 4, kind, str(root), str(out), tiered, timeout_s=240)
    counts = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert sum(c["exists"] for c in counts) == 0, counts
    distinct = 4 + 4  # the model's four chunks, one chunk of each rank's own tensor
    for save in (0, 1):
        assert sum(c["puts"][save] for c in counts) == distinct, counts
    assert len(list((root / "chunks").rglob("*"))) >= 2 * distinct


def _replicated_peer_copies(rank: int, world: int, kind: str, root: str, base: str) -> None:
    front = _two_nodes(kind, rank, root, base, peer_copies=1, durable_every=5)
    sent = []
    for step in (1, 2):  # 1 durable, 2 in the local tiers and their peer copies only
        # DCP names each rank's model apart (a planner dedups items by name only).
        state = {
            f"{k}{rank}" if kind == "dcp" else k: v for k, v in _replicated(step, rank).items()
        }
        front.save(step, state)
        stats = front.last_peer_copy()
        sent.append((stats.chunks_sent, stats.chunks_from_node))
    front.close()
    # Each rank's copy goes to a rank of the other node, which holds the model already: only
    # the rank's own tensor (one chunk) crosses; the model's four come from the node's copies.
    assert sent == [(1, 4), (1, 4)], (rank, sent)
    torch.distributed.barrier()
    if rank == 2:  # node 1 is replaced: node 0's copies of its ranks restore it
        shutil.rmtree(Path(base) / "node-1")
    torch.distributed.barrier()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    step, report = _two_nodes(kind, rank, root, base, peer_copies=1, durable_every=5).load(target)
    assert step == 2 and _same(target, state), (rank, step, report)
    assert report.source == ("peer" if rank >= 2 else "local"), report


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_peer_copies_send_only_the_chunks_the_holders_node_lacks(kind, tmp_path):
    """Issue 36: four data-parallel ranks as two nodes save a model every rank holds alike and
    a tensor of their own, with a peer copy of each rank on the other node. The holder's node
    already holds the model in its own ranks' copies: only each rank's own chunk crosses the
    wire, the model's chunks are taken (verified) from the node's copies, and a replaced node
    restores from those copies bit for bit."""
    run_ranks(
        _replicated_peer_copies, 4, kind, str(tmp_path / "durable"), str(tmp_path), timeout_s=240
    )


def _one_bad_chunk(rank: int, world: int, kind: str, root: str, base: str, bound: int) -> None:
    # Step 2 in the local tiers only; a repair held in memory, or over the bound written first.
    tiers = dict(peer_copies=1, durable_every=5, repair_memory_bytes=bound)
    _save_two_steps(kind, rank, root, base, tiers)
    n = 0
    if rank == 2:  # a byte of one chunk of rank 2's own copy of step 2 goes bad
        (own,) = (Path(base) / "node-1").glob("job-*/rank-00002")
        n = _flip_one_chunk(own, 2)
    torch.distributed.barrier()
    want = _ranks_own(rank, _state(10 * rank + 2))
    loads = []
    for _ in range(2):
        target = _ranks_own(rank, _blank())
        try:
            step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
        except BaseException as exc:  # noqa: BLE001 - DCP raises a CheckpointException (no Exception)
            failure = getattr(exc, "failures", {}).get(rank, (exc,))  # DCP's: (error, trace)
            loads.append(" ".join(str(failure[0]).split()))
            continue
        loads.append(None)
        break
    # The Checkpointer repairs the copy in the same load (its next source, the peer's copy).
    # DCP's reader meets the bad chunk inside ``read_data``, where no collective repair can
    # run: it unlists the copy and fails, and the next load repairs it.
    assert loads[-1] is None and len(loads) == (1 if kind == "checkpointer" else 2), loads
    assert step == 2 and _same(target, want), (rank, report)
    if rank == 2:
        if len(loads) == 2:
            assert "a load takes a peer's copy where one holds it" in loads[0], loads
        assert report.source == "peer", report
        # Only the bad chunk crossed the wire; the others still verified where they were.
        assert (report.repair_chunks_received, report.repair_chunks_here) == (1, n - 1), report
    else:
        assert report.source == "local" and report.repair_chunks_received == 0, report
    wait_written()
    torch.distributed.barrier()
    target = _ranks_own(rank, _blank())  # the repaired copy, written: every chunk verifies
    step, report = _two_nodes(kind, rank, root, base, **tiers).load(target)
    assert step == 2 and _same(target, want) and report.source == "local", (rank, report)


@pytest.mark.dist
@pytest.mark.parametrize("bound", [1 << 30, 0], ids=["in-memory", "over-the-bound"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_a_repair_sends_only_the_chunks_that_fail_on_the_ranks_node(kind, bound, tmp_path):
    """Issue 36, each chunk from the nearest holder that verifies: a rank's own copy of a step
    only the local tiers hold has one bad chunk; its repair from the holder's copy sends that
    chunk alone, the others are taken where they are (verified), and the copy is whole after."""
    root = str(tmp_path / "durable")
    run_ranks(_one_bad_chunk, 4, kind, root, str(tmp_path), bound, timeout_s=240)


def _options_apart(rank: int, world: int, kind: str, root: str, base: str, how: str) -> None:
    mine = TierOptions(local_dir=Path(base) / f"node-{rank}", node_rank=rank, peer_copies=1)
    if how == "untiered":
        tiers = mine if rank == 0 else None
    else:
        tiers = mine if rank == 0 else TierOptions(local_dir=Path(base) / "node-1", node_rank=1)
    with pytest.raises((ValueError, CheckpointException)) as raised:
        front = FRONTS[kind](Path(root), tiers, StorageOptions(lost_rank_timeout_s=8))
        front.no_dist = False
        front.save(1, _ranks_own(rank, _state(rank)))
    error = raised.value
    if isinstance(error, CheckpointException):  # DCP: each rank's error, on every rank
        text = " | ".join(f"{type(e).__name__}: {e}" for e, _ in error.failures.values())
    else:
        text = str(error)
    if how == "peer_copies":
        want = ["the ranks were given different TierOptions.peer_copies (rank 0 1; rank 1 0)"]
    elif kind == "checkpointer":
        want = ["the ranks were given different local_dir (set or not) (rank 0 True; rank 1 False)"]
    else:  # a DCP writer without tiers makes no tier group: the tiered rank names it
        want = ["rank 1 lost", "never started ckptstore's heartbeat", "TierOptions(local_dir"]
    assert all(w in text for w in want), (rank, text)
    torch.distributed.barrier()
    assert list_steps(Store(root)) == []


@pytest.mark.dist
@pytest.mark.parametrize("how", ["untiered", "peer_copies"])
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_ranks_given_different_tier_options_fail_naming_them_on_every_rank(kind, how, tmp_path):
    """A rank without tiers beside tiered ones, or another peer_copies: each rank would run
    exchanges the other never starts (gloo timeouts after a minute, or a live rank named lost).
    The Checkpointer compares the options as it is made; a DCP writer when its first tiered save
    makes the tier group (a writer without tiers makes none: the tiered ranks name it)."""
    run_ranks(_options_apart, 2, kind, str(tmp_path / "durable"), str(tmp_path), how, timeout_s=120)


def _save_a_durable_then_local_only_steps(
    rank: int, world: int, kind: str, root: str, local: str
) -> None:
    options = TierOptions(local_dir=local, durable_every=10)
    front = FRONTS[kind](Path(root), options, StorageOptions())
    front.no_dist = False
    for step in (1, 2, 3):  # 1 durable (a writer's first save), 2 and 3 in the local tier only
        front.save(step, _ranks_own(rank, _state(10 * rank + step)))
    front.wait_durable()
    front.close()
    torch.distributed.barrier()


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["checkpointer", "dcp"])
def test_local_copies_of_another_world_size_are_named_once_and_passed_over(kind, tmp_path, caplog):
    """A reviewer: a job restarted at another world size passed over the newer local-only
    steps with 8 lines per call, each a copy's tier record ('is not rank 0's copy for this
    job'), none saying that the world size changed or which steps the job goes back from.
    One line now names the steps, both world sizes, and that the next save unlists them."""
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    run_ranks(_save_a_durable_then_local_only_steps, 2, kind, root, local, timeout_s=240)
    front = FRONTS[kind](
        Path(root), TierOptions(local_dir=local, durable_every=10), StorageOptions()
    )
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        assert front.latest() == 1  # the durable step: copies load at the world that made them
        assert front.latest() == 1
    said = [r.getMessage() for r in caplog.records if "saved by a job of" in r.getMessage()]
    assert len(said) == 1, said
    assert "step(s) 2, 3" in said[0] and "a job of 2 ranks and this one has 1" in said[0]
    assert "unlists them" in said[0]
    assert not [r for r in caplog.records if "copy for this job" in r.getMessage()]
    front.close()


@pytest.mark.parametrize("planted", ["fifo", "garbage"])
def test_a_damaged_store_identity_fails_the_open_by_name_never_a_silent_roll_back(
    make, tmp_path, planted
):
    """A fuzzer: a FIFO at the durable store's ``identity.json`` read as 'no identity', so the
    local copies (which record one) were taken for another instance's: latest() and load()
    went back to the newest durable step with a warning that the store was made again. It
    fails as bad JSON there does: the identity named, nothing loaded from a guess."""
    front = make(durable_every=10)
    for step in (1, 2):  # 1 durable, 2 in the local tier alone
        front.save(step, _state(step))
    front.wait_durable()
    front.close()
    identity = tmp_path / "durable" / IDENTITY_KEY
    identity.unlink()
    if planted == "fifo":
        os.mkfifo(identity)
    else:
        identity.write_text("{not json")
    with pytest.raises((CheckpointError, CheckpointException)) as failed:  # DCP wraps it
        front.restart().load(_blank())
    said = str(failed.value)
    assert "cannot read the identity of" in said and "identity.json" in said, said
    assert "move it aside: the next tiered writer records the id again" in said, said
