"""Waiting in tests for a condition to hold, never for a length of time to pass."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout_s: float, interval_s: float = 0.02) -> T:
    """``condition()``'s first truthy value, polled every ``interval_s``; its last (falsy) value
    once ``timeout_s`` has passed, for the caller to assert."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)
