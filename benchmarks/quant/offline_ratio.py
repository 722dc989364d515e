"""Issue 28's offline target, measured in one process: the quantized file's output tokens/s over
the bf16 model's, 64 x (128, 128) greedy with ignore_eos, as nanoserve.bench.throughput runs it.
Both engines are loaded side by side and take turns, round after round, each round on fresh
random prompts (the same for both, so neither reads the other's prefix cache and both do the same
work); separate processes on a shared 2-core host drift by 10-20%, more than the effects measured
here. Prints every round, the medians and the ratio. Run on an idle machine:

    .venv/bin/python benchmarks/quant/offline_ratio.py [--rounds 4] [--quantized FILE.gguf] [--bf16 DIR]

Defaults: the default model's Q4_1 file and its bf16 import (nanoserve.models.gguf_import).
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
    args = parser.parse_args()

    from nanoserve import LLM, SamplingParams
    from nanoserve.kernels import cpu_ops
    from nanoserve.models.gguf_import import ensure_default_gguf, ensure_default_model

    paths = {"bf16": args.bf16 or str(ensure_default_model()), "quantized": args.quantized or str(ensure_default_gguf())}
    engines = {name: LLM(model=path, dtype="bfloat16") for name, path in paths.items()}
    vocab = min(engine.llm_engine.model_config.vocab_size for engine in engines.values())
    for engine in engines.values():  # warm-up: kernels built, first pages touched
        engine.generate([{"prompt_token_ids": [100, 200, 300]}], SamplingParams(max_tokens=2), use_tqdm=False)
    print(f"# {cpu_ops.describe_isa()}")
    print(f"# {args.num_prompts} x ({args.input_len}, {args.output_len}); bf16: {paths['bf16']}; "
          f"quantized: {paths['quantized']}")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=1000 + round_)
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for name in order:
            outputs, elapsed = greedy_timed(engines[name], prompts, args.output_len)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(tokens / elapsed)
            print(f"round {round_ + 1} {name:9s} {tokens / elapsed:7.1f} output tokens/s ({tokens} in {elapsed:.1f} s)",
                  flush=True)
    bf16, quantized = (statistics.median(rates[name]) for name in ("bf16", "quantized"))
    ratios = [q / b for q, b in zip(rates["quantized"], rates["bf16"])]
    print(f"median bf16 {bf16:.1f}, quantized {quantized:.1f} output tokens/s: {quantized / bf16:.2f}x "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
