"""End-to-end checks of the engine on a CUDA device, one stage per subcommand, so that
scripts/gpu_check.sh can give each its own time limit. Each stage writes WORK/<stage>-<name>.json;
`nanoserve.bench.gpu_report` merges them into e2e.json and e2e.md.

    python3 -m nanoserve.bench.gpu_e2e tokens --model DIR --name smollm2 --work DIR
    python3 -m nanoserve.bench.gpu_e2e memory --model DIR --name smollm2 --work DIR
    python3 -m nanoserve.bench.gpu_e2e throughput --model DIR --name llama-3.2-1b --work DIR

tokens: greedy tokens of the engine on CUDA in fp32 (eager, and with CUDA graphs) against the
  CPU reference path, and against transformers where it is installed; bf16 eager against
  bf16 with graphs is reported, not checked.
memory: the KV pool against --gpu-memory-utilization and the device's free memory.
throughput: offline decode speed at batch 1 (TPOT) and at batch 64, eager and with graphs.
--smoke: tiny workloads on a CPU, to check this script without a GPU (graphs are CUDA-only).
Imports nothing from nanoserve.server: it runs where msgspec and httptools are missing.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from nanoserve.bench.throughput import greedy_timed

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef normalize(x):",
    "The first law of thermodynamics states that",
    "Here is a recipe for pancakes:",
]
GIB = 1 << 30


def cuda_device(args) -> str:
    return "cpu" if args.smoke else "cuda"


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_llm(args, **kwargs):
    from nanoserve import LLM
    from nanoserve.models.config import ModelConfig

    kwargs.setdefault("device", cuda_device(args))
    if "max_model_len" in kwargs:  # no longer than the model allows
        longest = ModelConfig.from_dir(args.model).max_position_embeddings
        kwargs["max_model_len"] = min(kwargs["max_model_len"], longest)
    return LLM(model=args.model, seed=0, **kwargs)


def greedy(llm, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from nanoserve import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_mismatches(got: list[list[int]], want: list[list[int]]) -> list[dict]:
    """Per prompt that differs: its index and the first position where the tokens differ."""
    found = []
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            position = next(
                (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
            )
            found.append({"prompt": index, "position": position})
    return found


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int, device: str) -> list[int]:
    """transformers' own greedy decoding with its KV cache (no EOS handling)."""
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < num_tokens:
        out = model(
            input_ids=torch.tensor([[tokens[-1]]], device=device),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def stage_tokens(args) -> dict:
    engine = {"num_kv_blocks": 512, "max_model_len": 1024, "max_num_seqs": 16}
    reference_llm = make_llm(args, dtype="float32", device="cpu", **engine)
    tokenizer = reference_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in TEXT_PROMPTS]
    longest = 10 if args.smoke else 40
    # Different lengths: the decode batch shrinks from 8 to 1 through every captured size,
    # padded on the way (7 rows to 8, 3 to 4...).
    max_tokens = [longest - (longest // 10) * i for i in range(len(prompts))]
    runs = {"cpu_reference_fp32": greedy(reference_llm, prompts, max_tokens)}
    del reference_llm
    release()
    result = {"prompts": len(prompts), "max_tokens": max_tokens, "graph_steps": {}}
    for label, dtype, eager in (
        ("cuda_eager_fp32", "float32", True),
        ("cuda_graphs_fp32", "float32", False),
        ("cuda_eager_bf16", "bfloat16", True),
        ("cuda_graphs_bf16", "bfloat16", False),
    ):
        llm = make_llm(args, dtype=dtype, enforce_eager=eager, **engine)
        runs[label] = greedy(llm, prompts, max_tokens)
        graphs = llm.llm_engine.runner.decode_graphs
        result["graph_steps"][label] = graphs.num_steps if graphs is not None else 0
        del llm, graphs
        release()
    reference = runs["cpu_reference_fp32"]
    checks = {
        label: first_mismatches(runs[label], reference)
        for label in ("cuda_eager_fp32", "cuda_graphs_fp32")
    }
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        result["transformers"] = "not installed"
    else:
        device = cuda_device(args)
        model = (
            AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
        )
        runs["transformers_fp32"] = [
            hf_greedy(model, p, n, device) for p, n in zip(prompts, max_tokens)
        ]
        checks["transformers_fp32"] = first_mismatches(runs["transformers_fp32"], reference)
        del model
        release()
    bf16 = first_mismatches(runs["cuda_graphs_bf16"], runs["cuda_eager_bf16"])
    result.update(
        runs=runs,
        mismatches=checks,
        bf16_graphs_vs_eager_mismatches=bf16,
        ok=all(not found for found in checks.values()),
    )
    if not args.smoke and not any(
        result["graph_steps"][k] for k in ("cuda_graphs_fp32", "cuda_graphs_bf16")
    ):
        result["ok"] = False
        result["error"] = "no decode step went through the CUDA graphs"
    return result


def engine_memory(llm) -> dict:
    runner = llm.llm_engine.runner
    free_now = torch.cuda.mem_get_info(runner.device)[0]
    capture = runner.graph_capture
    return {
        "num_kv_blocks": runner.num_kv_blocks,
        "kv_bytes": runner.num_kv_blocks * runner._kv_bytes_per_block(),
        "used_bytes": runner.memory_at_start.free - free_now,
        "graph_bytes": capture.memory_bytes if capture else 0,
        "graph_capture_s": capture.seconds if capture else 0.0,
        "profile": runner.memory_profile,
    }


def stage_memory(args) -> dict:
    if args.smoke or not torch.cuda.is_available():
        return {"ok": True, "skipped": "needs a CUDA device"}
    total = torch.cuda.get_device_properties(0).total_memory
    engine = {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 64}
    result = {
        "total_bytes": total,
        "free_at_start_bytes": torch.cuda.mem_get_info()[0],
        "engines": {},
    }
    for utilization in (0.3, 0.6):
        llm = make_llm(args, gpu_memory_utilization=utilization, **engine)
        result["engines"][str(utilization)] = engine_memory(llm)
        del llm
        release()
    low, high = result["engines"]["0.3"], result["engines"]["0.6"]
    result["kv_difference_fraction"] = (high["kv_bytes"] - low["kv_bytes"]) / total
    # Each engine holds its share, less the activation headroom it leaves free, plus its graphs.
    result["used_fraction"] = {
        u: (e["used_bytes"] - e["graph_bytes"]) / total for u, e in result["engines"].items()
    }
    checks = {
        "kv_pool_tracks_utilization": abs(result["kv_difference_fraction"] - 0.3) <= 0.01,
        # (1% slack: the kernel tests run beside this stage, in processes of their own)
        "within_share": all(f <= float(u) + 0.01 for u, f in result["used_fraction"].items()),
    }
    # Two engines of 0.3 side by side fit; a third asking for 0.5 is refused, not run out of memory.
    first = make_llm(args, gpu_memory_utilization=0.3, **engine)
    second = make_llm(args, gpu_memory_utilization=0.3, **engine)
    checks["second_engine_same_pool"] = (
        second.llm_engine.runner.num_kv_blocks >= 0.98 * first.llm_engine.runner.num_kv_blocks
    )
    try:
        make_llm(args, gpu_memory_utilization=0.5, **engine)
        checks["over_asking_refused"] = False
    except ValueError as error:
        checks["over_asking_refused"] = "free at startup" in str(error)
        result["refusal"] = str(error)
    del first, second
    release()
    result.update(checks=checks, ok=all(checks.values()))
    return result


def timed_requests(llm, prompts: list[list[int]], output_len: int) -> dict:
    outputs, elapsed = greedy_timed(llm, prompts, output_len)
    tpots = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
    ]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "tpot_ms_median": 1e3 * statistics.median(tpots),
    }


