"""Quarantine (item 4 of issue 32): a step ``load(fallback=True)`` skipped as corrupt never
blocks the job again: it is taken out of the listing (kept for forensics), the job saves that
step number again, and a restart loads the new save."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore import Checkpointer, EncodingOptions, Store
from ckptstore.catalog import QUARANTINE_PREFIX as PREFIX
from ckptstore.catalog import list_steps, load_manifest, load_rank_index, quarantined
from ckptstore.cli import main
from ckptstore.dcp import StoreReader
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.format import commit_key
from tests.helpers import ROOT
from tests.helpers.crafted import put_rank_index, rank_index_doc
from tests.helpers.integrity import verify_all

BOUND_S = 60.0


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "step": step}


def _blank() -> dict:
    return {"w": torch.zeros(4096), "step": -1}


def _chunks(root: Path, step: int) -> set[str]:
    store = Store(str(root))
    return set(load_rank_index(store, load_manifest(store, step), 0).chunks)


def _flip_a_chunk_of(root: Path, step: int) -> str:
    """One byte flipped in a chunk only ``step`` references; its digest."""
    digest = sorted(_chunks(root, step) - _chunks(root, step - 1))[0]
    path = root / "chunks" / digest[:2] / digest
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return digest


def _resume(root: Path, last: int, healthy: bool = False) -> tuple[int, dict]:
    """The README's loop: resume from the newest step that loads, train and save up to
    ``last``; returns the step it resumed from and the state it ends with."""
    with Checkpointer(root) as ckpt:
        state = _blank()
        start = ckpt.load(state, fallback=True, healthy=healthy) if ckpt.latest() is not None else 0
        for step in range(start + 1, last + 1):
            state = _state(step)  # the same bytes as the first run: a deterministic job
            ckpt.save(step, state).wait(timeout_s=BOUND_S)
    return start, state


def test_a_corrupt_newest_step_is_quarantined_and_saved_again(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _resume(root, 3)
    digest = _flip_a_chunk_of(root, 3)
    assert _resume(root, 3)[0] == 2  # skipped 3, saved it again: no StepExistsError
    assert _resume(root, 4)[0] == 3  # the new step 3 loads
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state, 3) == 3 and torch.equal(state["w"], _state(3)["w"])
    store = Store(str(root))
    assert list(quarantined(store).values()) == [3]
    assert (root / PREFIX / "chunks" / digest).is_file()  # the damaged bytes, for forensics
    assert verify_all(str(root)) == [1, 2, 3, 4]
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0  # the step 3 now listed is the new save's
    out = capsys.readouterr().out
    assert "quarantined: step(s) 3, found damaged" in out
    assert "step(s) 3 saved again since: the rows above are the new saves" in out
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert list_steps(store) == [4] and list(quarantined(store).values()) == [3]
    assert main(["gc", str(root), "--keep-last", "1", "--remove-corrupt"]) == 0
    out = capsys.readouterr().out
    assert "deleted quarantined step(s) 3 (--remove-corrupt)" in out, out
    assert main(["ls", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined"] == []
    assert not quarantined(store) and not (root / PREFIX / "chunks" / digest).exists()
    assert verify_all(str(root)) == [4]


def _lose_a_chunk(root: Path, step: int) -> None:
    digest = sorted(_chunks(root, step) - _chunks(root, step - 1))[0]
    (root / "chunks" / digest[:2] / digest).unlink()


def _lose_the_index(root: Path, step: int) -> None:
    store = Store(str(root))
    store.delete(load_manifest(store, step).ranks[0].key)


def _garble_the_manifest(root: Path, step: int) -> None:
    path = root / "commits" / f"{step:020d}.json"
    path.chmod(0o644)
    path.write_bytes(b"not a manifest")


def _another_steps_manifest(root: Path, step: int) -> None:
    """A manifest that decodes, but is step ``step - 1``'s (copied over by hand, say)."""
    path = root / "commits" / f"{step:020d}.json"
    path.chmod(0o644)
    path.write_bytes((root / "commits" / f"{step - 1:020d}.json").read_bytes())


