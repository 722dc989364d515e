"""Offline tokens/s of the fused MoE path against the reference loop over experts, on a random
model of OLMoE-1B-7B's shape (64 experts, top-8, hidden 2048, expert intermediate 1024, 16
heads) cut to fewer layers, in one process: the same engine, the same prompts, only the experts'
implementation swapped (kernels/fused_moe.py's grouped CPU path / Triton kernel vs
fused_experts_reference). Not a test: nothing here is timed in CI.

    python benchmarks/moe/bench_moe.py --layers 4 --num-prompts 32 --input-len 128 --output-len 64
    python benchmarks/moe/bench_moe.py --tiny   # a few seconds: checks the script runs

Writes benchmarks/moe/<shape>-<dtype>-<device>.json unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

OLMOE_1B_7B = dict(
    hidden_size=2048,
    intermediate_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=50304,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
)


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id, so every id the model samples decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "t1", "bos_token": "t0", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )


def write_checkpoint(out_dir: Path, shape: dict, layers: int, seed: int = 0) -> Path:
    """Random bf16 weights in OLMoE's checkpoint layout (per-expert tensors)."""
    from safetensors.torch import save_file

    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden, inter, heads = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_attention_heads"],
    )
    generator = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) / cols**0.5).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    tensors = {
        "model.embed_tokens.weight": weight(shape["vocab_size"], hidden),
        "model.norm.weight": ones(hidden),
        "lm_head.weight": weight(shape["vocab_size"], hidden),
    }
    kv = shape["num_key_value_heads"] * hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": weight(hidden, hidden),
                p + "self_attn.k_proj.weight": weight(kv, hidden),
                p + "self_attn.v_proj.weight": weight(kv, hidden),
                p + "self_attn.o_proj.weight": weight(hidden, hidden),
                p + "self_attn.q_norm.weight": ones(hidden),
                p + "self_attn.k_norm.weight": ones(kv),
                p + "input_layernorm.weight": ones(hidden),
                p + "post_attention_layernorm.weight": ones(hidden),
                p + "mlp.gate.weight": weight(shape["num_experts"], hidden),
            }
        )
        for e in range(shape["num_experts"]):
            tensors.update(
                {
                    f"{p}mlp.experts.{e}.gate_proj.weight": weight(inter, hidden),
                    f"{p}mlp.experts.{e}.up_proj.weight": weight(inter, hidden),
                    f"{p}mlp.experts.{e}.down_proj.weight": weight(hidden, inter),
                }
            )
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        **shape,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 1,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out_dir, shape["vocab_size"])
    return out_dir


def unpack_experts(llm) -> None:
    """The loop over experts multiplies the expert matrices as they are: read them back once from
    the CPU packing, which is otherwise their only copy (layers/fused_moe.FusedMoE.prepack_gemm)."""
    from torch import nn

    from nanoserve.kernels.fused_moe import unpacked_experts
    from nanoserve.layers.fused_moe import FusedMoE

    for layer in llm.llm_engine.runner.model.modules():
        if isinstance(layer, FusedMoE) and layer.packed is not None:
            layer.w13_weight = nn.Parameter(
                unpacked_experts(layer.w13_weight, layer.packed[0]), requires_grad=False
            )
            layer.w2_weight = nn.Parameter(
                unpacked_experts(layer.w2_weight, layer.packed[1]), requires_grad=False
            )


def run(
    model_dir: Path, implementation: str, prompts, output_len: int, dtype: str, device: str
) -> dict:
    """One engine with the experts on `implementation` ("fused" or "reference"); output tok/s."""
    import nanoserve.kernels.fused_moe as fused_moe
    from nanoserve import LLM, SamplingParams

    saved = fused_moe.fused_experts_grouped, fused_moe.fused_experts_triton
    if (
        implementation == "reference"
    ):  # only the experts: attention, norms and GEMMs stay as they are
        reference = lambda *args, **kwargs: fused_moe.fused_experts_reference(*args[:5])  # noqa: E731
        fused_moe.fused_experts_grouped = fused_moe.fused_experts_triton = reference
    try:
        llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            device=device,
            max_model_len=1024,
            disable_log_stats=True,
        )
        if implementation == "reference":
            unpack_experts(llm)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False
        )  # warm-up
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        llm.shutdown()
    finally:
        fused_moe.fused_experts_grouped, fused_moe.fused_experts_triton = saved
    tokens = [o.outputs[0].token_ids for o in outputs]
    generated = sum(len(t) for t in tokens)
    del llm
    gc.collect()
    return {
        "implementation": implementation,
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/nanoserve-bench-olmoe"))
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (OLMoE-1B-7B has 16)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny shape and workload: checks the script runs"
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else OLMOE_1B_7B
    if args.tiny:
        args.layers, args.num_prompts, args.input_len, args.output_len = 2, 4, 16, 8
        args.model_dir = args.model_dir.with_name(args.model_dir.name + "-tiny")
    model_dir = write_checkpoint(args.model_dir / f"{args.layers}l", shape, args.layers)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        2, shape["vocab_size"], (args.num_prompts, args.input_len), generator=generator
    ).tolist()
    results = [
        run(model_dir, implementation, prompts, args.output_len, args.dtype, args.device)
        for implementation in ("fused", "reference")
    ]
    fused, reference = results
    same = sum(a == b for a, b in zip(fused.pop("tokens"), reference.pop("tokens")))
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    report = {
        "shape": "tiny" if args.tiny else "olmoe-1b-7b",
        **shape,
        "layers": args.layers,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "device": device,
        "machine": platform.processor() or platform.machine(),
        "cuda_device": torch.cuda.get_device_name() if device == "cuda" else None,
        "results": results,
        "speedup": fused["output_tokens_per_s"] / reference["output_tokens_per_s"],
        "prompts_with_identical_tokens": same,
    }
    for r in results:
        print(
            f"{r['implementation']:>9}: {r['output_tokens_per_s']:8.1f} output tok/s ({r['elapsed_s']:.2f} s)"
        )
    print(
        f"fused / reference: {report['speedup']:.2f}x; identical outputs {same}/{args.num_prompts}"
    )
    output = args.output or Path(__file__).with_name(
        f"{report['shape']}-{args.dtype}-{device}.json"
    )
    output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
