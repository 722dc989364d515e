"""The quantized GEMM against the bf16 GEMM, kernel by kernel, on SmolLM2-135M's shapes: microseconds
per call and the ratio, for M = 1 (batch-1 decode), 64 (a decode step of 64 sequences) and 512 (a
prompt chunk), with the threads torch has (or --threads). Random weights of sane scale (the
kernels' speed does not depend on the values). Run on an idle machine:

    .venv/bin/python benchmarks/quant/gemm_shapes.py [--threads N] [--rows 1 64 512] [--formats q4_1 q8_0 q4_0 fp8_e4m3]
        [--shapes smollm2 | 1b]

fp8_e4m3: FP8 weights (kernels/cpu/gemm_fp8.cpp). `--shapes 1b`: a Llama-3.2-1B layer's shapes
(its weights don't stay in cache, as a larger model's don't).

Best of five timings of repeated calls each; the CPU memory settings the engine uses
(nanoserve/kernels/cpu/malloc.py) are applied, so the output buffers are not fresh pages every call.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.cpu.malloc import keep_freed_memory
from nanoserve.kernels.quant import (
    FP8,
    GGUF_QTYPES,
    QuantComponents,
    QuantWeight,
    pack_weight,
    quant_gemm,
)

SHAPES = {
    "smollm2": {
        "qkv": (960, 576),
        "o_proj": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
    "1b": {
        "qkv": (3072, 2048),
        "o_proj": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
    },
}
FORMATS = ("q4_1", "q8_0", "q4_0")


def random_weight(qtype: str, n: int, k: int, generator: torch.Generator) -> QuantWeight:
    if qtype == FP8:  # random E4M3 bytes (no NaN), scales of 0.01
        u = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=generator)
        u = torch.where((u & 0x7F) == 0x7F, u ^ 1, u)
        return QuantWeight(
            FP8, n, k, None, components=QuantComponents(u, torch.full((n, k // 32), 0.01))
        )
    return QuantWeight(qtype, n, k, random_blocks(qtype, n, k, generator))


def random_blocks(qtype: str, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """GGUF bytes of a Q8_0 / Q4_0 / Q4_1 weight: random quants, scales (and mins) of 0.01."""
    elements, nbytes = GGUF_QTYPES[qtype]
    raw = torch.randint(0, 256, (n, k // elements, nbytes), dtype=torch.uint8, generator=generator)
    half = torch.full((n, k // elements, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    raw[..., 0:2] = half
    if qtype == "q4_1":
        raw[..., 2:4] = half
    return raw.reshape(n, -1)


def best_of(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    generator = torch.Generator().manual_seed(0)
    print(f"# {cpu_ops.describe_isa()}; {torch.get_num_threads()} threads")
    print(
        "| shape | M | bf16 us | "
        + " | ".join(f"{f.upper()} us (x bf16)" for f in args.formats)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.formats))
    for m in args.rows:
        for name, (n, k) in SHAPES[args.shapes].items():
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            packed = cpu_ops.pack_gemm_weight(
                (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
            )
            calls = max(3, int(2e8 / (m * n * k)))
            bf16 = best_of(lambda: cpu_ops.gemm(x, packed, None, n), calls)
            cells = []
            for qtype in args.formats:
                weight = random_weight(qtype, n, k, generator)
                weight.packed = pack_weight(weight)
                micros = best_of(lambda: quant_gemm(x, weight, None), calls)
                cells.append(f"{micros:.1f} ({bf16 / micros:.2f}x)")
            print(f"| {name} | {m} | {bf16:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
