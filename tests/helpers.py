"""Helpers shared by tests in every folder."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def random_prompts(
    count: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 60
) -> list[list[int]]:
    """`count` prompts of random token ids (never the 0-2 special ids), the same for a seed."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


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
