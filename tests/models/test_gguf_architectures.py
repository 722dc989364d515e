"""Every llama.cpp architecture in reader.py's table (issue 53: llama_config as a table of what
each architecture adds) yields a config.json the model config and the registry accept, as the
model class and model_type the table names; a "llama" file with experts is a Mixtral."""

from __future__ import annotations

import pytest

from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.reader import GGUF_ARCHITECTURES, GGUFImportError, llama_config
from nanoserve.models.registry import MODEL_CLASSES

LAYERS = 6
# One value for every key some architecture reads (each reads only its own).
HYPERPARAMETERS = {
    "context_length": 256,
    "embedding_length": 64,
    "block_count": LAYERS,
    "feed_forward_length": 128,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 16,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.sliding_window": 32,
    "rope.freq_base": 10000.0,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "expert_used_count": 2,
    "expert_feed_forward_length": 32,
    "expert_shared_feed_forward_length": 96,
    "rope.dimension_sections": [2, 3, 3, 0],  # qwen2vl's M-RoPE: half of key_length 16
}
TENSORS = {f"blk.{index}.attn_q.weight" for index in range(LAYERS)} | {"output.weight"}


def metadata(architecture: str, experts: int) -> dict:
    keys = HYPERPARAMETERS | ({"expert_count": experts} if experts else {})
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.tokens": [f"t{index}" for index in range(100)],
        **{f"{architecture}.{key}": value for key, value in keys.items()},
    }


@pytest.mark.parametrize("architecture", sorted(GGUF_ARCHITECTURES))
def test_each_architecture_is_a_model_the_registry_builds(architecture, tmp_path):
    entry = GGUF_ARCHITECTURES[architecture]
    experts = 4 if entry.experts_required else 0
    raw = llama_config(metadata(architecture, experts), TENSORS, "model.gguf")
    config = ModelConfig.from_hf_config(raw, tmp_path)
    assert (raw["architectures"], raw["model_type"]) == ([entry.hf_class], entry.model_type)
    assert config.architecture == entry.hf_class and config.architecture in MODEL_CLASSES
    assert config.num_hidden_layers == LAYERS


def test_experts_make_a_llama_file_a_mixtral_and_are_refused_elsewhere(tmp_path):
    raw = llama_config(metadata("llama", experts=4), TENSORS, "model.gguf")
    assert ModelConfig.from_hf_config(raw, tmp_path).architecture == "MixtralForCausalLM"
    assert (raw["num_local_experts"], raw["num_experts_per_tok"]) == (4, 2)
    with pytest.raises(GGUFImportError, match="experts in a 'qwen3' file are not supported"):
        llama_config(metadata("qwen3", experts=4), TENSORS, "model.gguf")
