"""Pipeline stages: which decoder layers each stage holds, placeholder modules for the rest, and
the point-to-point hand-offs between stages.

A model builds its layers with `make_layers`: the layers of other stages are `PPMissingLayer`s
(no parameters, no KV cache) and the weight loader skips their tensors (`is_missing_parameter`).
The embedding lives on the first stage, the final norm and LM head on the last; a model marks the
others with `PPMissingLayer` too. Stage k sends (hidden, residual) to stage k+1's rank with the
same tp rank; the last stage's tp rank 0 sends the sampled rows' logits to the driver (rank 0),
which samples (the per-request sampling state lives there), or only their argmax when the whole
step is plain greedy.
Messages are tagged with the step's virtual engine, so the hand-offs of micro-batches in flight
at once never match the wrong receive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from nanoserve.distributed import parallel_state


def layer_partition(
    num_layers: int, pp_size: int, override: str | None = None
) -> list[tuple[int, int]]:
    """Each stage's [start, end) layers. Even by default; a remainder goes to the stages before the
    last (which also holds the LM head), as vLLM does. `override`: layers per stage, comma-separated
    (EngineConfig.pp_layer_partition or $NANOSERVE_PP_LAYER_PARTITION)."""
    if pp_size < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {pp_size} is more than the model's {num_layers} "
            "decoder layers (each stage needs at least one)"
        )
    if override:
        try:
            sizes = [int(part) for part in override.split(",")]
        except ValueError:
            raise ValueError(
                f"pipeline layer partition {override!r}: expected comma-separated layer counts"
            ) from None
        if len(sizes) != pp_size or min(sizes) < 1 or sum(sizes) != num_layers:
            raise ValueError(
                f"pipeline layer partition {override!r} must give {pp_size} positive layer counts "
                f"adding up to the model's {num_layers} layers"
            )
    else:
        sizes = [num_layers // pp_size] * pp_size
        for stage in range(num_layers % pp_size):
            sizes[-2 - stage if pp_size > 1 else 0] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage holds: no parameters, never called."""


def is_first_stage() -> bool:
    return parallel_state().pp_rank == 0


def is_last_stage() -> bool:
    state = parallel_state()
    return state.pp_rank == state.pp_size - 1


def stage_layer_range(num_layers: int) -> tuple[int, int]:
    state = parallel_state()
    if state.pp_size == 1:
        return 0, num_layers
    return state.layer_partition[state.pp_rank]


def make_layers(
    num_layers: int, build: Callable[[int], nn.Module]
) -> tuple[int, int, nn.ModuleList]:
    """All `num_layers` positions (checkpoint names keep their indices), this stage's built with
    `build(index)`, the others `PPMissingLayer`."""
    start, end = stage_layer_range(num_layers)
    layers = nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def stage_module(build: Callable[[], nn.Module], present: bool) -> nn.Module:
    return build() if present else PPMissingLayer()


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(
        name + "." for name, module in model.named_modules() if isinstance(module, PPMissingLayer)
    )


def is_missing_parameter(name: str, prefixes: tuple[str, ...]) -> bool:
    return bool(prefixes) and name.startswith(prefixes)


def real_layers(layers: nn.ModuleList) -> list[nn.Module]:
    """This stage's decoder layers."""
    return [layer for layer in layers if not isinstance(layer, PPMissingLayer)]


# ---- hand-offs --------------------------------------------------------------------------------
def next_stage_rank() -> int:
    state = parallel_state()
    return state.rank + state.tp_size


def previous_stage_rank() -> int:
    state = parallel_state()
    return state.rank - state.tp_size


def last_stage_leader() -> int:
    state = parallel_state()
    return (state.pp_size - 1) * state.tp_size


def send_intermediate(hidden: torch.Tensor, residual: torch.Tensor, tag: int):
    """Start sending (hidden, residual) to the next stage; returns the work to wait on later."""
    message = torch.stack([hidden, residual]).contiguous()
    return message, dist.isend(message, dst=next_stage_rank(), tag=tag)


def recv_intermediate(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device, tag: int
) -> tuple[torch.Tensor, torch.Tensor]:
    message = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    dist.recv(message, src=previous_stage_rank(), tag=tag)
    return message[0], message[1]


def send_to_driver(result: torch.Tensor, tag: int):
    """The last stage's logits (or greedy token ids) of a step, to the driver."""
    result = result.contiguous()
    return result, dist.isend(result, dst=0, tag=tag)


def irecv_from_last_stage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tag: int
):
    """On the driver: post the receive of a step's logits (or token ids); (buffer, work)."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    return buffer, dist.irecv(buffer, src=last_stage_leader(), tag=tag)
