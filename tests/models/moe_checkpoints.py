"""Small random mixture-of-experts checkpoints in Hugging Face layout, written by transformers
itself (per-expert tensors, as the released Mixtral / Qwen-MoE / OLMoE checkpoints hold them;
gpt-oss's stacked, gate and up interleaved, with biases, attention sinks, YaRN and a sliding
window shorter than the tests' long prompts)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import build_tokenizer

SHAPE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_hidden_layers=2,
)
NUM_EXPERTS = 8
EXPERT_INTER = 32  # a multiple of 32: bf16 experts go through kernels/cpu/gemm*.cpp
# family -> top_k; Qwen3-MoE's 8 of 8 has every expert take every token.
MOE_FAMILIES = {"mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 8, "olmoe": 2, "gpt_oss": 2}


def moe_config(
    family: str,
    ids: dict,
    vocab: int,
    expert_inter: int = EXPERT_INTER,
    num_experts: int = NUM_EXPERTS,
    dense_layers: bool = True,
):
    import transformers as hf

    top_k = MOE_FAMILIES[family]
    if family == "mixtral":
        return hf.MixtralConfig(
            **SHAPE,
            **ids,
            intermediate_size=expert_inter,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            head_dim=16,
        ), hf.MixtralForCausalLM
    if family == "qwen2_moe":  # a shared expert; layer 1 dense (mlp_only_layers)
        return hf.Qwen2MoeConfig(
            **SHAPE,
            **ids,
            intermediate_size=96,
            moe_intermediate_size=expert_inter,
            shared_expert_intermediate_size=48 if dense_layers else 64,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=False,
            mlp_only_layers=[1] if dense_layers else [],
        ), hf.Qwen2MoeForCausalLM
    if family == "qwen3_moe":
        return hf.Qwen3MoeConfig(
            **SHAPE,
            **ids,
            intermediate_size=96,
            moe_intermediate_size=expert_inter,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            head_dim=16,
        ), hf.Qwen3MoeForCausalLM
    if family == "olmoe":
        return hf.OlmoeConfig(
            **SHAPE,
            **ids,
            intermediate_size=expert_inter,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=False,
        ), hf.OlmoeForCausalLM
    if family == "gpt_oss":
        yarn = {
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        }
        return hf.GptOssConfig(
            **SHAPE,
            **ids,
            intermediate_size=expert_inter,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            head_dim=16,
            sliding_window=8,
            rope_parameters=yarn,
        ), hf.GptOssForCausalLM
    raise ValueError(family)


def write_moe_checkpoint(
    out_dir: Path,
    family: str,
    seed: int = 0,
    expert_inter: int = EXPERT_INTER,
    num_experts: int = NUM_EXPERTS,
    dense_layers: bool = True,
) -> Path:
    """`dense_layers`: Qwen2-MoE's layer 1 dense (mlp_only_layers), as a GGUF file cannot say."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    specials = {
        t["content"]: t["id"]
        for t in json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    ids = dict(
        vocab_size=vocab,
        bos_token_id=specials["<|im_start|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
    )
    config, model_class = moe_config(family, ids, vocab, expert_inter, num_experts, dense_layers)
    torch.manual_seed(seed)
    model = model_class(config).float()
    # Large weights make greedy choices (and the router's) decisive; norms off 1.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.5 if "embed" in name else 2.0 / param.shape[-1] ** 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif family == "gpt_oss":  # biases (zero in transformers' init) and sinks
                param.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def assert_experts_hold(model, meaning: dict, qtype: str) -> None:
    """Every MoE layer of `model` (nanoserve's) keeps each expert's gate/up and down matrices as one
    QuantWeight of `qtype` each, no float copy, their values exactly `meaning`'s (the per-expert
    checkpoint names' float values, as the test writers save them)."""
    import torch

    from nanoserve.kernels import quant

    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert experts.w13_weight.is_meta and experts.w2_weight.is_meta
        for expert, (w13, w2) in enumerate(
            zip(experts.expert_weights.quantized("w13"), experts.expert_weights.quantized("w2"))
        ):
            assert w13.qtype == w2.qtype == qtype
            prefix = f"model.layers.{index}.mlp.experts.{expert}."
            gate_up = torch.cat(
                [meaning[prefix + "gate_proj.weight"], meaning[prefix + "up_proj.weight"]]
            )
            assert torch.equal(quant.dequantize_weight(w13), gate_up)
            assert torch.equal(quant.dequantize_weight(w2), meaning[prefix + "down_proj.weight"])
