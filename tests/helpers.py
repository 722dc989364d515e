"""Helpers shared by tests in every folder."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
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


def write_sentence_transformers_files(model_dir: Path, pooling: dict[str, object]) -> None:
    """An embedding checkpoint's sentence-transformers files, as such models ship them:
    modules.json (Transformer, Pooling, Normalize) and 1_Pooling/config.json holding `pooling`."""
    modules = [
        ("0", "", "Transformer"),
        ("1", "1_Pooling", "Pooling"),
        ("2", "2_Normalize", "Normalize"),
    ]
    (model_dir / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": index,
                    "name": name,
                    "path": path,
                    "type": f"sentence_transformers.models.{kind}",
                }
                for index, (name, path, kind) in enumerate(modules)
            ]
        )
    )
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (model_dir / "2_Normalize").mkdir(exist_ok=True)
