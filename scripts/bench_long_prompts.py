"""Prompt throughput on long prompts, in one process: N fresh random prompts of L tokens (16
greedy output tokens each) through LLM.generate, twice, after a warm-up; prints prompt tokens/s
and the CPU kernels in use. To compare two commits, run it at each (the CPU kernels are built per
source, so both builds stay cached) on an idle machine:

    .venv/bin/python scripts/bench_long_prompts.py            # default model, 8 x 1900
    .venv/bin/python scripts/bench_long_prompts.py --num-prompts 16 --input-len 1900 --model DIR
"""
from __future__ import annotations

import argparse
import random
import time

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=1900)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="bfloat16") if args.model else LLM(dtype="bfloat16")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def prompts(n: int, length: int) -> list[dict]:  # fresh each time: no prefix-cache hits
        return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(n)]

    llm.generate(prompts(2, 256), params, use_tqdm=False)
    print(cpu_ops.describe_isa())
    for _ in range(args.repeats):
        batch = prompts(args.num_prompts, args.input_len)
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(f"{args.num_prompts} x ({args.input_len}, 16): {seconds:.2f} s, "
              f"{args.num_prompts * args.input_len / seconds:.0f} prompt tok/s", flush=True)


if __name__ == "__main__":
    main()
