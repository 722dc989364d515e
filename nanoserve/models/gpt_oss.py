"""gpt-oss (OpenAI's open-weight MoE models): Llama's decoder with biases on q, k, v and o,
attention sinks (a learned logit per head that joins every softmax), sliding-window and global
layers alternating (config.layer_types), YaRN rotary, and a MoE block whose router has a bias
and whose experts have biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate)).

The checkpoint stacks each layer's experts in transformers' layout: gate_up_proj [experts,
hidden, 2 * inter] with gate and up columns interleaved, down_proj [experts, inter, hidden]. The
experts load them transposed and de-interleaved into layers/fused_moe.FusedMoE's [gate rows; up
rows]. OpenAI's own checkpoints hold the experts in MXFP4 (models/mxfp4.py: kept quantized on a
CPU, in the kernels' MXFP4 format)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from nanoserve.kernels.fused_moe import swiglu_oai
from nanoserve.layers.fused_moe import FusedMoE, ReplicatedLinear
from nanoserve.layers.linear import RowTiling
from nanoserve.models.config import ModelConfig
from nanoserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from nanoserve.models.mxfp4 import Mxfp4Weight


def gate_then_up(size: int) -> torch.Tensor:
    """The order that takes gate, up, gate, up, ... (`size` = 2 * inter) to the gate part, then
    the up part."""
    return torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)])


def deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] with gate, up, gate, up, ... -> [..., gate part; up part]."""
    return gate_up[..., gate_then_up(gate_up.shape[-1])]


class GptOssExperts(FusedMoE):
    def weight_loader(self, param: nn.Parameter, loaded, shard_id) -> None:
        """The stacked checkpoint tensors (shard_id (None, None)) in transformers' gpt-oss layout;
        FusedMoE's loader hands each expert's part back here (shard_id (expert, part))."""
        if shard_id != (None, None):
            super().weight_loader(param, loaded, shard_id)
            return
        if isinstance(loaded, Mxfp4Weight):  # [experts, outputs, inputs]
            if param is self.w13_weight:
                loaded = loaded.rows(gate_then_up(loaded.blocks.shape[1]))
            super().weight_loader(param, loaded, shard_id)
            return
        loaded = (
            loaded[:] if not isinstance(loaded, torch.Tensor) else loaded
        )  # a safetensors slice
        if param is self.w13_weight:
            loaded = deinterleave(loaded)  # [experts, hidden, gate; up]
        super().weight_loader(param, loaded.transpose(1, 2), shard_id)

    def bias_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        loaded = loaded[:] if not isinstance(loaded, torch.Tensor) else loaded
        super().bias_loader(
            param, deinterleave(loaded) if param is self.w13_bias else loaded, shard_id
        )


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        moe = config.moe
        self.router = ReplicatedLinear(config.hidden_size, moe.num_experts, True, dtype)
        self.experts = GptOssExperts(
            moe.num_experts,
            moe.top_k,
            config.hidden_size,
            moe.intermediate_size,
            True,
            dtype,
            config.enable_expert_parallel,
            bias=True,
            activation=partial(swiglu_oai, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit),
        )

    def forward(self, hidden: torch.Tensor, rows: RowTiling | None) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden, rows))


class GptOssAttention(LlamaAttention):
    o_proj_bias = True
    attention_sinks = True


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def build_mlp(self, config: ModelConfig, dtype: torch.dtype, layer_index: int) -> nn.Module:
        return GptOssMoE(config, dtype)


class GptOssModel(LlamaModel):
    decoder_layer_class = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    # The sinks live beside the attention kernel's other settings (layers/attention.PagedAttention);
    # the experts' biases are FusedMoE's w13_bias / w2_bias.
    checkpoint_renames = {
        ".self_attn.sinks": ".self_attn.attn.sinks",
        ".experts.gate_up_proj_bias": ".experts.w13_bias",
        ".experts.down_proj_bias": ".experts.w2_bias",
    }
