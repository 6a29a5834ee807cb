"""The loader's state saved and restored by ckptstore.Checkpointer like any other Stateful."""

from __future__ import annotations

import numpy as np
import pytest

import ckptstore
from loaders import LoaderConfig, ShardDataset, StatefulLoader, TokenFiles

pytestmark = pytest.mark.timeout(120)


def _checkpointer():
    if not hasattr(ckptstore, "Checkpointer"):
        pytest.skip("ckptstore.Checkpointer is not importable yet (the lead is building it)")
    return ckptstore.Checkpointer


def _loader(root, workers):
    ds = ShardDataset(
        root,
        TokenFiles(sample_tokens=8, read_bytes=160),
        config=LoaderConfig(seed=5, shuffle_block_units=2),
    )
    return StatefulLoader(
        ds, batch_size=4, num_workers=workers, collate_fn=lambda b: [int(s["__index__"]) for s in b]
    )


def test_checkpointer_saves_and_restores_the_loader_exactly(tmp_path):
    checkpointer_cls = _checkpointer()
    (tmp_path / "data").mkdir()
    np.arange(8 * 300, dtype=np.uint16).tofile(tmp_path / "data" / "tokens.bin")
    root = str(tmp_path / "data")
    full = [i for batch in _loader(root, 0) for i in batch]

    loader = _loader(root, 2)
    it = iter(loader)
    seen = [i for _ in range(9) for i in next(it)]
    del it
    ckpt = checkpointer_cls(str(tmp_path / "ckpt"))
    try:
        ckpt.save(3, {"loader": loader, "step": 3}).wait()
    finally:
        ckpt.close()

    resumed = _loader(root, 0)
    ckpt = checkpointer_cls(str(tmp_path / "ckpt"))
    try:
        state = {"loader": resumed, "step": 0}
        assert ckpt.load(state) == 3
    finally:
        ckpt.close()
    rest = [i for batch in resumed for i in batch]
    assert seen == full[:36]
    assert rest == full[36:]
