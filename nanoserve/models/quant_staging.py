"""A quantized linear layer's parts as a loader stages them, and the QuantWeight(s) made of them
(kernels/quant.py); shared by the GGUF loader (models/gguf_weights.py, the file's bytes) and the
compressed-tensors one (models/compressed_tensors.py, integers and scales).

Each part arrives as one or more arrays of the whole checkpoint tensor, rows in output order and
columns that split with the input features (GGUF bytes, or u / scale per 32 / min per 32). Shards
follow the bf16 loaders: the layer's own weight_loader runs on each array, so column-parallel
layers take whole rows and row-parallel layers whole blocks of each row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanoserve.kernels import quant
from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.linear import RowParallelLinear


@dataclass
class StagedLinear:
    """One layer's parts as they arrive (a fused layer takes several tensors)."""
    # qtype -> array name ("raw", or "u" / "scale" / "mins") -> this rank's [n_local, columns]
    buffers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    row_qtype: list[str | None] = field(default_factory=list)  # per output row of this rank
    float_parts: int = 0


def stage_quantized(module: nn.Module, name: str, arrays: dict[str, torch.Tensor], qtype: str, block: int,
                    k: int, shard_id, parts: StagedLinear) -> None:
    """This rank's rows (or, row-parallel, whole blocks of `block` inputs of each row) of one part
    (`arrays`, each [rows, columns proportional to k]) into the layer's buffers for `qtype`,
    through the layer's own weight_loader."""
    if isinstance(module, ParallelLMHead):
        parts.buffers[qtype] = {key: array[module.vocab_start : module.vocab_end] for key, array in arrays.items()}
        parts.row_qtype = [qtype] * (module.vocab_end - module.vocab_start)
        return
    n_local, k_local = module.weight.shape
    if k_local % block:
        raise ValueError(f"{name}: {qtype.upper()} blocks of {block} values cannot split its {k} "
                         f"input features into {k // k_local} shards of {k_local}")
    if not parts.row_qtype:
        parts.row_qtype = [None] * n_local
    buffers = parts.buffers.setdefault(qtype, {})
    for key, array in arrays.items():
        if key not in buffers:
            buffers[key] = array.new_zeros(n_local, array.shape[1] * k_local // k)
        module.weight_loader(buffers[key], array, shard_id)
    rows = next(iter(arrays.values())).shape[0]
    if isinstance(module, RowParallelLinear):
        written = range(n_local)
    else:  # the same loader on a column of marks says which rows this part filled
        marks = torch.zeros(n_local, 1, dtype=torch.uint8)
        module.weight_loader(marks, torch.ones(rows, 1, dtype=torch.uint8), shard_id)
        written = marks[:, 0].nonzero()[:, 0].tolist()
    for row in written:
        parts.row_qtype[row] = qtype


def _quant_weight(qtype: str, k: int, arrays: dict[str, torch.Tensor], device: torch.device) -> quant.QuantWeight:
    arrays = {key: array.contiguous().to(device) for key, array in arrays.items()}
    n = next(iter(arrays.values())).shape[0]
    if "raw" in arrays:
        return quant.QuantWeight(qtype, n, k, arrays["raw"])
    components = quant.QuantComponents(arrays["u"], arrays["scale"], arrays.get("mins"))
    return quant.QuantWeight(qtype, n, k, None, components=components)


def finish_quantized(module: nn.Module, target: str, parts: StagedLinear, shared: bool) -> None:
    """The layer's QuantWeight (or, when its fused parts differ in type, one per run of rows in
    output order: `quant_parts`); its bf16 weight goes to the meta device unless shared (a tied
    embedding)."""
    if any(qtype is None for qtype in parts.row_qtype):
        raise ValueError(f"{target}: the checkpoint lacks some of this layer's parts")
    device = module.weight.device
    k_local = module.weight.shape[1]
    weights, start = [], 0
    labels = parts.row_qtype
    for end in range(1, len(labels) + 1):
        if end == len(labels) or labels[end] != labels[start]:
            arrays = {key: array[start:end] for key, array in parts.buffers[labels[start]].items()}
            weights.append(_quant_weight(labels[start], k_local, arrays, device))
            start = end
    if len(weights) == 1:
        module.quant_weight = weights[0]
    else:
        module.quant_parts = weights
    if not shared:
        module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                     requires_grad=False)
