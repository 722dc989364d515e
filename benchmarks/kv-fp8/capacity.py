"""What --kv-cache-dtype fp8 is for: the same KV memory holds twice the tokens. One process, the
same model served twice with the same small --kv-cache-memory (bf16 pool, then fp8 pool), the
same random prompts (greedy, ignore_eos) submitted at once through LLM.generate, each engine
run `--rounds` times in turns. Prints the pool's blocks, the most sequences running at once, the
preemptions and the output tokens/s of each. Run on an idle machine:

    .venv/bin/python benchmarks/kv-fp8/capacity.py [--kv-cache-memory 0.11] [--num-prompts 32]
        [--input-len 512] [--output-len 128] [--model DIR] [--kv fp8]
"""

from __future__ import annotations

import argparse
import statistics

from nanoserve.bench.throughput import greedy_timed, random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="model directory or GGUF file (default: the default model's bf16 import)"
    )
    parser.add_argument(
        "--kv-cache-memory", type=float, default=0.11, help="GiB, the same for both pools"
    )
    parser.add_argument("--kv", default="fp8")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from nanoserve import LLM
    from nanoserve.kernels.cpu import ops as cpu_ops
    from nanoserve.models.gguf.importer import ensure_default_model

    model = args.model or str(ensure_default_model())
    engines = {
        kv: LLM(
            model=model, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory
        )
        for kv in ("auto", args.kv)
    }
    print(f"# {cpu_ops.describe_isa()}")
    print(
        f"# {model}; {args.num_prompts} x ({args.input_len}, {args.output_len}); "
        f"--kv-cache-memory {args.kv_cache_memory} GiB"
    )
    vocab = engines["auto"].llm_engine.model_config.vocab_size
    rates: dict[str, list[float]] = {kv: [] for kv in engines}
    for round_ in range(args.rounds):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=2000 + round_)
        for kv in list(engines) if round_ % 2 == 0 else list(reversed(engines)):
            engine = engines[kv].llm_engine
            before = engine.stats()
            most_running = 0
            step = engine.step

            def counted_step(step=step, engine=engine):
                nonlocal most_running
                outputs = step()
                most_running = max(most_running, engine.stats().num_running)
                return outputs

            engine.step = counted_step
            try:
                outputs, elapsed = greedy_timed(engines[kv], prompts, args.output_len)
            finally:
                del engine.step
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[kv].append(tokens / elapsed)
            preemptions = engine.stats().num_preemptions_total - before.num_preemptions_total
            print(
                f"round {round_ + 1} KV {kv:8s} {engine.block_managers[0].num_blocks} blocks, at most {most_running} "
                f"running, {preemptions} preemptions, {tokens / elapsed:6.1f} output tokens/s",
                flush=True,
            )
    base, other = statistics.median(rates["auto"]), statistics.median(rates[args.kv])
    print(
        f"median: bf16 pool {base:.1f}, {args.kv} pool {other:.1f} output tokens/s: {other / base:.2f}x"
    )


if __name__ == "__main__":
    main()
