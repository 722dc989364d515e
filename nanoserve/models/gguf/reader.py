"""Reading a Llama-architecture GGUF file: its metadata as plain values, the HF `config.json` it
implies, and its tensors dequantized and renamed to the HF Llama layout (bfloat16)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import gguf
import numpy as np
import torch


class GGUFImportError(RuntimeError, ValueError):
    """The GGUF file cannot be turned into a model directory or served (unsupported, corrupt,
    download failed). A ValueError too: the CLI reports it as one line, as other bad input."""


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """All key/value fields as plain Python values (works on every gguf-py version we allow)."""
    metadata = {}
    for name, field in reader.fields.items():
        if not field.types:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[index]).decode("utf-8") for index in field.data]
            else:
                value = [field.parts[index][0].item() for index in field.data]
        elif kind == gguf.GGUFValueType.STRING:
            value = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            value = field.parts[field.data[0]][0].item()
        metadata[name] = value
    return metadata


def _float32_value(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.999999747378752e-06; keep the value that was meant.
    return float(str(np.float32(value)))


GPT_OSS = "gpt-oss"
# Gemma 2 / 3 (models/gemma.py): llama.cpp's converter stores each RMSNorm's weight as 1 + w (the
# factor itself; transformers keeps w: GGUFArchitecture.norm_weight), rows in HF's order, no
# query_pre_attn_scalar (llama.cpp takes the head size, hidden / heads for the 27B models), Gemma
# 2's sliding window on every other layer from the first and Gemma 3's on five layers of six, the
# sliding layers' rope base 10,000.
# Phi-3 / Phi-4-mini (models/phi3.py): q/k/v fused (attn_qkv) and gate/up fused (ffn_up) as the HF
# checkpoint has them, rows in HF's order, rotary on rope.dimension_count of each head (Phi-4-mini:
# three quarters), LongRoPE's factors as the tensors rope_factors_short / rope_factors_long (read
# into the config by models/gguf/model.py), the sliding window on every layer when the file has one.
PHI3 = "phi3"
ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_architecture(metadata: dict, file_name: str) -> str:
    """The file's `general.architecture` (GGUFImportError, one line, for one we don't serve)."""
    architecture = metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise GGUFImportError(
            f"{file_name}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(repr(a) for a in GGUF_ARCHITECTURES)})"
        )
    return architecture


def reader_architecture(reader: gguf.GGUFReader) -> str | None:
    """The file's `general.architecture` without reading the rest of its metadata."""
    field = reader.fields.get("general.architecture")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def rotary_rows_permuted(config) -> bool:
    """Whether the file's Q/K rows are in llama.cpp's interleaved order (unpermute_rotary_rows
    puts them back): a "llama" file's are; a "qwen2" file's are as Hugging Face had them."""
    architecture = (
        (config.get("architectures") or [None])[0]
        if isinstance(config, dict)
        else config.architecture
    )
    # (a LLaVA's language model comes from a "llama" file: models/gguf/mmproj.py checks it)
    return architecture in (
        GGUF_ARCHITECTURES["llama"].hf_class,
        _MIXTRAL[0],
        "LlavaForConditionalGeneration",
    )


# The hyperparameters llama_config reads, by the kind of value each must hold (a file whose bits
# changed a type or a count gets one line, not a TypeError or a layer list of 2^32 entries).
_WHOLE_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "rope.dimension_count",
    "vocab_size",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "attention.sliding_window",
    "rope.scaling.original_context_length",
)
_POSITIVE_KEYS = (
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "block_count",
)
_NUMBER_KEYS = (
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.scaling.factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "attn_logit_softcapping",
    "final_logit_softcapping",
)
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id")


