"""Decode attention over a bf16 KV pool against the same values in an fp8 pool (--kv-cache-dtype
fp8 / fp8_e5m2: kernels/cpu/kv_fp8.cpp widens chunks into a scratch pool for the bf16 kernels), in
one process, the pools taking turns. SmolLM2-135M's heads (9 query, 3 KV, head_dim 64), 16-token
blocks, 30 layers' pools (each its own tensors, on huge pages, as the engine allocates them), a
decode step's attention calls over all of them per timed step: K/V come from memory as in a real
step. Prints the median step time of each pool, the ratio, and whether the outputs are the same
bits (they must be: the bf16 pool holds the fp8 values). Run on an idle machine:

    .venv/bin/python benchmarks/kv-fp8/attention.py [--seqs 64] [--contexts 128 256 512] [--isa avx512bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.cpu.malloc import keep_freed_memory, zeros_on_huge_pages
from nanoserve.kernels.kv_dtype import KV_CACHE_DTYPES, to_cache

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def pool(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` [blocks, kv_heads, block, dim] on huge pages, seen as the engine's permuted pool."""
    physical = zeros_on_huge_pages(tuple(values.shape), dtype)
    physical.copy_(values)
    return physical.permute(0, 2, 1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--kv", default="fp8", choices=[k for k in KV_CACHE_DTYPES if k != "auto"])
    parser.add_argument("--isa", default=None)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    keep_freed_memory()
    if args.isa:
        cpu_ops.set_isa(args.isa)
    print(
        f"# {cpu_ops.describe_isa()}; {args.seqs} decodes, {LAYERS} layers' pools, KV cache {args.kv}"
    )
    fp8 = KV_CACHE_DTYPES[args.kv]
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        blocks = -(-context // BLOCK)
        num_blocks = args.seqs * blocks + 1
        layers = {"bf16": [], args.kv: []}
        for _ in range(LAYERS):
            pair = []
            for _ in range(2):  # K, V
                values = to_cache(
                    torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=generator), fp8
                )
                pair.append((pool(values.to(torch.bfloat16), torch.bfloat16), pool(values, fp8)))
            layers["bf16"].append((pair[0][0], pair[1][0]))
            layers[args.kv].append((pair[0][1], pair[1][1]))
        table = torch.randperm(num_blocks - 1, generator=generator)[: args.seqs * blocks].to(
            torch.int32
        )
        table = table.reshape(args.seqs, blocks)
        query = torch.randn(args.seqs, HEADS, DIM, generator=generator).to(torch.bfloat16)
        cu_seqlens = torch.arange(args.seqs + 1, dtype=torch.int32)
        seq_lens = torch.full((args.seqs,), context, dtype=torch.int32)
        outs = {name: torch.empty_like(query) for name in layers}
        times: dict[str, list[float]] = {name: [] for name in layers}
        for round_ in range(args.rounds):
            for name in list(layers) if round_ % 2 == 0 else list(reversed(layers)):
                start = time.perf_counter()
                for keys, values in layers[name]:
                    cpu_ops.paged_attention(
                        query, keys, values, table, cu_seqlens, seq_lens, DIM**-0.5, out=outs[name]
                    )
                times[name].append((time.perf_counter() - start) * 1e3)
        bf16, other = statistics.median(times["bf16"]), statistics.median(times[args.kv])
        print(
            f"{args.seqs} x {context} keys, {LAYERS} layers: bf16 pool {bf16:.2f} ms, {args.kv} pool {other:.2f} ms "
            f"a step: {bf16 / other:.2f}x; same bits: {torch.equal(outs['bf16'], outs[args.kv])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
