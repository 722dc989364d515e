"""OLMoE: Llama's attention with RMSNorm over the whole q and k projections (not per head) and
optional clipping of q, k, v; the MoE block of models/mixtral.py. With tensor parallelism a
rank holds some heads, so the norms' mean square is summed across ranks."""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import all_reduce, get_tp_rank, get_tp_world_size
from nanoserve.kernels import apply_rotary
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.norm import RMSNorm
from nanoserve.models.config import ModelConfig
from nanoserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from nanoserve.models.mixtral import MoEDecoderLayer


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dimension split across tensor-parallel ranks: this rank's
    `size` of `total_size` features, its slice of the weight starting at `start`. The sum of
    squares is all-reduced; `replicas` ranks hold each slice (KV heads fewer than ranks)."""

    def __init__(
        self, size: int, total_size: int, start: int, replicas: int, eps: float, dtype: torch.dtype
    ):
        super().__init__()
        self.total_size, self.start, self.replicas, self.eps = total_size, start, replicas, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(loaded[self.start : self.start + param.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        square_sum = all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas
        return (x32 * torch.rsqrt(square_sum / self.total_size + self.eps)).to(
            x.dtype
        ) * self.weight


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_index: int = 0):
        super().__init__(config, dtype, layer_index)
        self.clip_qkv = config.moe.clip_qkv
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        eps = config.rms_norm_eps
        if tp_size == 1:
            self.q_norm = RMSNorm(self.q_size, eps, dtype)
            self.k_norm = RMSNorm(self.kv_size, eps, dtype)
            return
        replicas = max(1, tp_size // config.num_key_value_heads)
        kv_rank = tp_rank // replicas
        self.q_norm = ShardedRMSNorm(
            self.q_size, self.q_size * tp_size, tp_rank * self.q_size, 1, eps, dtype
        )
        self.k_norm = ShardedRMSNorm(
            self.kv_size,
            config.num_key_value_heads * self.head_dim,
            kv_rank * self.kv_size,
            replicas,
            eps,
            dtype,
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
        qkv = self.qkv_proj(hidden, rows)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        apply_rotary(q, k, positions, cos_sin_cache)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), rows)


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeModel(LlamaModel):
    decoder_layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_class = OlmoeModel