def _check_value_kinds(
    metadata: dict, architecture: str, tensor_names: set[str], file_name: str
) -> None:
    """Whole numbers (positive where a model divides by them or builds one thing each), numbers and
    token ids where llama_config reads them; no more layers than the file has tensors."""

    def bad(key: str, value, kind: str) -> GGUFImportError:
        return GGUFImportError(
            f"{file_name}: GGUF metadata {key} is {str(value)[:60]!r}, not {kind}"
        )

    for suffix in _WHOLE_KEYS:
        key = f"{architecture}.{suffix}"
        value = metadata.get(key)
        if value is None:
            continue
        positive = suffix in _POSITIVE_KEYS
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
            raise bad(key, value, "a positive whole number" if positive else "a whole number")
    for key in (f"{architecture}.{suffix}" for suffix in _NUMBER_KEYS):
        value = metadata.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise bad(key, value, "a number")
    for key in (f"tokenizer.ggml.{suffix}" for suffix in _TOKEN_ID_KEYS):
        value = metadata.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad(key, value, "a token id")
    if not isinstance(metadata.get("tokenizer.ggml.tokens", []), list):
        raise bad("tokenizer.ggml.tokens", metadata["tokenizer.ggml.tokens"], "an array")
    if not isinstance(metadata.get(f"{architecture}.rope.scaling.type", ""), str):
        raise bad(
            f"{architecture}.rope.scaling.type",
            metadata[f"{architecture}.rope.scaling.type"],
            "a string",
        )
    layers = metadata.get(f"{architecture}.block_count")
    if layers is not None and layers > len(tensor_names):
        raise GGUFImportError(
            f"{file_name}: GGUF metadata {architecture}.block_count {layers} is more layers than "
            f"the file's {len(tensor_names)} tensors hold"
        )


