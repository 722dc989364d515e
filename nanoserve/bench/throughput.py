"""Offline throughput: nanoserve's LLM.generate against Hugging Face transformers' generate on
the same workload, in one run, the baseline in a process of its own. Prints output tokens/s of
each and the ratio, and writes a JSON. (vLLM-CPU, the yardstick: ../shared/bench/, and
benchmarks/vllm-cpu/bench_vs_vllm.sh.)

    python -m nanoserve.bench.throughput --num-prompts 64 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

import torch


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the low ids, where the special tokens live.
    return torch.randint(100, vocab_size, (num_prompts, input_len), generator=generator).tolist()


def greedy_timed(llm, prompts: list[list[int]], output_len: int) -> tuple[list, float]:
    """Every prompt in one `generate` call, greedy with `ignore_eos`: (outputs, seconds). Shared by
    the offline benchmarks (this one, bench serve's offline side, the GPU end-to-end run), and free
    of the server's packages."""
    from nanoserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outputs, time.perf_counter() - started


def run_nanoserve(
    model_dir: str, prompts, output_len: int, dtype: str, tp: int, **engine_args
) -> dict:
    from nanoserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, tensor_parallel_size=tp, **engine_args)
    load_s = time.perf_counter() - started
    llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False
    )  # warm-up
    outputs, elapsed = greedy_timed(llm, prompts, output_len)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    runner = llm.llm_engine.runner
    result = {
        "engine": "nanoserve",
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "tensor_parallel_size": tp,
        "rank_weight_bytes": list(runner.rank_weight_bytes),
    }
    if runner.broadcast_steps:
        result["steps"] = runner.broadcast_steps
        result["step_input_broadcast_ms_per_step"] = (
            1e3 * runner.broadcast_seconds / runner.broadcast_steps
        )
    llm.shutdown()
    return result


def run_transformers(model_dir: str, prompts, output_len: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    from nanoserve.models.gguf.model import find_gguf_file

    gguf_file = find_gguf_file(Path(model_dir))
    if gguf_file is not None:  # transformers dequantizes a GGUF file itself
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=getattr(torch, dtype)
        ).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    input_ids = torch.tensor(prompts)
    attention_mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        model.generate(
            input_ids[:1], attention_mask=attention_mask[:1], max_new_tokens=2, do_sample=False
        )
        started = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - started
    generated = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return {
        "engine": "transformers",
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanoserve bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default=None, help="model dir or GGUF file (default: the imported SmolLM2)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes to run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-transformers", action="store_true", help="skip the transformers baseline"
    )
    parser.add_argument("--output", default=None, help="JSON path for the results")
    args = parser.parse_args(argv)

    model_dir = args.model
    if model_dir is None:
        from nanoserve.models.gguf.importer import ensure_default_model

        model_dir = str(ensure_default_model())
    from nanoserve.models.config import ModelConfig

    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    results = []
    for tp in args.tp:
        result = run_nanoserve(model_dir, prompts, args.output_len, args.dtype, tp)
        results.append(result)
        extra = ""
        if "step_input_broadcast_ms_per_step" in result:
            extra = (
                f"; step-input broadcast {result['step_input_broadcast_ms_per_step']:.2f} ms/step "
                f"over {result['steps']} steps"
            )
        print(
            f"nanoserve (tp={tp}): {result['output_tokens_per_s']:.1f} output tokens/s "
            f"({result['output_tokens']} tokens in {result['elapsed_s']:.1f} s; weights per rank "
            f"{[round(b / 2**20) for b in result['rank_weight_bytes']]} MiB{extra})",
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
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        },
        "command": "python -m nanoserve.bench.throughput "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "results": results,
    }
    if not args.no_transformers:
        # In a process of its own: torch in a process that already ran an engine (its threads,
        # its allocator) runs the baseline about half as fast.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            baseline = pool.apply(
                run_transformers, (model_dir, prompts, args.output_len, args.dtype)
            )
        results.append(baseline)
        ratio = results[0]["output_tokens_per_s"] / baseline["output_tokens_per_s"]
        report["ratio_nanoserve_over_transformers"] = ratio
        print(
            f"transformers: {baseline['output_tokens_per_s']:.1f} output tokens/s "
            f"({baseline['output_tokens']} tokens in {baseline['elapsed_s']:.1f} s)"
        )
        print(f"ratio nanoserve / transformers: {ratio:.2f}x")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # the guard matters: tensor-parallel ranks are spawned processes
    sys.exit(main())
