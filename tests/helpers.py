"""Helpers shared by tests in every folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str = "the condition", timeout: float = 60.0) -> T:
    """Poll `condition` until it returns something truthy, and return that.

    Another thread (a server, an engine) gets there in its own time; the timeout only keeps a
    broken build from hanging the suite and is never what a test measures."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
