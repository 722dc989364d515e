"""Prompt throughput on long prompts, in one process: N random prompts of L tokens (16 greedy
output tokens each) through LLM.generate, `--repeats` times with fresh prompts (no prefix-cache
hits), after a warm-up; prints prompt tokens/s and the CPU kernels in use. To compare two commits,
run it at each (the CPU kernels are built per source, so both builds stay cached) on an idle machine:

    .venv/bin/python benchmarks/vllm-cpu/bench_long_prompts.py            # default model, 8 x 1900
    .venv/bin/python benchmarks/vllm-cpu/bench_long_prompts.py --num-prompts 16 --input-len 1900 --model DIR
"""

from __future__ import annotations

import argparse

from nanoserve import LLM
from nanoserve.bench.throughput import greedy_timed, random_prompts
from nanoserve.engine.startup import resolve_model_dir
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.models.config import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=1900)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    llm = LLM(model=str(model_dir), dtype="bfloat16")
    greedy_timed(llm, random_prompts(2, 256, vocab_size, seed=0), 16)  # warm-up
    print(cpu_ops.describe_isa())
    for repeat in range(1, args.repeats + 1):
        _, seconds = greedy_timed(
            llm, random_prompts(args.num_prompts, args.input_len, vocab_size, seed=repeat), 16
        )
        print(
            f"{args.num_prompts} x ({args.input_len}, 16): {seconds:.2f} s, "
            f"{args.num_prompts * args.input_len / seconds:.0f} prompt tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
