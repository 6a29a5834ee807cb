"""Loads that fail: what they leave in the state, falling back to an older step, and states
that cannot be saved (cycles) or loaded (numpy arrays of another shape or dtype)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptstore.loading
import ckptstore.pipeline
from ckptstore import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointNotFoundError,
    EncodingOptions,
    Store,
    UnsupportedStateError,
)
from ckptstore.catalog import list_steps, load_manifest, load_rank_index
from ckptstore.errors import PartialLoadError
from ckptstore.format import chunk_key
from tests.helpers import ROOT
from tests.helpers.crafted import put_rank_index, rank_index_doc
from tests.helpers.dist import run_ranks

N = 16 * 1024  # float32 elements: 16 chunks of 4096 bytes each


class Counter:
    """A stateful object that records every load_state_dict call."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.loaded: list[int] = []

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state["value"])
        self.value = state["value"]


def make_state(step: int) -> dict:
    """Two 16-chunk tensors whose chunks are all distinct, from each other and across steps."""
    base = torch.arange(N, dtype=torch.float32)
    return {
        "a": base + 100_000 * step,
        "b": -(base + 100_000 * step) - 1,
        "step": step,
        "counter": Counter(step),
    }


def blank_state() -> dict:
    return {"a": torch.zeros(N), "b": torch.zeros(N), "step": -1, "counter": Counter(-1)}


def chunks_of(root: Path, step: int, path: str, rank: int = 0) -> list[str]:
    """The digests of the chunks holding the tensor at top-level key ``path``, in order."""
    store = Store(root)
    index = load_rank_index(store, load_manifest(store, step), rank)
    entry = index.tensors[index.tree[path]["$t"]]
    return [seg.chunk for seg in entry.segments]


def all_chunks(root: Path, step: int, rank: int) -> set[str]:
    store = Store(root)
    return set(load_rank_index(store, load_manifest(store, step), rank).chunks)