class _Keys:
    """One file's `{architecture}.*` metadata: `get` for a key the config needs (GGUFImportError,
    one line, where it is missing), `opt` for one it may lack."""

    def __init__(self, metadata: dict, architecture: str):
        self.metadata, self.architecture = metadata, architecture

    def opt(self, key: str, default=None):
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def get(self, key: str, default=None):
        value = self.opt(key, default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks {self.architecture}.{key}")
        return value


@dataclass(frozen=True)
class _Shape:
    """The attention sizes every family's extra keys may depend on."""

    hidden_size: int
    num_heads: int
    head_dim: int


def _yarn_scaling(keys: _Keys, scaling: str, tensor_names: set[str]) -> dict | None:
    """gpt-oss's YaRN: llama.cpp's converter writes the factor and the original context; the betas
    are gpt-oss's (llama.cpp's defaults too) unless the file says otherwise; transformers' gpt-oss
    YaRN does not round its correction range (truncate false)."""
    if scaling != "yarn" or "rope_freqs.weight" in tensor_names:
        return None
    return {
        "rope_type": "yarn",
        "factor": _float32_value(keys.get("rope.scaling.factor")),
        "original_max_position_embeddings": keys.get("rope.scaling.original_context_length"),
        "beta_fast": _float32_value(keys.opt("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _float32_value(keys.opt("rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }


def _longrope_scaling(keys: _Keys, scaling: str, tensor_names: set[str]) -> dict | None:
    """Phi-3's LongRoPE, where the file has its factor tensors (with_rope_factors reads them)."""
    if not set(ROPE_FACTOR_TENSORS) <= tensor_names:
        return None
    return {
        "rope_type": "longrope",
        "original_max_position_embeddings": keys.get("rope.scaling.original_context_length"),
    }


def _linear_scaling(keys: _Keys, scaling: str, tensor_names: set[str]) -> dict | None:
    """Gemma 3's linear scaling (its global layers')."""
    if scaling != "linear" or "rope_freqs.weight" in tensor_names:
        return None
    return {"rope_type": "linear", "factor": _float32_value(keys.get("rope.scaling.factor"))}


def _local_experts(keys: _Keys) -> dict:
    """Mixtral's and gpt-oss's router keys."""
    return {
        "num_local_experts": keys.get("expert_count"),
        "num_experts_per_tok": keys.get("expert_used_count"),
    }


def _qwen_experts(keys: _Keys, norm_topk_prob: bool) -> dict:
    """Qwen-MoE's router keys: Qwen3-MoE renormalises the top-k weights, as llama.cpp's qwen3moe
    graph does; Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) does not."""
    return {
        "num_experts": keys.get("expert_count"),
        "num_experts_per_tok": keys.get("expert_used_count"),
        "norm_topk_prob": norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": keys.get("expert_feed_forward_length"),
    }


def _qwen2_experts(keys: _Keys) -> dict:
    """Qwen2-MoE adds a shared expert behind a sigmoid gate."""
    return _qwen_experts(keys, norm_topk_prob=False) | {
        "shared_expert_intermediate_size": keys.get("expert_shared_feed_forward_length")
    }


def _gemma_keys(keys: _Keys, shape: _Shape, gemma: str, every: int) -> dict:
    """Gemma's activation, window and query scale, a full-attention layer every `every` layers."""
    layers, window = keys.get("block_count"), keys.get("attention.sliding_window")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "query_pre_attn_scalar": shape.hidden_size // shape.num_heads
        if layers == _GEMMA_27B_LAYERS[gemma]
        else shape.head_dim,
        "layer_types": [
            "full_attention" if (index + 1) % every == 0 else "sliding_attention"
            for index in range(layers)
        ],
    }


def _gemma2_keys(keys: _Keys, shape: _Shape) -> dict:
    """Gemma 2: sliding on every other layer, both softcaps always written."""
    return _gemma_keys(keys, shape, "gemma2", every=2) | {
        "attn_logit_softcapping": _float32_value(keys.get("attn_logit_softcapping")),
        "final_logit_softcapping": _float32_value(keys.get("final_logit_softcapping")),
    }


def _gemma3_keys(keys: _Keys, shape: _Shape) -> dict:
    """Gemma 3: sliding on five layers of six (rope base 10,000), a final softcap only where set."""
    family = _gemma_keys(keys, shape, "gemma3", every=6) | {"rope_local_base_freq": 10000.0}
    cap = keys.opt("final_logit_softcapping")  # (written only when set)
    if cap:
        family["final_logit_softcapping"] = _float32_value(cap)
    return family


def _phi3_keys(keys: _Keys, shape: _Shape) -> dict:
    """Phi-3: the window on every layer when the file has one; rotary on part of each head."""
    rotary = keys.opt("rope.dimension_count", shape.head_dim)
    return {
        "sliding_window": keys.opt("attention.sliding_window") or None,
        "partial_rotary_factor": rotary / shape.head_dim,
    }


def _gpt_oss_keys(keys: _Keys, shape: _Shape) -> dict:
    """gpt-oss: biases everywhere, a window on every other layer from the first, clamped SwiGLU."""
    window = keys.get("attention.sliding_window")
    layers = keys.get("block_count")
    return {
        "sliding_window": window,
        "attention_bias": True,
        "intermediate_size": keys.get("expert_feed_forward_length"),
        "layer_types": [
            "sliding_attention" if index % 2 == 0 else "full_attention" for index in range(layers)
        ],
        "swiglu_limit": 7.0,
    }


@dataclass(frozen=True)
class GGUFArchitecture:
    """What one llama.cpp architecture's config.json has beyond the keys every Llama shares:
    its HF class, its RoPE scaling (None where the file must have none), its router keys (None:
    experts are refused; `with_experts`: the HF class a file with experts is), its own keys."""

    hf_class: str
    model_type: str
    rope_scaling: Callable[[_Keys, str, set[str]], dict | None] | None = None
    experts: Callable[[_Keys], dict] | None = None
    experts_required: bool = False
    with_experts: tuple[str, str] | None = None
    family: Callable[[_Keys, _Shape], dict] | None = None
    # Phi's rope.dimension_count may be part of a head: not a head size for it.
    rotary_is_head_size: bool = True
    # Its RMSNorm weights (`*norm.weight`) from the file's values to the model's, where they
    # differ (None: taken as stored).
    norm_weight: Callable[[torch.Tensor], torch.Tensor] | None = None


def _norm_from_factor(weight: torch.Tensor) -> torch.Tensor:
    """Gemma: the file holds each RMSNorm's factor 1 + w, the model (as transformers) w."""
    return weight - 1.0


def tensor_step(architecture: str | None, tensor_name: str) -> Callable | None:
    """The architecture's step from a dense tensor's values in the file (`tensor_name`: its
    GGUF name) to its parameter's; None where the values are taken as stored."""
    arch = GGUF_ARCHITECTURES.get(architecture)
    if arch is not None and tensor_name.endswith("norm.weight"):
        return arch.norm_weight
    return None


_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# llama.cpp's architectures of the Llama family, each as the Hugging Face class it was converted
# from. Qwen2 is Llama with Q/K/V biases, and its converter keeps the Q/K rows in Hugging Face's
# order (llama.cpp rotates them NeoX-style), where "llama" reorders them; Qwen3 adds per-head Q/K
# norms, Qwen3-MoE routes to experts (stacked: ffn_*_exps). A "llama" file with experts
# (`llama.expert_count`) is a Mixtral, as llama.cpp's converter writes one. gpt-oss
# (models/gpt_oss.py) keeps HF's rows too, with biases on q/k/v/o, the router and the experts,
# attention sinks (attn_sinks), YaRN, a sliding window on every other layer from the first, and
# its experts in MXFP4.
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture(
        "LlamaForCausalLM", "llama", experts=_local_experts, with_experts=_MIXTRAL
    ),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        experts=partial(_qwen_experts, norm_topk_prob=True),
        experts_required=True,
    ),
    GPT_OSS: GGUFArchitecture(
        "GptOssForCausalLM",
        "gpt_oss",
        rope_scaling=_yarn_scaling,
        experts=_local_experts,
        experts_required=True,
        family=_gpt_oss_keys,
    ),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", "gemma2", family=_gemma2_keys, norm_weight=_norm_from_factor
    ),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM",
        "gemma3_text",
        rope_scaling=_linear_scaling,
        family=_gemma3_keys,
        norm_weight=_norm_from_factor,
    ),
    PHI3: GGUFArchitecture(
        "Phi3ForCausalLM",
        "phi3",
        rope_scaling=_longrope_scaling,
        family=_phi3_keys,
        rotary_is_head_size=False,
    ),
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeForCausalLM", "qwen2_moe", experts=_qwen2_experts, experts_required=True
    ),
}


