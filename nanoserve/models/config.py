"""The model's hyperparameters, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    sliding_window: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        raw = json.loads(path.read_text())
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"{model_dir}: unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta")
        if rope_theta is None and isinstance(raw.get("rope_parameters"), dict):
            rope_theta = raw["rope_parameters"].get("rope_theta")
            if rope_scaling is None and raw["rope_parameters"].get("rope_type", "default") != "default":
                rope_scaling = raw["rope_parameters"]
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
        )

    def resolve_dtype(self, requested: str) -> torch.dtype:
        if requested == "auto":
            return _DTYPE_NAMES.get(str(self.torch_dtype), torch.float32)
        return _DTYPE_NAMES[requested]
