"""Issue 28's offline target, measured in one process: the quantized file's output tokens/s over
the bf16 model's, 64 x (128, 128) greedy with ignore_eos, as nanoserve.bench.throughput runs it.
Both engines are loaded side by side and take turns, round after round, each round on fresh
random prompts (the same for both, so neither reads the other's prefix cache and both do the same
work); separate processes on a shared 2-core host drift by 10-20%, more than the effects measured
here. Prints every round, the medians and the ratio. Run on an idle machine:

    .venv/bin/python benchmarks/quant/offline_ratio.py [--rounds 4] [--quantized FILE.gguf] [--bf16 DIR]
        [--kv-cache-dtypes auto,fp8]

Defaults: the default model's Q4_1 file and its bf16 import (nanoserve.models.gguf.importer).
--kv-cache-dtypes with several values loads both models once per KV cache dtype (all engines take
turns in each round) and prints the quantized / bf16 ratio per dtype and each dtype's speed-up
over the first one's, per model.
"""

from __future__ import annotations

import argparse
import statistics

from nanoserve.bench.throughput import greedy_timed, random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", help="GGUF file (default: the default model's Q4_1 file)")
    parser.add_argument("--bf16", help="bf16 model directory (default: the default model's import)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help="comma-separated --kv-cache-dtype values"
    )
    args = parser.parse_args()
    kv_dtypes = args.kv_cache_dtypes.split(",")

    from nanoserve import LLM, SamplingParams
    from nanoserve.kernels.cpu import ops as cpu_ops
    from nanoserve.models.gguf.importer import ensure_default_gguf, ensure_default_model

    paths = {
        "bf16": args.bf16 or str(ensure_default_model()),
        "quantized": args.quantized or str(ensure_default_gguf()),
    }
    engines = {}
    for kv in kv_dtypes:
        for name, path in paths.items():
            label = name if kv == kv_dtypes[0] and len(kv_dtypes) == 1 else f"{name}/{kv}"
            engines[label] = LLM(model=path, dtype="bfloat16", kv_cache_dtype=kv)
    vocab = min(engine.llm_engine.model_config.vocab_size for engine in engines.values())
    for engine in engines.values():  # warm-up: kernels built, first pages touched
        engine.generate(
            [{"prompt_token_ids": [100, 200, 300]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
    print(f"# {cpu_ops.describe_isa()}")
    print(
        f"# {args.num_prompts} x ({args.input_len}, {args.output_len}); bf16: {paths['bf16']}; "
        f"quantized: {paths['quantized']}; KV cache: {', '.join(kv_dtypes)}"
    )
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=1000 + round_)
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for name in order:
            outputs, elapsed = greedy_timed(engines[name], prompts, args.output_len)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(tokens / elapsed)
            print(
                f"round {round_ + 1} {name:9s} {tokens / elapsed:7.1f} output tokens/s ({tokens} in {elapsed:.1f} s)",
                flush=True,
            )

    def compare(over: str, under: str, what: str) -> None:
        ratios = [a / b for a, b in zip(rates[over], rates[under])]
        print(
            f"{what}: median {statistics.median(rates[over]):.1f} over {statistics.median(rates[under]):.1f} "
            f"output tokens/s: {statistics.median(rates[over]) / statistics.median(rates[under]):.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
        )

    if len(kv_dtypes) == 1:
        compare("quantized", "bf16", "quantized / bf16")
        return
    for kv in kv_dtypes:
        compare(f"quantized/{kv}", f"bf16/{kv}", f"KV {kv}: quantized / bf16")
    for kv in kv_dtypes[1:]:
        for name in paths:
            compare(f"{name}/{kv}", f"{name}/{kv_dtypes[0]}", f"{name}: KV {kv} / {kv_dtypes[0]}")


if __name__ == "__main__":
    main()
