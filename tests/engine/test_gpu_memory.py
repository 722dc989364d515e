"""The KV pool's share of a CUDA device (nanoserve.engine.gpu_memory), against a simulated
device: other processes' memory, another engine in this process, the weights, a profile run
that peaks and frees, and memory held outside torch's allocator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoserve.engine.gpu_memory import GIB, MemoryAtStart, kv_cache_budget

DEVICE = torch.device("cuda", 0)


class FakeDevice:
    def __init__(self, total_gib: float, other_processes_gib: float) -> None:
        self.total = int(total_gib * GIB)
        self.others = int(other_processes_gib * GIB)
        self.allocated = self.reserved = self.peak = self.outside_torch = 0

    def free(self) -> int:
        return self.total - self.others - self.reserved - self.outside_torch

    def allocate(self, gib: float) -> None:
        size = int(gib * GIB)
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def release(self, gib: float) -> None:  # back to torch's cache, not to the device
        self.allocated -= int(gib * GIB)

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free(), self.total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(
            cuda,
            "reset_peak_memory_stats",
            lambda device=None: setattr(self, "peak", self.allocated),
        )
        monkeypatch.setattr(cuda, "empty_cache", lambda: setattr(self, "reserved", self.allocated))
        monkeypatch.setattr(
            cuda,
            "get_device_properties",
            lambda device=None: SimpleNamespace(total_memory=self.total),
        )


def start_engine(
    fake: FakeDevice,
    utilization: float,
    weights_gib=10.0,
    activations_gib=5.0,
    outside_torch_gib=1.0,
):
    start = MemoryAtStart.take(DEVICE)
    fake.allocate(weights_gib)

    def profile_run():
        fake.allocate(activations_gib)
        fake.outside_torch += int(outside_torch_gib * GIB)  # e.g. a cuBLAS workspace
        fake.release(activations_gib)

    budget, figures = kv_cache_budget(DEVICE, utilization, start, profile_run)
    fake.allocate(budget / GIB)  # the pool itself
    return budget, figures


def test_budget_is_the_share_less_weights_peak_and_outside_memory(monkeypatch):
    fake = FakeDevice(total_gib=140, other_processes_gib=40)
    fake.install(monkeypatch)
    budget, figures = start_engine(fake, 0.5)
    assert budget == int(0.5 * 140 * GIB) - 15 * GIB - 1 * GIB
    assert figures["peak_torch"] == 15 * GIB and figures["outside_torch"] == 1 * GIB
    # With a forward pass at the full token budget running, the engine holds its share of the
    # device, and no more.
    fake.allocate(5)
    assert fake.total - fake.others - fake.free() == pytest.approx(0.5 * fake.total, abs=1 << 20)


def test_a_second_engine_in_the_process_gets_the_same_share(monkeypatch):
    fake = FakeDevice(total_gib=140, other_processes_gib=0)
    fake.install(monkeypatch)
    first, _ = start_engine(fake, 0.3)
    second, _ = start_engine(fake, 0.3)
    assert second == first


def test_asking_for_more_than_is_free_is_refused(monkeypatch):
    fake = FakeDevice(total_gib=140, other_processes_gib=80)
    fake.install(monkeypatch)
    with pytest.raises(ValueError, match="free at startup"):
        start_engine(fake, 0.5)


def test_no_room_for_the_pool_is_refused(monkeypatch):
    fake = FakeDevice(total_gib=16, other_processes_gib=0)
    fake.install(monkeypatch)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        start_engine(fake, 0.5, weights_gib=6, activations_gib=3)
