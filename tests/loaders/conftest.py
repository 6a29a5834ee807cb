"""Each loader test starts with no one-time warning said yet: what a test sees of them does
not depend on which tests ran before it in the process."""

from __future__ import annotations

import pytest

from loaders.formats import layout


@pytest.fixture(autouse=True)
def _nothing_said_yet():
    layout.forget_said()
    yield
