"""Architecture name → model class, and building a model with its weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from nanoserve.distributed.pipeline import real_layers
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.fused_moe import FusedMoE
from nanoserve.layers.linear import LinearBase
from nanoserve.models.bert import ENCODER_CLASSES
from nanoserve.models.compressed_tensors import compressed_tensors_config
from nanoserve.models.config import ModelConfig
from nanoserve.models.fp8 import FP8_METHOD, fp8_config, quantize_online
from nanoserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from nanoserve.models.gguf.mmproj import MMPROJ_PARAMETERS
from nanoserve.models.gguf.mmproj_weights import load_mmproj_weights
from nanoserve.models.gguf.model import find_gguf_file
from nanoserve.models.gguf.weights import load_gguf_weights
from nanoserve.models.gpt_oss import GptOssForCausalLM
from nanoserve.models.gptq_awq import group_quant_config
from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.models.llava import LlavaForConditionalGeneration
from nanoserve.models.mixtral import MixtralForCausalLM
from nanoserve.models.mxfp4 import mxfp4_config
from nanoserve.models.olmoe import OlmoeForCausalLM
from nanoserve.models.phi3 import Phi3ForCausalLM
from nanoserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from nanoserve.models.qwen3 import Qwen3ForCausalLM
from nanoserve.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from nanoserve.models.sequence_classification import label_token_ids, sequence_classifier_class
from nanoserve.models.weights import load_weights

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    **ENCODER_CLASSES,  # pooling models only (--runner pooling)
}


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The class that serves `config`: its architecture's, made a sequence classifier for a
    decoder *ForSequenceClassification checkpoint (models/sequence_classification.py)."""
    base = MODEL_CLASSES[config.architecture]
    if config.num_labels and config.encoder is None:
        return sequence_classifier_class(base)
    return base


def check_pipeline_support(config: ModelConfig, pipeline_parallel_size: int) -> None:
    """A model class takes part in pipeline parallelism by building its layers with
    distributed/pipeline.py's make_layers and taking `intermediate` in forward; it says so with
    `supports_pipeline_parallel = True`."""
    if pipeline_parallel_size > 1 and (
        config.num_labels or not getattr(model_class(config), "supports_pipeline_parallel", False)
    ):
        raise ValueError(f"{config.architecture} does not support --pipeline-parallel-size > 1 yet")


def check_vision_support(
    config: ModelConfig, tensor_parallel_size: int, draft_model: bool = False
) -> None:
    """A vision-language model runs with tensor parallelism where its class says so (LLaVA,
    Qwen2.5-VL: the encoder on rank 0, its rows broadcast with the step), and without a draft
    model (a draft would read image tokens as text)."""
    if config.vision is None:
        return
    if tensor_parallel_size > 1 and not getattr(
        model_class(config), "supports_tensor_parallel", False
    ):
        raise ValueError(f"{config.architecture} does not support --tensor-parallel-size > 1 yet")
    if draft_model:
        raise ValueError(
            f"{config.architecture} does not support a draft model in --speculative-config yet"
        )


def model_pooling_tasks(config: ModelConfig) -> tuple[str, ...]:
    """What a pooling model answers (PoolingParams.task), its default first: a sequence
    classifier classifies and scores pairs; an embedding model embeds (and scores by cosine)."""
    return getattr(model_class(config), "pooling_tasks", ("embed", "score"))


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    model_dir: Path,
    max_model_len: int | None = None,
    enable_expert_parallel: bool = False,
    quantization: str | None = None,
) -> torch.nn.Module:
    """`quantization`: the checked --quantization (models/gguf_model.check_quantization); "fp8" on
    an unquantized checkpoint rounds its linear layers to FP8 at load (models/fp8.quantize_online).
    `max_model_len`: no sequence is longer. A sliding window at least that long never leaves
    a key out, so such layers drop it and keep the fast kernels (the CPU's C++ attention and
    fused decode step; Mistral's 4,096-token window when serving up to 4,096 tokens)."""
    model_type = model_class(config)
    if enable_expert_parallel:  # MoE layers place whole experts on ranks (layers/fused_moe.py)
        config = dataclasses.replace(config, enable_expert_parallel=True)
    with torch.device(device):
        model = model_type(config, dtype)
    if config.classifier_from_token:
        model.label_token_ids = label_token_ids(config, model_dir)
    if max_model_len is not None and config.encoder is None:
        for layer in real_layers(model.model.layers):  # this pipeline stage's
            attention = layer.self_attn.attn
            if attention.sliding_window is not None and attention.sliding_window >= max_model_len:
                attention.sliding_window = None
    gguf_file = find_gguf_file(model_dir)
    if gguf_file is not None:  # linear layers keep the file's quantization blocks
        if config.mmproj_file is None:
            load_gguf_weights(model, gguf_file)
        else:  # a LLaVA: the text model's file, then the tower and projector's (--mmproj)
            load_gguf_weights(model, gguf_file, elsewhere=MMPROJ_PARAMETERS)
            load_mmproj_weights(model, config.mmproj_file)
    else:  # a compressed-tensors, GPTQ, AWQ or FP8 checkpoint's quantized layers keep their integers / bytes
        checkpoint = (
            compressed_tensors_config(model_dir)
            or group_quant_config(model_dir)
            or fp8_config(model_dir)
        )
        load_weights(model, model_dir, checkpoint, mxfp4_config(model_dir))
        if checkpoint is None and quantization == FP8_METHOD:
            quantize_online(model)
    return model.eval()


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights take: parameters (not the meta placeholders of quantized or packed
    layers) plus what each layer's weight holds beside them (layers/cpu_prepack.py's packings,
    quantized blocks) and a GGUF embedding's mapped rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    held_blocks = set()  # GGUF bytes a layer holds (a tied head shares the embedding's on CUDA)
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            total += module.weight_form.nbytes()
            if module.weight_form.quantized:
                held_blocks |= {
                    p.raw.data_ptr() for p in module.weight_form.parts if p.raw is not None
                }
        elif isinstance(module, FusedMoE):
            total += module.kernel_bytes()
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.file_rows is not None:
            if module.file_rows.data.data_ptr() not in held_blocks:
                total += module.file_rows.nbytes  # mapped from a GGUF file (CPU), or on CUDA
    return total
