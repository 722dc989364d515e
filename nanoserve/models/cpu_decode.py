"""A CPU decode step's decoder layers in one C++ call (kernels/cpu/decode_layers.cpp).

The modules' path (models/llama.py) calls ~9 kernels a layer through Python; at batch 1 the
Python around them is several ms of a ~25 ms step. Llama's (LLaVA's language model's too),
Qwen3's (per-head Q/K norms) and Qwen3-MoE's layers (the router, ns_moe_topk and the experts of
kernels/cpu/moe.cpp in place of the MLP; no shared expert, no expert parallelism). For steps of
decodes only, on one rank, with bf16 activations and every linear layer on one of our CPU GEMMs
(bf16 weights packed for gemm*.cpp, or GGUF blocks packed for gemm_quant.cpp: the layer's
weight_form; at any ISA level), `FusedDecode.run` calls the same kernels in the same order with
the same inputs from C++, so its hidden states have the same bits as the modules'
(tests/engine/test_cpu_decode.py checks that), and everything else (embedding, final norm, LM
head, sampling) stays where it was. Any other step, model or machine takes the modules.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels import fused_decode_layers, fused_decode_layers_available
from nanoserve.kernels.kv_dtype import fused_decode_kv_format
from nanoserve.layers.linear_weight import LINEAR_ENTRIES
from nanoserve.models.llama import LlamaForCausalLM, LlamaMLP
from nanoserve.models.llava import LlavaForConditionalGeneration
from nanoserve.models.mixtral import SparseMoeBlock
from nanoserve.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from nanoserve.models.qwen_moe import Qwen3MoeForCausalLM


def _linear_entry(linear: nn.Module) -> list[int] | None:
    """A linear layer as decode_layers.cpp reads it (layers/linear_weight.py's decode_entry:
    the number of parts, then (format, packed weights' address, output columns) of each, then
    its input order's address); None when the layer can't go (a bias: Qwen2's QKV, the
    modules; a weight not packed for the CPU GEMMs; columns not a multiple of 16)."""
    if linear.bias is not None:
        return None
    return linear.weight_form.decode_entry(linear.weight)


_MOE_ENTRIES = LINEAR_ENTRIES + 5  # decode_layers.cpp's kMoeEntries: the router, then the experts


def _moe_entry(mlp: nn.Module) -> list[int] | None:
    """A layer's MoE entries as decode_layers.cpp reads them: zeros for a dense MLP; for a sparse
    block (models/mixtral.SparseMoeBlock) the router as a linear, the experts' table
    (kernels/fused_moe.cpu_expert_table, kept alive by the layer), the number of experts, top_k,
    renormalize and each expert's intermediate size. None when the block can't go (a shared
    expert, biases, another activation, expert parallelism, experts not packed, a router whose
    columns aren't whole tiles of 16)."""
    if not isinstance(mlp, SparseMoeBlock):
        return [0] * _MOE_ENTRIES
    experts = mlp.experts
    if (
        mlp.shared_expert is not None
        or experts.expert_weights.cpu_table is None
        or experts.expert_map is not None
        or experts.activation is not None
        or experts.w13_bias is not None
    ):
        return None
    router = _linear_entry(mlp.gate)
    if router is None or mlp.gate.weight.shape[0] != experts.num_experts:
        return None
    return router + [
        experts.expert_weights.cpu_table.data_ptr(),
        experts.num_experts,
        experts.top_k,
        int(experts.renormalize),
        experts.inter,
    ]


def _qk_norms(attn: nn.Module, eps: float) -> list[int] | None:
    """The q_norm and k_norm weights' addresses (models/qwen3.py: per head, in place), [0, 0]
    without; None when they can't go (not bf16 rows of head_dim, another eps)."""
    if not isinstance(attn, Qwen3Attention):
        return [0, 0]
    q_norm, k_norm = attn.q_norm, attn.k_norm
    for norm in (q_norm, k_norm):
        if (
            norm.weight.dtype != torch.bfloat16
            or norm.weight.shape != (attn.head_dim,)
            or not norm.weight.is_contiguous()
            or norm.eps != eps
        ):
            return None
    return [q_norm.weight.data_ptr(), k_norm.weight.data_ptr()]


FUSED_MODELS = (
    LlamaForCausalLM,
    LlavaForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)


class FusedDecode:
    def __init__(self, model: nn.Module, layer_table: torch.Tensor, config, kv_format: int) -> None:
        self.model = model
        self.kv_format = (
            kv_format  # the pools' elements (kv_dtype.fused_decode_kv_format): bf16 or fp8
        )
        # [layers, 6 + 4 * LINEAR_ENTRIES + _MOE_ENTRIES] (addresses kept alive by the model)
        self.layer_table = layer_table
        self.hidden = config.hidden_size
        layers = model.model.layers
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = (
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
        )
        self.qkv_n = attn.q_size + 2 * attn.kv_size
        dense = [
            layer.mlp.down_proj.weight.shape[1]
            for layer in layers
            if isinstance(layer.mlp, LlamaMLP)
        ]
        self.inter = max(dense, default=0)
        # MoE layers: the widest router, top_k and expert intermediate size (the scratch's sizes).
        sparse = [layer.mlp.experts for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]
        self.num_experts = max((e.num_experts for e in sparse), default=0)
        self.top_k = max((e.top_k for e in sparse), default=0)
        self.moe_inter = max((e.inter for e in sparse), default=0)
        # Scratch columns for inputs gathered in a layer's input order (GPTQ's activation order,
        # the last entry of a linear's row in the table); 0: no layer has one, no scratch.
        entries = layer_table[:, 6 : 6 + 4 * LINEAR_ENTRIES].reshape(
            layer_table.shape[0], 4, LINEAR_ENTRIES
        )
        self.gather_width = (
            max(self.hidden, self.num_heads * self.head_dim, self.inter)
            if bool(entries[:, :, -1].any())
            else 0
        )
        self.eps = layers[0].input_layernorm.eps
        self.scale = attn.attn.scale

    @classmethod
    def build(cls, model: nn.Module, world_size: int) -> FusedDecode | None:
        """None unless every condition for the fused path holds for this model here."""
        # Exactly Llama's, Qwen3's and Qwen3-MoE's layers (not another family's subclass; LLaVA's
        # language model is Llama's, and a decode step has no image rows), no sliding window
        # (decode_layers.cpp attends to every key).
        if (
            world_size != 1
            or type(model) not in FUSED_MODELS
            or not fused_decode_layers_available()
        ):
            return None
        if any(layer.self_attn.attn.sliding_window for layer in model.model.layers):
            return None
        config = model.config
        if config.hidden_act != "silu" or config.hidden_size % 16:
            return None
        rows = []
        cache = model.model.layers[0].self_attn.attn.key_cache
        kv_format = fused_decode_kv_format(cache.dtype) if cache is not None else None
        if kv_format is None:
            return None
        eps = model.model.layers[0].input_layernorm.eps
        dense_inters = {
            layer.mlp.down_proj.weight.shape[1]
            for layer in model.model.layers
            if isinstance(layer.mlp, LlamaMLP)
        }
        if (
            len(dense_inters) > 1
        ):  # one intermediate size for every dense layer (decode_layers.cpp's `inter`)
            return None
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = _moe_entry(mlp)
            norms = _qk_norms(attn, eps)
            if moe is None or norms is None:
                return None
            dense = [mlp.gate_up_proj, mlp.down_proj] if moe[LINEAR_ENTRIES] == 0 else []
            linears = [_linear_entry(lin) for lin in (attn.qkv_proj, attn.o_proj, *dense)]
            if any(entry is None for entry in linears):
                return None
            linears += [[0] * LINEAR_ENTRIES] * (4 - len(linears))
            pool = attn.attn.key_cache
            if pool is None or pool.shape[1] != 16 or pool.dtype != cache.dtype:
                return None
            rows.append(
                [
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    attn.attn.key_cache.data_ptr(),
                    attn.attn.value_cache.data_ptr(),
                    *norms,
                    *(value for entry in linears for value in entry),
                    *moe,
                ]
            )
        return cls(model, torch.tensor(rows, dtype=torch.int64), config, kv_format)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, lora=None
    ) -> torch.Tensor | None:
        """The final-normed hidden states of a step of decodes only, or None (then use the model).
        `lora`: the step's LoRA rows, as (lora/manager.py's fused_table(), each row's slot)."""
        rows = input_ids.shape[0]
        if rows == 0 or metadata.num_decode_seqs != rows or metadata.seq_lens.shape[0] != rows:
            return None
        if not (
            positions.dtype == torch.long
            and metadata.slot_mapping.dtype == torch.long
            and metadata.block_table.is_contiguous()
            and metadata.block_table.dtype == torch.int32
        ):
            return None
        if lora is not None and self.num_experts:  # adapters on a MoE model: the modules
            return None
        model = self.model.model
        x = model.embed_tokens(input_ids)
        if x.dtype != torch.bfloat16:
            return None
        new = x.new_empty
        buffers = [
            x,
            new(rows, self.hidden),
            new(rows, self.hidden),
            new(rows, self.hidden),
            new(rows, self.hidden),
            new(rows, self.qkv_n),
            new(rows, self.num_heads * self.head_dim),
            new(rows, 2 * self.inter),
            new(rows, self.inter),
            new(rows, self.gather_width),
            new(rows, self.num_experts),
            torch.empty(rows, self.top_k, dtype=torch.float32),
            torch.empty(rows, self.top_k, dtype=torch.int64),
            new(rows * self.top_k * (2 * self.hidden + 3 * self.moe_inter)),
        ]
        addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        cos_sin = self.model.cos_sin_cache
        lora_arguments = None
        if lora is not None:  # scratch for the adapters' shrink and delta (decode_layers.cpp)
            (table, num_slots, rank, width), row_slots = lora
            if row_slots.dtype != torch.long or row_slots.shape[0] != rows:
                return None
            lora_arguments = (
                table,
                row_slots,
                num_slots,
                rank,
                new(rows, width),
                new(rows, max(self.qkv_n, self.hidden, 2 * self.inter)),
            )
        which = fused_decode_layers(
            self.layer_table,
            addresses,
            rows,
            self.hidden,
            self.qkv_n,
            self.inter,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.scale,
            positions,
            cos_sin,
            metadata,
            self.kv_format,
            lora_arguments,
        )
        if which == 0:
            return None
        hidden, _ = model.norm(x, buffers[which])
        return hidden