def _rope_scaling(
    arch: GGUFArchitecture, keys: _Keys, tensor_names: set[str], file_name: str
) -> dict | None:
    """The architecture's own RoPE scaling where it applies; a file with any other is refused."""
    scaling = keys.opt("rope.scaling.type", "none")
    if arch.rope_scaling is not None:
        rope_scaling = arch.rope_scaling(keys, scaling, tensor_names)
        if rope_scaling is not None:
            return rope_scaling
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise GGUFImportError(f"RoPE scaling ({scaling!r} / rope_freqs) is not supported")
    return None


def _class_and_experts(
    arch: GGUFArchitecture, keys: _Keys, file_name: str
) -> tuple[tuple[str, str], dict]:
    """The HF (class, model_type) and the router keys: an expert count only where the
    architecture routes, and always where it must."""
    hf = (arch.hf_class, arch.model_type)
    if not keys.opt("expert_count"):
        if arch.experts_required:
            raise GGUFImportError(f"GGUF metadata lacks {keys.architecture}.expert_count")
        return hf, {}
    if arch.experts is None:
        raise GGUFImportError(
            f"{file_name}: experts in a {keys.architecture!r} file are not supported"
        )
    return arch.with_experts or hf, arch.experts(keys)


def llama_config(metadata: dict, tensor_names: set[str], file_name: str) -> dict:
    """The Hugging Face config.json of a GGUF file of the Llama family (GGUF_ARCHITECTURES: the
    keys every Llama shares, then its architecture's own; GGUFImportError, one line naming
    `file_name`, for another architecture or a value of the wrong kind)."""
    architecture = gguf_architecture(metadata, file_name)
    _check_value_kinds(metadata, architecture, tensor_names, file_name)
    arch, keys = GGUF_ARCHITECTURES[architecture], _Keys(metadata, architecture)
    get = keys.get
    rope_scaling = _rope_scaling(arch, keys, tensor_names, file_name)
    hidden_size = get("embedding_length")
    num_heads = get("attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    rotated = keys.opt("rope.dimension_count") if arch.rotary_is_head_size else None
    head_dim = keys.opt("attention.key_length", rotated or hidden_size // num_heads)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = keys.opt("vocab_size", len(tokens))
    (hf_class, model_type), experts = _class_and_experts(arch, keys, file_name)
    shape = _Shape(hidden_size, num_heads, head_dim)
    family = arch.family(keys, shape) if arch.family is not None else {}
    # A Qwen3-MoE file may carry no dense feed_forward_length (no layer uses one).
    dense_ffn = keys.opt("feed_forward_length")
    if dense_ffn is None:
        dense_ffn = experts.get("moe_intermediate_size") or get("feed_forward_length")
    return {
        **experts,
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": dense_ffn,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        **family,
    }


def with_rope_factors(config: dict, tensors) -> dict:
    """`config` with Phi-3's LongRoPE factors (rope_scaling's short_factor / long_factor) read from
    the file's rope_factors_short / rope_factors_long tensors (`tensors`: the reader's), each
    float32 value as the shortest decimal that rounds to it; `config` itself when it has none."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") != "longrope":
        return config
    by_name = {tensor.name: tensor for tensor in tensors if tensor.name in ROPE_FACTOR_TENSORS}
    factors = {
        f"{kind}_factor": [
            float(str(value)) for value in by_name[f"rope_factors_{kind}.weight"].data
        ]
        for kind in ("short", "long")
    }
    return {**config, "rope_scaling": {**scaling, **factors}}


# ---------------------------------------------------------------------------------------- weights

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss's norm before its MoE block
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# gpt-oss's router is transformers' mlp.router (the others' mlp.gate); Gemma's four norms a layer.
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCHITECTURE_NAMES = {
    GPT_OSS: {"ffn_gate_inp": "mlp.router"},
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    PHI3: {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Every expert's matrix stacked in one tensor ([experts, outputs, inputs]): our FusedMoE's stacked
# parameter and the part (0 gate, 1 up, None down) it fills (expert_part).
_EXPERT_TENSOR_NAMES = {
    "ffn_gate_exps": ("mlp.experts.w13", 0),
    "ffn_up_exps": ("mlp.experts.w13", 1),
    "ffn_down_exps": ("mlp.experts.w2", None),
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, architecture: str | None = None) -> str:
    """llama.cpp's tensor name → the HF Llama (Qwen2, Qwen3, gpt-oss) name; biases as Qwen2's q/k/v
    have them; stacked experts (and gpt-oss's stacked expert biases) → the FusedMoE parameter they
    load into (expert_part says which part). `architecture`: the file's, where a name differs."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and match.group(2) in _EXPERT_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_EXPERT_TENSOR_NAMES[match.group(2)][0]}_{match.group(3)}"
    names = {**_LAYER_TENSOR_NAMES, **_ARCHITECTURE_NAMES.get(architecture, {})}
    if match is None or match.group(2) not in names:
        raise GGUFImportError(
            f"unexpected tensor {gguf_name!r} in a {architecture or 'llama'} GGUF"
        )
    if (
        match.group(2) == "attn_sinks"
    ):  # a parameter of its own in transformers, not a module's weight
        return f"model.layers.{match.group(1)}.{names['attn_sinks']}"
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"


def expert_part(gguf_name: str) -> tuple[bool, int | None]:
    """(whether the tensor stacks every expert's matrix, the part: 0 gate, 1 up, None down)."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_TENSOR_NAMES:
        return False, None
    return True, _EXPERT_TENSOR_NAMES[match.group(2)][1]


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row order.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3) ... while HF rotates the two halves of each
    head, so the converter reorders each head's rows from [half 0 | half 1] to interleaved. This
    puts them back: gguf row 2*j + s of a head is HF row s * head_dim/2 + j.
    """
    out_features, in_features = weight.shape
    head_dim = out_features // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
        .contiguous()
    )


def llama_state_dict(reader: gguf.GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized (bf16) under their HF names, each through its
    architecture's step (tensor_step: Gemma's norms back to w from the stored 1 + w); Phi-3's
    LongRoPE factor tensors left to the config."""
    state_dict = {}
    permuted = rotary_rows_permuted(config)
    architecture = reader_architecture(reader)
    for tensor in reader.tensors:
        if expert_part(tensor.name)[0]:
            raise GGUFImportError(
                f"{tensor.name}: a mixture-of-experts GGUF file is served as it is "
                "(--model FILE.gguf), not imported into a Hugging Face directory"
            )
        if tensor.name in ROPE_FACTOR_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, architecture)
        # GGUF lists dims fastest-first; torch wants them slowest-first.
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise GGUFImportError(
                f"{tensor.name}: quantization {tensor.tensor_type.name} is not supported"
            ) from error
        # np.array copies: unquantized tensors come back as read-only views of the memory map.
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        step = tensor_step(architecture, tensor.name)
        if step is not None:
            weight = step(weight)
        if name.endswith("q_proj.weight") and permuted:
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight") and permuted:
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        state_dict[name] = weight.to(torch.bfloat16).contiguous()
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - state_dict.keys()
    if missing:
        raise GGUFImportError(f"GGUF lacks tensors for {sorted(missing)}")
    return state_dict
