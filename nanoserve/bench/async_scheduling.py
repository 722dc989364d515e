"""--async-scheduling on a device (scripts/gpu_check.sh's async-scheduling stage): the same
greedy tokens as without it, and the offline speed of both.

    python3 -m nanoserve.bench.async_scheduling --model DIR --name smollm2 --work DIR [--smoke]

tokens: one batch of prompts of different lengths, ending at different steps (max_tokens, EOS),
  on two fp32 engines that differ in the flag only (CUDA graphs on): the tokens must be equal.
throughput: 64 prompts x 128 output tokens in the model's dtype, output tokens per second with
  and without the flag, and the steps that overlapped (engine/async_scheduling.py's StepLog).
--smoke: the tokens check only, tiny, on a CPU, to check this script without a GPU (its tok/s,
  from that check's runs, mean nothing: the CPU's "device" is the same cores). Writes WORK/async_scheduling-NAME.json, which
  nanoserve.bench.gpu_report merges with the other stages.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams


def _prompts(vocab_size: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 200))]}
        for _ in range(count)
    ]


def _run(model: str, async_scheduling: bool, dtype: str, count: int, params) -> dict:
    """One engine: its outputs' tokens, the timed run's seconds and its step counts."""
    kwargs = (
        {"gpu_memory_utilization": 0.4} if torch.cuda.is_available() else {"num_kv_blocks": 512}
    )
    with LLM(model=model, dtype=dtype, async_scheduling=async_scheduling, **kwargs) as llm:
        prompts = _prompts(llm.llm_engine.model_config.vocab_size, count, seed=0)
        batch = params(len(prompts))
        llm.generate(prompts[:2], batch[:2], use_tqdm=False)  # warm-up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts, batch, use_tqdm=False)
        seconds = time.perf_counter() - started
        scheduling = llm.llm_engine.async_scheduling
        log = scheduling.log if scheduling is not None else None
        result = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "seconds": seconds,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "steps": log.num_launched if log else None,
            "overlapped_steps": log.num_overlapped if log else None,
        }
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _mixed(count: int, longest: int) -> list[SamplingParams]:
    """Greedy requests ending at different steps: max_tokens from 8 up, every third by EOS."""
    return [
        SamplingParams(temperature=0, max_tokens=8 + (i * 7) % (longest - 7), ignore_eos=i % 3 != 0)
        for i in range(count)
    ]


def check(args) -> dict:
    count, longest = (8, 16) if args.smoke else (48, 96)
    runs = {flag: _run(args.model, flag, "float32", count, lambda n: _mixed(n, longest))
            for flag in (False, True)}  # fmt: skip
    mismatches = sum(a != b for a, b in zip(runs[False]["tokens"], runs[True]["tokens"]))
    if not args.smoke:  # the speed in the model's own dtype, with one length for all
        for flag in (False, True):
            runs[flag] = _run(
                args.model,
                flag,
                "auto",
                64,
                lambda n: [SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)] * n,
            )
    tokens_per_s = {
        "async_scheduling" if flag else "sync": run["output_tokens"] / run["seconds"]
        for flag, run in runs.items()
    }
    overlapped = runs[True]["overlapped_steps"], runs[True]["steps"]
    return {
        "ok": mismatches == 0 and overlapped[0] > 0,
        "token_mismatches": mismatches,
        "requests": len(runs[False]["tokens"]),
        "output_tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s["async_scheduling"] / tokens_per_s["sync"],
        "overlapped_steps": overlapped[0],
        "steps": overlapped[1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--name", required=True, help="the model's name in the report")
    parser.add_argument("--work", required=True, help="directory for async_scheduling-NAME.json")
    parser.add_argument("--smoke", action="store_true", help="tiny workloads on a CPU")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "nanoserve.bench.async_scheduling: no CUDA device (--smoke: on a CPU)", file=sys.stderr
        )
        return 2
    started = time.perf_counter()
    try:
        result = check(args)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr)
    result.update(stage="async_scheduling", name=args.name, model=args.model)
    result["seconds"] = time.perf_counter() - started
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / f"async_scheduling-{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"async_scheduling {args.name}: {'ok' if result['ok'] else 'FAILED'} {json.dumps(result)}"
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
