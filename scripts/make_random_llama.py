"""Write a random Llama checkpoint in Hugging Face layout (config.json, model.safetensors) with
the tokenizer files of a reference model dir, for benchmarks that need a shape SmolLM2 lacks
(e.g. head counts divisible by 2 for --tp 2). Only safetensors and torch are needed.

    python scripts/make_random_llama.py OUT_DIR [--tokenizer-from DIR] [--hidden 512 --heads 8 --kv-heads 2]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="copy tokenizer files from this dir (default: the imported SmolLM2)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer_dir = args.tokenizer_from
    if tokenizer_dir is None:
        from nanoserve.models.gguf_import import ensure_default_model

        tokenizer_dir = ensure_default_model()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, args.out_dir / name)
    head_dim = args.hidden // args.heads
    torch.manual_seed(args.seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols) / cols ** 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(args.vocab, args.hidden),
               "model.norm.weight": torch.ones(args.hidden, dtype=torch.bfloat16)}
    for i in range(args.layers):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": weight(args.heads * head_dim, args.hidden),
            prefix + "self_attn.k_proj.weight": weight(args.kv_heads * head_dim, args.hidden),
            prefix + "self_attn.v_proj.weight": weight(args.kv_heads * head_dim, args.hidden),
            prefix + "self_attn.o_proj.weight": weight(args.hidden, args.heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(args.intermediate, args.hidden),
            prefix + "mlp.up_proj.weight": weight(args.intermediate, args.hidden),
            prefix + "mlp.down_proj.weight": weight(args.hidden, args.intermediate),
            prefix + "input_layernorm.weight": torch.ones(args.hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(args.hidden, dtype=torch.bfloat16),
        })
    save_file(tensors, str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
        "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (args.out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(args.out_dir)


if __name__ == "__main__":
    main()