def flip_byte(root: Path, digest: str) -> Path:
    path = root / chunk_key(digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return path


def save_steps(root: Path, steps, state_of=make_state) -> None:
    with Checkpointer(root, encoding=EncodingOptions(chunk_bytes=4096, compression="none")) as ckpt:
        for step in steps:
            ckpt.save(step, state_of(step)).wait()


def assert_loaded(target: dict, step: int) -> None:
    expected = make_state(step)
    assert torch.equal(target["a"], expected["a"])
    assert torch.equal(target["b"], expected["b"])
    assert target["step"] == step
    assert target["counter"].value == step


# -- item 6: a failed load leaves a mixed state ------------------------------------------------


def test_failed_load_names_the_tensors_it_overwrote_and_applies_nothing_else(tmp_path, monkeypatch):
    save_steps(tmp_path, [7])
    b_chunks = chunks_of(tmp_path, 7, "b")
    assert len(b_chunks) == 16 and len(set(b_chunks)) == 16
    bad = flip_byte(tmp_path, b_chunks[8])
    # The chunks after the corrupt one arrive late, once load() has raised: they must not land.
    late = set(b_chunks[9:])
    late_begun, release, ended = threading.Event(), threading.Event(), threading.Semaphore(0)
    started: list[str] = []  # late fetches begun (the others are cancelled once load() fails)
    fetch = ckptstore.pipeline.fetch_chunk

    def late_fetch(store, digest, *args, **kwargs):
        if digest == b_chunks[8]:  # fails once a late chunk is on its way
            assert late_begun.wait(timeout=30)
        if digest not in late:
            return fetch(store, digest, *args, **kwargs)
        started.append(digest)
        late_begun.set()
        assert release.wait(timeout=30)
        return fetch(store, digest, *args, **kwargs)

    store_map = Store.map

    def map_telling_when_a_late_chunk_ended(self, fn, items, **kwargs):
        def one(item):  # a chunk's whole read: its fetch, then its copy into the tensors
            try:
                return fn(item)
            finally:
                if item in late:
                    ended.release()

        return store_map(self, one, items, **kwargs)

    monkeypatch.setattr(ckptstore.pipeline, "fetch_chunk", late_fetch)
    monkeypatch.setattr(Store, "map", map_telling_when_a_late_chunk_ended)
    target = blank_state()
    with pytest.raises(PartialLoadError) as info:
        Checkpointer(tmp_path).load(target)
    after_raise = target["b"].clone()
    error = info.value
    assert isinstance(error, CheckpointCorruptError)  # what callers caught before still catches
    assert error.written == ["a", "b"]
    message = str(error)
    assert "partly overwritten: a, b" in message and "step 7" in message
    assert "no non-tensor value was set and no load_state_dict() called" in message
    assert isinstance(error.__cause__, CheckpointCorruptError) and bad.name in str(error.__cause__)
    # Nothing but the tensors changed: no scalar set, no load_state_dict called.
    assert target["step"] == -1 and target["counter"].loaded == [] and target["counter"].value == -1
    saved = make_state(7)
    assert torch.equal(target["a"], saved["a"])
    assert torch.equal(target["b"][: 8 * 1024], saved["b"][: 8 * 1024])
    assert not target["b"][8 * 1024 :].any()  # the corrupt chunk and the late ones: not yet
    release.set()
    for _ in started:
        assert ended.acquire(timeout=30)
    assert torch.equal(target["b"], after_raise)  # nothing written after load() raised


def test_failed_load_that_wrote_nothing_raises_the_plain_error(tmp_path):
    save_steps(tmp_path, [7])
    flip_byte(tmp_path, chunks_of(tmp_path, 7, "b")[8])
    # "a" is not contiguous: it is filled through a temporary, copied in only once every chunk
    # verified, so the failed load never reached it (though all of its chunks had arrived).
    target = blank_state()
    target["a"] = torch.zeros(2 * N)[::2]
    with pytest.raises(PartialLoadError) as info:
        Checkpointer(tmp_path).load(target)
    assert info.value.written == ["b"]
    assert not target["a"].any()
    # A failure before any byte reached the state: the plain error, the state untouched.
    with Checkpointer(
        tmp_path, encoding=EncodingOptions(chunk_bytes=4096, compression="none")
    ) as ckpt:
        ckpt.save(8, {"w": torch.arange(100.0), "n": 8}).wait()
    store = Store(tmp_path)
    (digest,) = load_rank_index(store, load_manifest(store, 8), 0).chunks
    flip_byte(tmp_path, digest)
    target = {"w": torch.zeros(100), "n": 0}
    with pytest.raises(CheckpointCorruptError) as info:
        Checkpointer(tmp_path).load(target, step=8)
    assert not isinstance(info.value, PartialLoadError)
    assert not target["w"].any() and target["n"] == 0


# -- item 8: a corrupt latest step blocks resume -----------------------------------------------


def test_fallback_skips_a_corrupt_latest_step(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    unique = set(chunks_of(tmp_path, 2, "b")) - all_chunks(tmp_path, 1, 0)
    assert len(unique) == 16  # dedup shares nothing: the corruption hits step 2 only
    bad = flip_byte(tmp_path, chunks_of(tmp_path, 2, "b")[8])
    target = blank_state()
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(PartialLoadError):  # strict, as before: no fallback
            ckpt.load(target)
        with pytest.raises(ValueError, match="fallback=True starts from the latest step"):
            ckpt.load(target, step=2, fallback=True)
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert ckpt.load(target, fallback=True) == 1  # also repairs the half-loaded state
    assert_loaded(target, 1)
    assert target["counter"].loaded == [1]
    skipped = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("ckptstore") and r.levelno >= logging.WARNING
    ]
    assert len(skipped) == 1, skipped
    assert "step 2" in skipped[0] and "cannot be loaded" in skipped[0] and bad.name in skipped[0]
    assert "\n" not in skipped[0]

    # Step 2's damage re-checked: quarantined (issue 32), so it blocks no later save of step 2.
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1]
    # Every step corrupt: the error names each, and the state is reported partly overwritten.
    flip_byte(tmp_path, chunks_of(tmp_path, 1, "a")[3])
    target = blank_state()
    with pytest.raises(CheckpointCorruptError) as info:
        Checkpointer(tmp_path).load(target, fallback=True)
    message = str(info.value)
    assert "could be loaded, every one failed: step 1:" in message
    assert "step 1: step 1" not in message, message  # named once (a reviewer saw it twice)
    assert isinstance(info.value, PartialLoadError) and info.value.written == ["a"]  # step 1 only
    assert target["step"] == -1 and target["counter"].loaded == []


