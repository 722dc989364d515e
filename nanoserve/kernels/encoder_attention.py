"""Bidirectional attention over whole prompts packed one after another (encoder models: BERT,
XLM-RoBERTa), with no KV cache: every token of a prompt sees every token of its own prompt and
none of another's.

The choice of implementation is made here. Today one: torch's scaled_dot_product_attention
per prompt (its fused CPU and CUDA kernels), which needs no padding and no mask. A packed
varlen kernel is the next step for batches of many short prompts on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim], the prompts packed; `cu_seqlens`: where each prompt
    starts, then the total (as flash-attention's varlen API). Returns [tokens, heads, head_dim]."""
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v shapes differ: {q.shape}, {k.shape}, {v.shape}")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens {cu_seqlens} do not cover {q.shape[0]} tokens")
    return encoder_attention_sdpa(q, k, v, cu_seqlens, scale)


def encoder_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        # [heads, len, head_dim]: each prompt attends within itself, unmasked.
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            scale=scale,
        ).transpose(0, 1)
    return out


def encoder_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """The oracle: softmax(q k^T * scale) v in float32, one prompt at a time."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (weights @ vs).transpose(0, 1).to(q.dtype)
    return out