def stage_throughput(args) -> dict:
    from nanoserve.models.config import ModelConfig

    vocab = ModelConfig.from_dir(args.model).vocab_size
    rng = random.Random(0)
    batch, input_len, output_len = (4, 16, 8) if args.smoke else (64, 128, 128)
    prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch + 4)]
    result = {"batch": batch, "input_len": input_len, "output_len": output_len, "modes": {}}
    for mode in ("eager", "graphs"):
        started = time.perf_counter()
        llm = make_llm(
            args,
            dtype="float32" if args.smoke else "bfloat16",
            enforce_eager=mode == "eager",
            gpu_memory_utilization=0.5,
            max_model_len=2048,
            max_num_seqs=64,
        )
        startup = time.perf_counter() - started
        timed_requests(llm, prompts[-4:], 8)  # warm-up
        single = [timed_requests(llm, [prompts[i]], 16 if args.smoke else 256) for i in range(3)]
        capture = llm.llm_engine.runner.graph_capture
        result["modes"][mode] = {
            "startup_s": startup,
            "graph_capture_s": capture.seconds if capture else None,
            "graph_bytes": capture.memory_bytes if capture else None,
            "batch1_tpot_ms": statistics.median(run["tpot_ms_median"] for run in single),
            f"batch{batch}": timed_requests(llm, prompts[:batch], output_len),
        }
        result["modes"][mode]["batch1_decode_tokens_per_s"] = (
            1e3 / result["modes"][mode]["batch1_tpot_ms"]
        )
        del llm
        release()
    eager, graphs = result["modes"]["eager"], result["modes"]["graphs"]
    result["batch1_speedup"] = eager["batch1_tpot_ms"] / graphs["batch1_tpot_ms"]
    result["ok"] = True  # speeds are targets (gpu_report), not failures
    return result


STAGES = {"tokens": stage_tokens, "memory": stage_memory, "throughput": stage_throughput}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--name", required=True, help="the model's name in the report")
    parser.add_argument("--work", required=True, help="directory for <stage>-<name>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny workloads on a CPU")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "nanoserve.bench.gpu_e2e: no CUDA device (use --smoke to check the script on a CPU)",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    try:
        result = STAGES[args.stage](args)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr)
    result.update(
        stage=args.stage, name=args.name, model=args.model, seconds=time.perf_counter() - started
    )
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{args.stage}-{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("runs", "engines", "modes", "error")}
    print(
        f"{args.stage} {args.name}: {'ok' if result['ok'] else 'FAILED'} {json.dumps(summary)[:2000]}",
        flush=True,
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
