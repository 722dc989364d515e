"""CPU only: bf16 weights packed once at load instead of on every call. In the layout of our own
GEMM (kernels/cpu/gemm.cpp and gemm_levels.cpp, one packing for every ISA level;
prepack_gemm_weights) wherever it takes the shape (K a multiple of 32). Otherwise (or with
NANOSERVE_CPU_GEMM=onednn, for A/B measurements) in oneDNN's blocked layout
(prepack_linear_weights), through the (private, stable since torch 2.1) ops that inductor's CPU
freezing uses; if they are missing, nothing is packed and F.linear runs as before. oneDNN's
rows are not invariant to the batch: prompt rows are then padded (model_input.PREFILL_ROW_TILE)."""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from nanoserve.kernels import cpu_ops

logger = logging.getLogger(__name__)


def _ops_available() -> bool:
    if os.environ.get("NANOSERVE_CPU_PREPACK", "1") == "0":
        return False
    return (hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available())


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def prepack_gemm_weights(model: nn.Module) -> tuple[int, int]:
    """Give every module with a `gemm_weight` slot (the linear layers, the LM head) its packing
    for kernels/cpu/gemm*.cpp, which then multiplies all of its rows. Returns (packed, slots)
    over the layers that prompt rows pass through (not the LM head, which sees sampled rows
    only): those are row-invariant without padding only when every one is packed."""
    packed = slots = 0
    enabled = os.environ.get("NANOSERVE_CPU_GEMM", "nanoserve") != "onednn"
    for module in model.modules():
        if hasattr(module, "prepack_gemm"):  # layers/fused_moe.FusedMoE: every expert's matrices
            slots += 1
            packed += bool(enabled and module.prepack_gemm())
            continue
        if not hasattr(module, "gemm_weight"):
            continue
        if enabled:
            module.gemm_weight = cpu_ops.pack_gemm_weight(module.weight)
        if not getattr(module, "sees_sampled_rows_only", False):
            slots += 1
            packed += module.gemm_weight is not None
    return packed, slots


def prepack_linear_weights(model: nn.Module, batch_size_hint: int = 64) -> int:
    """Give every module with a 2-D bf16 `weight` on CPU and a `packed_weight` slot its packed
    copy; returns how many were packed."""
    if not _ops_available():
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed_weight") or weight is None or weight.dim() != 2:
            continue
        if getattr(module, "gemm_weight", None) is not None:  # multiplied by gemm.cpp instead
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            continue
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
            probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
            packed_linear(probe, packed, None)
        except RuntimeError as error:  # an unsupported shape or build: keep F.linear
            logger.info("not prepacking %s: %s", type(module).__name__, error)
            continue
        module.packed_weight = packed
        count += 1
    return count
