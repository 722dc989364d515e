"""The LoRA registry beside the engine (lora/registry.py): which adapters every rank holds, in
least-recently-used order, dropped past the capacity unless a request still runs with them, and
removed only once the last request with them finishes. A fake runner records what the ranks
were told."""

from __future__ import annotations

import pytest

from nanoserve.errors import InvalidRequestError
from nanoserve.lora.adapter import LoRAError
from nanoserve.lora.registry import LoRARegistry
from nanoserve.lora.request import LoRARequest


class FakeRunner:
    def __init__(self) -> None:
        self.lora = object()  # a model that takes adapters
        self.held: list[int] = []
        self.bad_paths: set[str] = set()

    def add_lora(self, lora_int_id: int, lora_path: str) -> None:
        if lora_path in self.bad_paths:
            raise LoRAError(f"{lora_path}: no adapter_config.json")
        self.held.append(lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        self.held.remove(lora_int_id)


def make(capacity: int = 2, in_use: set[int] | None = None, enabled: bool = True):
    runner, running = FakeRunner(), set() if in_use is None else in_use
    return runner, LoRARegistry(runner, enabled, capacity, lambda: set(running)), running


def adapter(lora_int_id: int, path: str | None = None) -> LoRARequest:
    return LoRARequest(f"a{lora_int_id}", lora_int_id, path or f"/adapters/{lora_int_id}")


def test_least_recently_used_is_dropped_past_capacity():
    runner, registry, _ = make(capacity=2)
    registry.add(adapter(1))
    registry.add(adapter(2))
    registry.add(adapter(1))  # used again: 2 is now the least recent
    registry.add(adapter(3))
    assert list(registry.adapters) == [1, 3] and sorted(runner.held) == [1, 3]


def test_an_adapter_in_use_is_never_dropped():
    runner, registry, running = make(capacity=1)
    registry.add(adapter(1))
    running.add(1)
    registry.add(adapter(2))  # over capacity, but 1 still runs
    assert sorted(runner.held) == [1, 2]


def test_remove_waits_for_the_last_request():
    runner, registry, running = make()
    registry.add(adapter(1))
    running.add(1)
    assert registry.remove(1) and registry.ids() == set() and runner.held == [1]
    assert not registry.remove(1)  # already being removed
    registry.finish_removals()
    assert runner.held == [1]  # still running
    running.clear()
    registry.finish_removals()
    assert runner.held == [] and 1 not in registry.adapters


def test_refusals_name_the_problem():
    runner, registry, _ = make(enabled=False)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        registry.add(adapter(1))
    runner, registry, _ = make()
    runner.bad_paths.add("/adapters/bad")
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        registry.add(adapter(1, "/adapters/bad"))
    registry.add(adapter(2))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        registry.add(adapter(2, "/adapters/other"))
    assert registry.names({2, 7}) == ["a2"]
