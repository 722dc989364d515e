"""Qwen3 (dense): Llama's layers with a per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

import torch

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.norm import RMSNorm
from nanoserve.models.config import ModelConfig
from nanoserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int = 0):
        super().__init__(config, dtype, layer_index)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        rows = metadata.row_tiling
        qkv = self.qkv_proj(hidden, rows)
        # Each head's q and k normed in place, then Llama's rotary + cache write and attention:
        # the kernels models/cpu_decode.py calls in the same order.
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size))
        k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size))
        out = self.attn.forward_qkv(qkv, positions, cos_sin_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), rows)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