@pytest.mark.parametrize("healthy", [False, True])
@pytest.mark.parametrize(
    "damage", [_lose_a_chunk, _lose_the_index, _garble_the_manifest, _another_steps_manifest]
)
def test_a_newest_step_missing_an_object_or_unreadable_is_quarantined_and_saved_again(
    tmp_path, damage, healthy
):
    """Reviewer of stop 61: a step load(fallback=True) skipped for a missing chunk or index
    (CheckpointNotFoundError) or an unreadable manifest was never quarantined: the resumed job's
    save of that step number failed with StepExistsError at every restart. Reviewer Y: with
    healthy=True, a step whose manifest cannot be read was passed over, never quarantined, and
    the job (the README's) never saved that step again."""
    root = tmp_path / "ckpt"
    _resume(root, 3)
    damage(root, 3)
    assert _resume(root, 3, healthy)[0] == 2  # skipped 3, saved it again
    assert _resume(root, 4, healthy)[0] == 3  # the new step 3 loads
    assert list(quarantined(Store(str(root))).values()) == [3]
    assert verify_all(str(root)) == [1, 2, 3, 4]


def test_objects_missing_for_a_moment_leave_the_step_committed(tmp_path, monkeypatch):
    """Reviewer of stop 61: chunks that answered "not found" for 3 s (a replica behind) made a
    fallback load skip the step, and its quarantine, re-checking within the same window,
    deleted the commit of a good step; gc then swept its chunks. A step whose only damage is
    missing objects is looked at again after a wait; objects that turn up keep it."""
    from ckptstore import quarantine

    root = tmp_path / "ckpt"
    _resume(root, 3)
    digest = sorted(_chunks(root, 3) - _chunks(root, 2))[0]
    path = root / "chunks" / digest[:2] / digest
    aside = tmp_path / "aside"
    path.rename(aside)
    back = []

    def wait(seconds: float) -> None:  # the replica catches up during the first wait
        if not back:
            aside.rename(path)
            back.append(seconds)

    monkeypatch.setattr(quarantine.time, "sleep", wait)
    with Checkpointer(root) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 2  # step 3 skipped: a chunk missing
    assert back and list_steps(Store(str(root))) == [1, 2, 3]  # not quarantined
    assert not quarantined(Store(str(root)))
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state) == 3 and torch.equal(state["w"], _state(3)["w"])


def test_gc_keeps_a_quarantined_steps_chunks_until_remove_corrupt(tmp_path, monkeypatch):
    """A step quarantined for a missing chunk keeps its other chunks through gc (it can be put
    back whole), until --remove-corrupt."""
    from ckptstore import quarantine

    monkeypatch.setattr(quarantine.time, "sleep", lambda seconds: None)
    root = tmp_path / "ckpt"
    small = EncodingOptions(chunk_bytes=4096)  # the state in four chunks
    with Checkpointer(root, encoding=small) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).wait(timeout_s=BOUND_S)
    only_3 = sorted(_chunks(root, 3) - _chunks(root, 2))
    assert len(only_3) >= 2, only_3
    (root / "chunks" / only_3[0][:2] / only_3[0]).unlink()
    with Checkpointer(root, encoding=small) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 2
        ckpt.save(3, _state(30)).wait(timeout_s=BOUND_S)  # another step 3, other bytes
    assert list(quarantined(Store(str(root))).values()) == [3]
    kept = [root / "chunks" / d[:2] / d for d in only_3[1:]]
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert all(path.exists() for path in kept)  # the quarantined step could be put back
    # seconds old: with the default --grace-s they would wait 2 min, unnamed by any step
    assert main(["gc", str(root), "--keep-last", "1", "--remove-corrupt", "--grace-s", "0"]) == 0
    assert not any(path.exists() for path in kept)


def _two_ranks_save(rank: int, world: int, root: str) -> None:
    with Checkpointer(root) as ckpt:
        for step in (1, 2):
            g = torch.Generator().manual_seed(100 * step + rank)
            ckpt.save(step, {f"w{rank}": torch.randn(4096, generator=g)}).wait(timeout_s=BOUND_S)


