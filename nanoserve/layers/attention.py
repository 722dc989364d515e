"""Attention over the paged KV cache. Per-step inputs arrive as an explicit AttentionMetadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.kernels import paged_attention, store_kvcache


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length including this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Set by the model runner once the pool is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] → [T, H, D]."""
        store_kvcache(k, v, self.key_cache, self.value_cache, metadata.slot_mapping)
        return paged_attention(
            q, self.key_cache, self.value_cache, metadata.block_table, metadata.cu_seqlens_q,
            metadata.seq_lens, self.scale, metadata.max_seqlen_q, metadata.max_seqlen_k)