def test_fallback_over_missing_chunks_and_an_empty_store(tmp_path):
    save_steps(tmp_path, [1, 2])
    for digest in all_chunks(tmp_path, 2, 0):  # every chunk missing: nothing is ever written
        (tmp_path / chunk_key(digest)).unlink()
    target = blank_state()
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match=r"^step 2: chunk .* is missing"):
            ckpt.load(target)  # the step named (a reviewer saw the chunk alone)
        assert not target["a"].any() and target["step"] == -1
        assert ckpt.load(target, fallback=True) == 1
    assert_loaded(target, 1)
    assert list_steps(Store(tmp_path)) == [1]  # step 2, skipped for its missing chunks, quarantined
    for digest in all_chunks(tmp_path, 1, 0):
        (tmp_path / chunk_key(digest)).unlink()
    target = blank_state()
    with pytest.raises(CheckpointNotFoundError, match="every one failed: step 1: chunk .* missing"):
        Checkpointer(tmp_path).load(target, fallback=True)
    assert not target["a"].any()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        Checkpointer(tmp_path / "empty").load(blank_state(), fallback=True)


def test_fallback_refuses_a_step_that_cannot_repair_what_the_failed_load_wrote(tmp_path):
    def nested(step: int) -> dict:
        state = make_state(step)
        return {"m": {"a": state["a"], **({"b": state["b"]} if step == 2 else {})}}

    save_steps(tmp_path, [1, 2], nested)
    store = Store(tmp_path)
    index = load_rank_index(store, load_manifest(store, 2), 0)
    b_chunks = [s.chunk for s in index.tensors[index.tree["m"]["b"]["$t"]].segments]
    flip_byte(tmp_path, b_chunks[8])
    target = {"m": {"a": torch.zeros(N), "b": torch.zeros(N)}}
    with pytest.raises(PartialLoadError) as info:
        Checkpointer(tmp_path).load(target, fallback=True)
    # Step 1 has no m/b: loading it would leave m/b half from step 2, so nothing is claimed.
    assert info.value.written == ["m/a", "m/b"]
    assert isinstance(info.value.__cause__, UnsupportedStateError)
    assert "state keys not in the checkpoint: ['m/b']" in str(info.value)


def _dist_state(rank: int, step: int) -> dict:
    base = torch.arange(N, dtype=torch.float32) + 100_000 * step + 1_000_000 * rank
    return {"w": base, "v": -base, "step": step, "rank": rank}


def _dist_save(rank: int, world: int, root: str) -> None:
    with Checkpointer(root, encoding=EncodingOptions(chunk_bytes=4096, compression="none")) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _dist_state(rank, step))
        ckpt.wait()


def _dist_load(rank: int, world: int, root: str) -> None:
    blank = {"w": torch.zeros(N), "v": torch.zeros(N), "step": -1, "rank": -1}
    with Checkpointer(root) as ckpt:
        target = dict(blank)
        # Strict: rank 0's own step 2 is fine, yet every rank raises, naming rank 1.
        with pytest.raises(CheckpointCorruptError, match="failed to load on 1 of 2 rank.*rank 1"):
            ckpt.load(target)
        assert target["step"] == -1
        if rank == 0:
            assert torch.equal(target["w"], _dist_state(0, 2)["w"])  # written, then refused
        target = dict(blank, w=torch.zeros(N), v=torch.zeros(N))
        assert ckpt.load(target, fallback=True) == 1
    expected = _dist_state(rank, 1)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["v"], expected["v"])
    assert target["step"] == 1 and target["rank"] == rank


@pytest.mark.dist
def test_ranks_fall_back_together(tmp_path):
    run_ranks(_dist_save, 2, str(tmp_path))
    assert list_steps(Store(tmp_path)) == [1, 2]
    others = all_chunks(tmp_path, 2, 0) | all_chunks(tmp_path, 1, 0) | all_chunks(tmp_path, 1, 1)
    bad = chunks_of(tmp_path, 2, "w", rank=1)[5]
    assert bad in all_chunks(tmp_path, 2, 1) - others  # no other rank or step reads it
    flip_byte(tmp_path, bad)
    run_ranks(_dist_load, 2, str(tmp_path))


