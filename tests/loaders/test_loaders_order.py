"""Order determinism per (seed, epoch, rank, worker) and exact resume across workers and ranks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from loaders import LoaderConfig, ShardDataset, StatefulLoader, TokenFiles

SAMPLE_TOKENS = 4


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    # 3 files of 137, 60 and 203 samples; token t of sample i holds i*SAMPLE_TOKENS + t
    start = 0
    for name, samples in (("a.bin", 137), ("b.bin", 60), ("c.bin", 203)):
        n = samples * SAMPLE_TOKENS
        np.arange(start, start + n, dtype=np.uint32).tofile(root / name)
        start += n
    return str(root)


def _dataset(root, *, seed=7, rank=0, world_size=1, **cfg) -> ShardDataset:
    cfg.setdefault("shuffle_block_units", 3)
    config = LoaderConfig(seed=seed, window_reads=4, **cfg)
    fmt = TokenFiles(dtype="uint32", sample_tokens=SAMPLE_TOKENS, read_bytes=16 * 20)
    return ShardDataset(root, fmt, config=config, rank=rank, world_size=world_size)


def _ids(samples) -> list[int]:
    out = []
    for s in samples:
        tokens = np.asarray(s["tokens"]).reshape(-1, SAMPLE_TOKENS)
        ids = np.asarray(s["__index__"]).reshape(-1)
        assert (tokens[:, 0] == ids * SAMPLE_TOKENS).all()  # the bytes belong to the id
        out.extend(ids.tolist())
    return out


def test_order_is_a_permutation_and_deterministic(token_dir):
    a = _ids(_dataset(token_dir))
    assert sorted(a) == list(range(400))
    assert a != list(range(400))
    assert _ids(_dataset(token_dir)) == a
    assert _ids(_dataset(token_dir, seed=8)) != a
    ds = _dataset(token_dir)
    ds.set_epoch(1)
    epoch1 = _ids(ds)
    assert epoch1 != a and sorted(epoch1) == sorted(a)
    ds.set_epoch(1)
    assert _ids(ds) == epoch1
    unshuffled = _ids(_dataset(token_dir, shuffle=False))
    assert unshuffled == list(range(400))


def test_iterating_again_runs_the_next_epoch(token_dir):
    ds = _dataset(token_dir)
    first = _ids(ds)
    assert ds.epoch == 1
    second = _ids(ds)
    other = _dataset(token_dir)
    other.set_epoch(1)
    assert second == _ids(other) != first


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_split_the_global_order(token_dir, world_size):
    full = _ids(_dataset(token_dir))
    per_rank = [_ids(_dataset(token_dir, rank=r, world_size=world_size)) for r in range(world_size)]
    length = 400 // world_size
    for r, ids in enumerate(per_rank):
        assert ids == full[r::world_size][:length]


def test_state_dict_is_plain_values(token_dir):
    ds = _dataset(token_dir)
    state = ds.state_dict()

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return isinstance(v, (int, float, str, bool))

    assert plain(state)


@pytest.mark.parametrize(("world_before", "world_after"), [(2, 2), (2, 3), (3, 1), (1, 4)])
def test_resume_across_world_sizes_sees_exactly_the_unseen(token_dir, world_before, world_after):
    full = _ids(_dataset(token_dir))
    steps = 23
    seen, states = [], []
    for r in range(world_before):
        ds = _dataset(token_dir, rank=r, world_size=world_before)
        it = iter(ds)
        seen.extend(_ids(next(it) for _ in range(steps)))
        states.append(ds.state_dict())
    assert len({s["position"] for s in states}) == 1
    position = states[0]["position"]
    assert sorted(seen) == sorted(full[:position])
    resumed = []
    for r in range(world_after):
        ds = _dataset(token_dir, rank=r, world_size=world_after)
        ds.load_state_dict(states[r % world_before])
        resumed.append(_ids(ds))
    rest = full[position:]
    usable = len(rest) // world_after * world_after
    for r, ids in enumerate(resumed):
        assert ids == rest[r:usable:world_after]
    assert set(seen).isdisjoint(x for ids in resumed for x in ids)


def test_resume_with_same_world_size_continues_each_rank(token_dir):
    for r in range(2):
        uninterrupted = _ids(_dataset(token_dir, rank=r, world_size=2))
        ds = _dataset(token_dir, rank=r, world_size=2)
        it = iter(ds)
        head = _ids(next(it) for _ in range(50))
        again = _dataset(token_dir, rank=r, world_size=2)
        again.load_state_dict(ds.state_dict())
        assert head + _ids(again) == uninterrupted


def test_load_state_rejects_another_dataset(token_dir):
    state = _dataset(token_dir).state_dict()
    with pytest.raises(ValueError, match="seed"):
        _dataset(token_dir, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        _dataset(token_dir).load_state_dict({"version": 99})


def test_load_state_rejects_a_dataset_of_the_same_size_laid_out_otherwise(token_dir, tmp_path):
    """Seed, shuffle and sample count alike, the shards differ: a saved position would name
    other samples (it was accepted)."""
    import shutil

    other = tmp_path / "other"
    other.mkdir()
    for name, new in (("a.bin", "x.bin"), ("b.bin", "y.bin"), ("c.bin", "z.bin")):
        shutil.copy(os.path.join(token_dir, name), other / new)
    state = _dataset(token_dir).state_dict()
    assert _dataset(str(other)).num_samples == state["num_samples"]
    with pytest.raises(ValueError, match="another dataset"):
        _dataset(str(other)).load_state_dict(state)
    _dataset(token_dir).load_state_dict({k: v for k, v in state.items() if k != "dataset"})


def _collate(batch):
    return {
        "tokens": np.stack([s["tokens"] for s in batch]),
        "__index__": np.array([s["__index__"] for s in batch]),
    }


@pytest.mark.timeout(120)
def test_dataloader_workers_yield_the_rank_order_and_resume_exactly(token_dir):
    """Rank 1 of 2, batch 5: 2 workers, stop after 7 batches, resume with 2 workers and world
    size 1: the resumed run sees exactly the unseen samples, in global order."""
    full = _ids(_dataset(token_dir))
    rank_order = full[1::2][:200]
    for workers in (0, 2):
        loader = StatefulLoader(
            _dataset(token_dir, rank=1, world_size=2),
            batch_size=5,
            num_workers=workers,
            collate_fn=_collate,
        )
        assert _ids(loader) == rank_order
    loader = StatefulLoader(
        _dataset(token_dir, rank=1, world_size=2), batch_size=5, num_workers=2, collate_fn=_collate
    )
    it = iter(loader)
    head = _ids(next(it) for _ in range(7))
    assert head == rank_order[:35]
    state = loader.state_dict()
    del it
    assert state["position"] == 70
    resumed = StatefulLoader(
        _dataset(token_dir, rank=0, world_size=1), batch_size=4, num_workers=2, collate_fn=_collate
    )
    resumed.load_state_dict(state)
    assert _ids(resumed) == full[70:]
    assert resumed.dataset.epoch == 1


@pytest.mark.timeout(120)
def test_stateful_loaders_of_two_batch_sizes_share_one_dataset_and_leave_its_config(token_dir):
    """Each StatefulLoader hands its own batch size to its workers; the dataset's config stays
    the caller's, and the position the loaders count is the dataset's."""
    full = _ids(_dataset(token_dir))
    ds = _dataset(token_dir)
    config = ds.config
    small = StatefulLoader(ds, batch_size=3, num_workers=2, collate_fn=_collate)
    large = StatefulLoader(ds, batch_size=8, num_workers=2, collate_fn=_collate)
    assert ds.config is config and config.batch_size == 1
    it = iter(large)
    assert _ids(next(it) for _ in range(4)) == full[:32]
    del it
    assert ds.state_dict()["position"] == 32
    assert _ids(small) == full[32:]
    epoch1 = _dataset(token_dir)
    epoch1.set_epoch(1)
    assert ds.epoch == 1 and _ids(large) == _ids(epoch1)


def test_dataloader_batches_collate_to_tensors(token_dir):
    loader = StatefulLoader(_dataset(token_dir, shuffle=False), batch_size=8, num_workers=0)
    batch = next(iter(loader))
    assert isinstance(batch["tokens"], torch.Tensor) and batch["tokens"].shape == (8, 4)
    assert batch["__index__"].tolist() == list(range(8))


@pytest.mark.parametrize("shuffle", [True, False])
def test_iter_batches_matches_sample_order(token_dir, shuffle):
    # every batch is held to the end: views of read buffers and gathered copies must stay intact
    samples = _ids(_dataset(token_dir, rank=1, world_size=3, shuffle=shuffle))
    ds = _dataset(token_dir, rank=1, world_size=3, shuffle=shuffle)
    batches = list(ds.iter_batches(16))
    assert all(len(b["__index__"]) == 16 for b in batches[:-1])
    assert _ids(batches) == samples
    assert ds.epoch == 1


def test_in_order_false_is_refused(token_dir):
    """Batches delivered out of order would make the counted position name other samples."""
    with pytest.raises(ValueError, match="in_order=False"):
        StatefulLoader(_dataset(token_dir), batch_size=4, num_workers=2, in_order=False)


def test_set_epoch_of_the_resumed_epoch_keeps_the_position(token_dir):
    """The DistributedSampler habit: set_epoch(epoch) at the top of each epoch, after a load."""
    full = _ids(_dataset(token_dir))
    ds = _dataset(token_dir)
    it = iter(StatefulLoader(ds, batch_size=5, collate_fn=_collate))
    _ids(next(it) for _ in range(6))
    state = ds.state_dict()
    del it
    resumed = StatefulLoader(_dataset(token_dir), batch_size=5, collate_fn=_collate)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    assert _ids(resumed) == full[30:]
    assert resumed.dataset.epoch == 1
    it = iter(resumed)
    _ids(next(it) for _ in range(2))
    del it
    resumed.set_epoch(1)  # no load since that pass began: epoch 1 again from its start
    epoch1 = _dataset(token_dir)
    epoch1.set_epoch(1)
    assert _ids(resumed) == _ids(epoch1)


def test_an_epoch_that_gives_no_batch_is_an_error_not_an_endless_loop(token_dir):
    ds = _dataset(token_dir, rank=0, world_size=2)  # 200 samples for this rank
    loader = StatefulLoader(ds, batch_size=201, drop_last=True, collate_fn=_collate)
    with pytest.raises(ValueError, match=r"epoch 0 gave rank 0 no batch.*drop_last=True"):
        list(loader)
    assert ds.epoch == 0
    # A pass resumed at the epoch's end is empty by right: it moves on to the next epoch.
    ds = _dataset(token_dir)
    state = {**ds.state_dict(), "position": ds.num_samples}
    loader = StatefulLoader(ds, batch_size=8, collate_fn=_collate)
    loader.load_state_dict(state)
    assert list(loader) == [] and ds.epoch == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epoch": -1}, r"epoch -1 is not in \[0, 2\*\*63\)"),
        # adversary of stop 75: a 4,000-digit epoch a JSON checkpoint cannot hold again, bools
        ({"epoch": 10**4000}, r"epoch 1000000000000000000000000000000000000000 is not in"),
        ({"position": True}, "no integer epoch and position"),
        ({"version": True}, "loader state version True is not"),
        ({"version": 1.0}, "loader state version 1.0 is not"),
        ({"position": None}, "no integer epoch and position"),
        # a reviewer's: these were truncated to epoch 1 and position 3, or read as 7
        ({"epoch": 1.7}, "no integer epoch and position"),
        ({"position": 3.9}, "no integer epoch and position"),
        ({"position": "7"}, "no integer epoch and position"),
    ],
)
def test_a_loader_state_with_a_bad_epoch_or_position_is_refused(token_dir, change, message):
    ds = _dataset(token_dir)
    state = {**ds.state_dict(), **change}
    with pytest.raises(ValueError, match=message):
        ds.load_state_dict(state)
    state = ds.state_dict()
    del state["position"]
    with pytest.raises(ValueError, match="no integer epoch and position"):
        ds.load_state_dict(state)


def test_a_loaders_length_is_the_batches_it_gives(token_dir):
    """A reviewer's: with drop_last=True, len() counted the short batch the pass drops."""
    ds = _dataset(token_dir, rank=0, world_size=2)  # 200 samples for this rank
    for batch_size, drop_last in ((64, True), (64, False), (50, True), (50, False)):
        loader = StatefulLoader(ds, batch_size=batch_size, drop_last=drop_last, collate_fn=_collate)
        assert len(loader) == len(list(loader)) == (3 if drop_last and batch_size == 64 else 4)
    state = {**ds.state_dict(), "position": 0, "epoch": 0}
    loader = StatefulLoader(ds, batch_size=64, drop_last=True, collate_fn=_collate)
    ds.load_state_dict(state)
    next(iter(loader))
    assert len(loader) == 2  # the batches left in the pass, as before
