"""A random bf16 checkpoint of gpt-oss-20b's shape (hidden 2880, 64 query heads and 8 KV heads of
64, 32 experts of intermediate 2880, top-4, sliding window 128 on every other layer, YaRN) cut to
--layers decoder layers and a smaller vocabulary, in transformers' layout (stacked experts, gate
and up interleaved), for benchmarks/quant/gptq_awq.py (`--models bf16,mxfp4`: the MXFP4 copy is
written there, as OpenAI's checkpoints hold the experts). Not a test.

    .venv/bin/python benchmarks/moe/gpt_oss_checkpoint.py /tmp/gpt-oss-2l --layers 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

GPT_OSS_20B = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
)


def write_gpt_oss(out_dir: Path, layers: int, vocab_size: int = 32000, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    from benchmarks.moe.bench_moe import write_tokenizer

    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    s = GPT_OSS_20B
    hidden, inter, experts, head_dim = (
        s["hidden_size"],
        s["intermediate_size"],
        s["num_local_experts"],
        s["head_dim"],
    )
    q_size, kv_size = s["num_attention_heads"] * head_dim, s["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": randn(vocab_size, hidden, scale=0.02),
        "lm_head.weight": randn(vocab_size, hidden, scale=hidden**-0.5),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            tensors[p + f"self_attn.{name}.weight"] = randn(rows, hidden, scale=hidden**-0.5)
            tensors[p + f"self_attn.{name}.bias"] = randn(rows, scale=0.02)
        tensors[p + "self_attn.o_proj.weight"] = randn(hidden, q_size, scale=q_size**-0.5)
        tensors[p + "self_attn.o_proj.bias"] = randn(hidden, scale=0.02)
        tensors[p + "self_attn.sinks"] = randn(s["num_attention_heads"])
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "mlp.router.weight"] = randn(experts, hidden, scale=hidden**-0.5)
        tensors[p + "mlp.router.bias"] = randn(experts, scale=0.02)
        tensors[p + "mlp.experts.gate_up_proj"] = randn(
            experts, hidden, 2 * inter, scale=hidden**-0.5
        )
        tensors[p + "mlp.experts.gate_up_proj_bias"] = randn(experts, 2 * inter, scale=0.02)
        tensors[p + "mlp.experts.down_proj"] = randn(experts, inter, hidden, scale=inter**-0.5)
        tensors[p + "mlp.experts.down_proj_bias"] = randn(experts, hidden, scale=0.02)
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **s,
        "num_hidden_layers": layers,
        "vocab_size": vocab_size,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "swiglu_limit": 7.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 1,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out_dir, vocab_size)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()
    print(write_gpt_oss(args.out_dir, args.layers, args.vocab_size))


if __name__ == "__main__":
    main()
