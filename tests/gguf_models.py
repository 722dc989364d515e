"""Small quantized GGUF files for the tests: a random Llama checkpoint written by transformers'
own classes (tests/conftest.write_random_llama), turned into a GGUF file as llama.cpp's converter
lays one out (Q/K rows permuted for its rotary, tokenizer and chat template in the metadata), with
its linear layers quantized by the `gguf` package where it can quantize the type (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, MXFP4) and as random blocks of sane scale where it cannot (Q4_K, Q5_K, Q6_K:
`gguf.quants` dequantizes them but has no quantizer). As llama.cpp's quantizer, a K type asked
for a tensor whose rows are not a multiple of 256 falls back to a 32-element type."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.conftest import write_random_llama

T = gguf.GGMLQuantizationType
# A mix like llama.cpp's Q4_K_M: Q6_K for V and the down projection, Q4_K elsewhere.
PRESETS = {
    "q8_0": {},
    "q4_0": {},
    "q4_1": {},
    "q5_0": {},
    "q5_1": {},
    "mxfp4": {},  # gpt-oss's experts' type, here in every linear layer (the kernels' MXFP4 format)
    "tq2_0": {},  # ternary: not supported, the unsupported-type error
    "f16": {},  # unquantized linear layers: dequantized into the bf16 / fp32 weights
    "q4_k_m": {"v_proj": "q6_k", "down_proj": "q6_k"},
}
# What llama.cpp's quantizer (llama-quant.cpp) writes for --type Q4_K_M / Q5_K_M: this K type
# everywhere but attn_v and ffn_down in the layers use_more_bits picks (Q6_K), then the fallback
# for rows not a multiple of 256 (_K_FALLBACK). On SmolLM2-135M (hidden 576) Q4_K_M is Q5_0 but for
# ffn_down (Q4_K / Q6_K) and some attn_v (Q8_0); LLAMA_CPP_SHAPE, its default here, has the same
# pattern (two layers: layer 1 uses more bits, layer 0 not) and splits across two ranks.
LLAMA_CPP_MIXES = {"llama_cpp_q4_k_m": "q4_k", "llama_cpp_q5_k_m": "q5_k"}
PRESETS.update({name: {} for name in LLAMA_CPP_MIXES})
_K_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
DEFAULT_SHAPE = dict(
    hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2
)
LLAMA_CPP_SHAPE = dict(
    hidden_size=384, intermediate_size=512, num_heads=6, num_kv_heads=2, num_layers=2
)
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Families whose GGUF files write_moe_gguf writes, and the llama.cpp architecture of each (a Mixtral
# is a "llama" file with experts).
MOE_GGUF_ARCHITECTURES = {
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "gpt_oss": "gpt-oss",
    "qwen2_moe": "qwen2moe",
}
# gpt-oss's names where llama.cpp's converter gives them others than the Llama family's.
_GPT_OSS_GGUF_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
    "self_attn.sinks": "attn_sinks",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    stem, _, kind = name.rpartition(".")  # weight, or a Qwen2 q/k/v bias
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def write_random_qwen2(
    out_dir: Path,
    *,
    hidden_size,
    num_layers,
    num_heads,
    num_kv_heads,
    intermediate_size,
    tie=False,
    seed=0,
) -> Path:
    """A random Qwen2 checkpoint (Llama with Q/K/V biases, here random too), written by
    transformers' own classes with tests/conftest.py's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out_dir)
    specials = {
        t["content"]: t["id"]
        for t in json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=tie,
        use_sliding_window=False,
        bos_token_id=specials["<|im_start|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.5 if "embed" in name else 2.0 / param.shape[1] ** 0.5)
            elif name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows, columns = weight.shape
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, columns)
        .transpose(1, 2)
        .reshape(rows, columns)
    )


