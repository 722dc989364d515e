"""The model's hyperparameters, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoserve.models.llava_config import LLAVA_ARCHITECTURE, VisionConfig, llava_text_config
from nanoserve.models.qwen2_5_vl_config import (
    QWEN2_5_VL_ARCHITECTURE,
    QwenVisionConfig,
    qwen2_5_vl_text_config,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
)
# Decoder checkpoints without their LM head (e5-mistral's MistralModel, Llama/Qwen embedders):
# tensors named without the "model." prefix; served as pooling models (--runner pooling).
HEADLESS_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
# Decoder sequence classifiers (rerankers such as Qwen3-Reranker converted to one label): the
# decoder's tensors with a `score` head in place of the LM head; pooling models only.
SEQUENCE_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
# Encoder-only models (bidirectional attention, absolute positions, token types): pooling
# models only, with no KV cache (models/bert.py).
ENCODER_ARCHITECTURES = (
    "BertModel",
    "XLMRobertaModel",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
)
SLIDING, FULL = "sliding_attention", "full_attention"

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
}


@dataclass(slots=True)
class EncoderConfig:
    """What an encoder-only checkpoint (ENCODER_ARCHITECTURES) adds to the shared fields."""

    type_vocab_size: int
    layer_norm_eps: float
    # Position ids start here: 0 for BERT; XLM-RoBERTa's count from padding_idx + 1.
    position_offset: int
    position_table_size: int  # config.json's max_position_embeddings (rows of the table)

    @classmethod
    def from_raw(cls, raw: dict, architecture: str) -> EncoderConfig | None:
        if architecture not in ENCODER_ARCHITECTURES:
            return None
        roberta = architecture.startswith("XLMRoberta")
        position_kind = raw.get("position_embedding_type") or "absolute"
        if position_kind != "absolute":
            raise ValueError(
                f"{architecture}: position_embedding_type {position_kind!r} is not supported "
                "(absolute only)"
            )
        return cls(
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            position_offset=int(raw.get("pad_token_id", 1)) + 1 if roberta else 0,
            position_table_size=int(raw.get("max_position_embeddings", 512)),
        )


@dataclass(slots=True)
class MoEConfig:
    """The sparse MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (moe_intermediate_size, else intermediate_size)
    renormalize: bool  # the top-k weights rescaled to sum to 1 (norm_topk_prob; Mixtral always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    decoder_sparse_step: int = 1  # Qwen-MoE: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv
    swiglu_alpha: float = 1.702  # gpt-oss: its experts' activation (kernels/fused_moe.swiglu_oai)
    swiglu_limit: float = 7.0

    def check_tensor_parallel(self, tp_size: int, expert_parallel: bool) -> None:
        """One clear ValueError, before any weight is read, for a split layers/fused_moe.py can't make."""
        if expert_parallel and tp_size > 1 and self.num_experts % tp_size:
            raise ValueError(
                f"--enable-expert-parallel: --tensor-parallel-size {tp_size} does not divide the "
                f"model's {self.num_experts} experts"
            )
        if not expert_parallel and self.intermediate_size % tp_size:
            raise ValueError(
                f"--tensor-parallel-size {tp_size} does not divide the experts' intermediate size "
                f"{self.intermediate_size} (--enable-expert-parallel places whole experts instead)"
            )
        if self.shared_expert_intermediate_size % tp_size:
            raise ValueError(
                f"--tensor-parallel-size {tp_size} does not divide the shared expert's size "
                f"{self.shared_expert_intermediate_size}"
            )

    def is_sparse(self, layer_index: int) -> bool:
        return (
            layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_raw(cls, raw: dict, architecture: str) -> MoEConfig | None:
        if architecture not in MOE_ARCHITECTURES:
            return None
        num_experts = raw.get("num_local_experts") or raw.get("num_experts")
        top_k = raw.get("num_experts_per_tok") or raw.get(
            "experts_per_token"
        )  # gpt-oss's own name too
        if not num_experts or not top_k or not 0 < top_k <= num_experts:
            raise ValueError(
                f"{architecture}: config.json needs num_experts (or num_local_experts) and "
                f"num_experts_per_tok in 1..num_experts, got {num_experts} and {top_k}"
            )
        return cls(
            num_experts=int(num_experts),
            top_k=int(top_k),
            intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            # gpt-oss: a softmax over the top-k logits, the same as the top-k of all renormalised
            renormalize=architecture in ("MixtralForCausalLM", "GptOssForCausalLM")
            or bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(raw.get("mlp_only_layers") or []),
            clip_qkv=raw.get("clip_qkv"),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        )


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
    eos_token_id: int | list[int] | None
    sliding_window: int | None
    # Per layer, SLIDING or FULL (config.json's layer_types, else each family's rule); empty:
    # every layer has sliding_window.
    layer_types: list[str] = field(default_factory=list)
    partial_rotary_factor: float = 1.0  # Phi-3 / Phi-4-mini: rotary on the first part of each head
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # Gemma 2
    rope_local_base_freq: float | None = None  # Gemma 3: rope theta of the sliding layers
    # The checkpoint is a headless decoder (HEADLESS_ARCHITECTURES): no LM head, tensors without
    # the "model." prefix. Such a model only embeds (--runner pooling).
    headless: bool = False
    moe: MoEConfig | None = None  # mixture-of-experts families
    encoder: EncoderConfig | None = None  # encoder-only families (BERT, XLM-RoBERTa)
    # A sequence classifier's labels (*ForSequenceClassification; 0: no classification head).
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    # vLLM's classifier_from_token: a decoder classifier whose labels are these tokens' rows of
    # its LM head; with is_original_qwen3_reranker, one label: the second's logit less the
    # first's (Qwen3-Reranker's "yes" vs "no", as vLLM serves it).
    classifier_from_token: tuple[str, ...] = ()
    original_qwen3_reranker: bool = False
    # Set by models/registry.build_model from --enable-expert-parallel: whole experts per rank.
    enable_expert_parallel: bool = False
    # Vision-language models (LLaVA, Qwen2.5-VL): the vision tower and projector; None: text only.
    vision: VisionConfig | QwenVisionConfig | None = None
    # The GGUF mmproj file (--mmproj) the vision tower and projector come from, beside a GGUF
    # text model (models/gguf/mmproj.py); None: the checkpoint's own.
    mmproj_file: Path | None = None

    def layer_window(self, index: int) -> int | None:
        """The sliding window (keys a query attends to, itself included) of layer `index`."""
        if not self.sliding_window or (self.layer_types and self.layer_types[index] != SLIDING):
            return None
        return int(self.sliding_window)

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, overrides: dict | None = None, mmproj: str | None = None
    ) -> ModelConfig:
        """From a Hugging Face directory's config.json, or from a GGUF file's metadata (the
        config.json it implies; models/gguf/model.py); `overrides` (--hf-overrides) merged
        over it. `mmproj` (--mmproj): a GGUF vision tower and projector beside a GGUF text
        model, the pair a LLaVA (models/gguf/mmproj.py)."""
        from nanoserve.models.gguf.model import find_gguf_file, gguf_hf_config, gguf_metadata

        gguf_file = find_gguf_file(Path(model_dir))
        if gguf_file is not None:
            config = cls.from_hf_config(
                {**gguf_hf_config(gguf_file), **(overrides or {})}, model_dir
            )
            if mmproj is None:
                return config
            from nanoserve.models.gguf.mmproj import mmproj_vision

            text_architecture = gguf_metadata(gguf_file)[0].get("general.architecture")
            vision = mmproj_vision(
                mmproj, config.architecture, text_architecture, config.hidden_size
            )
            return dataclasses.replace(
                config,
                architecture=LLAVA_ARCHITECTURE,
                vision=vision,
                mmproj_file=Path(mmproj).expanduser().resolve(),
            )
        if mmproj is not None:
            raise ValueError(
                f"--mmproj goes with a GGUF text model (--model FILE.gguf), not {model_dir}"
            )
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{model_dir}: no config.json (expected a Hugging Face model directory)"
            )
        return cls.from_hf_config({**json.loads(path.read_text()), **(overrides or {})}, model_dir)

    @classmethod
    def from_hf_config(cls, raw: dict, model_dir: str | Path) -> ModelConfig:
        """`raw`: config.json's content; `model_dir` names the model in errors."""
        architectures = raw.get("architectures") or []
        if LLAVA_ARCHITECTURE in architectures:  # its language model's fields, then the vision's
            text = cls.from_hf_config(llava_text_config(raw), model_dir)
            return dataclasses.replace(
                text, architecture=LLAVA_ARCHITECTURE, vision=VisionConfig.from_raw(raw)
            )
        if QWEN2_5_VL_ARCHITECTURE in architectures:  # Qwen2 text, then the vision tower
            text = cls.from_hf_config(qwen2_5_vl_text_config(raw), model_dir)
            vision = QwenVisionConfig.from_raw(raw, text.head_dim)
            return dataclasses.replace(text, architecture=QWEN2_5_VL_ARCHITECTURE, vision=vision)
        headless = next((a for a in architectures if a in HEADLESS_ARCHITECTURES), None)
        architecture = next(
            (a for a in architectures if a in SUPPORTED_ARCHITECTURES + ENCODER_ARCHITECTURES),
            None,
        )
        if architecture is None and headless is not None:
            architecture = HEADLESS_ARCHITECTURES[headless]
        classifier = next((a for a in architectures if a in SEQUENCE_CLASSIFIERS), None)
        if architecture is None and classifier is not None:
            architecture = SEQUENCE_CLASSIFIERS[classifier]
        elif architecture is not None and architecture.endswith("ForSequenceClassification"):
            classifier = architecture
        if architecture is None:
            named = (
                ", ".join(architectures)
                if architectures
                else f"model_type {raw.get('model_type')!r}"
            )
            raise ValueError(
                f"{model_dir}: unsupported architecture {named}; "
                "supported: "
                + ", ".join(
                    SUPPORTED_ARCHITECTURES
                    + tuple(HEADLESS_ARCHITECTURES)
                    + ENCODER_ARCHITECTURES
                    + tuple(SEQUENCE_CLASSIFIERS)
                    + (LLAVA_ARCHITECTURE, QWEN2_5_VL_ARCHITECTURE)
                )
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta")
        rope_local = raw.get("rope_local_base_freq")
        rope_parameters = raw.get("rope_parameters")
        if isinstance(rope_parameters, dict) and FULL in rope_parameters:  # Gemma 3: per layer type
            if rope_local is None:
                rope_local = rope_parameters.get(SLIDING, {}).get("rope_theta")
            rope_parameters = rope_parameters[FULL]
        if isinstance(rope_parameters, dict):  # transformers 5: its theta wins over a top-level one
            rope_theta = rope_parameters.get("rope_theta") or rope_theta
            kind = rope_parameters.get("rope_type", rope_parameters.get("type"))
            if rope_scaling is None and kind not in (None, "default"):
                rope_scaling = rope_parameters
        if (
            isinstance(rope_scaling, dict)
            and "original_max_position_embeddings" not in rope_scaling
        ):
            original = raw.get(
                "original_max_position_embeddings"
            )  # Phi-3's LongRoPE keeps it outside
            if original is not None:
                rope_scaling = {**rope_scaling, "original_max_position_embeddings": original}
        partial_rotary = raw.get("partial_rotary_factor")
        if partial_rotary is None and isinstance(rope_parameters, dict):
            partial_rotary = rope_parameters.get("partial_rotary_factor")
        sliding_window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        num_layers = raw["num_hidden_layers"]
        encoder = EncoderConfig.from_raw(raw, architecture)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            # An encoder's usable length: its table less XLM-RoBERTa's offset (514 - 2 = 512).
            max_position_embeddings=raw.get("max_position_embeddings", 2048)
            - (encoder.position_offset if encoder is not None else 0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(
                raw.get(
                    "attention_bias",
                    raw.get(  # Qwen2-MoE names it qkv_bias
                        "qkv_bias", architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                    ),
                )
            ),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_id=raw.get("eos_token_id"),
            sliding_window=sliding_window,
            layer_types=_layer_types(raw, architecture, num_layers, sliding_window),
            partial_rotary_factor=float(partial_rotary or 1.0),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            rope_local_base_freq=float(rope_local) if rope_local is not None else None,
            moe=MoEConfig.from_raw(raw, architecture),
            headless=headless is not None and architecture == HEADLESS_ARCHITECTURES[headless],
            encoder=encoder,
            **_labels(raw, classifier),
        )

    @property
    def pooling_only(self) -> bool:
        """The checkpoint cannot generate: a headless decoder, an encoder, a classifier."""
        return self.headless or self.encoder is not None or self.num_labels > 0

    def resolve_dtype(self, requested: str) -> torch.dtype:
        if requested == "auto":
            return _DTYPE_NAMES.get(str(self.torch_dtype), torch.float32)
        return _DTYPE_NAMES[requested]


def _labels(raw: dict, classifier: str | None) -> dict:
    """A sequence classifier's label fields (none for other checkpoints)."""
    if classifier is None:
        return {}
    tokens = tuple(str(t) for t in raw.get("classifier_from_token") or ())
    original = bool(raw.get("is_original_qwen3_reranker"))
    if original and len(tokens) != 2:
        raise ValueError("is_original_qwen3_reranker needs two classifier_from_token entries")
    labels = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
    if tokens:
        count = 1 if original else len(tokens)
        labels = {} if original else dict(enumerate(tokens))
    else:
        count = len(labels) if labels else int(raw.get("num_labels", 2))
    return {
        "num_labels": count,
        "id2label": labels or {i: f"LABEL_{i}" for i in range(count)},
        "classifier_from_token": tokens,
        "original_qwen3_reranker": original,
    }


def _layer_types(
    raw: dict, architecture: str, num_layers: int, sliding_window: int | None
) -> list[str]:
    """Which layers use the sliding window: config.json's layer_types when it has them (newer
    exports), else the family's rule as in transformers' configs."""
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(
                f"config.json layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}"
            )
        return list(types)
    if architecture == "Gemma2ForCausalLM":
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if architecture == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if architecture in (
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    ):
        first = raw.get("max_window_layers", num_layers)
        return [SLIDING if sliding_window and i >= first else FULL for i in range(num_layers)]
    return [SLIDING if sliding_window else FULL] * num_layers
