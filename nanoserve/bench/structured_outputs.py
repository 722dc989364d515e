"""Structured outputs' cost in decoding: one batch of requests decoded free, then the same batch
with every row constrained by a grammar, in this process one after the other. The grammar (JSON
records, one after another) never completes, so both runs decode the same number of tokens at
the same batch size. Prints and writes (JSON) each run's time and output tokens/s, the overhead,
and the grammar's compile time.

    nanoserve bench structured-outputs --batch-size 16 --input-len 64 --output-len 128 \\
        --out benchmarks/structured_outputs/smollm2-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from nanoserve.bench.throughput import random_prompts

RECORDS_GRAMMAR = r'''root ::= record root
record ::= "{\"name\": \"" [a-z]+ "\", \"age\": " [0-9]+ ", \"tags\": [" tag ("," tag)* "]}\n"
tag ::= "\"" ("red" | "green" | "blue") "\""'''


def timed_run(llm, prompts: list[list[int]], output_len: int, grammar: str | None) -> dict:
    from nanoserve import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(grammar=grammar) if grammar is not None else None
    params = SamplingParams(
        temperature=0, max_tokens=output_len, ignore_eos=True, structured_outputs=constraint
    )
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "constrained": grammar is not None,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / elapsed, 2),
        "finish_reasons": sorted({o.outputs[0].finish_reason for o in outputs}),
        "sample_text": outputs[0].outputs[0].text[:120],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanoserve bench structured-outputs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="default: sized from memory"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from nanoserve import LLM, SamplingParams, StructuredOutputsParams
    from nanoserve.engine.startup import resolve_model_dir
    from nanoserve.models.config import ModelConfig

    args.model = str(resolve_model_dir(args.model))
    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed)
    with LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch_size, 1),
        num_kv_blocks=args.num_kv_blocks,
    ) as llm:
        # Warm-up: the model, and xgrammar's import, tokenizer info and the grammar's compile.
        llm.generate(
            [{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
        engine = llm.llm_engine
        started = time.perf_counter()
        engine.prepare_structured_output(
            SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
        ).result()
        setup_s = time.perf_counter() - started
        started = time.perf_counter()
        engine.prepare_structured_output(
            SamplingParams(structured_outputs=StructuredOutputsParams(grammar=RECORDS_GRAMMAR))
        ).result()
        compile_s = time.perf_counter() - started
        results = [
            timed_run(llm, prompts, args.output_len, None),
            timed_run(llm, prompts, args.output_len, RECORDS_GRAMMAR),
        ]
    for result in results:
        print(json.dumps(result), flush=True)
    free, constrained = (r["output_tokens_per_s"] for r in results)
    summary = {
        "workload": {
            k: getattr(args, k)
            for k in ("model", "dtype", "device", "batch_size", "input_len", "output_len", "seed")
        },
        "grammar": RECORDS_GRAMMAR,
        "xgrammar_setup_s": round(setup_s, 3),  # import, tokenizer info, first (tiny) compile
        "grammar_compile_s": round(compile_s, 4),
        "results": results,
        "overhead_percent": round(100.0 * (free - constrained) / free, 1),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
        },
    }
    print(
        f"free {free} tok/s, constrained {constrained} tok/s: overhead "
        f"{summary['overhead_percent']}%",
        flush=True,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    same_length = results[0]["output_tokens"] == results[1]["output_tokens"]
    return 0 if same_length else 1