def _random_k_blocks(rows: int, k: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K blocks whose values are about N(0, 2 / sqrt(k)) in size."""
    target = 2.0 / np.sqrt(k)
    block_bytes = {"q4_k": 144, "q5_k": 176, "q6_k": 210}[qtype]
    raw = rng.integers(0, 256, size=(rows, k // 256, block_bytes), dtype=np.uint8)
    if qtype in ("q4_k", "q5_k"):  # d, dmin (f16), 12 bytes of 6-bit scales and mins, the values
        # Q5_K: dmin * min about d * scale * (the values' middle, 16): about zero-mean, as real
        # blocks (Q4_K's, kept as they were, lean positive).
        d_and_dmin = (
            [target / (32 * 8), target / (32 * 16)]
            if qtype == "q4_k"
            else [target / (32 * 16), target / 32]
        )
        scales = rng.uniform(0.5, 1.5, size=(rows, k // 256, 2)) * d_and_dmin
        raw[..., 0:4] = scales.astype(np.float16).view(np.uint8).reshape(rows, k // 256, 4)
    else:  # 128 + 64 bytes of 6-bit values, 16 int8 scales, d (f16) last
        d = rng.uniform(0.5, 1.5, size=(rows, k // 256, 1)) * target / (64 * 32)
        raw[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(rows, k // 256, 2)
    return raw.reshape(rows, -1)


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _preset_qtype(preset: str, name: str, layers: int) -> str:
    """A linear weight's type in `preset` (before the fallback for short rows)."""
    if preset in LLAMA_CPP_MIXES:
        layer = int(name.split(".")[2])
        more_bits = name.endswith(("v_proj.weight", "down_proj.weight")) and _use_more_bits(
            layer, layers
        )
        return "q6_k" if more_bits else LLAMA_CPP_MIXES[preset]
    default = "q4_k" if preset == "q4_k_m" else preset
    return next((q for fragment, q in PRESETS[preset].items() if f".{fragment}." in name), default)


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    """Header, metadata and tensors to the file; its path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensor_bytes(name: str, weight: torch.Tensor, qtype: str, rng):
    values = weight.float().numpy()
    if weight.shape[-1] % 256:
        qtype = _K_FALLBACK.get(qtype, qtype)
    if qtype.endswith("_k"):  # (stacked experts [experts, rows, k]: each expert's rows in turn)
        blocks = _random_k_blocks(int(np.prod(values.shape[:-1])), values.shape[-1], qtype, rng)
        return blocks.reshape(*values.shape[:-1], -1), getattr(T, qtype.upper())
    ggml_type = getattr(T, qtype.upper())
    return gguf.quants.quantize(values, ggml_type), ggml_type


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, pre: str = "default") -> None:
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in tokenizer["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    jinja = hf_dir / "chat_template.jinja"  # (Gemma's checkpoints keep it there)
    writer.add_chat_template(tokenizer_config.get("chat_template") or jinja.read_text())


def write_quantized_gguf(
    out_dir: Path,
    preset: str = "q4_1",
    *,
    tie: bool = True,
    seed: int = 0,
    embedding: str = "q8_0",
    head: str = "q6_k",
    arch: str = "llama",
    **shape,
) -> Path:
    """`out_dir`/model.gguf (and the HF checkpoint it came from in `out_dir`/hf). `embedding`:
    token_embd's type (the tied head's too); `head`: output.weight's when not tied. `arch`:
    "llama" (Q/K rows permuted as llama.cpp's converter does) or "qwen2" (a random Qwen2: Q/K/V
    biases in F32, rows in Hugging Face's order, the tokenizer's pre-tokenizer named "qwen2")."""
    shape = {**DEFAULT_SHAPE, **(LLAMA_CPP_SHAPE if preset in LLAMA_CPP_MIXES else {}), **shape}
    writer_of = write_random_qwen2 if arch == "qwen2" else write_random_llama
    hf_dir = writer_of(out_dir / "hf", tie=tie, seed=seed, **shape)
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(
        config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    )
    _add_tokenizer(writer, hf_dir, "qwen2" if arch == "qwen2" else "default")
    rng = np.random.default_rng(seed)
    for name, weight in weights.items():
        if name.endswith(("norm.weight", ".bias")):
            writer.add_tensor(_gguf_name(name), weight.float().numpy())
            continue
        if name.endswith("q_proj.weight") and arch == "llama":
            weight = _llama_cpp_permute(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight") and arch == "llama":
            weight = _llama_cpp_permute(weight, config["num_key_value_heads"])
        if name == "model.embed_tokens.weight":
            qtype = embedding
        elif name == "lm_head.weight":
            qtype = head
        else:
            qtype = _preset_qtype(preset, name, config["num_hidden_layers"])
        data, ggml_type = _tensor_bytes(name, weight, qtype, rng)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=ggml_type)
    return _finish(writer, path)


def _write_header(
    writer: gguf.GGUFWriter, config, rope_theta: float | None = None, rotary_dims: int | None = None
) -> None:
    """The Llama family's hyperparameters; `rope_theta` where config.rope_parameters has one per layer
    type (Gemma 3); `rotary_dims` where rotary takes part of a head (Phi-4-mini)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rotary_dims or head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta or config.rope_parameters["rope_theta"])


