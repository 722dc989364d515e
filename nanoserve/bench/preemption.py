"""A preemption storm: many long requests over a KV pool far too small for them, run once with
--preemption-mode recompute and once with swap, in this process one after the other. Prints and
writes (JSON) each mode's time, output tokens/s, preemptions and swap traffic, and checks that
both modes gave the same greedy tokens.

    nanoserve bench preemption --num-prompts 24 --input-len 192 --output-len 64 \\
        --num-kv-blocks 96 --out benchmarks/preemption/smollm2-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from nanoserve.bench.throughput import greedy_timed, random_prompts


def run_mode(args: argparse.Namespace, prompts: list[list[int]], mode: str) -> tuple[dict, list]:
    from nanoserve import LLM, SamplingParams

    engine_args = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=mode,
        swap_space=args.swap_space,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    with LLM(**engine_args) as llm:
        llm.generate(
            [{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
        engine = llm.llm_engine
        before = engine.stats()
        outputs, elapsed = greedy_timed(llm, prompts, args.output_len)
        stats = engine.stats()
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {
            "preemption_mode": mode,
            "elapsed_s": round(elapsed, 3),
            "output_tokens": generated,
            "output_tokens_per_s": round(generated / elapsed, 2),
            "preemptions": stats.num_preemptions_total - before.num_preemptions_total,
            "swap_outs": stats.num_swap_outs_total - before.num_swap_outs_total,
        }
        swapper = engine.runner.swapper
        if swapper is not None:
            block_bytes = engine.runner._kv_bytes_per_block()
            result.update(
                host_pool_blocks=engine.host_pool.num_blocks,
                blocks_swapped_out=swapper.blocks_swapped_out,
                blocks_swapped_in=swapper.blocks_swapped_in,
                swapped_gib=round(
                    (swapper.blocks_swapped_out + swapper.blocks_swapped_in)
                    * block_bytes
                    / (1 << 30),
                    4,
                ),
                swap_s=round(swapper.swap_seconds, 3),
            )
        return result, [o.outputs[0].token_ids for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanoserve bench preemption", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=96, help="the (small) device pool, in blocks"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--swap-space", type=float, default=1.0, help="GiB for the host pool (swap mode)"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(recompute finds a preempted prompt's blocks while they stay cached)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from nanoserve.engine.startup import resolve_model_dir
    from nanoserve.models.config import ModelConfig

    args.model = str(resolve_model_dir(args.model))
    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    results = []
    tokens = {}
    for mode in ("recompute", "swap"):
        result, tokens[mode] = run_mode(args, prompts, mode)
        print(json.dumps(result), flush=True)
        results.append(result)
    same = tokens["recompute"] == tokens["swap"]
    summary = {
        "workload": {
            k: getattr(args, k)
            for k in (
                "model",
                "dtype",
                "device",
                "num_prompts",
                "input_len",
                "output_len",
                "num_kv_blocks",
                "max_num_batched_tokens",
                "swap_space",
                "enable_prefix_caching",
                "seed",
            )
        },
        "machine": {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0))},
        "results": results,
        "same_tokens": same,
        "swap_speedup": round(results[0]["elapsed_s"] / results[1]["elapsed_s"], 3),
    }
    print(
        f"recompute {results[0]['elapsed_s']} s, swap {results[1]['elapsed_s']} s "
        f"(x{summary['swap_speedup']}); same tokens: {same}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