@pytest.mark.slow
def test_train_gpt_resumes_from_the_previous_step_when_the_latest_is_corrupt(tmp_path):
    ckpt = tmp_path / "gpt"

    def train(steps: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--ckpt", str(ckpt)]
        cmd += ["--steps", str(steps), "--every", "2", "--data", str(tmp_path / "data")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    first = train(4)
    assert first.returncode == 0, first.stdout + first.stderr
    assert list_steps(Store(ckpt)) == [2, 4]
    newest = all_chunks(ckpt, 4, 0) - all_chunks(ckpt, 2, 0)
    assert newest
    for digest in newest:
        flip_byte(ckpt, digest)
    second = train(6)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 2" in second.stdout
    assert "step 4 in" in second.stderr and "cannot be loaded" in second.stderr


# -- item 13: cycles on save, numpy arrays that do not match on load ----------------------------


def test_a_state_that_contains_itself_is_refused_by_path(tmp_path):
    loop: list = [1]
    loop.append(loop)
    looped: dict = {"x": 1}
    looped["me"] = looped
    shared = [torch.ones(3)]
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"^a/1: the state refers to itself"):
            ckpt.save(1, {"a": loop})
        with pytest.raises(UnsupportedStateError, match=r"d/me: .*a cycle back to d\)"):
            ckpt.save(1, {"d": looped})
        ckpt.save(1, {"p": shared, "q": shared}).wait()  # shared, not cyclic: fine
    target = {"p": [torch.zeros(3)], "q": [torch.zeros(3)]}
    Checkpointer(tmp_path).load(target)
    assert torch.equal(target["q"][0], torch.ones(3))


def test_numpy_arrays_of_another_shape_or_dtype_are_refused(tmp_path):
    saved = np.arange(12, dtype=np.int32).reshape(3, 4)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"arr": saved, "w": torch.ones(5)}).wait()
    ckpt = Checkpointer(tmp_path)
    for wrong in (np.zeros((4, 3), np.int32), np.zeros((3, 4), np.float64)):
        target = {"arr": wrong, "w": torch.zeros(5)}
        with pytest.raises(UnsupportedStateError, match=r"arr: checkpoint has .*int32 \(3, 4\)"):
            ckpt.load(target)
        assert target["arr"] is wrong and not target["w"].any()  # refused before any write
    for fine in (np.zeros((3, 4), np.int32), None, torch.zeros(3, 4)):  # as before: replaced
        target = {"arr": fine, "w": torch.zeros(5)}
        ckpt.load(target)
        assert isinstance(target["arr"], np.ndarray) and np.array_equal(target["arr"], saved)
        assert target["arr"].dtype == np.int32
    ckpt.close()


def test_arrays_of_a_second_name_or_byte_order_are_saved_as_their_values(tmp_path):
    """Reviewer V: np.ulonglong (uint64 by another name) and big-endian arrays were torch's
    raw TypeError and ValueError at save; a tensor torch cannot copy (uint3) was its raw
    NotImplementedError from the staging copy."""
    state = {
        "u": np.arange(5, dtype=np.ulonglong),
        "big": np.arange(6, dtype=">f4").reshape(2, 3),
        "big0d": np.array(7, dtype=">i8"),
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state).wait()
        with pytest.raises(UnsupportedStateError, match=r"s/1: a numpy array of .*<U1"):
            ckpt.save(2, {"s": [None, np.array(["a"])]})
        with pytest.raises(UnsupportedStateError, match=r"t: unsupported tensor .*torch\.uint3"):
            ckpt.save(2, {"t": torch.empty(4, dtype=torch.uint3)})
        ckpt.save(2, {"ok": torch.ones(2)}).wait()  # the refused saves left nothing behind
        into = {"u": None, "big": None, "big0d": None}
        ckpt.load(into, step=1)
        # Reviewer X: into arrays of the saved dtypes, big-endian, was "float32, state has >f4"
        again = {key: np.zeros_like(value) for key, value in state.items()}
        ckpt.load(again, step=1)
    for key, saved in state.items():
        for loaded in (into[key], again[key]):
            assert np.array_equal(loaded, saved) and loaded.shape == saved.shape, key
            assert loaded.dtype == saved.dtype.newbyteorder("="), key


@pytest.mark.parametrize(
    "scalar, dtype, hint",
    [
        (np.longdouble(1.5), np.dtype(np.longdouble).name, r"float\(value\)"),
        (np.complex64(1 + 2j), "complex64", r"np\.asarray\(value\)"),
        (np.datetime64("2026-12-05T10:00", "ns"), r"datetime64\[ns\]", r"str\(value\)"),
        (np.datetime64("2026-12-05T10:00", "s"), r"datetime64\[s\]", r"str\(value\)"),
        (np.timedelta64(5, "ns"), r"timedelta64\[ns\]", r"value\.astype\('int64'\)"),
        (np.void(b"ab"), r"\|V2", r"its fields one by one"),
    ],
)
def test_a_numpy_scalar_without_a_plain_value_is_refused_by_its_dtype(
    tmp_path, scalar, dtype, hint
):
    """Reviewer X: a longdouble scalar (whose .item() is itself) was a RecursionError at save;
    a complex64 one was refused as "builtins.complex", a type the state did not hold. A
    datetime64[ns] (or timedelta64[ns]) scalar was saved as its int and loaded back as one, a
    void one as bytes."""
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match=rf"^x/0: a numpy {dtype} scalar.*{hint}"):
            ckpt.save(1, {"x": [scalar]})
        ckpt.save(1, {"x": [np.float64(2.5), np.int64(3), np.bool_(True)]}).wait()
        into = {"x": None}
        ckpt.load(into)
    assert into["x"] == [2.5, 3, True]


