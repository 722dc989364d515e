"""The Llama family (Llama 2/3, Mistral, Qwen2 with QKV bias) in one readable file."""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn

from nanoserve.distributed.pipeline import is_first_stage, is_last_stage, make_layers, stage_module
from nanoserve.kernels import build_cos_sin_cache, silu_and_mul
from nanoserve.layers.attention import AttentionMetadata, PagedAttention
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    RowTiling,
)
from nanoserve.layers.norm import RMSNorm
from nanoserve.models.config import ModelConfig


class LlamaAttention(nn.Module):
    # gpt-oss (models/gpt_oss.py): a bias on o_proj (config.attention_bias) and attention sinks.
    o_proj_bias = False
    attention_sinks = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int = 0):
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
            self.o_proj_bias and config.attention_bias,
            dtype,
        )
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=config.layer_window(layer_index),
            sinks=self.attention_sinks,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        rows = metadata.row_tiling
        out = self.attn.forward_qkv(self.qkv_proj(hidden, rows), positions, cos_sin_cache, metadata)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size), rows)


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, intermediate_size: int | None = None
    ):
        """`intermediate_size`: config.intermediate_size unless given (Qwen2-MoE's shared expert)."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter] * 2, config.mlp_bias, dtype
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, dtype)

    def forward(self, x: torch.Tensor, rows: RowTiling | None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, rows)), rows)


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # a family's subclass swaps in its own (models/qwen3.py)

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int = 0):
        super().__init__()
        self.self_attn = self.attention_class(config, dtype, layer_index)
        self.mlp = self.build_mlp(config, dtype, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def build_mlp(self, config: ModelConfig, dtype: torch.dtype, layer_index: int) -> nn.Module:
        """The feed-forward block, called as mlp(hidden, row_tiling) (models/mixtral.py: experts)."""
        return LlamaMLP(config, dtype)

    def forward(self, hidden, residual, positions, cos_sin_cache, metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, metadata.row_tiling), residual


class LlamaModel(nn.Module):
    decoder_layer_class = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        # With pipeline parallelism: this stage's layers only (see distributed/pipeline.py); a
        # layer keeps its global index (its sliding window comes from config.layer_types).
        self.embed_tokens = stage_module(
            lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype),
            is_first_stage(),
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: self.decoder_layer_class(config, dtype, i)
        )
        self.norm = stage_module(
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype), is_last_stage()
        )

    def forward(self, input_ids, positions, cos_sin_cache, metadata, intermediate=None):
        """The final hidden states; on a stage before the last, (hidden, residual) for the next
        stage. `intermediate`: the previous stage's (hidden, residual), on stages after the first."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, metadata)
        if not is_last_stage():
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    supports_pipeline_parallel = True  # see models/registry.check_pipeline_support
    model_class = LlamaModel
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, dtype)
        self.lm_head = stage_module(
            lambda: ParallelLMHead(config.vocab_size, config.hidden_size, dtype), is_last_stage()
        )
        if config.tie_word_embeddings and is_first_stage() and is_last_stage():
            self.lm_head.weight = self.model.embed_tokens.weight
        rotary_dim = int(
            config.head_dim * config.partial_rotary_factor
        )  # below head_dim: Phi-4-mini
        cos_sin = build_cos_sin_cache(
            rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate=None,
    ):
        return self.model(input_ids, positions, self.cos_sin_cache, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)
