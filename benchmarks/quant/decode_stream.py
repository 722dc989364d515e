"""Batch-1 GEMMs streaming from memory: a Llama-3.2-1B decode step's linear layers (16 layers of
qkv, o_proj, gate_up, down; 1.5 GB of bf16, so nothing stays in cache between calls) in one
format, packed as a model's load packs it at this level, called in order as a decode step calls
them, one row of x. Prints microseconds a step and the rate the packed weights and the GGUF
file's bytes are read at. Run on an idle machine:

    .venv/bin/python benchmarks/quant/decode_stream.py [--formats q4_k q6_k q8_0 q4_0 q5_k] [--layers 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.cpu.malloc import keep_freed_memory
from nanoserve.kernels.quant import GGUF_QTYPES, QuantWeight, pack_for_cpu, quant_gemm

SHAPES = {
    "qkv": (3072, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
}


def random_raw(qtype: str, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """GGUF bytes: random quants and scale codes, fp16 d (and dmin) of 0.01 where the format has them."""
    elements, nbytes = GGUF_QTYPES[qtype]
    raw = torch.randint(0, 256, (n, k // elements, nbytes), dtype=torch.uint8, generator=generator)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    at = {
        "q4_k": (0, 2),
        "q5_k": (0, 2),
        "q6_k": (nbytes - 2,),
        "q8_0": (0,),
        "q4_0": (0,),
        "q4_1": (0, 2),
        "q5_0": (0,),
        "q5_1": (0, 2),
    }[qtype]
    for offset in at:
        raw[..., offset : offset + 2] = half
    return raw.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--formats", nargs="+", default=["q4_k", "q6_k", "q5_k", "q8_0", "q4_0", "bf16"]
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    keep_freed_memory()
    generator = torch.Generator().manual_seed(0)
    print(f"# {cpu_ops.describe_isa()}; {torch.get_num_threads()} threads")
    for qtype in args.formats:
        calls, packed_bytes, file_bytes = [], 0, 0
        for _ in range(args.layers):
            for n, k in SHAPES.values():
                x = torch.randn(1, k, generator=generator).to(torch.bfloat16)
                if qtype == "bf16":
                    weight = cpu_ops.pack_gemm_weight(
                        (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
                    )
                    calls.append(lambda x=x, w=weight, n=n: cpu_ops.gemm(x, w, None, n))
                    packed_bytes += weight.numel() * 2
                    file_bytes += n * k * 2
                    continue
                raw = random_raw(qtype, n, k, generator)
                file_bytes += raw.numel()
                weight = QuantWeight(qtype, n, k, raw)
                pack_for_cpu(weight)  # as a model's load packs it at this level
                packed_bytes += weight.packed.numel()
                calls.append(lambda x=x, w=weight: quant_gemm(x, w, None))
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for call in calls:
                call()
            best = min(best, time.perf_counter() - start)
        weights = sum(n * k for n, k in SHAPES.values()) * args.layers
        print(
            f"{qtype:6s} {best * 1e6:9.0f} us a step; packed {packed_bytes / best / 1e9:5.1f} GB/s "
            f"({8 * packed_bytes / weights:.2f} bits a weight; file {8 * file_bytes / weights:.2f}), "
            f"file {file_bytes / best / 1e9:5.1f} GB/s",
            flush=True,
        )
        del calls


if __name__ == "__main__":
    main()