def _two_ranks_fall_back(rank: int, world: int, root: str) -> None:
    from tests.helpers.dcp_tiers import log_records

    heard = log_records("ckptstore")
    with Checkpointer(root) as ckpt:
        target = {f"w{rank}": torch.zeros(4096)}
        assert ckpt.load(target, fallback=True) == 1
    said = [r for r in heard if "cannot be loaded, trying an older step" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == (logging.WARNING if rank == 0 else logging.INFO), rank


@pytest.mark.dist
def test_a_step_skipped_by_every_rank_is_warned_of_once_by_rank_0(tmp_path, monkeypatch):
    """A reviewer: the fallback's warning came once from every rank (4 lines on 4 ranks) for
    one agreed skip; the other ranks say it at INFO."""
    from tests.helpers.dist import run_ranks

    root = tmp_path / "ckpt"
    run_ranks(_two_ranks_save, 2, str(root), timeout_s=120)
    store = Store(str(root))
    digest = sorted(load_rank_index(store, load_manifest(store, 2), 1).chunks)[0]
    path = root / "chunks" / digest[:2] / digest
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-5])
    run_ranks(_two_ranks_fall_back, 2, str(root), timeout_s=120)


@pytest.mark.dist
def test_gc_keeps_the_chunks_of_every_rank_whose_index_still_reads(tmp_path, monkeypatch):
    """Reviewer of stop 61: one rank index of a quarantined 2-rank step gone, gc kept none of
    the other rank's chunks (one failure stopped the collection)."""
    from ckptstore import quarantine
    from tests.helpers.dist import run_ranks

    monkeypatch.setattr(quarantine.time, "sleep", lambda seconds: None)
    root = tmp_path / "ckpt"
    run_ranks(_two_ranks_save, 2, str(root), timeout_s=120)
    store = Store(str(root))
    manifest = load_manifest(store, 2)
    rank_1 = set(load_rank_index(store, manifest, 1).chunks) - set(
        load_rank_index(store, load_manifest(store, 1), 1).chunks
    )
    store.delete(manifest.ranks[0].key)
    assert quarantine.quarantine_step(store, 2, "rank 0's index missing")
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert rank_1 and all((root / "chunks" / d[:2] / d).exists() for d in rank_1)


def test_a_quarantined_step_asked_for_by_number_is_named_as_quarantined(tmp_path, capsys):
    """``inspect``, ``restore`` and ``verify`` of a step a load quarantined say so (when, how
    many chunks, the marker's key), not only that it is not committed; so do
    ``Checkpointer.load(step=N)`` and ``verify(N)`` and a DCP load of the step by its id."""
    root = tmp_path / "ckpt"
    _resume(root, 3)
    _flip_a_chunk_of(root, 3)
    assert _resume(root, 2)[0] == 2  # skipped step 3 and quarantined it; not saved again
    (marker,) = quarantined(Store(str(root)))
    for command in (["inspect"], ["verify"], ["restore", "--to", str(tmp_path / "out.pt")]):
        capsys.readouterr()
        assert main([*command, str(root), "--step", "3"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"ckptstore {command[0]}: error: step 3 is not committed"), err
        assert "a load found step 3 damaged and quarantined it (at 20" in err, err
        assert f"1 damaged chunk(s); {marker}): kept for forensics until" in err, err
        assert len(err.splitlines()) == 1
    assert main(["inspect", str(root), "--step", "9"]) == 1
    assert "quarantined it" not in capsys.readouterr().err
    said = "a load found step 3 damaged and quarantined it (at 20"
    with Checkpointer(root) as ckpt:
        for call in (lambda: ckpt.load(_blank(), step=3), lambda: ckpt.verify(3)):
            with pytest.raises(CheckpointNotFoundError, match=re.escape(said)):
                call()
    with pytest.raises(CheckpointException, match=re.escape(said)):
        dcp.load({"w": torch.zeros(4096)}, storage_reader=StoreReader(root), checkpoint_id=3)


def test_gc_keep_last_counts_no_quarantined_step(tmp_path):
    """``gc --keep-last 1`` after the corrupt newest step was skipped keeps the step that
    loads, never the corrupt one."""
    root = tmp_path / "ckpt"
    _resume(root, 3)
    _flip_a_chunk_of(root, 3)
    with Checkpointer(root) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 2
        assert ckpt.steps() == [1, 2] and ckpt.latest() == 2
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert list_steps(Store(str(root))) == [2]
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state, fallback=True) == 2 and torch.equal(state["w"], _state(2)["w"])