def test_a_zero_dimensional_array_keeps_its_shape_and_loads_into_the_state_that_saved_it(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"best": np.array(2.5), "t": np.arange(6).reshape(2, 3).T}).wait()
        target = {"best": np.array(0.0), "t": np.zeros((3, 2), np.int64)}
        ckpt.load(target)
    assert target["best"].shape == () and target["best"] == 2.5
    assert np.array_equal(target["t"], np.arange(6).reshape(2, 3).T)  # saved non-contiguous


def test_a_number_in_the_step_never_silently_replaces_a_live_object(tmp_path):
    """With ``strict``, a tensor, array or stateful object of the state where the step holds
    a number (or a string, bytes): refused before any write (it kept its old value, unseen,
    while the dict entry became the number). ``strict=False``, or a None saved (a value not
    set yet, say a best score), replaces it; a None does not replace a stateful object or a
    dict with ``strict``."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(
            1, {"scale": 0.5, "ema": {"decay": 0.99}, "name": "run", "w": torch.ones(2)}
        ).wait()
        for place, live in [
            ("scale", torch.zeros(4)),
            ("ema/decay", np.zeros(3)),
            ("name", torch.nn.Linear(2, 2)),
            ("scale", {"a": 1}),  # a dict of the state where the step has a number: a schema
            ("ema/decay", [0.9, 0.99]),
        ]:
            target = {"scale": 0.0, "ema": {"decay": 0.0}, "name": "", "w": torch.zeros(2)}
            outer, _, key = place.rpartition("/")
            (target[outer] if outer else target)[key] = live
            with pytest.raises(UnsupportedStateError, match=f"{place}: checkpoint has a"):
                ckpt.load(target)
            assert not target["w"].any()
            ckpt.load(target, strict=False)
            assert target["scale"] == 0.5 and target["ema"]["decay"] == 0.99
        target = {"scale": None, "ema": {"decay": 1}, "name": b"", "w": torch.zeros(2)}
        ckpt.load(target)  # plain values of another type are replaced, as before
        assert target["scale"] == 0.5 and target["ema"]["decay"] == 0.99 and target["name"] == "run"
        ckpt.save(2, {"best": None, "w": torch.ones(2)}).wait()
        target = {"best": torch.tensor(0.25), "w": torch.zeros(2)}
        ckpt.load(target, 2)  # a rollback to before a best score was set
        assert target["best"] is None and target["w"].all()
        # Adversary of stop 79: a model (or a dict) where the step saved None (an EMA made
        # later; a hostile index's "model": null) loaded nothing, its entry set to None.
        ckpt.save(3, {"ema": None, "extra": None, "w": torch.ones(2)}).wait()
        for place, live in [("ema", torch.nn.Linear(2, 2)), ("extra", {"a": torch.zeros(1)})]:
            target = {"ema": None, "extra": None, "w": torch.zeros(2), place: live}
            with pytest.raises(UnsupportedStateError, match=f"{place}: checkpoint has None"):
                ckpt.load(target, 3)
            assert target[place] is live and not target["w"].any()
            ckpt.load(target, 3, strict=False)
            assert target[place] is None and target["w"].all()


def test_a_stateful_object_the_state_omits_names_strict_false(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(2, 2), "opt": torch.nn.Linear(1, 1)}).wait()
        with pytest.raises(UnsupportedStateError, match="opt: .*does not hold.*strict=False"):
            ckpt.load({"model": torch.nn.Linear(2, 2)})
        ckpt.load({"model": torch.nn.Linear(2, 2)}, strict=False)
        assert ckpt.last_load_left_out == ["opt (not in the state)"]


def test_values_the_state_holds_no_tensor_for_are_bounded_by_available_memory(
    tmp_path, monkeypatch
):
    """Adversary: a step may add values the state lacks, allocated at their declared size (a
    4 MiB zero tensor stores in a few hundred bytes; a crafted one declares 100 GiB). On a
    host with less memory available than those values take, the load is refused by name
    before anything is allocated or read; values the state holds load in place, uncounted."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.zeros(1 << 20), "opt": {"m": torch.zeros(1 << 20)}}).wait()
    monkeypatch.setattr(ckptstore.loading, "host_available_bytes", lambda: 3 << 20)
    state: dict = {"w": torch.ones(1 << 20)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError) as refused:
            ckpt.load(state)
        assert "step 1 has 4.0 MiB of values the state holds no tensor for (opt/m)" in str(
            refused.value
        ) and "more than the 3.0 MiB this host has available" in str(refused.value)
        assert list(state) == ["w"] and torch.equal(state["w"], torch.ones(1 << 20))
        monkeypatch.setattr(ckptstore.loading, "host_available_bytes", lambda: 6 << 20)
        with pytest.raises(UnsupportedStateError, match="8.0 MiB of values .* \\(w, opt/m\\)"):
            ckpt.load({})
        ckpt.load(state, strict=False)  # leaves opt/m out
        assert list(state) == ["w"] and not state["w"].any()
        held = {"w": torch.ones(1 << 20), "opt": {"m": torch.ones(1 << 20)}}
        assert ckpt.load(held) == 1 and not held["opt"]["m"].any()


