"""Write a random Llama checkpoint in Hugging Face layout (config.json, model.safetensors) with
the tokenizer files of a reference model dir, for benchmarks that need a shape SmolLM2 lacks
(e.g. head counts divisible by 2 for --tp 2). Only safetensors and torch are needed.

    python scripts/make_random_llama.py OUT_DIR [--tokenizer-from DIR] [--hidden 512 --heads 8 --kv-heads 2]
    python scripts/make_random_llama.py OUT_DIR --shape llama-3.2-1b --device cuda

--shape takes a real model's shape (throughput depends on the shape, not on the weights);
explicit flags override it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_SHAPE = {
    "hidden": 512,
    "intermediate": 1536,
    "layers": 30,
    "heads": 8,
    "kv_heads": 2,
    "vocab": 49152,
    "rope_theta": 100000.0,
}
SHAPES = {
    "smollm2-135m": {
        "hidden": 576,
        "intermediate": 1536,
        "layers": 30,
        "heads": 9,
        "kv_heads": 3,
        "vocab": 49152,
        "rope_theta": 100000.0,
    },
    "llama-3.2-1b": {
        "hidden": 2048,
        "intermediate": 8192,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 128256,
        "rope_theta": 500000.0,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="copy tokenizer files from this dir (default: the imported SmolLM2)",
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="a real model's shape"
    )
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--rope-theta", type=float, default=None)
    parser.add_argument("--max-position", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cpu", help="where to draw the weights (cuda is faster)"
    )
    args = parser.parse_args()
    for name, value in (SHAPES[args.shape] if args.shape else DEFAULT_SHAPE).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    tokenizer_dir = args.tokenizer_from
    if tokenizer_dir is None:
        from nanoserve.models.gguf.importer import ensure_default_model

        tokenizer_dir = ensure_default_model()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, args.out_dir / name)
    head_dim = args.hidden // args.heads
    generator = torch.Generator(device=args.device).manual_seed(args.seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        drawn = torch.randn(rows, cols, generator=generator, device=args.device) / cols**0.5
        return drawn.to(torch.bfloat16).cpu()

    tensors = {
        "model.embed_tokens.weight": weight(args.vocab, args.hidden),
        "model.norm.weight": torch.ones(args.hidden, dtype=torch.bfloat16),
    }
    for i in range(args.layers):
        prefix = f"model.layers.{i}."
        tensors.update(
            {
                prefix + "self_attn.q_proj.weight": weight(args.heads * head_dim, args.hidden),
                prefix + "self_attn.k_proj.weight": weight(args.kv_heads * head_dim, args.hidden),
                prefix + "self_attn.v_proj.weight": weight(args.kv_heads * head_dim, args.hidden),
                prefix + "self_attn.o_proj.weight": weight(args.hidden, args.heads * head_dim),
                prefix + "mlp.gate_proj.weight": weight(args.intermediate, args.hidden),
                prefix + "mlp.up_proj.weight": weight(args.intermediate, args.hidden),
                prefix + "mlp.down_proj.weight": weight(args.hidden, args.intermediate),
                prefix + "input_layernorm.weight": torch.ones(args.hidden, dtype=torch.bfloat16),
                prefix + "post_attention_layernorm.weight": torch.ones(
                    args.hidden, dtype=torch.bfloat16
                ),
            }
        )
    save_file(tensors, str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (args.out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(args.out_dir)


if __name__ == "__main__":
    main()
