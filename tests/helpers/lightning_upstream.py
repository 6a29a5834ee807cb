"""The plugin fixture for Lightning's own tests vendored into
``tests/integrations/test_lightning_upstream_*``.

``ckptstore_io`` is autouse there: every Lightning strategy that would make its default
``TorchCheckpointIO`` gets a ``CkptstoreCheckpointIO`` instead, all of one test on one store kept
outside ``tmp_path`` (Lightning's tests list ``tmp_path`` and expect only their checkpoint files
there: the pointers). The vendored tests themselves run unmodified.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import lightning.pytorch.strategies.strategy as strategy_module  # noqa: E402

from ckptstore.catalog import list_steps  # noqa: E402
from ckptstore.integrations.lightning import CkptstoreCheckpointIO  # noqa: E402
from ckptstore.store import Store  # noqa: E402


class StoreOfTest:
    """The store URI of the running test, and the plugins made on it."""

    uri = ""
    plugins: list[CkptstoreCheckpointIO] = []


def plugin() -> CkptstoreCheckpointIO:
    io = CkptstoreCheckpointIO(StoreOfTest.uri)
    StoreOfTest.plugins.append(io)
    return io


def use_store(uri: str, monkeypatch: pytest.MonkeyPatch):
    """Make every default CheckpointIO a plugin on ``uri``; yields, then closes them all and
    checks that the test saved through the store."""
    StoreOfTest.uri, StoreOfTest.plugins = uri, []
    monkeypatch.setattr(strategy_module, "TorchCheckpointIO", plugin)
    yield uri
    plugins, StoreOfTest.plugins = StoreOfTest.plugins, []
    for io in plugins:
        io.close()
    assert list_steps(Store(uri)) or not plugins, f"nothing was saved to {uri}"
