"""Tensor-parallel process group state. With one rank every collective is a no-op."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1


_state = ParallelState()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_world_size() -> int:
    return _state.world_size


def set_parallel_state(rank: int, world_size: int) -> None:
    _state.rank = rank
    _state.world_size = world_size


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if _state.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def gather_to_first(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's shard along `dim` on rank 0 (others get None)."""
    if _state.world_size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(_state.world_size)] if _state.rank == 0 else None
    dist.gather(tensor.contiguous(), shards, dst=0)
    return torch.cat(shards, dim=dim) if _state.rank == 0 else None
