"""Architecture name → model class, and building a model with its weights."""
from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.models.config import ModelConfig
from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.models.weights import load_weights

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def check_pipeline_support(config: ModelConfig, pipeline_parallel_size: int) -> None:
    """A model class takes part in pipeline parallelism by building its layers with
    distributed/pipeline.py's make_layers and taking `intermediate` in forward; it says so with
    `supports_pipeline_parallel = True`."""
    model_class = MODEL_CLASSES[config.architecture]
    if pipeline_parallel_size > 1 and not getattr(model_class, "supports_pipeline_parallel", False):
        raise ValueError(f"{config.architecture} does not support --pipeline-parallel-size > 1 yet")


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, model_dir: Path) -> torch.nn.Module:
    model_class = MODEL_CLASSES[config.architecture]
    with torch.device(device):
        model = model_class(config, dtype)
    load_weights(model, model_dir)
    return model.eval()