def write_moe_gguf(
    out_dir: Path,
    family: str,
    experts: str = "q4_1",
    others: str = "q8_0",
    *,
    seed: int = 0,
    expert_inter: int | None = None,
    num_experts: int | None = None,
) -> Path:
    """`out_dir`/model.gguf from a random Qwen3-MoE or Mixtral checkpoint (tests/models/
    moe_checkpoints.py, in `out_dir`/hf) as llama.cpp's converter lays one out: each layer's experts
    stacked in ffn_gate_exps / ffn_up_exps / ffn_down_exps ([experts, outputs, inputs]) of type
    `experts`, the router (ffn_gate_inp) and norms in F32, the other matrices of type `others`
    (the embedding Q8_0), Q/K rows permuted in a "llama" (Mixtral) file."""
    from transformers import AutoModelForCausalLM

    from tests.models.moe_checkpoints import EXPERT_INTER, NUM_EXPERTS, write_moe_checkpoint

    hf_dir = write_moe_checkpoint(
        out_dir / "hf",
        family,
        seed,
        expert_inter or EXPERT_INTER,
        num_experts or NUM_EXPERTS,
        dense_layers=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    config = model.config
    arch = MOE_GGUF_ARCHITECTURES[family]
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    if family == "gpt_oss":
        return _write_gpt_oss(
            writer, path, model, hf_dir, experts, others, np.random.default_rng(seed)
        )
    _write_header(writer, config)
    qwen = family in ("qwen3_moe", "qwen2_moe")
    writer.add_expert_count(config.num_experts if qwen else config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if qwen:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _add_tokenizer(writer, hf_dir, "qwen2" if qwen else "default")
    rng = np.random.default_rng(seed)

    def quantized(name, values, qtype):
        data, ggml_type = _tensor_bytes(name, values, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=ggml_type)

    for name, weight in model.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):  # [experts, gate rows then up rows, hidden]
            gate, up = weight.chunk(2, dim=1)
            quantized(f"blk.{layer}.ffn_gate_exps.weight", gate, experts)
            quantized(f"blk.{layer}.ffn_up_exps.weight", up, experts)
        elif name.endswith("experts.down_proj"):
            quantized(f"blk.{layer}.ffn_down_exps.weight", weight, experts)
        elif name.endswith(
            ("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight", ".bias")
        ):
            writer.add_tensor(_gguf_name(name), weight.float().numpy())
        else:
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (
                    config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                )
                weight = _llama_cpp_permute(weight, heads)
            quantized(_gguf_name(name), weight, "q8_0" if "embed" in name else others)
    return _finish(writer, path)


def _write_gpt_oss(
    writer: gguf.GGUFWriter, path: Path, model, hf_dir: Path, experts: str, others: str, rng
) -> Path:
    """A gpt-oss file as llama.cpp's converter writes one: the header plus the sliding window, YaRN
    and the experts' sizes; each layer's gate_up_proj ([experts, hidden, 2 inter], gate and up
    interleaved) split into ffn_gate_exps / ffn_up_exps ([experts, inter, hidden]) and down_proj
    transposed into ffn_down_exps, each of type `experts` (MXFP4 as llama.cpp's), their biases split
    the same way (F32); sinks (attn_sinks), router, norms and biases F32; the rest `others`."""
    config = model.config
    _write_header(writer, config)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    yarn = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(yarn["factor"])
    writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
    _add_tokenizer(writer, hf_dir, "default")

    def quantized(name, values, qtype):
        data, ggml_type = _tensor_bytes(name, values, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=ggml_type)

    for name, weight in model.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            quantized(
                f"blk.{layer}.ffn_gate_exps.weight",
                weight[:, :, ::2].transpose(1, 2).contiguous(),
                experts,
            )
            quantized(
                f"blk.{layer}.ffn_up_exps.weight",
                weight[:, :, 1::2].transpose(1, 2).contiguous(),
                experts,
            )
        elif name.endswith("experts.down_proj"):
            quantized(
                f"blk.{layer}.ffn_down_exps.weight", weight.transpose(1, 2).contiguous(), experts
            )
        elif name.endswith("experts.gate_up_proj_bias"):
            writer.add_tensor(
                f"blk.{layer}.ffn_gate_exps.bias", weight[:, ::2].contiguous().numpy()
            )
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", weight[:, 1::2].contiguous().numpy())
        elif name.endswith("experts.down_proj_bias"):
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", weight.numpy())
        elif layer is not None:
            stem, _, kind = name.rpartition(".")
            module = stem.split(".", 3)[3]
            if name.endswith(
                ".sinks"
            ):  # a parameter of its own: llama.cpp names it attn_sinks.weight
                module, kind = "self_attn.sinks", "weight"
            gguf_name = (
                f"blk.{layer}.{_GPT_OSS_GGUF_NAMES.get(module) or _GGUF_NAMES[module]}.{kind}"
            )
            if weight.dim() == 1 or "router" in name:
                writer.add_tensor(gguf_name, weight.float().numpy())
            else:
                quantized(gguf_name, weight, others)
        elif name.endswith("norm.weight"):
            writer.add_tensor(_gguf_name(name), weight.float().numpy())
        else:
            quantized(_gguf_name(name), weight, "q8_0" if "embed" in name else others)
    return _finish(writer, path)


def _dequantized_tensors(gguf_file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized by the gguf package: GGUF name -> float32 in torch's
    order of dims (GGUF lists them fastest first)."""
    tensors = {}
    for tensor in gguf.GGUFReader(gguf_file).tensors:
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        tensors[tensor.name] = torch.from_numpy(values.reshape(shape))
    return tensors


def dequantized_gpt_oss(gguf_file: Path):
    """transformers' gpt-oss (float32, CPU) holding a gpt-oss file's tensors dequantized by the gguf
    package: the experts and their biases put back into gate_up_proj's interleaved columns."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent / "hf"), dtype=torch.float32
    ).eval()
    names = {v: k for k, v in {**_GGUF_NAMES, **_GPT_OSS_GGUF_NAMES}.items()}
    tensors = _dequantized_tensors(gguf_file)
    state = {
        "model.embed_tokens.weight": tensors.pop("token_embd.weight"),
        "model.norm.weight": tensors.pop("output_norm.weight"),
        "lm_head.weight": tensors.pop("output.weight"),
    }
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        parts = {
            kind: tensors.pop(f"blk.{layer}.ffn_{kind}_exps.weight")
            for kind in ("gate", "up", "down")
        }
        biases = {
            kind: tensors.pop(f"blk.{layer}.ffn_{kind}_exps.bias")
            for kind in ("gate", "up", "down")
        }
        gate_up = torch.stack(
            [parts["gate"], parts["up"]], dim=2
        )  # [E, inter, 2, hidden]: interleaved rows
        state[prefix + "gate_up_proj"] = gate_up.flatten(1, 2).transpose(1, 2).contiguous()
        state[prefix + "gate_up_proj_bias"] = torch.stack(
            [biases["gate"], biases["up"]], dim=2
        ).flatten(1)
        state[prefix + "down_proj"] = parts["down"].transpose(1, 2).contiguous()
        state[prefix + "down_proj_bias"] = biases["down"]
    for name, values in tensors.items():
        _, layer, module, kind = name.split(".")
        hf_module = names[module]
        state[
            f"model.layers.{layer}.{hf_module}"
            if hf_module == "self_attn.sinks"
            else f"model.layers.{layer}.{hf_module}.{kind}"
        ] = values
    model.load_state_dict(state, strict=True)
    return model


# Gemma's names where llama.cpp's differ from the Llama family's (four norms a layer).
_GEMMA_GGUF_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gemma_gguf(out_dir: Path, family: str, qtype: str = "q4_1", seed: int = 0) -> Path:
    """`out_dir`/model.gguf from a random Gemma 2 or Gemma 3 (tests/models/family_checkpoints.py's
    "gemma2-gguf" / "gemma3-gguf", in `out_dir`/hf) as llama.cpp's converter writes one: every
    RMSNorm weight stored as 1 + w (F32), rows in HF's order, the embedding tied to the head (Q8_0),
    the sliding window, Gemma 2's soft-capping, Gemma 3's linear rope scaling of its global layers."""
    from transformers import AutoModelForCausalLM

    from tests.models.family_checkpoints import write_random_checkpoint

    hf_dir = write_random_checkpoint(out_dir / "hf", f"{family}-gguf", seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    config = model.config
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), family)
    rope = config.rope_parameters
    _write_header(writer, config, rope.get("full_attention", rope)["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    _add_tokenizer(writer, hf_dir, "default")
    state = {
        name: weight for name, weight in model.state_dict().items() if name != "lm_head.weight"
    }  # tied
    return _write_tensors(
        writer, path, state, _GEMMA_GGUF_NAMES, qtype, np.random.default_rng(seed), norm_shift=1.0
    )


def _write_tensors(
    writer: gguf.GGUFWriter,
    path: Path,
    state: dict,
    names: dict,
    qtype: str,
    rng,
    norm_shift: float = 0.0,
) -> Path:
    """A dense model's tensors under llama.cpp's names (`names`: a family's own, over _GGUF_NAMES),
    norms in F32 (plus `norm_shift`), the embedding Q8_0, the other matrices `qtype`; the file."""
    for name, weight in state.items():
        if name.startswith("model.layers."):
            stem, _, kind = name.rpartition(".")
            layer, module = stem.split(".", 3)[2:]
            gguf_name = f"blk.{layer}.{names.get(module) or _GGUF_NAMES[module]}.{kind}"
        else:
            gguf_name = _gguf_name(name)
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name, (weight.float() + norm_shift).numpy())
            continue
        data, ggml_type = _tensor_bytes(name, weight, "q8_0" if "embed" in name else qtype, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=ggml_type)
    return _finish(writer, path)


def write_phi3_gguf(
    out_dir: Path, family: str = "phi3", qtype: str = "q4_1", seed: int = 0
) -> Path:
    """`out_dir`/model.gguf from a random Phi-3 or Phi-4-mini (tests/models/family_checkpoints.py,
    in `out_dir`/hf) as llama.cpp's converter writes one: qkv_proj as attn_qkv and gate_up_proj as
    ffn_up (fused, rows in HF's order), rope.dimension_count the rotated part of a head, the
    sliding window, and Phi-4-mini's LongRoPE factors as rope_factors_short / rope_factors_long."""
    from transformers import AutoModelForCausalLM

    from tests.models.family_checkpoints import write_random_checkpoint

    hf_dir = write_random_checkpoint(out_dir / "hf", family, seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    config = model.config
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    _write_header(
        writer, config, rotary_dims=int(head_dim * rope.get("partial_rotary_factor", 1.0))
    )
    writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor(
            "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)
        )
        writer.add_tensor(
            "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        )
    _add_tokenizer(writer, hf_dir, "default")
    fused = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    return _write_tensors(
        writer, path, model.state_dict(), fused, qtype, np.random.default_rng(seed)
    )


def dequantized_phi3(gguf_file: Path):
    """transformers' Phi-3 (float32) holding a phi3 file's tensors dequantized by the gguf package."""
    from transformers import AutoModelForCausalLM

    from nanoserve.models.gguf.reader import ROPE_FACTOR_TENSORS, hf_tensor_name

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent / "hf"), dtype=torch.float32
    ).eval()
    state = {}
    for name, values in _dequantized_tensors(gguf_file).items():
        if name not in ROPE_FACTOR_TENSORS:
            state[hf_tensor_name(name, "phi3")] = values
    model.load_state_dict(state, strict=True)
    return model


def dequantized_gemma(gguf_file: Path):
    """transformers' Gemma 2 / 3 (float32) holding a Gemma file's tensors dequantized by the gguf
    package, each norm's stored 1 + w back to w."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent / "hf"), dtype=torch.float32
    ).eval()
    names = {v: k for k, v in {**_GGUF_NAMES, **_GEMMA_GGUF_NAMES}.items()}
    state = {}
    for gguf_name, values in _dequantized_tensors(gguf_file).items():
        if gguf_name.endswith("norm.weight"):
            values = values - 1
        if gguf_name.startswith("blk."):
            _, layer, module, kind = gguf_name.split(".")
            state[f"model.layers.{layer}.{names[module]}.{kind}"] = values
        else:
            state[
                {
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                }[gguf_name]
            ] = values
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def write_qwen3_gguf(out_dir: Path, qtype: str = "q4_1", seed: int = 0) -> Path:
    """`out_dir`/model.gguf from a random dense Qwen3 (tests/models/family_checkpoints.py, in
    `out_dir`/hf): per-head Q/K norms (attn_q_norm / attn_k_norm, F32), rows in Hugging Face's order."""
    from transformers import AutoModelForCausalLM

    from tests.models.family_checkpoints import write_random_checkpoint

    hf_dir = write_random_checkpoint(out_dir / "hf", "qwen3", seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    _write_header(writer, model.config)
    _add_tokenizer(writer, hf_dir, "qwen2")
    rng = np.random.default_rng(seed)
    for name, weight in model.state_dict().items():
        if name.endswith("norm.weight"):
            writer.add_tensor(_gguf_name(name), weight.float().numpy())
            continue
        data, ggml_type = _tensor_bytes(name, weight, "q8_0" if "embed" in name else qtype, rng)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=ggml_type)
    return _finish(writer, path)


def dequantized_transformers(gguf_file: Path):
    """transformers' Llama or Qwen2 (float32, CPU) holding the file's tensors dequantized by the
    gguf package (a llama file's Q/K rows un-permuted): the exact product of activations and dequantized weights,
    the arithmetic of the CUDA path (kernels/quant_triton.py), which quantizes no activations."""
    from transformers import AutoModelForCausalLM

    from nanoserve.models.gguf.reader import hf_tensor_name, unpermute_rotary_rows

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent / "hf"), dtype=torch.float32
    ).eval()
    config = model.config
    permuted = config.model_type in ("llama", "mixtral")
    state = {}
    gate_up: dict[str, dict] = {}  # a layer's stacked experts -> {0: gate, 1: up}
    for gguf_name, weight in _dequantized_tensors(gguf_file).items():
        kind = gguf_name.split(".")[-2]
        if kind.endswith(
            "_exps"
        ):  # transformers' stacked experts: gate_up_proj [E, 2 I, H], down_proj [E, H, I]
            prefix = f"model.layers.{gguf_name.split('.')[1]}.mlp.experts."
            if kind == "ffn_down_exps":
                state[prefix + "down_proj"] = weight
            else:
                gate_up.setdefault(prefix, {})[0 if kind == "ffn_gate_exps" else 1] = weight
            continue
        name = hf_tensor_name(gguf_name)
        if name.endswith("q_proj.weight") and permuted:
            weight = unpermute_rotary_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight") and permuted:
            weight = unpermute_rotary_rows(weight, config.num_key_value_heads)
        state[name] = weight
    for prefix, parts in gate_up.items():
        state[prefix + "gate_up_proj"] = torch.cat([parts[0], parts[1]], dim=1)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


