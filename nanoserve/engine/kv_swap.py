"""The host pool's tensors and the block copies between it and the device pool.

Each copy is one indexed gather and one indexed write per pool tensor (the keys and the values of
every layer) for all of a step's blocks, never one copy per block. The pools are copied through
their block-major storage: on CPU the device pool is head-major underneath a permuted view
(ModelRunner._new_cache), and a block there is still one contiguous run of memory. On a CPU device
the host pool is a second pool in memory, copied by the same code.
"""

from __future__ import annotations

import time

import torch

from nanoserve.engine.swap import SwapPlan
from nanoserve.kernels.kv_dtype import FP8_DTYPES


def block_major_storage(cache: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor under a pool view, blocks along dim 0 (an fp8 pool as its bytes:
    torch's indexed copies don't all take fp8)."""
    storage = (
        cache if cache.is_contiguous() else cache.permute(0, 2, 1, 3)
    )  # undoes _new_cache's permutation
    assert storage.is_contiguous(), "a KV pool whose storage is not block-major"
    return storage.view(torch.uint8) if storage.dtype in FP8_DTYPES else storage


class KVSwapper:
    def __init__(self, device_pools: list[torch.Tensor], num_host_blocks: int):
        self.device_pools = [block_major_storage(pool) for pool in device_pools]
        self.device = self.device_pools[0].device
        # Pinned on CUDA, so the copies are DMA transfers (as vLLM's CPU swap cache).
        pin = self.device.type == "cuda"
        self.host_pools = [
            torch.empty((num_host_blocks, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin)
            for pool in self.device_pools
        ]
        self.blocks_swapped_out = self.blocks_swapped_in = 0
        self.swap_seconds = 0.0  # host time in swap(), copies included (they synchronize)

    @property
    def host_bytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pool in self.host_pools)

    @torch.inference_mode()
    def swap(self, plan: SwapPlan) -> None:
        """Copies out, then copies in (a block freed by one may be reused by the other)."""
        started = time.perf_counter()
        self.blocks_swapped_out += len(plan.swap_out)
        self.blocks_swapped_in += len(plan.swap_in)
        if plan.swap_out:
            device_index, host_index = self._indices(
                plan.swap_out, self.device, torch.device("cpu")
            )
            for device_pool, host_pool in zip(self.device_pools, self.host_pools):
                host_pool[host_index] = device_pool[device_index].to("cpu")
        if plan.swap_in:
            host_index, device_index = self._indices(plan.swap_in, torch.device("cpu"), self.device)
            for device_pool, host_pool in zip(self.device_pools, self.host_pools):
                device_pool[device_index] = host_pool[host_index].to(self.device)
        self.swap_seconds += time.perf_counter() - started

    @staticmethod
    def _indices(
        pairs: list[tuple[int, int]], source: torch.device, destination: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.tensor(pairs, dtype=torch.long).T
        return both[0].to(source), both[1].to(destination)
