"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm with (1 + weight),
norms before and after both attention and the MLP, GeGLU (tanh GELU), attention scale
query_pre_attn_scalar ** -0.5, layers alternating between a sliding window and global
attention (config.layer_types). Gemma 2 soft-caps attention scores and final logits; Gemma 3
has q/k norms and its own rope base for the sliding layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels import apply_rotary, build_cos_sin_cache
from nanoserve.layers.attention import AttentionMetadata, PagedAttention
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    RowTiling,
)
from nanoserve.models.config import SLIDING, ModelConfig
from nanoserve.models.llama import LlamaForCausalLM

_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32 as transformers does (the checkpoint stores weight
    around 0, so 1 + weight is not rounded to the model's dtype)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int, qk_norm: bool):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
            dtype,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            config.attention_bias,
            dtype,
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            float(scalar) ** -0.5,
            sliding_window=config.layer_window(layer_index),
            softcap=config.attn_logit_softcapping,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        rows = metadata.row_tiling
        q, k, v = self.qkv_proj(hidden, rows).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        apply_rotary(q, k, positions, cos_sin_cache)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), rows)


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act not in _GELU_APPROXIMATIONS:
            raise ValueError(
                f"unsupported hidden_activation {config.hidden_act!r} for Gemma "
                f"(supported: {', '.join(_GELU_APPROXIMATIONS)})"
            )
        self.approximate = _GELU_APPROXIMATIONS[config.hidden_act]
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, config.mlp_bias, dtype
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, dtype
        )

    def forward(self, x: torch.Tensor, rows: RowTiling | None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, rows).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up, rows)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int, qk_norm: bool):
        super().__init__()
        self.is_sliding = config.layer_types[layer_index] == SLIDING
        self.self_attn = GemmaAttention(config, dtype, layer_index, qk_norm)
        self.mlp = GemmaMLP(config, dtype)
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, hidden, positions, cos_sin_cache, metadata):
        attended = self.self_attn(self.input_layernorm(hidden), positions, cos_sin_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden), metadata.row_tiling)
        return hidden + self.post_feedforward_layernorm(mixed)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, dtype, i, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, cos_sin_caches, metadata):
        hidden = self.embed_tokens(input_ids)
        # transformers rounds the scale to the model's dtype before multiplying.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, positions, cos_sin_caches[layer.is_sliding], metadata)
        return self.norm(hidden)


class Gemma2ForCausalLM(nn.Module):
    qk_norm = False
    packed_modules = LlamaForCausalLM.packed_modules  # the same checkpoint names as Llama's

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, dtype, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = config.final_logit_softcapping
        full = build_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin_cache", full, persistent=False)
        if config.rope_local_base_freq is not None:  # Gemma 3: sliding layers, unscaled
            local = build_cos_sin_cache(
                config.head_dim, config.max_position_embeddings, config.rope_local_base_freq, None
            )
            self.register_buffer("local_cos_sin_cache", local, persistent=False)
        else:
            self.local_cos_sin_cache = self.cos_sin_cache

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        # Indexed by layer.is_sliding.
        caches = (self.cos_sin_cache, self.local_cos_sin_cache)
        return self.model(input_ids, positions, caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is not None and self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
