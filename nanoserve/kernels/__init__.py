"""Kernel dispatch, in one place: CUDA tensors run the Triton kernels, CPU tensors our C++
kernels (kernels/cpu/, through kernels/cpu/ops.py) where they take the call and the torch references
otherwise. Layers and models never ask which device they are on: they call the ops here (and the
linear layers' GEMM in kernels/gemm.py). ``NANOSERVE_KERNELS=triton`` forces Triton (with
``TRITON_INTERPRET=1`` on a CPU);
``NANOSERVE_KERNELS=reference`` forces the references. The variable is read once, at the first
dispatch (kernels/choice.py; ``reset_kernel_choice()`` makes the next dispatch read it again).

Importing this package never imports Triton; the first Triton launch does (see triton_utils).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.kernels.attention import paged_attention_reference, paged_attention_triton
from nanoserve.kernels.choice import kernel_choice, reset_kernel_choice
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.cpu.attention import PrefillSpan, paged_attention_cpu
from nanoserve.kernels.gemm import RowTiling, unquantized_gemm
from nanoserve.kernels.kv_cache import store_kvcache_reference, store_kvcache_triton
from nanoserve.kernels.rmsnorm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from nanoserve.kernels.rotary import (
    apply_rotary_reference,
    apply_rotary_triton,
    build_cos_sin_cache,
    mrope_cos_sin,
)
from nanoserve.kernels.token_bitmask import (
    apply_token_bitmask_cpu,
    apply_token_bitmask_reference,
    apply_token_bitmask_triton,
)


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


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    max_seqlen_q=None,
    max_seqlen_k=None,
    sliding_window=None,
    softcap=None,
    sinks=None,
) -> torch.Tensor:
    """``max_seqlen_q == 1`` (an int from the caller, no sync) selects the split-KV decode
    configuration of the Triton kernel; ``None`` is computed on the host (a sync).
    ``sliding_window`` / ``softcap`` / ``sinks``: None for Llama (see kernels/attention.py)."""
    if use_triton(query):
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            max_seqlen_q,
            max_seqlen_k,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
    return paged_attention_reference(
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale,
        max_seqlen_q,
        max_seqlen_k,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )


def paged_attention_step(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_decode_seqs: int,
    prefill_spans: Callable[[], list[PrefillSpan]],
    sliding_window=None,
    softcap=None,
    sinks=None,
) -> torch.Tensor:
    """Attention of an engine step's rows over the cache (their K/V already stored): the first
    num_decode_seqs sequences are decodes, one row each; prompt rows follow; rows past the last
    prompt row are padding (CPU: see AttentionMetadata.prefill_row_tile) and come back zero.
    ``prefill_spans()``: the prompt rows as host-side spans, asked for on a CPU only (where
    reading the lengths back costs no sync). On a CPU: the C++ kernels, whose rows' bits do not
    depend on the batch (kernels/cpu/attention.py; torch's SDPA in position-fixed tiles for what they
    don't take, the torch reference for a sliding window, a softcap or sinks)."""
    if use_triton(query):
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            max_seqlen_q,
            max_seqlen_k,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
    if not query.is_cuda:
        return paged_attention_cpu(
            query,
            key_cache,
            value_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            num_decode_seqs,
            prefill_spans(),
            max_seqlen_q,
            max_seqlen_k,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
    return paged_attention_reference(
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale,
        max_seqlen_q,
        max_seqlen_k,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )


def rotary_and_store_kvcache(
    qkv,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions,
    cos_sin_cache,
    key_cache,
    value_cache,
    slot_mapping,
) -> torch.Tensor:
    """The fused QKV projection's rows [tokens, (heads + 2 * kv_heads) * head_dim]: rotary on the
    q and k heads, k and v written to the cache at slot_mapping (-1: skipped). Returns q as
    [tokens, heads, head_dim], rotated. On a CPU one C++ pass over the rows, in place; elsewhere
    (or when it can't take them) apply_rotary then store_kvcache."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if (
        not qkv.is_cuda
        and cpu_ops.available()
        and cpu_ops.rotary_store(
            qkv,
            num_heads,
            num_kv_heads,
            head_dim,
            positions,
            cos_sin_cache,
            key_cache,
            value_cache,
            slot_mapping,
        )
    ):
        return qkv[:, :q_size].view(tokens, num_heads, head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    apply_rotary(q, k, positions, cos_sin_cache)
    store_kvcache(
        k, v.reshape(tokens, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping
    )
    return q


def fused_decode_layers_available() -> bool:
    """Whether kernels/cpu/decode_layers.cpp (every decoder layer of a decode step in one call,
    models/cpu_decode.py) can run in this process."""
    return cpu_ops.gemm_available()


def fused_decode_layers(
    layer_table,
    addresses,
    rows,
    hidden,
    qkv_n,
    inter,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    scale,
    positions,
    cos_sin_cache,
    metadata,
    kv_format: int = 0,
    lora=None,
) -> int:
    """kernels/cpu/decode_layers.cpp over every layer: the index of the residual among the
    buffers, 0 when it can't run here (then the modules run the step). kv_format: the pools'
    (kv_dtype.fused_decode_kv_format); lora: the step's adapters (models/cpu_decode.py)."""
    if not cpu_ops.available():
        return 0
    return cpu_ops.decode_layers(
        layer_table,
        addresses,
        rows,
        hidden,
        qkv_n,
        inter,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        scale,
        positions,
        cos_sin_cache,
        metadata,
        kv_format,
        lora,
    )


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
    "RowTiling",
    "apply_rotary",
    "apply_token_bitmask",
    "build_cos_sin_cache",
    "mrope_cos_sin",
    "fused_add_rms_norm",
    "fused_decode_layers",
    "fused_decode_layers_available",
    "greedy_argmax",
    "silu_and_mul",
    "paged_attention",
    "paged_attention_step",
    "reset_kernel_choice",
    "rms_norm",
    "rotary_and_store_kvcache",
    "store_kvcache",
    "unquantized_gemm",
    "use_triton",
]