def test_gc_remove_corrupt_dry_run_says_one_thing(tmp_path):
    """The dry run printed "would delete" on stdout and "it is kept" on stderr; a gc's
    report is not repeated as warnings."""
    root = tmp_path / "ckpt"
    _resume(root, 3)
    manifest = next((root / "commits").glob("*3.json"))
    manifest.chmod(0o644)
    manifest.write_bytes(b"{" + manifest.read_bytes()[1:-5])
    argv = ["gc", str(root), "--keep-last", "1", "--remove-corrupt", "--dry-run"]
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr
    assert "unreadable step 3: would delete (--remove-corrupt)" in done.stdout, done.stdout
    assert "kept" not in done.stderr, done.stderr
    assert list_steps(Store(str(root))) == [1, 2, 3]  # a dry run
    # Without --remove-corrupt: the printed report says what happens to the step, once.
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *argv[:4], "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "step(s) 3 cannot be read" in done.stderr, done.stderr
    assert "unreadable step 3: kept, not counted" in done.stdout, done.stdout


def test_gc_verify_counts_no_step_with_a_damaged_chunk_and_removes_it(tmp_path, capsys):
    """``verify``-found chunk damage, never loaded: ``gc --keep-last 1 --verify`` keeps the
    step that loads, not the damaged newest one; with ``--remove-corrupt`` it removes it."""
    root = tmp_path / "ckpt"
    _resume(root, 3)
    _flip_a_chunk_of(root, 3)
    assert main(["gc", str(root), "--keep-last", "1", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "kept steps: 2" in out and "unreadable step 3: kept, not counted" in out, out
    assert list_steps(Store(str(root))) == [2, 3]
    assert main(["gc", str(root), "--keep-last", "1", "--verify", "--remove-corrupt"]) == 0
    assert list_steps(Store(str(root))) == [2]
    assert verify_all(str(root)) == [2]


@pytest.mark.parametrize("field", [0, 1], ids=["raw-size", "stored-size"])
def test_a_shared_chunk_another_index_misdescribes_stays_for_the_steps_it_serves(tmp_path, field):
    """Adversary: step 2's index edited only in one size of a chunk that step 1 shares (content
    addressing stores it once), its checksums made right. The fallback load skips step 2 and
    quarantines it; the chunk's own bytes still decode to its digest, so it stays where step 1
    reads it (moving it broke step 1 for the next restart)."""
    root = tmp_path / "ckpt"
    store = Store(str(root))
    with Checkpointer(root) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {**_state(step), "c": torch.arange(4096)}).wait(timeout_s=BOUND_S)
    shared = sorted(_chunks(root, 1) & _chunks(root, 2))
    assert shared
    doc = rank_index_doc(store, 2)
    doc["chunks"][shared[0]][field] += 1
    put_rank_index(store, 2, 0, doc)
    state = {**_blank(), "c": torch.zeros(4096, dtype=torch.int64)}
    with Checkpointer(root) as ckpt:
        assert ckpt.load(state, fallback=True) == 1
    assert list(quarantined(store).values()) == [2] and list_steps(store) == [1]
    assert (root / "chunks" / shared[0][:2] / shared[0]).is_file()
    assert verify_all(str(root)) == [1]
    state = {**_blank(), "c": torch.zeros(4096, dtype=torch.int64)}
    with Checkpointer(root) as ckpt:
        assert ckpt.load(state) == 1 and torch.equal(state["c"], torch.arange(4096))


class _LyingReads(Store):
    """A store reached through a path that flips a byte of every chunk it reads (a corrupting
    cache or proxy; S3 sends no checksum with a ranged GET): the objects stored are intact."""

    def _flip(self, key, data):
        if not key.startswith("chunks/") or not len(data):
            return data
        out = bytearray(data)
        out[-1] ^= 0xFF
        return bytes(out)

    def get(self, key, start=None, end=None, **kwargs):
        return self._flip(key, super().get(key, start, end, **kwargs))

    def get_view(self, key, start=None, end=None, **kwargs):
        return self._flip(key, bytes(super().get_view(key, start, end, **kwargs)))


def test_quarantine_keeps_the_stores_own_bytes_when_its_reads_lied(s3_uri):
    """The quarantine copied the bytes it had read (corrupted on the way) and deleted the
    intact object: the only good copy of a chunk two steps shared was gone. On S3 the store
    copies the object itself."""
    from ckptstore.format import chunk_key
    from ckptstore.quarantine import quarantine_step

    with Checkpointer(s3_uri) as ckpt:
        ckpt.save(1, {"w": torch.arange(4096.0)}).wait()
    store = Store(s3_uri)
    stored = {k: store.get(k) for k in store.list("chunks/")}
    assert quarantine_step(_LyingReads(s3_uri), 1, "every read of it was damaged")
    assert list_steps(store) == []  # quarantined on the reads' word, as the load saw them
    for key, data in stored.items():
        digest = key.rsplit("/", 1)[-1]
        assert store.get(f"{PREFIX}/chunks/{digest}") == data  # the store's bytes, intact
        assert not store.exists(chunk_key(digest))


class _DamagedOnce(Store):
    """The first read of a chunk (or of an object under ``prefix``) is answered with one byte
    flipped (on the way: S3 sends no checksum with a ranged GET); later reads are the store's
    bytes."""

    damaged = 0
    prefix = "chunks/"

    def _once(self, key, data):
        if key.startswith(self.prefix) and not self.damaged:
            self.damaged += 1
            data = bytes(data)
            return data[:-1] + bytes([data[-1] ^ 0xFF])
        return data

    def get(self, key, start=None, end=None, **kwargs):
        return self._once(key, super().get(key, start, end, **kwargs))

    def get_view(self, key, start=None, end=None, **kwargs):
        return self._once(key, super().get_view(key, start, end, **kwargs))


@pytest.mark.parametrize("prefix", ["chunks/", "commits/", "indexes/"])
def test_an_object_damaged_on_the_way_once_is_read_again_not_called_corrupt(s3_uri, caplog, prefix):
    """One damaged answer failed the load (or, with fallback, skipped a good step and
    quarantined it); a reviewer's proxy found a manifest's or a rank index's (one byte cut
    short) still sent ``load(fallback=True)`` and ``dcp.resume`` to the step before."""
    from ckptstore import StorageOptions

    state = {"w": torch.arange(4096.0)}
    with Checkpointer(s3_uri) as ckpt:
        ckpt.save(1, state).wait()
    damaged = _DamagedOnce(s3_uri)
    damaged.prefix = prefix
    into = {"w": torch.zeros(4096)}
    with (
        caplog.at_level("WARNING"),
        Checkpointer(s3_uri, storage=StorageOptions(store=damaged)) as ckpt,
    ):
        assert ckpt.load(into, fallback=True) == 1
    assert damaged.damaged == 1 and torch.equal(into["w"], state["w"])
    assert "read again, it checks out" in caplog.text
    assert list_steps(Store(s3_uri)) == [1] and not quarantined(Store(s3_uri))


def test_a_huge_object_planted_at_a_chunk_key_is_quarantined_without_being_read(tmp_path):
    """The quarantine after a fallback load read the whole object at a damaged chunk's key and
    wrote a copy of it: a 2 GiB sparse file cost 3.3 GiB of memory and a 2 GiB copy, on every
    restart. It is read to the size an encoding of the chunk can take, and linked, not copied."""
    from ckptstore.format import chunk_key
    from tests.helpers.child import growth_in_child

    uri = str(tmp_path / "s")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.arange(4096.0)}).wait()
        ckpt.save(2, {"w": -torch.arange(4096.0)}).wait()
    store = Store(uri)
    (digest,) = load_rank_index(store, load_manifest(store, 2), 0).chunks
    os.truncate(tmp_path / "s" / chunk_key(digest), 1 << 30)  # sparse: no disk, 1 GiB read
    setup = f"""
        import torch
        from ckptstore import Checkpointer
        ckpt = Checkpointer({uri!r})
        """
    action = """
        outcome = f"LOADED {ckpt.load({'w': torch.zeros(4096)}, fallback=True)}"
        """
    growth, outcome = growth_in_child(setup, action, 120)
    assert outcome == "LOADED 1" and growth < 256 << 20, (outcome, growth >> 20)
    assert list_steps(store) == [1] and 2 in quarantined(store).values()
    assert os.stat(tmp_path / "s" / PREFIX / "chunks" / digest).st_blocks < 1024  # no copy


