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

from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.fused_moe import FusedMoE
from nanoserve.layers.linear import LinearBase


def prepack_gemm_weights(model: nn.Module) -> tuple[int, int]:
    """Give every linear layer and the LM head its packing for our CPU GEMMs (a quantized
    layer's: kernels/quant.py's own, never the bf16 one), which then multiply all of its rows.
    Returns (packed, slots) over the layers that prompt rows pass through (not the LM head,
    which sees sampled rows only): those are row-invariant without padding only when every
    one is packed."""
    packed = slots = 0
    shared = shared_parameter_ids(model)
    for module in model.modules():
        if isinstance(module, FusedMoE):  # every expert's matrices
            slots += 1
            packed += bool(module.prepack_gemm())
            continue
        if not isinstance(module, (LinearBase, ParallelLMHead)):
            continue
        form = module.weight_form
        is_packed = form.pack_for_cpu_gemm(module.weight)
        if is_packed and not form.quantized and id(module.weight) not in shared:
            module.weight = nn.Parameter(module.weight.detach().to("meta"), requires_grad=False)
        if not isinstance(module, ParallelLMHead):
            slots += 1
            packed += is_packed
    return packed, slots


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters more than one module holds (a tied LM head and embedding): those
    a layer must not give up (here, and models/gguf/weights.py's quantized layers)."""
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {key for key, count in counts.items() if count > 1}


def prepack_linear_weights(model: nn.Module, batch_size_hint: int = 64) -> int:
    """Give every dense linear layer and LM head that our GEMM does not multiply its oneDNN
    packing where oneDNN takes it; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            count += module.weight_form.pack_for_onednn(module.weight, batch_size_hint)
    return count
