"""Phi-3 / Phi-4-mini: Llama's layers from a checkpoint whose q/k/v and gate/up projections are
already fused (``qkv_proj``, ``gate_up_proj``); each rank takes its heads' rows of every part
(layers/linear.py, shard ids "qkv" and "fused"). A partial_rotary_factor below 1 (Phi-4-mini)
rotates only the first part of each head (LlamaForCausalLM builds the cos/sin cache that wide);
LongRoPE scaling is kernels/rotary.py's."""

from __future__ import annotations

import torch

from nanoserve.kernels import apply_rotary
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.config import ModelConfig
from nanoserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def rotary_dim(config: ModelConfig) -> int:
    return int(config.head_dim * config.partial_rotary_factor)


class Phi3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int = 0):
        super().__init__(config, dtype, layer_index)
        self.rotary_dim = rotary_dim(config)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super().forward(hidden, positions, cos_sin_cache, metadata)
        num_tokens = hidden.shape[0]
        rows = metadata.row_tiling
        q, k, v = self.qkv_proj(hidden, rows).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        apply_rotary(q[..., : self.rotary_dim], k[..., : self.rotary_dim], positions, cos_sin_cache)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), rows)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention


class Phi3Model(LlamaModel):
    decoder_layer_class = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model
    packed_modules = {
        "qkv_proj": ("qkv_proj", "qkv"),
        "gate_up_proj": ("gate_up_proj", "fused"),
    }