@pytest.mark.parametrize("planted", ["fifo", "link-out"])
def test_a_fifo_or_a_link_out_at_a_chunk_key_is_skipped_and_quarantined(tmp_path, planted):
    """A FIFO at a chunk's key was a StorageError: load(fallback=True) raised it at every
    restart instead of loading the step before. Both it and a link leading out of the store
    are damage: the step is skipped and quarantined, the planted object removed (not copied,
    not followed: the link's target stays as it was)."""
    from ckptstore.format import chunk_key

    root = tmp_path / "s"
    _resume(root, 2)
    store = Store(str(root))
    digest = sorted(_chunks(root, 2) - _chunks(root, 1))[0]
    path = root / chunk_key(digest)
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(outside)
    state = _blank()
    with Checkpointer(root) as ckpt:
        assert ckpt.load(state, fallback=True) == 1
    assert torch.equal(state["w"], _state(1)["w"])
    assert list_steps(store) == [1] and 2 in quarantined(store).values()
    assert not os.path.lexists(path) and not (root / PREFIX / "chunks" / digest).exists()
    assert outside.read_bytes() and len(list(tmp_path.iterdir())) == 2
    _resume(root, 2)  # step 2 saved again: its chunk written again, and it loads
    with Checkpointer(root) as ckpt:
        assert ckpt.load(state, 2) == 2 and torch.equal(state["w"], _state(2)["w"])


