"""How much of a CUDA device's memory the KV pool gets, as vLLM sizes it: an engine may use
--gpu-memory-utilization of the device's memory, which must be free when it starts (other
processes, and other engines in this one, keep theirs). The pool gets what is left of that after
the weights, a forward pass at the full token budget, and what the engine holds outside torch's
allocator (cuBLAS workspaces and the like)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryAtStart:
    """The device's free memory and this process's torch memory before an engine loads."""

    free: int
    allocated: int
    reserved: int

    @classmethod
    def take(cls, device: torch.device) -> MemoryAtStart:
        torch.cuda.empty_cache()
        return cls(
            torch.cuda.mem_get_info(device)[0],
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
        )


def kv_cache_budget(
    device: torch.device, utilization: float, start: MemoryAtStart, profile_run: Callable[[], None]
) -> tuple[int, dict[str, int]]:
    """(bytes for the KV pool, the figures it was computed from). Runs profile_run."""
    total = torch.cuda.get_device_properties(device).total_memory
    requested = int(total * utilization)
    if requested > start.free:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} asks for {requested / GIB:.1f} GiB but only "
            f"{start.free / GIB:.1f} GiB of {total / GIB:.1f} GiB were free at startup (other "
            "processes hold the rest); lower it"
        )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_run()
    peak = torch.cuda.max_memory_allocated(device) - start.allocated
    torch.cuda.empty_cache()
    used = start.free - torch.cuda.mem_get_info(device)[0]
    outside_torch = max(0, used - (torch.cuda.memory_reserved(device) - start.reserved))
    budget = requested - peak - outside_torch
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: the weights and a forward pass peak at "
            f"{(peak + outside_torch) / GIB:.1f} GiB of the {requested / GIB:.1f} GiB that "
            "--gpu-memory-utilization allows; raise it or lower --max-num-batched-tokens"
        )
    figures = {
        "total": total,
        "requested": requested,
        "peak_torch": peak,
        "outside_torch": outside_torch,
        "kv_budget": budget,
        **{f"{name}_at_start": value for name, value in asdict(start).items()},
    }
    return budget, figures
