"""Qwen2-MoE (Qwen1.5-MoE: QKV bias, a shared expert beside the routed ones) and Qwen3-MoE
(Qwen3's q/k norms, no shared expert): the MoE block of models/mixtral.py on their attention."""

from __future__ import annotations

from nanoserve.models.llama import LlamaForCausalLM, LlamaModel
from nanoserve.models.mixtral import MoEDecoderLayer
from nanoserve.models.qwen3 import Qwen3Attention


class Qwen2MoeModel(LlamaModel):
    decoder_layer_class = MoEDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen2MoeModel


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3MoeModel(LlamaModel):
    decoder_layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen3MoeModel