def test_a_load_state_dict_of_the_callers_that_raises_is_raised_as_it_is_with_a_note(tmp_path):
    class Refuses:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, saved):
            raise ValueError("schema 2 expected")

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(4), "obj": Refuses()}).wait()
        into = {"w": torch.zeros(4), "obj": Refuses()}
        with pytest.raises(ValueError, match="schema 2 expected") as info:
            ckpt.load(into)
    assert torch.equal(into["w"], torch.ones(4))  # set before the objects, as the note says
    (note,) = info.value.__notes__
    assert "raised while step 1 was set into the state" in note and "rebuild the state" in note


def _model_and_optimizer(groups: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if groups == 1:
        return model, torch.optim.AdamW(model.parameters())
    return model, torch.optim.AdamW([{"params": m.parameters()} for m in model])


def _stepped(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).sum().backward()
    optim.step()


@pytest.mark.parametrize("craft", [None, "state", "groups"])
def test_an_optimizer_state_its_optimizer_would_refuse_is_refused_before_any_io(tmp_path, craft):
    """Reviewer S: torch's load_state_dict refused these after every tensor of the state
    (the model's weights) had been overwritten, and fallback did not skip the step."""
    model, optim = _model_and_optimizer(1)
    _stepped(model, optim)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}).wait()
    groups, says = 2, r"parameter groups of \[4\] parameters, this optimizer's of \[2, 2\]"
    if craft is not None:  # the same optimizer, its saved state damaged
        groups = 1
        store = Store(tmp_path)
        doc = rank_index_doc(store, 1)
        optim_node = dict(doc["tree"]["optim"]["$stateful"])
        if craft == "state":
            optim_node["state"], says = "hello", "its 'state' is not a dict"
        else:
            optim_node["param_groups"], says = [{"lr": 1}], "its 'param_groups' is not a list"
        doc["tree"]["optim"]["$stateful"] = optim_node
        put_rank_index(store, 1, 0, doc)
    into_model, into_optim = _model_and_optimizer(groups)
    before = [p.detach().clone() for p in into_model.parameters()]
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match=f"optim: .*AdamW: {says}"):
            ckpt.load({"model": into_model, "optim": into_optim})
    assert all(torch.equal(a, b) for a, b in zip(before, into_model.parameters()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA generator can be made here")
def test_a_generator_of_a_device_this_process_lacks_is_refused_before_any_io(tmp_path):
    """A GPU job's checkpoint loaded on a CPU machine: its CUDA generator failed after every
    tensor of the state had been overwritten (reviewer S)."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(4), "g": torch.Generator()}).wait()
    store = Store(tmp_path)
    doc = rank_index_doc(store, 1)
    doc["tree"]["g"]["$generator"]["device"] = "cuda"  # as a GPU machine saves it
    put_rank_index(store, 1, 0, doc)
    into = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedStateError, match="g: a generator on device 'cuda'.*strict"):
            ckpt.load(into)
        assert not into["w"].any()
        assert ckpt.load(into, strict=False) == 1 and "g" not in into
