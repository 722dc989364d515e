"""Pipeline against tensor parallelism (and neither) on one workload: output tokens/s, weights and
KV blocks per rank, and what the stage hand-offs cost. Every configuration must give the same
greedy tokens (exit 1 otherwise). On a CPU the ranks share the cores, so this measures the cost of
the communication, not a speed-up; on GPUs (`--device cuda`, 2+ GPUs) it measures the real thing.

    python -m nanoserve.bench.pipeline --configs tp1 pp2 --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from nanoserve.bench.throughput import greedy_timed, random_prompts


def parse_config(text: str) -> tuple[int, int]:
    """'tp2pp2' → (2, 2); 'pp2' → (1, 2); 'tp1' → (1, 1)."""
    match = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", text)
    if not match or not text:
        raise argparse.ArgumentTypeError(f"expected tpN, ppN or tpNppM, got {text!r}")
    return int(match.group(1) or 1), int(match.group(2) or 1)


def run_config(
    model_dir: str,
    prompts,
    output_len: int,
    dtype: str,
    device: str,
    tp: int,
    pp: int,
    **engine_args,
) -> tuple[dict, list]:
    from nanoserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        device=device,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **engine_args,
    )
    load_s = time.perf_counter() - started
    llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False
    )  # warm-up
    engine = llm.llm_engine
    pipeline = engine.runner.pipeline
    if pipeline is not None:
        pipeline.steps_launched, pipeline.handoff_bytes, pipeline.wait_seconds = 0, 0, 0.0
    outputs, elapsed = greedy_timed(llm, prompts, output_len)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "rank_weight_bytes": list(engine.runner.rank_weight_bytes),
        "kv_blocks_per_rank": engine.runner.num_kv_blocks,
    }
    if pipeline is not None and pipeline.steps_launched:
        steps = pipeline.steps_launched
        result.update(
            steps=steps,
            handoff_kib_per_step=pipeline.handoff_bytes / steps / 1024,
            driver_wait_ms_per_step=1e3 * pipeline.wait_seconds / steps,
        )
    tokens = [o.outputs[0].token_ids for o in outputs]
    llm.shutdown()
    return result, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nanoserve.bench.pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model dir (default: the imported SmolLM2)")
    parser.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        default=[(1, 1), (1, 2)],
        help="tpN / ppN / tpNppM, run in this order (default: tp1 pp2)",
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--kv-cache-memory", type=float, default=None, help="CPU: GiB of KV pool per rank"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path for the results")
    args = parser.parse_args(argv)

    model_dir = args.model
    if model_dir is None:
        from nanoserve.models.gguf.importer import ensure_default_model

        model_dir = str(ensure_default_model())
    from nanoserve.models.config import ModelConfig

    prompts = random_prompts(
        args.num_prompts, args.input_len, ModelConfig.from_dir(model_dir).vocab_size, args.seed
    )
    engine_args = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}
    results, reference, same = [], None, True
    for tp, pp in args.configs:
        result, tokens = run_config(
            model_dir, prompts, args.output_len, args.dtype, args.device, tp, pp, **engine_args
        )
        reference = tokens if reference is None else reference
        result["same_tokens_as_first"] = tokens == reference
        same &= tokens == reference
        results.append(result)
        extra = ""
        if "steps" in result:
            extra = (
                f"; hand-off {result['handoff_kib_per_step']:.0f} KiB/step, driver waits "
                f"{result['driver_wait_ms_per_step']:.1f} ms/step over {result['steps']} steps"
            )
        print(
            f"tp={tp} pp={pp}: {result['output_tokens_per_s']:.1f} output tokens/s ({result['output_tokens']} "
            f"tokens in {result['elapsed_s']:.1f} s; weights per rank "
            f"{[round(b / 2**20) for b in result['rank_weight_bytes']]} MiB, "
            f"{result['kv_blocks_per_rank']} KV blocks per rank{extra})",
            flush=True,
        )
    report = {
        "workload": {
            "model": model_dir,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dtype": args.dtype,
            "ignore_eos": True,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": args.device
            if args.device != "auto"
            else ("cuda" if torch.cuda.is_available() else "cpu"),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        },
        "command": "python -m nanoserve.bench.pipeline "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "results": results,
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    if not same:
        print("error: the configurations gave different greedy tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
