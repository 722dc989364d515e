"""Mixtral, and the sparse MoE block every MoE family here shares: Llama's attention, then a
router (softmax top-k) and the experts (layers/fused_moe.FusedMoE) in place of the MLP; Qwen2-MoE
adds a shared expert behind a sigmoid gate (models/qwen_moe.py)."""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.fused_moe import FusedMoE, ReplicatedLinear
from nanoserve.layers.linear import RowTiling
from nanoserve.models.config import ModelConfig
from nanoserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        moe = config.moe
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts, False, dtype)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            config.hidden_size,
            moe.intermediate_size,
            moe.renormalize,
            dtype,
            config.enable_expert_parallel,
        )
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:  # Qwen2-MoE
            self.shared_expert = LlamaMLP(config, dtype, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, False, dtype)

    def forward(self, hidden: torch.Tensor, rows: RowTiling | None) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden, rows))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden, rows).float())
            out = out + (gate * self.shared_expert(hidden, rows).float()).to(out.dtype)
        return out


class MoEDecoderLayer(LlamaDecoderLayer):
    """A family's attention (attention_class) and, on sparse layers, the MoE block; Qwen-MoE's
    mlp_only_layers / decoder_sparse_step keep a dense MLP on the others."""

    def build_mlp(self, config: ModelConfig, dtype: torch.dtype, layer_index: int) -> nn.Module:
        if config.moe.is_sparse(layer_index):
            return SparseMoeBlock(config, dtype)
        return LlamaMLP(config, dtype)


class MixtralModel(LlamaModel):
    decoder_layer_class = MoEDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_class = MixtralModel
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}  # see models/weights.load_weights
