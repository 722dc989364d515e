"""Rank 0's hold on the other ranks (engine/ranks.py): an explicit serving state decides what a
lost rank means. While starting, rank 0 may be blocked in a collective that never completes, so
the process ends; once serving, the engine is marked dead and the callbacks are told."""

from __future__ import annotations

import pytest

from nanoserve.engine import ranks as ranks_module
from nanoserve.engine.ranks import OtherRanks


class FakeWorkers:
    def __init__(self) -> None:
        self.callbacks: list = []
        self.killed = False
        self.stopped = False

    def on_failure(self, callback) -> None:
        self.callbacks.append(callback)

    def fail(self, reason: str) -> None:
        for callback in list(self.callbacks):
            callback(reason)

    def kill(self) -> None:
        self.killed = True

    def stop(self) -> None:
        self.stopped = True


class Exited(Exception):
    pass


@pytest.fixture
def held(monkeypatch) -> tuple[OtherRanks, FakeWorkers]:
    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(ranks_module.os, "_exit", exit_)
    ranks, workers = OtherRanks(), FakeWorkers()
    ranks.workers = workers
    workers.on_failure(ranks._fail_during_startup)
    return ranks, workers


def test_a_rank_lost_while_starting_ends_the_process(held):
    ranks, workers = held
    with pytest.raises(Exited):
        workers.fail("rank 1 exited")
    assert workers.killed and ranks.dead_reason is None


def test_a_rank_lost_while_serving_marks_the_engine_dead(held):
    ranks, workers = held
    told: list[str] = []
    ranks.add_failure_callback(told.append)
    ranks.now_serving()
    workers.fail("rank 1 exited")
    assert ranks.dead_reason == "rank 1 exited" and told == ["rank 1 exited"]
    assert not workers.killed
    late: list[str] = []
    ranks.add_failure_callback(late.append)  # asked after the failure: told at once
    assert late == ["rank 1 exited"]


def test_stop_skips_telling_dead_ranks(held):
    ranks, workers = held
    ranks.now_serving()
    workers.fail("rank 1 exited")
    told: list[bool] = []
    ranks.stop(lambda: told.append(True))
    assert told == [] and workers.stopped and ranks.workers is None