@torch.inference_mode()
def assert_greedy_logprobs_match(model, llm, prompts: list[str], params) -> None:
    """The engine's greedy tokens on `prompts` teacher-forced through `model` (transformers on the
    file's dequantized tensors): every logprob within 1e-3 of the oracle's, each token its argmax."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    forced = teacher_forced(model, llm.get_tokenizer(), prompts, tokens)
    for prompt, ours, (rows, theirs) in zip(prompts, logprobs, forced):
        assert all(abs(a - b) < 1e-3 for a, b in zip(ours, theirs)), prompt
        assert all(row.max().item() - value < 1e-3 for row, value in zip(rows, theirs)), prompt


@torch.inference_mode()
def teacher_forced(model, tokenizer, prompts: list[str], tokens: list[list[int]]):
    """Per prompt, a transformers model fed the prompt and the engine's generated tokens: its
    log-softmax rows at the generated positions and each generated token's logprob in them
    (the oracle the quantized-serving tests hold the engine's logprobs to)."""
    out = []
    for prompt, generated in zip(prompts, tokens):
        prompt_ids = tokenizer.encode(prompt)
        log_softmax = torch.log_softmax(
            model(torch.tensor([prompt_ids + generated])).logits[0], dim=-1
        )
        rows = log_softmax[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)]
        out.append((rows, [row[token].item() for row, token in zip(rows, generated)]))
    return out
