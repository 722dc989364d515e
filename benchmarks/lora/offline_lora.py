"""Offline throughput with a LoRA adapter: nanoserve and vLLM-CPU on the same workload, the base
model and the model with an adapter on every request, each run in a process of its own.

    .venv/bin/python benchmarks/lora/offline_lora.py [--rank 16] [--rounds 2] [--engines nanoserve,vllm]

Writes a random PEFT adapter for the model (every projection of every layer, rank --rank, in the
layout peft saves) under --adapter-dir, then runs LLM.generate on --num-prompts random prompts of
--input-len tokens, --output-len greedy tokens each (ignore_eos), as ../shared/bench/offline.sh
does. vLLM-CPU runs from ../shared/bench/setup-vllm-cpu.sh's venv. Prints each run's output
tokens/s, then nanoserve / vLLM per mode and the adapter's cost (lora / base) per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", Path.home() / ".cache/vllm-cpu/venv/bin/python"))


def default_model() -> Path:
    home = Path(os.environ.get("NANOSERVE_HOME", Path.home() / ".cache/nanoserve"))
    return Path(os.environ.get("MODEL_DIR", home / "models/SmolLM2-135M-Instruct"))


def write_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int = 0) -> Path:
    """A random LoRA adapter over every q/k/v/o/gate/up/down projection, saved as peft saves one."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            ).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=generator) * 0.01
            ).bfloat16()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": sorted(m.split(".")[1] for m in shapes),
                "base_model_name_or_path": str(model_dir),
                "task_type": "CAUSAL_LM",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
            }
        )
    )
    return out_dir


def child(
    engine: str,
    model: str,
    adapter: str | None,
    rank: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
) -> None:
    """One engine, one mode, in this process: prints 'RESULT <output tokens/s>'."""
    import torch

    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        extra = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1} if adapter else {}
        llm = LLM(
            model=model, dtype="bfloat16", max_model_len=max(2048, input_len + output_len), **extra
        )
    else:
        from nanoserve import LLM, LoRARequest, SamplingParams

        extra = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1} if adapter else {}
        llm = LLM(model=model, dtype="bfloat16", **extra)
    lora = LoRARequest("bench", 1, adapter) if adapter else None
    vocab = llm.get_tokenizer().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": p}
        for p in torch.randint(100, vocab, (num_prompts, input_len), generator=generator).tolist()
    ]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=lora)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    elapsed = time.perf_counter() - started
    print(f"RESULT {sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed:.2f}", flush=True)


def run(engine: str, args, adapter: Path | None) -> float:
    python = str(VLLM_PYTHON) if engine == "vllm" else sys.executable
    command = [
        python,
        __file__,
        "--child",
        engine,
        "--model",
        str(args.model),
        "--rank",
        str(args.rank),
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
    ] + (["--adapter", str(adapter)] if adapter else [])
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(
            f"{engine} ({'lora' if adapter else 'base'}) failed:\n{result.stderr[-3000:]}"
        )
    return float(lines[-1].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model())
    parser.add_argument("--adapter-dir", type=Path, default=Path("/tmp/nanoserve-bench-lora"))
    parser.add_argument("--adapter", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engines", default="nanoserve,vllm")
    args = parser.parse_args()
    if args.child:
        child(
            args.child,
            str(args.model),
            args.adapter,
            args.rank,
            args.num_prompts,
            args.input_len,
            args.output_len,
        )
        return
    adapter = write_adapter(args.model, args.adapter_dir, args.rank)
    engines = args.engines.split(",")
    results: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):  # the engines and modes take turns in every round
        for engine in engines:
            for mode, path in (("base", None), ("lora", adapter)):
                value = run(engine, args, path)
                results.setdefault((engine, mode), []).append(value)
                print(
                    f"round {round_index + 1}: {engine:9s} {mode:4s} {value:8.1f} output tokens/s",
                    flush=True,
                )
    median = {key: statistics.median(values) for key, values in results.items()}
    print(
        f"\n{args.num_prompts} x ({args.input_len}, {args.output_len}), rank {args.rank} on every projection, "
        f"medians of {args.rounds} round(s)"
    )
    for engine in engines:
        print(
            f"{engine:9s} base {median[engine, 'base']:8.1f}  lora {median[engine, 'lora']:8.1f}  "
            f"lora / base {median[engine, 'lora'] / median[engine, 'base']:.2f}x"
        )
    if "nanoserve" in engines and "vllm" in engines:
        for mode in ("base", "lora"):
            print(
                f"nanoserve / vllm, {mode}: {median['nanoserve', mode] / median['vllm', mode]:.2f}x"
            )


if __name__ == "__main__":
    main()
