"""Attention over the paged KV cache. Per-step inputs arrive as an explicit AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanoserve.distributed import get_tp_rank
from nanoserve.kernels import (
    RowTiling,
    paged_attention_step,
    rotary_and_store_kvcache,
    store_kvcache,
)
from nanoserve.kernels.cpu.attention import PrefillSpan, prefill_spans


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length including this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int
    # The first num_decode_seqs sequences are decodes of generated tokens, one row each, at
    # rows 0..num_decode_seqs; prompt rows follow; rows past cu_seqlens_q[-1] are padding.
    num_decode_seqs: int = 0
    # CPU: nonzero. Where the linear layers use oneDNN, prompt rows are padded to a multiple of
    # this and multiplied in tiles of exactly this many rows, so that a prompt row's GEMM results
    # never depend on what else is in the step (oneDNN picks kernels, and summation orders, by
    # M); our GEMM (kernels/cpu/gemm*.cpp, every ISA level) needs neither. 0: CUDA. Attention
    # (kernels.paged_attention_step) returns zeros for the padding rows.
    prefill_row_tile: int = 0
    spans: list[PrefillSpan] | None = field(default=None)  # host-side; built on first use

    @property
    def row_tiling(self) -> RowTiling | None:
        if not self.prefill_row_tile:
            return None
        return RowTiling(self.num_decode_seqs, self.prefill_row_tile)

    def prefill_spans(self) -> list[PrefillSpan]:
        if self.spans is None:
            self.spans = prefill_spans(
                self.cu_seqlens_q.tolist(), self.seq_lens.tolist(), self.num_decode_seqs
            )
        return self.spans


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Both None for Llama. A window W: a query sees its last W positions only; a softcap c:
        # scores c * tanh(scores / c) (Gemma 2).
        self.sliding_window = sliding_window
        self.softcap = softcap
        # gpt-oss: a learned logit per head that joins each softmax (kernels/attention.py), in
        # fp32; this rank's heads of the checkpoint's [num_heads] under tensor parallelism.
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.empty(num_heads, dtype=torch.float32), requires_grad=False
            )
            self.sinks.weight_loader = self._load_sinks
        # Set by the model runner once the pool is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def _load_sinks(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        start = get_tp_rank() * self.num_heads
        param.data.copy_(loaded[start : start + self.num_heads])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] → [T, H, D]. The cache is written first and
        attention reads what it holds, so a cached prefix and a fresh one see the same values."""
        store_kvcache(k, v, self.key_cache, self.value_cache, metadata.slot_mapping)
        return self.attend(q, metadata)

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """qkv: the fused QKV projection's rows [T, (H + 2 * KVH) * D] → [T, H, D]: rotary on q
        and k and the cache write in one kernel where there is one (kernels/__init__.py), then
        attention."""
        q = rotary_and_store_kvcache(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            positions,
            cos_sin_cache,
            self.key_cache,
            self.value_cache,
            metadata.slot_mapping,
        )
        return self.attend(q, metadata)

    def attend(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of q over what the cache holds (this step's K/V already stored)."""
        return paged_attention_step(
            q,
            self.key_cache,
            self.value_cache,
            metadata.block_table,
            metadata.cu_seqlens_q,
            metadata.seq_lens,
            self.scale,
            metadata.max_seqlen_q,
            metadata.max_seqlen_k,
            metadata.num_decode_seqs,
            metadata.prefill_spans,
            self.sliding_window,
            self.softcap,
            self.sinks,
        )
