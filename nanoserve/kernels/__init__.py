"""Kernel dispatch, in one place: CUDA tensors run the Triton kernels, CPU tensors the torch
references. ``NANOSERVE_KERNELS=triton`` forces Triton (with ``TRITON_INTERPRET=1`` on a CPU);
``NANOSERVE_KERNELS=reference`` forces the references. The variable is read once, at the first
dispatch (kernels/choice.py; ``reset_kernel_choice()`` makes the next dispatch read it again).

Importing this package never imports Triton; the first Triton launch does (see triton_utils).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import cpu_ops
from nanoserve.kernels.attention import paged_attention_reference, paged_attention_triton
from nanoserve.kernels.choice import kernel_choice, reset_kernel_choice
from nanoserve.kernels.kv_cache import store_kvcache_reference, store_kvcache_triton
from nanoserve.kernels.rmsnorm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from nanoserve.kernels.rotary import apply_rotary_reference, apply_rotary_triton, build_cos_sin_cache
from nanoserve.kernels.token_bitmask import (apply_token_bitmask_cpu, apply_token_bitmask_reference,
                                             apply_token_bitmask_triton)

def use_triton(tensor: torch.Tensor) -> bool:
    choice = kernel_choice()
    if choice == "reference":
        return False
    return choice == "triton" or tensor.is_cuda


def graph_safe(device: torch.device) -> bool:
    """Whether a step on ``device`` can be captured as a CUDA graph: the Triton kernels never
    sync with the host; the torch references do (masks and lengths read back), so
    ``NANOSERVE_KERNELS=reference`` on CUDA runs every step eagerly."""
    return device.type == "cuda" and use_triton(torch.empty(0, device=device))


def store_kvcache(key, value, key_cache, value_cache, slot_mapping) -> None:
    if use_triton(key):
        store_kvcache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kvcache_reference(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale,
                    max_seqlen_q=None, max_seqlen_k=None, sliding_window=None, softcap=None) -> torch.Tensor:
    """``max_seqlen_q == 1`` (an int from the caller, no sync) selects the split-KV decode
    configuration of the Triton kernel; ``None`` is computed on the host (a sync).
    ``sliding_window`` / ``softcap``: None for Llama (see kernels/attention.py)."""
    if use_triton(query):
        return paged_attention_triton(query, key_cache, value_cache, block_table, cu_seqlens_q,
                                      seq_lens, scale, max_seqlen_q, max_seqlen_k,
                                      sliding_window=sliding_window, softcap=softcap)
    return paged_attention_reference(query, key_cache, value_cache, block_table, cu_seqlens_q,
                                     seq_lens, scale, max_seqlen_q, max_seqlen_k,
                                     sliding_window=sliding_window, softcap=softcap)


def rms_norm(x, weight, eps):
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    if not x.is_cuda and cpu_ops.available():
        done = cpu_ops.rms_norm(x, None, weight, eps)
        if done is not None:
            return done[0]
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """Returns (rms_norm(x + residual) * weight, x + residual) as new tensors."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if not x.is_cuda and cpu_ops.available():
        done = cpu_ops.rms_norm(x, residual, weight, eps)
        if done is not None:
            return done
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * inter] holding gate then up (the C++ kernel on
    CPU; on CUDA torch's two ops, which are not where a GPU step's time goes)."""
    if not gate_up.is_cuda and cpu_ops.available():
        done = cpu_ops.silu_and_mul(gate_up)
        if done is not None:
            return done
    return silu_and_mul_reference(gate_up)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [rows, vocab] logits, on CPU without a float copy."""
    if not logits.is_cuda and cpu_ops.available():
        done = cpu_ops.argmax_rows(logits)
        if done is not None:
            return done
    return logits.float().argmax(dim=-1)


def apply_token_bitmask(logits, bitmask, rows) -> None:
    """Structured outputs: -inf, in place, for the tokens each constrained row's grammar forbids."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, rows)
    elif not logits.is_cuda and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        apply_token_bitmask_cpu(logits, bitmask, rows)
    else:
        apply_token_bitmask_reference(logits, bitmask, rows)


def apply_rotary(query, key, positions, cos_sin_cache) -> None:
    if use_triton(query):
        apply_rotary_triton(query, key, positions, cos_sin_cache)
    else:
        apply_rotary_reference(query, key, positions, cos_sin_cache)


__all__ = [
    "apply_rotary",
    "apply_token_bitmask",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "greedy_argmax",
    "silu_and_mul",
    "paged_attention",
    "reset_kernel_choice",
    "rms_norm",
    "store_kvcache",
    "use_triton",
]
