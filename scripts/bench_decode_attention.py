"""Decode attention of one layer, kernel against kernel, on each ISA level this CPU runs, in one
process, alternating (this shared host drifts by 10-20% from minute to minute; compare within a
run). SmolLM2-135M's heads (9 query heads, 3 KV heads, head_dim 64), bf16, 16-token blocks, 64
sequences each `--context` keys long; the pool holds 8x the live blocks and each call takes one of
8 random block tables, so K/V come from memory as in a decode step (its 30 layers' caches do not
fit in any cache). Run on an idle machine from the project root:

    .venv/bin/python scripts/bench_decode_attention.py [--context 64 192 512]

The `portable` level runs the plain loops of kernels/cpu/ops.cpp (what the `avx2` level ran for
decodes before its own kernel); `avx2` its AVX2 + FMA decode kernel; `avx512bf16` the two-pass
VDPBF16PS kernel; `amx` the AMX tiles of attention_amx.cpp.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoserve.cpu_malloc import keep_freed_memory
from nanoserve.kernels import cpu_ops

SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 192, 512])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if cpu_ops.library() is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu_ops.load_error()}")
    keep_freed_memory()
    levels = cpu_ops.supported_isas()
    chosen = cpu_ops.isa()
    print(f"# {cpu_ops.describe_isa()}; {torch.get_num_threads()} threads")
    generator = torch.Generator().manual_seed(0)
    for context in args.context:
        blocks = (context + BLOCK - 1) // BLOCK
        pool = SEQS * blocks * 8
        k_phys, v_phys = (
            torch.randn(pool, KV_HEADS, BLOCK, HEAD_DIM, generator=generator).to(torch.bfloat16)
            for _ in range(2)
        )
        key_cache, value_cache = k_phys.permute(0, 2, 1, 3), v_phys.permute(0, 2, 1, 3)
        tables = [
            torch.randperm(pool, generator=generator)[: SEQS * blocks]
            .to(torch.int32)
            .reshape(SEQS, blocks)
            for _ in range(8)
        ]
        query = torch.randn(SEQS, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        cu_seqlens = torch.arange(SEQS + 1, dtype=torch.int32)
        seq_lens = torch.full((SEQS,), context, dtype=torch.int32)
        out = torch.empty_like(query)
        times: dict[str, list[float]] = {level: [] for level in levels}
        try:
            for _ in range(args.rounds):
                for level in levels:
                    cpu_ops.set_isa(level)
                    start = time.perf_counter()
                    for call in range(16):
                        cpu_ops.paged_attention(
                            query,
                            key_cache,
                            value_cache,
                            tables[call % 8],
                            cu_seqlens,
                            seq_lens,
                            HEAD_DIM**-0.5,
                            out=out,
                        )
                    times[level].append((time.perf_counter() - start) / 16 * 1e6)
        finally:
            cpu_ops.set_isa(chosen)
        medians = {level: sorted(t)[len(t) // 2] for level, t in times.items()}
        base = medians[levels[0]]
        print(
            f"context {context}: "
            + ", ".join(
                f"{level} {us:.0f} us ({base / us:.2f}x {levels[0]})"
                for level, us in medians.items()
            )
        )


if __name__ == "__main__":
    main()