@pytest.mark.parametrize("where", ["index", "commit"])
@pytest.mark.parametrize("planted", ["fifo", "link-out", "directory"])
def test_a_fifo_or_a_link_out_at_an_index_or_commit_key_is_skipped_and_quarantined(
    tmp_path, where, planted
):
    """Reviewer M: a FIFO or a link out of the store at a rank index's or a commit's key made
    load(fallback=True) raise at every restart (only chunks were damage). Both are damage now:
    the step is skipped, quarantined (a planted commit removed), and saved again. A storage-
    fault adversary of stop 80: a directory at a commit's key hid the step from every listing
    (ls, verify --all, restore and a fallback load passed it over in silence, and saving it
    again said to look at an ls that did not show it); it is damage as a FIFO is."""
    root = tmp_path / "s"
    _resume(root, 2)
    store = Store(str(root))
    if where == "index":
        path = root / load_manifest(store, 2).ranks[0].key
    else:
        path = root / commit_key(2)
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())
    path.chmod(0o644)
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "directory":
        path.mkdir()
    else:
        path.symlink_to(outside)
    if where == "commit":
        assert list_steps(store) == [1, 2]  # listed, so ls names it (ERROR) and gc keeps it
    assert _resume(root, 2)[0] == 1  # skipped step 2, saved it again
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state, 2) == 2 and torch.equal(state["w"], _state(2)["w"])
    assert 2 in quarantined(store).values() and outside.read_bytes()


def test_a_directory_with_files_at_a_commit_key_is_named_not_deleted(tmp_path, capsys):
    """The fix's adversary of stop 80 (MED): a directory with files in it at a commit key
    made ``gc --remove-corrupt`` end in a raw "OSError: [Errno 39] Directory not empty". It
    says what is there, deletes none of it, and exits 1."""
    root = tmp_path / "s"
    _resume(root, 2)
    path = root / commit_key(2)
    path.chmod(0o644)
    path.unlink()
    path.mkdir()
    (path / "notes.txt").write_text("someone's")
    assert main(["gc", str(root), "--remove-corrupt"]) == 1
    err = capsys.readouterr().err
    assert "is a directory with files in it, where an object belongs: not deleted" in err, err
    assert len(err.strip().splitlines()) == 1 and (path / "notes.txt").exists()


def _during_the_check(monkeypatch, action) -> None:
    """``action()`` once, right after the quarantine's first look at the damaged chunks (a
    concurrent process acting between that check and the move)."""
    from ckptstore import quarantine

    check = quarantine._damaged_chunks
    pending = [action]

    def checked(*args, **kwargs):
        found = check(*args, **kwargs)
        if pending:
            pending.pop()()
        return found

    monkeypatch.setattr(quarantine, "_damaged_chunks", checked)


def test_a_chunk_written_again_after_the_check_is_not_quarantined(tmp_path, monkeypatch):
    """Reviewer: a save's recheck wrote a damaged chunk again and committed a step naming it
    while the quarantine of an older step was between its check and its move; the move then
    took the good chunk away and the new step did not load. The chunks are checked again under
    the quarantine's lease: changed since, the step is left for a later load."""
    root = tmp_path / "ckpt"
    _resume(root, 2)
    digest = _flip_a_chunk_of(root, 2)
    path = root / "chunks" / digest[:2] / digest
    damaged = path.read_bytes()
    data = bytearray(damaged)
    data[len(data) // 2] ^= 0xFF
    good = bytes(data)

    def repaired():
        path.unlink()
        path.write_bytes(good)

    _during_the_check(monkeypatch, repaired)
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state, fallback=True) == 1
    store = Store(str(root))
    assert quarantined(store) == {} and list_steps(store) == [1, 2]
    assert path.read_bytes() == good
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state) == 2 and torch.equal(state["w"], _state(2)["w"])


