"""A CPU decode step's decoder layers in one C++ call (kernels/cpu/decode_layers.cpp).

The modules' path (models/llama.py) calls ~9 kernels a layer through Python; at batch 1 the
Python around them is several ms of a ~25 ms step. For steps of decodes only, on one rank, in
bf16, with every linear layer on our GEMM (at any ISA level), `FusedDecode.run` calls the same
kernels in the same order with the same inputs from C++, so its hidden states have the same bits
as the modules' (tests/engine/test_cpu_decode.py checks that), and everything else (embedding,
final norm, LM head, sampling) stays where it was. Any other step, model or machine takes the modules.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels import fused_decode_layers, fused_decode_layers_available


class FusedDecode:
    def __init__(self, model: nn.Module, layer_table: torch.Tensor, config) -> None:
        self.model = model
        self.layer_table = layer_table  # [layers, 8] int64 addresses (kept alive by the model)
        self.hidden = config.hidden_size
        attn = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv_n = attn.q_size + 2 * attn.kv_size
        self.inter = model.model.layers[0].mlp.down_proj.weight.shape[1]
        self.eps = model.model.layers[0].input_layernorm.eps
        self.scale = attn.attn.scale

    @classmethod
    def build(cls, model: nn.Module, world_size: int) -> "FusedDecode | None":
        """None unless every condition for the fused path holds for this model here."""
        from nanoserve.models.llama import LlamaForCausalLM

        # Exactly Llama's layers (not a family's subclass), no sliding window (decode_layers.cpp
        # attends to every key).
        if world_size != 1 or type(model) is not LlamaForCausalLM or not fused_decode_layers_available():
            return None
        if any(layer.self_attn.attn.sliding_window for layer in model.model.layers):
            return None
        config = model.config
        if config.hidden_act != "silu" or config.hidden_size % 16:
            return None
        rows = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.gemm_weight is None or lin.weight.dtype != torch.bfloat16 or lin.weight.shape[0] % 16
                   for lin in linears):
                return None
            if any(lin.bias is not None for lin in linears):  # Qwen2's QKV bias: the modules
                return None
            if attn.attn.key_cache is None or attn.attn.key_cache.shape[1] != 16:
                return None
            rows.append([layer.input_layernorm.weight.data_ptr(), attn.qkv_proj.gemm_weight.data_ptr(),
                         attn.o_proj.gemm_weight.data_ptr(),
                         layer.post_attention_layernorm.weight.data_ptr(), mlp.gate_up_proj.gemm_weight.data_ptr(),
                         mlp.down_proj.gemm_weight.data_ptr(), attn.attn.key_cache.data_ptr(),
                         attn.attn.value_cache.data_ptr()])
        return cls(model, torch.tensor(rows, dtype=torch.int64), config)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor | None:
        """The final-normed hidden states of a step of decodes only, or None (then use the model)."""
        rows = input_ids.shape[0]
        if rows == 0 or metadata.num_decode_seqs != rows or metadata.seq_lens.shape[0] != rows:
            return None
        if not (positions.dtype == torch.long and metadata.slot_mapping.dtype == torch.long
                and metadata.block_table.is_contiguous() and metadata.block_table.dtype == torch.int32):
            return None
        model = self.model.model
        x = model.embed_tokens(input_ids)
        if x.dtype != torch.bfloat16:
            return None
        new = x.new_empty
        buffers = [x, new(rows, self.hidden), new(rows, self.hidden), new(rows, self.hidden), new(rows, self.hidden),
                   new(rows, self.qkv_n), new(rows, self.num_heads * self.head_dim), new(rows, 2 * self.inter),
                   new(rows, self.inter)]
        addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        cos_sin = self.model.cos_sin_cache
        which = fused_decode_layers(
            self.layer_table, addresses, rows, self.hidden, self.qkv_n, self.inter, self.num_heads,
            self.num_kv_heads, self.head_dim, self.eps, self.scale, positions, cos_sin, metadata)
        if which == 0:
            return None
        hidden, _ = model.norm(x, buffers[which])
        return hidden
