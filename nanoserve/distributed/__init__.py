"""Process-group state: this rank's place among tp x pp ranks. With one rank every collective is
a no-op. Ranks are laid out as vLLM's: global rank = pp_rank * tp_size + tp_rank, so each pipeline
stage's tensor-parallel group is a run of consecutive ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelState:
    rank: int = 0  # global rank
    world_size: int = 1  # tp_size * pp_size
    tp_size: int = 1
    pp_size: int = 1
    tp_group: object = None  # this stage's tensor-parallel group; None: the whole world (pp == 1)
    # Each stage's [start, end) decoder layers (see distributed/pipeline.py); () with pp == 1.
    layer_partition: tuple = ()

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_leader(self) -> int:
        """The global rank of tp rank 0 in this rank's stage."""
        return self.rank - self.tp_rank


_state = ParallelState()


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_world_size() -> int:
    return _state.tp_size


def get_pp_rank() -> int:
    return _state.pp_rank


def get_pp_world_size() -> int:
    return _state.pp_size


def get_rank() -> int:
    return _state.rank


def get_world_size() -> int:
    return _state.world_size


def parallel_state() -> ParallelState:
    return _state


def set_parallel_state(
    rank: int,
    world_size: int,
    tp_size: int | None = None,
    pp_size: int = 1,
    tp_group=None,
    layer_partition: tuple = (),
) -> None:
    _state.rank = rank
    _state.world_size = world_size
    _state.tp_size = world_size // pp_size if tp_size is None else tp_size
    _state.pp_size = pp_size
    _state.tp_group = tp_group
    _state.layer_partition = tuple(layer_partition)


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if _state.tp_size > 1:
        dist.all_reduce(tensor, group=_state.tp_group)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum over the tensor-parallel ranks, in place."""
    if _state.tp_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_state.tp_group)
    return tensor


def gather_to_first(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every tp rank's shard along `dim` on this stage's tp rank 0 (others get None)."""
    if _state.tp_size == 1:
        return tensor
    first = _state.tp_rank == 0
    shards = [torch.empty_like(tensor) for _ in range(_state.tp_size)] if first else None
    dist.gather(tensor.contiguous(), shards, dst=_state.tp_leader, group=_state.tp_group)
    return torch.cat(shards, dim=dim) if first else None