def test_a_step_committed_again_after_the_check_is_not_removed(tmp_path, monkeypatch):
    """Reviewer: step 2 was taken out by another process and its job saved step 2 again while
    a quarantine of the old step 2 was on its way; the quarantine then deleted the new step
    2's commit (`wait()` had returned for it). The manifest is read again under the lease:
    another save's, it stays."""
    root = tmp_path / "ckpt"
    _resume(root, 2)
    _flip_a_chunk_of(root, 2)
    again = {"w": torch.full((4096,), 7.0), "step": 2}

    store = Store(str(root))

    def another_job():  # removed step 2 (gc --remove-corrupt, say), then saved it again
        store.delete(commit_key(2))
        with Checkpointer(root) as other:
            other.save(2, again).wait(timeout_s=BOUND_S)

    _during_the_check(monkeypatch, another_job)
    with Checkpointer(root) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 1
    assert list_steps(store) == [1, 2] and quarantined(store) == {}
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state) == 2 and torch.equal(state["w"], again["w"])


def test_a_save_in_flight_defers_the_quarantine(tmp_path, monkeypatch, caplog):
    """The quarantine moves objects under a gc lease while no save is in flight (a save may
    repair a chunk it holds, or commit the step number again): with one in flight it moves
    nothing and says so; a later fallback load quarantines the step."""
    from ckptstore.leases import SAVE, Lease

    root = tmp_path / "ckpt"
    _resume(root, 2)
    digest = _flip_a_chunk_of(root, 2)
    store = Store(str(root))
    held: list[Lease] = []
    _during_the_check(
        monkeypatch, lambda: held.append(Lease(store, SAVE, "other-job", ttl_s=60).acquire())
    )
    with Checkpointer(root) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 1
    assert quarantined(store) == {} and list_steps(store) == [1, 2]
    assert "not quarantined now: a save is in flight" in caplog.text
    held[0].release()
    monkeypatch.undo()
    with Checkpointer(root) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 1
    assert list(quarantined(store).values()) == [2] and list_steps(store) == [1]
    assert (root / PREFIX / "chunks" / digest).is_file()


def test_a_quarantine_that_meets_a_storage_error_leaves_the_load_it_follows(
    tmp_path, monkeypatch, caplog
):
    """The quarantine runs after the fallback load went through: its storage error (its lease
    lost, a put refused) is one warning, not an error of that load."""
    from ckptstore import quarantine
    from ckptstore.errors import StorageError

    root = tmp_path / "ckpt"
    _resume(root, 2)
    _flip_a_chunk_of(root, 2)

    def refused(*args, **kwargs):
        raise StorageError("put quarantine/...: access denied")

    monkeypatch.setattr(quarantine, "quarantine_step", refused)
    with Checkpointer(root) as ckpt:
        state = _blank()
        assert ckpt.load(state, fallback=True) == 1
    assert torch.equal(state["w"], _state(1)["w"])
    assert "step 2 was skipped as corrupt but could not be quarantined" in caplog.text


def test_the_quarantines_lease_says_it_deletes_before_its_first_delete(tmp_path, monkeypatch):
    """Reviewer of this change: the quarantine's gc lease never recorded that it deletes, so a
    quarantining process that died was over at once for a save on another store's clock, while
    a delete it had given up at its deadline could still land. It is marked (and checked still
    held) before the first delete, as a gc's is."""
    from ckptstore.leases import Lease

    root = tmp_path / "ckpt"
    _resume(root, 2)
    _flip_a_chunk_of(root, 2)
    events: list[str] = []
    mark = Lease.mark_deleting

    def marked(self):
        events.append("marked")
        return mark(self)

    monkeypatch.setattr(Lease, "mark_deleting", marked)
    delete = Store.delete

    def deleted(self, key, *args, **kwargs):
        if key.startswith(("chunks/", "commits/")):
            events.append(key.split("/")[0])
        return delete(self, key, *args, **kwargs)

    monkeypatch.setattr(Store, "delete", deleted)
    with Checkpointer(root) as ckpt:
        assert ckpt.load(_blank(), fallback=True) == 1
    assert list(quarantined(Store(str(root))).values()) == [2]
    assert events[:2] == ["marked", "chunks"] and "commits" in events, events
