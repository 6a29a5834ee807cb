"""Issue 21 item 6: retention never deletes the last loadable step because a newer one is damaged.

Damaged stores are real saves rewritten by ``tests.helpers.crafted``: a truncated manifest, a manifest whose
checksum is recomputed over a broken field, a rank index that references a chunk of the wrong
size. gc keeps the loadable step, marks the damaged one, sweeps nothing while it is there, and
deletes it only when asked (``--remove-corrupt``)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from ckptstore import Checkpointer, Store
from ckptstore.catalog import list_steps, load_manifest
from ckptstore.cli import main
from ckptstore.errors import StorageError
from ckptstore.format import commit_key
from ckptstore.retention import collect
from tests.helpers.crafted import (
    manifest_doc,
    put_manifest,
    put_rank_index,
    rank_index_doc,
    rewrite,
)

W = {1: torch.arange(64.0), 2: torch.arange(64.0) + 100}


def save_two_steps(uri: str) -> None:
    with Checkpointer(uri) as ckpt:
        for step, w in W.items():
            ckpt.save(step, {"w": w}).wait()


def truncate_manifest(store: Store, step: int) -> None:
    data = store.get(commit_key(step))
    rewrite(store, commit_key(step), data[: len(data) // 2])


def break_manifest(store: Store, step: int) -> None:
    """A manifest whose checksum matches but whose world size is nonsense."""
    doc = manifest_doc(store, step)
    doc["world_size"] = "many"
    put_manifest(store, step, doc)


def break_rank_index(store: Store, step: int) -> None:
    """A rank index (and the manifest's hash of it) consistent, its chunk table not."""
    doc = rank_index_doc(store, step)
    doc["chunks"] = "nothing"
    put_rank_index(store, step, 0, doc)


def truncate_own_chunk(store: Store, step: int) -> str:
    """Cut short a chunk only ``step`` references (its bytes half gone); its key."""
    from ckptstore.catalog import load_rank_indexes
    from ckptstore.format import chunk_key

    def chunks(s: int) -> set[str]:
        return {d for i in load_rank_indexes(store, load_manifest(store, s)) for d in i.chunks}

    own = sorted(chunks(step) - set().union(*(chunks(s) for s in list_steps(store) if s != step)))
    key = chunk_key(own[0])
    data = store.get(key)
    rewrite(store, key, data[: len(data) // 2])
    return key


DAMAGE = {
    "truncated": truncate_manifest,
    "manifest": break_manifest,
    "index": break_rank_index,
    "chunk-cut-short": truncate_own_chunk,
}


def loads_step_1(uri: str) -> bool:
    target = {"w": torch.zeros(64)}
    return Checkpointer(uri).load(target, step=1) == 1 and torch.equal(target["w"], W[1])


def gc_json(capsys, *argv: str, code: int = 0) -> dict:
    assert main(["gc", *argv, "--json"]) == code
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("damage", DAMAGE)
def test_gc_keep_last_1_keeps_the_loadable_step_when_the_newest_is_damaged(
    tmp_path, capsys, damage
):
    uri = str(tmp_path)
    save_two_steps(uri)
    DAMAGE[damage](Store(uri), 2)
    chunks = Store(uri).list("chunks")
    assert main(["gc", uri, "--keep-last", "1"]) == 1  # a cron job's `gc || alert` hears of it
    out, err = capsys.readouterr()
    assert "step(s) 2 cannot be read and are kept (exit 1)" in err, err
    assert "deleted steps: none" in out and "unreadable step 2: kept, not counted" in out
    assert "chunk sweep skipped: step(s) 2 are kept unreadable or damaged" in out
    assert list_steps(Store(uri)) == [1, 2] and Store(uri).list("chunks") == chunks
    assert loads_step_1(uri)


def test_checkpointer_retention_keeps_the_loadable_steps(tmp_path):
    uri = str(tmp_path)
    save_two_steps(uri)
    truncate_manifest(Store(uri), 2)
    with Checkpointer(uri, keep_last=2) as ckpt:
        ckpt.save(3, {"w": W[1] + 1}).wait()
    # Steps 1 and 3 load: they are the two kept; step 2 is neither counted nor deleted.
    assert list_steps(Store(uri)) == [1, 2, 3]
    assert loads_step_1(uri)
    report = collect(Store(uri), keep_last=1)
    assert report.deleted_steps == [1] and report.kept_steps == [3]
    assert list(report.unreadable_steps) == [2] and not report.swept


def test_dry_run_prints_the_whole_plan_with_the_damaged_step_marked(tmp_path, capsys):
    uri = str(tmp_path)
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
    break_manifest(Store(uri), 3)
    before = Store(uri).list()
    assert main(["gc", uri, "--keep-last", "1", "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "dry run: kept steps: 2" in out and "would delete steps: 1" in out
    assert "unreadable step 3: kept, not counted: corrupt: " in out
    assert "chunk sweep skipped" in out
    doc = gc_json(capsys, uri, "--keep-last", "1", "--dry-run", code=1)
    assert doc["kept_steps"] == [2] and doc["deleted_steps"] == [1]
    [unreadable] = doc["unreadable_steps"]
    assert unreadable["step"] == 3 and not unreadable["removed"]
    assert unreadable["error"].startswith("corrupt: ") and commit_key(3) in unreadable["error"]
    assert Store(uri).list() == before


def test_remove_corrupt_deletes_the_damaged_step_then_sweeps(tmp_path, capsys):
    uri = str(tmp_path)
    save_two_steps(uri)
    truncate_manifest(Store(uri), 2)
    doc = gc_json(capsys, uri, "--keep-last", "1", "--remove-corrupt", "--dry-run")
    assert doc["removed_corrupt"] == [2] and doc["unreadable_steps"][0]["removed"]
    assert doc["swept"] and doc["deleted_chunks"] == 0 and doc["young_chunks"] == 1
    assert list_steps(Store(uri)) == [1, 2]
    assert main(["gc", uri, "--keep-last", "1", "--remove-corrupt"]) == 0
    out = capsys.readouterr().out
    assert "unreadable step 2: deleted (--remove-corrupt)" in out
    # its chunk, named by no step read (its manifest does not decode), is seconds old
    assert (
        "deleted 0 unreferenced chunk(s)" in out and "1 unreferenced chunk(s) written less" in out
    )
    assert main(["gc", uri, "--remove-corrupt", "--grace-s", "0"]) == 0
    assert "deleted 1 unreferenced chunk(s)" in capsys.readouterr().out
    assert list_steps(Store(uri)) == [1] and loads_step_1(uri)
    assert main(["verify", uri, "--all"]) == 0


def test_remove_corrupt_without_keep_last_keeps_every_readable_step(tmp_path, capsys):
    """An operator removing a damaged step need not choose a retention too (``--keep-last``
    was required, so ``gc --remove-corrupt`` alone was a usage error)."""
    uri = str(tmp_path)
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
    truncate_manifest(Store(uri), 2)
    doc = gc_json(capsys, uri, "--remove-corrupt")
    assert doc["keep_last"] is None and doc["kept_steps"] == [1, 3]
    assert doc["deleted_steps"] == [] and doc["removed_corrupt"] == [2] and doc["swept"]
    assert list_steps(Store(uri)) == [1, 3]
    assert main(["verify", uri, "--all"]) == 0


@pytest.mark.parametrize("damage", ["manifest", "index"])
def test_restore_of_a_step_whose_manifest_or_index_is_damaged_names_the_step_before(
    tmp_path, capsys, damage
):
    """Reviewer G: a damaged chunk's error said "the step before it: --step N"; a damaged
    manifest (or index) of the latest step said nothing of what to try next."""
    uri = str(tmp_path / "s")
    save_two_steps(uri)
    DAMAGE[damage](Store(uri), 2)
    assert main(["restore", uri, "--to", str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert "the step before it: --step 1" in err and len(err.strip().splitlines()) == 1, err
    assert main(["restore", uri, "--step", "1", "--to", str(tmp_path / "out.pt")]) == 0


@pytest.mark.s3
@pytest.mark.parametrize("damage", ["index", "chunk-cut-short"])
def test_gc_keeps_the_loadable_step_on_s3(s3_uri, capsys, damage):
    """A chunk cut short shows in the listing's sizes (no chunk is read without --verify)."""
    save_two_steps(s3_uri)
    DAMAGE[damage](Store(s3_uri), 2)
    doc = gc_json(capsys, s3_uri, "--keep-last", "1", code=1)
    assert doc["deleted_steps"] == [] and doc["kept_steps"] == [1] and not doc["swept"]
    assert [u["step"] for u in doc["unreadable_steps"]] == [2]
    assert loads_step_1(s3_uri)


def test_gc_never_keeps_a_step_that_lost_a_chunk_in_place_of_one_that_loads(tmp_path, capsys):
    """A chunk of the newest step deleted under the store: ``ckptstore gc --keep-last 1``
    (no --verify) sees it missing from its listing, keeps the step that loads and names the
    damaged one; --remove-corrupt then deletes it."""
    from ckptstore.catalog import load_rank_indexes
    from ckptstore.format import chunk_key

    uri = str(tmp_path)
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
    store = Store(uri)

    def chunks(step: int) -> set[str]:
        return {d for i in load_rank_indexes(store, load_manifest(store, step)) for d in i.chunks}

    [lost] = chunks(3) - chunks(2) - chunks(1)
    store.delete(chunk_key(lost))
    doc = gc_json(capsys, uri, "--keep-last", "1", "--dry-run", code=1)
    assert doc["kept_steps"] == [2] and doc["deleted_steps"] == [1], doc
    [unreadable] = doc["unreadable_steps"]
    assert unreadable["step"] == 3 and chunk_key(lost) in unreadable["error"]
    assert main(["gc", uri, "--keep-last", "1"]) == 1
    out = capsys.readouterr().out
    assert f"unreadable step 3: kept, not counted: corrupt: {chunk_key(lost)} missing" in out
    assert list_steps(store) == [2, 3]
    target = {"w": torch.zeros(64)}
    assert Checkpointer(uri).load(target, step=2) == 2 and torch.equal(
        target["w"], torch.full((64,), 2.0)
    )
    assert main(["gc", uri, "--keep-last", "1", "--remove-corrupt"]) == 0
    assert list_steps(store) == [2]


def test_gc_verify_that_cannot_read_a_chunk_fails_and_deletes_nothing(
    tmp_path, capsys, monkeypatch
):
    """A chunk the store does not serve (its read fails as a storage error, an EIO, not as
    bad bytes) under ``gc --verify``: the plan claimed every step verified and exited 0; the
    command now fails naming it, and deletes nothing."""
    from ckptstore.catalog import load_rank_indexes
    from ckptstore.errors import StorageError
    from ckptstore.format import chunk_key
    from ckptstore.store.backends import LocalBackend

    uri = str(tmp_path)
    save_two_steps(uri)
    store = Store(uri)
    digest = sorted(load_rank_indexes(store, load_manifest(store, 2))[0].chunks)[0]
    opened = LocalBackend._open_file

    def failing(self, path):
        if path.endswith(digest):
            raise StorageError(f"{path}: [Errno 5] Input/output error")
        return opened(self, path)

    monkeypatch.setattr(LocalBackend, "_open_file", failing)
    before = store.list()
    assert main(["gc", uri, "--keep-last", "1", "--verify"]) == 1
    err = capsys.readouterr().err
    assert (
        f"gc could not read 1 object(s) of step(s) 2 to re-hash them (first: {chunk_key(digest)}"
        in err
    )
    assert err.count("\n") == 1 and "nothing deleted" in err
    assert store.list() == before and list_steps(store) == [1, 2]


def test_a_saves_own_retention_keeps_its_step_where_the_listing_lags_behind_it(
    tmp_path, monkeypatch
):
    """A store whose listing does not show a commit yet (an eventually consistent gateway):
    the save's own retention swept the chunks of the step it had just committed, a step
    wait() reported committed and that then failed to load. The step it keeps is read by
    name, listed or not, and its chunks are referenced."""
    import ckptstore.retention as retention

    uri = str(tmp_path / "store")
    listed = retention.list_steps
    monkeypatch.setattr(retention, "list_steps", lambda store: [s for s in listed(store) if s != 4])
    with Checkpointer(uri, keep_last=3) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    monkeypatch.undo()
    assert list_steps(Store(uri)) == [2, 3, 4]  # step 4 counted among the newest 3, as it is
    into = {"w": torch.zeros(4096)}
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")
        assert ckpt.load(into) == 4 and into["w"][0] == 4.0


def test_gc_deletes_nothing_where_the_listing_of_commits_leaves_the_newest_step_out(
    tmp_path, monkeypatch, capsys
):
    """Reviewer (a proxy hiding the newest entry of every commits/ listing): ``gc --keep-last
    1`` took step 3's index for a failed save's and its chunks for unreferenced, and deleted
    them; ``ls`` still listed step 3, and its load failed. Now a save the sweep would delete
    is first looked up by its commit's key: committed, nothing is swept."""
    import ckptstore.retention as retention

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    listed = retention.list_steps
    monkeypatch.setattr(retention, "list_steps", lambda store: [s for s in listed(store) if s != 3])
    _forget_what_this_process_saw(monkeypatch)  # gc run later: nothing names the newest step
    assert main(["gc", uri, "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "the listing of commits/ lacks step 3" in err, err
    assert "no index or chunk was deleted" in err, err
    monkeypatch.undo()
    assert list_steps(Store(uri)) == [2, 3]  # step 1, older than the newest listed, dropped
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")
    assert main(["gc", uri, "--keep-last", "1"]) == 0  # the listing whole again: a plain gc
    assert list_steps(Store(uri)) == [3]


def test_a_saves_own_retention_sweeps_past_a_failed_attempt_of_its_step_while_listing_lags(
    tmp_path, monkeypatch
):
    """An adversary: the check for commits a listing leaves out read the kept step's own
    commit (the save's retention keeps its step, listed or not) and refused the sweep, where
    an older failed attempt of the same step number had left an index."""
    import ckptstore.retention as retention
    from ckptstore.format import rank_index_key

    uri = str(tmp_path / "store")
    save_two_steps(uri)
    store = Store(uri)
    store.put(rank_index_key(2, "failed-attempt", 0), b"{}")  # a failed save of step 2
    listed = retention.list_steps
    monkeypatch.setattr(retention, "list_steps", lambda store: [s for s in listed(store) if s != 2])
    report = collect(store, keep_last=1, keep_steps={2})
    assert report.swept and not store.exists(rank_index_key(2, "failed-attempt", 0))
    monkeypatch.undo()
    assert list_steps(store) == [2]


def test_gc_dry_run_writes_nothing(tmp_path, monkeypatch, capsys):
    """A full-disk reviewer: ``gc --dry-run`` wrote a clock probe, so it failed on a read-only
    or full store, where a preview is what an operator wants first."""
    from ckptstore.errors import StorageError

    uri = str(tmp_path / "store")
    save_two_steps(uri)

    def refused(self, key, *args, **kwargs):
        raise StorageError(f"put {key}: Read-only file system")

    monkeypatch.setattr(Store, "put", refused)
    assert main(["gc", uri, "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete steps: 1\n" in out, out
    monkeypatch.undo()
    assert list_steps(Store(uri)) == [1, 2]


def test_gc_re_hashes_the_steps_it_keeps_before_deleting_older_ones(tmp_path, capsys):
    """A new user's review: one byte flipped in the newest step's chunk (its size unchanged),
    then ``gc --keep-last 1``: the good step before it was deleted, gc exited 0, and no step
    could be loaded. Now the kept step is re-hashed first: the damaged one is kept apart, the
    good one kept in its place, gc exits 1 naming the damage."""
    from ckptstore.catalog import load_rank_indexes
    from ckptstore.format import chunk_key

    uri = str(tmp_path / "store")
    save_two_steps(uri)
    with Checkpointer(uri) as ckpt:
        ckpt.save(3, {"w": W[2] + 100}).wait()
    store = Store(uri)
    digest = sorted(load_rank_indexes(store, load_manifest(store, 3))[0].chunks)[0]
    data = bytearray(store.get(chunk_key(digest)))
    data[len(data) // 2] ^= 0x01
    rewrite(store, chunk_key(digest), bytes(data))
    assert main(["gc", uri, "--keep-last", "1", "--dry-run", "--no-verify"]) == 0
    assert "would delete steps: 1, 2\n" in capsys.readouterr().out  # what the default guards
    assert main(["gc", uri, "--keep-last", "1"]) == 1
    out, err = capsys.readouterr()
    assert "re-hashed, every chunk checks out: step(s) 2\n" in out, out
    assert "deleted steps: 1\n" in out and "unreadable step 3: kept" in out, out
    assert "step(s) 3 cannot be read" in err
    assert list_steps(store) == [2, 3]
    target = {"w": torch.zeros(64)}
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(target, fallback=True) == 2 and torch.equal(target["w"], W[2])


def _own_chunks(store: Store, step: int) -> list[str]:
    from ckptstore.catalog import load_rank_indexes
    from ckptstore.format import chunk_key

    def chunks(s: int) -> set[str]:
        return {d for i in load_rank_indexes(store, load_manifest(store, s)) for d in i.chunks}

    others = set().union(*(chunks(s) for s in list_steps(store) if s != step))
    return [chunk_key(d) for d in sorted(chunks(step) - others)]


def _delete_like_retention(store: Store, step: int) -> None:
    """What a saver's ``keep_last`` does to ``step`` in another process: manifest, then chunks."""
    doomed = _own_chunks(store, step)
    store.delete(commit_key(step))
    for key in doomed:
        store.delete(key)


@pytest.mark.parametrize("how", ["listing", "verify"])
def test_gc_running_beside_a_savers_retention_never_calls_the_step_it_deleted_corrupt(
    tmp_path, capsys, monkeypatch, how
):
    """A durability reviewer: ``ckptstore gc`` in a loop beside a saver whose ``keep_last``
    deleted steps called a healthy step "corrupt: chunks/… missing" (exit 1, advising
    --remove-corrupt): the saver deleted it between gc's read of its manifest and of its
    chunks. A step whose manifest is gone by then was deleted, not damaged."""
    import ckptstore._inspect as inspect_module

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
    store = Store(uri)
    if how == "listing":
        real = Store.list_sizes

        def list_sizes(self, prefix, *args, **kwargs):
            if prefix == "chunks" and commit_key(1) in self.list():
                _delete_like_retention(store, 1)
            return real(self, prefix, *args, **kwargs)

        monkeypatch.setattr(Store, "list_sizes", list_sizes)
        argv = ["gc", uri, "--keep-last", "2", "--no-verify"]
    else:
        real = inspect_module.verify_steps

        def verify_steps(on, steps, *args, **kwargs):
            if 1 in steps:
                _delete_like_retention(store, 1)
            return real(on, steps, *args, **kwargs)

        monkeypatch.setattr(inspect_module, "verify_steps", verify_steps)
        argv = ["gc", uri, "--keep-last", "2", "--verify"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unreadable_steps"] == [] and doc["kept_steps"] == [2, 3], doc
    assert list_steps(store) == [2, 3]
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")


def test_gc_never_removes_a_step_saved_again_while_it_ran_as_corrupt(tmp_path, capsys, monkeypatch):
    """A reviewer: step 2 deleted and saved again (a quarantined step saved anew) between gc's
    read of its manifest and its listing of the chunks: gc judged the new save by the old
    one's chunks, called it corrupt, and ``--remove-corrupt`` deleted a step wait() had
    reported committed. The save gc read is compared with the one there now."""
    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
    store = Store(uri)
    real, done = Store.list_sizes, []

    def list_sizes(self, prefix, *args, **kwargs):
        if prefix == "chunks" and not done:
            done.append(True)
            _delete_like_retention(store, 2)
            with Checkpointer(uri) as again:
                again.save(2, {"w": torch.full((64,), 22.0)}).wait()
        return real(self, prefix, *args, **kwargs)

    monkeypatch.setattr(Store, "list_sizes", list_sizes)
    argv = ["gc", uri, "--keep-last", "3", "--no-verify", "--remove-corrupt", "--json"]
    assert main(argv) == 0 and done
    doc = json.loads(capsys.readouterr().out)
    assert doc["unreadable_steps"] == [] and doc["kept_steps"] == [1, 2, 3], doc
    monkeypatch.undo()
    target = {"w": torch.zeros(64)}
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")
        assert ckpt.load(target, step=2) == 2 and torch.equal(target["w"], torch.full((64,), 22.0))


def _listings_leave_out(monkeypatch, step: int) -> None:
    """Every listing of the store leaves out ``step``'s commit and its save's objects (a store
    whose listings lag its writes); reads by key find them."""
    import ckptstore.retention as retention
    from ckptstore.format import save_of_key

    listed, listing = retention.list_steps, Store.list

    def lagging(store, prefix=""):
        return [k for k in listing(store, prefix) if (save_of_key(k) or (0,))[0] != step]

    monkeypatch.setattr(
        retention, "list_steps", lambda store: [s for s in listed(store) if s != step]
    )
    monkeypatch.setattr(Store, "list", lagging)


def test_gc_keeps_the_chunks_of_a_step_whose_commit_and_indexes_the_listings_leave_out(
    tmp_path, monkeypatch, capsys
):
    """Adversary of stop 74 (a listing lagging behind both a commit and its indexes, as an NFS
    client's cached directories do): ``gc --keep-last 1`` found no commit and no index of step
    3, so nothing led it to look step 3 up, and it swept step 3's own chunks as a failed save's;
    the listing caught up and step 3 failed to load. A chunk that no step gc read names is now
    swept only once it is older than a listing may lag."""

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    _listings_leave_out(monkeypatch, 3)
    _forget_what_this_process_saw(monkeypatch)  # gc run later: nothing names the newest step
    assert main(["gc", uri, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted steps: 1" in out, out
    assert "stay until a later gc" in out, out
    monkeypatch.undo()
    assert list_steps(Store(uri)) == [2, 3]
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")
        into = {"w": torch.zeros(4096)}
        assert ckpt.load(into) == 3 and into["w"][0] == 3.0


def _forget_what_this_process_saw(monkeypatch) -> None:
    """A fresh process's view: no step known found or gone (``ckptstore gc`` run later)."""
    import ckptstore.catalog as catalog

    monkeypatch.setattr(catalog, "_SEEN", {})
    monkeypatch.setattr(catalog, "_GONE_AS_NAMED", {})


@pytest.mark.parametrize("who", ["gc", "retention"])
def test_an_old_step_the_listings_leave_out_keeps_its_chunks(tmp_path, monkeypatch, capsys, who):
    """Storage adversary (a proxy dropping every key of step 2 from the S3 listings, reads by
    key answered): ``ckptstore gc`` without --keep-last (every step kept) and a saver's own
    ``keep_last=5`` retention swept step 2's chunks as unreferenced, old enough for any grace;
    step 2 listed again and no longer loaded. The step after it names it in its manifest as
    the step committed before it, and gc looks up a step so named that the listing lacks."""
    uri = str(tmp_path / "store")
    with Checkpointer(uri, keep_last=5) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
        assert load_manifest(Store(uri), 3).previous == [2, 1]
        _listings_leave_out(monkeypatch, 2)
        if who == "retention":
            ckpt.save(5, {"w": torch.full((4096,), 5.0)}).wait()
        else:
            _forget_what_this_process_saw(monkeypatch)
            assert main(["gc", uri, "--grace-s", "0"]) == 1
            err = capsys.readouterr().err
            assert re.search(r"lacks step 2 \(named by step [34] as committed before it\)", err)
    monkeypatch.undo()
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")
        into = {"w": torch.zeros(4096)}
        assert ckpt.load(into, step=2) == 2 and into["w"][0] == 2.0


def test_a_step_kept_long_stays_named_by_the_steps_after_it(tmp_path, monkeypatch):
    """Fix adversary, round 2: a manifest named the 8 newest steps below it only; a step kept
    long (top-k's best, the newest healthy one) was named only by manifests deleted since, and
    a fresh gc swept it under a listing that left it out. A manifest names the oldest steps
    below it too."""
    from ckptstore.retention import drop_step

    uri = str(tmp_path / "store")
    store = Store(uri)
    with Checkpointer(uri) as ckpt:
        for step in range(1, 41):
            ckpt.save(step, {"w": torch.full((256,), float(step))}).wait()
    for step in range(2, 31):  # top-k keeps step 1, the best, and the newest ten
        drop_step(store, step)
    assert all(1 in load_manifest(store, s).previous for s in range(31, 41))
    _forget_what_this_process_saw(monkeypatch)
    _listings_leave_out(monkeypatch, 1)
    with pytest.raises(StorageError, match="lacks step 1 "):
        collect(store, keep_last=None)
    monkeypatch.undo()
    with Checkpointer(uri) as ckpt:
        ckpt.verify(1)


def test_a_step_retention_found_saved_again_is_looked_up_where_a_later_listing_lacks_it(
    tmp_path, monkeypatch
):
    """Fix adversary, round 2: a step retention meant to drop, found saved again (so kept),
    still counted as dropped; a later listing of the same run leaving it out had its new
    save's chunks swept."""
    import ckptstore.retention as retention

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    unchanged, listed, calls = retention._unchanged, retention.list_steps, []
    monkeypatch.setattr(
        retention, "_unchanged", lambda store, step, a: step != 1 and unchanged(store, step, a)
    )

    def later_without_1(store):
        calls.append(1)
        return [s for s in listed(store) if len(calls) == 1 or s != 1]

    monkeypatch.setattr(retention, "list_steps", later_without_1)
    with pytest.raises(StorageError, match="lacks step 1 "):
        collect(Store(uri), keep_last=1)
    monkeypatch.undo()
    with Checkpointer(uri) as ckpt:
        ckpt.verify(1)


@pytest.mark.parametrize("case", ["newest-seen", "gap", "saved-again"])
def test_a_step_the_listings_leave_out_keeps_its_chunks_where_no_next_step_names_it(
    tmp_path, monkeypatch, case
):
    """Fix adversary: only the step right after a step protected it. ``newest-seen``: the
    newest step, which this process wrote, nothing naming it. ``gap``: the step after it
    dropped (Lightning's top-k drops any step), gc in a fresh process: a manifest names the 8
    newest steps below it its writer knew. ``saved-again``: a long-lived process that found
    step 3 gone, step 3 saved again by another: a step found gone as one manifest named it is
    looked up again where another names it."""
    from ckptstore.retention import drop_step

    uri = str(tmp_path / "store")
    store = Store(uri)
    with Checkpointer(uri) as ckpt:
        for step in (1, 2, 3, 4, 5):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    dropped = 3
    if case == "newest-seen":
        dropped = 5
    elif case == "gap":
        drop_step(store, 4)
        _forget_what_this_process_saw(monkeypatch)
    else:
        drop_step(store, 5)
        drop_step(store, 4)
        drop_step(store, 3)
        collect(store, keep_last=None)  # this process finds 3 gone, as step 4 named it
        import ckptstore.catalog as catalog

        seen, gone = catalog._SEEN, catalog._GONE_AS_NAMED
        _forget_what_this_process_saw(monkeypatch)  # another process saves 3 and 4 again
        with Checkpointer(uri) as ckpt:
            ckpt.load({"w": torch.zeros(4096)}, step=2)
            for step in (3, 4):
                ckpt.save(step, {"w": torch.full((4096,), 10.0 + step)}).wait()
        monkeypatch.setattr(catalog, "_SEEN", seen)
        monkeypatch.setattr(catalog, "_GONE_AS_NAMED", gone)
    _listings_leave_out(monkeypatch, dropped)
    with pytest.raises(StorageError, match=f"lacks step {dropped} "):
        collect(store, keep_last=None)
    monkeypatch.undo()
    with Checkpointer(uri) as ckpt:
        ckpt.verify(dropped)


def test_a_step_deleted_before_is_looked_up_once_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """The other side: the oldest kept step names a step retention deleted; a gc in a fresh
    process looks it up once, finds it gone and sweeps."""
    from ckptstore.format import chunk_key

    uri = str(tmp_path / "store")
    with Checkpointer(uri, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    store = Store(uri)
    assert list_steps(store) == [2, 3] and load_manifest(store, 2).previous == [1]
    orphan = chunk_key("ab" * 16)
    store.put(orphan, b"a chunk a save died before naming")
    _forget_what_this_process_saw(monkeypatch)
    asked = []
    exists = Store.exists
    monkeypatch.setattr(Store, "exists", lambda self, key: asked.append(key) or exists(self, key))
    swept = [collect(store, keep_last=None).deleted_chunks for _ in range(2)]
    assert swept == [1, 0], swept
    assert asked.count(commit_key(1)) == 1, asked
    assert not store.exists(orphan)


def test_gc_sweeps_a_failed_saves_chunks_once_they_are_older_than_a_listing_may_lag(
    tmp_path, capsys
):
    """The other side of the rule above: an unreferenced chunk no step names is left while it is
    young, said so, and swept by the gc that finds it old (its time set back, as the store's
    clock would have moved on)."""
    import os

    from ckptstore.format import chunk_key

    uri = str(tmp_path / "store")
    save_two_steps(uri)
    store = Store(uri)
    orphan = chunk_key("ab" * 16)
    store.put(orphan, b"a chunk a save died before naming")
    assert main(["gc", uri, "--keep-last", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "deleted 0 unreferenced chunk(s)" in out and "1 unreferenced chunk(s) written less" in out
    )
    assert store.exists(orphan)
    old = store.modified(orphan) - 600
    os.utime(tmp_path / "store" / orphan, (old, old))
    assert main(["gc", uri, "--keep-last", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted_chunks"] == 1 and doc["young_chunks"] == 0, doc
    assert not store.exists(orphan)
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")


def test_a_state_step_whose_manifest_says_dcp_is_corrupt_and_fallback_passes_it(tmp_path):
    """Adversary of stop 75: a Checkpointer step's manifest resealed with ``"kind": "dcp"``
    (no DCP metadata: no DCP load can read it) sent ``load(fallback=True)`` to DCP with an
    UnsupportedStateError instead of the step before. A dcp step without DCP metadata is
    corrupt, whichever front-end loads it."""
    uri = str(tmp_path / "store")
    save_two_steps(uri)
    doc = manifest_doc(Store(uri), 2)
    doc["kind"] = "dcp"
    put_manifest(Store(uri), 2, doc)
    into = {"w": torch.zeros(64)}
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(into, fallback=True) == 1
    assert torch.equal(into["w"], W[1])
    assert list_steps(Store(uri)) == [1]  # quarantined, as a corrupt step is


def test_gc_keeps_an_old_chunk_that_a_step_the_listings_miss_found_stored(tmp_path, monkeypatch):
    """Adversary of the rule above: step 2 held the bytes of step 0, whose chunk an hour old it
    found stored (an exclusive put answered "exists", the chunk's time unchanged); with step 2
    missing from the listings, ``gc --keep-last 1`` dropped step 0 and swept that chunk at once,
    and the newest step lost it. A chunk a save finds stored is made young again (a local or NFS
    file's time), and gc leaves every unreferenced chunk younger than --grace-s."""
    import os

    uri = str(tmp_path / "store")
    x = torch.arange(8192.0)
    with Checkpointer(uri) as ckpt:
        ckpt.save(0, {"w": x}).wait()
        hour_ago = time.time() - 3600
        for key in Store(uri).list("chunks"):
            os.utime(tmp_path / "store" / key, (hour_ago, hour_ago))
        ckpt.save(1, {"w": -x}).wait()
        ckpt.save(2, {"w": x}).wait()  # step 0's chunk, found stored
    _listings_leave_out(monkeypatch, 2)
    _forget_what_this_process_saw(monkeypatch)  # gc run later: nothing names the newest step
    assert main(["gc", uri, "--keep-last", "1"]) == 0
    monkeypatch.undo()
    assert list_steps(Store(uri)) == [1, 2]
    with Checkpointer(uri) as ckpt:
        ckpt.verify("all")
        into = {"w": torch.zeros(8192)}
        assert ckpt.load(into) == 2 and torch.equal(into["w"], x)


def test_verify_does_not_decode_a_chunk_declared_larger_than_the_hosts_memory(
    tmp_path, monkeypatch, capsys
):
    """Adversary of stop 75: a state index declaring a 64 GiB tensor in one chunk (a 2 MB
    zstd frame of zeros that says so) had verify allocate and fill the declared size. A chunk
    declared beyond the host's available memory is reported unread, not judged."""
    from ckptstore import pipeline

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.zeros(1024, dtype=torch.uint8)}).wait()
    doc = rank_index_doc(Store(uri), 1)
    (digest,) = doc["chunks"]
    huge = 1 << 50
    doc["chunks"][digest][0] = huge
    doc["tensors"][0]["shape"] = [huge]
    doc["tensors"][0]["segments"] = [[digest, 0, huge]]
    put_rank_index(Store(uri), 1, 0, doc)
    fetched = []
    fetch = pipeline.fetch_chunk
    monkeypatch.setattr(
        pipeline,
        "fetch_chunk",
        lambda store, d, *a, **k: fetched.append(d) or fetch(store, d, *a, **k),
    )
    assert main(["verify", uri]) == 1
    out = capsys.readouterr().out
    assert f"declares {huge} raw bytes, more than this host's available memory" in out, out
    assert fetched == []


def test_verify_reads_a_chunk_of_at_most_1_gib_whatever_memory_is_free(tmp_path, monkeypatch):
    """The second adversary: with MemAvailable down for a moment (other reads hold memory), a
    real 32 MiB chunk was reported unreadable. The memory check is for declared sizes beyond any
    chunk this format writes (MAX_CHUNK_BYTES)."""
    import ckptstore.device as device

    uri = str(tmp_path / "store")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.randn(1 << 20)}).wait()
    monkeypatch.setattr(device, "host_available_bytes", lambda: 1 << 20)
    assert main(["verify", uri]) == 0
