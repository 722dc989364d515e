"""Weights packed once at load instead of on every call: each linear layer (and the LM head) is
given the packings kernels/gemm.py makes of its weight, which then picks the kernel per call. On
a CPU, bf16: our own GEMM's layout (kernels/cpu/gemm*.cpp, one packing for every ISA level)
wherever it takes the shape (K a multiple of 32); otherwise (or with NANOSERVE_CPU_GEMM=onednn,
for A/B measurements) oneDNN's blocked layout, through the ops that inductor's CPU freezing uses;
if they are missing, nothing is packed and F.linear runs as before. oneDNN's rows are not
invariant to the batch: prompt rows are then padded (model_input.PREFILL_ROW_TILE). Elsewhere
nothing is packed.

A weight our GEMM has packed is held once: the packing is every multiplication's operand from then
on, so the bf16 parameter moves to the meta device (its shape and dtype stay for the fused decode
step's tables), unless another module shares it (a tied LM head is the embedding's table)."""

from __future__ import annotations

from collections import Counter

from torch import nn

from nanoserve.kernels import quant
from nanoserve.kernels.gemm import gemm_packing, onednn_packing


def prepack_gemm_weights(model: nn.Module) -> tuple[int, int]:
    """Give every module with a `gemm_weight` slot (the linear layers, the LM head) its packing
    for kernels/cpu/gemm*.cpp, which then multiplies all of its rows. Returns (packed, slots)
    over the layers that prompt rows pass through (not the LM head, which sees sampled rows
    only): those are row-invariant without padding only when every one is packed."""
    packed = slots = 0
    shared = shared_parameter_ids(model)
    for module in model.modules():
        if hasattr(module, "prepack_gemm"):  # layers/fused_moe.FusedMoE: every expert's matrices
            slots += 1
            packed += bool(module.prepack_gemm())
            continue
        if not hasattr(module, "gemm_weight"):
            continue
        quantized = _quant_weights(module)
        if quantized:  # a GGUF layer: kernels/quant.py's own packing, never the bf16 one
            for weight in quantized:
                quant.pack_for_cpu(weight)
            is_packed = all(weight.packed is not None for weight in quantized)
        else:
            module.gemm_weight = gemm_packing(module.weight)
            is_packed = module.gemm_weight is not None
            if is_packed and id(module.weight) not in shared:
                module.weight = nn.Parameter(module.weight.detach().to("meta"), requires_grad=False)
        if not getattr(module, "sees_sampled_rows_only", False):
            slots += 1
            packed += is_packed
    return packed, slots


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters more than one module holds (a tied LM head and embedding): those
    a layer must not give up (here, and models/gguf/weights.py's quantized layers)."""
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {key for key, count in counts.items() if count > 1}


def _quant_weights(module: nn.Module) -> list[quant.QuantWeight]:
    if getattr(module, "quant_weight", None) is not None:
        return [module.quant_weight]
    return list(getattr(module, "quant_parts", None) or [])


def prepack_linear_weights(model: nn.Module, batch_size_hint: int = 64) -> int:
    """Give every module with a `packed_weight` slot that our GEMM does not multiply its oneDNN
    packing where oneDNN takes it; returns how many were packed."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed_weight") or weight is None:
            continue
        if getattr(module, "gemm_weight", None) is not None or _quant_weights(module):
            continue  # multiplied by gemm.cpp or kernels/quant.py instead
        module.packed_weight = onednn_packing(weight, batch_size_hint)
        count += module.packed_weight is not None
    return count
