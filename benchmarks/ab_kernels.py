"""CPU kernels against each other in one process: two builds (decode attention, the quantized
GEMM, a decode step's GEMMs) or the ISA levels of this build (decode attention), alternating call
batches. Separate processes on a shared 2-core host drift by 10-20% (sometimes 2x) within minutes;
two libraries loaded side by side see the same host. Each side of an A/B is a git commit (its
nanoserve/kernels/cpu exported) or a directory holding the kernel sources. Run on an idle machine
from the project root:

    .venv/bin/python benchmarks/ab_kernels.py attention OLD NEW [--seqs 64] [--isa avx512bf16]
    .venv/bin/python benchmarks/ab_kernels.py gemm OLD NEW [--rows 64] [--formats q4_1 q8_0] [--threads 1]
    .venv/bin/python benchmarks/ab_kernels.py decode OLD NEW [--rows 1] [--formats bf16 q4_1]
    .venv/bin/python benchmarks/ab_kernels.py levels [--context 64 192 512]

e.g. `attention HEAD~1 nanoserve/kernels/cpu`. Attention: SmolLM2-135M's heads (9 query, 3 KV,
head_dim 64), 16-token blocks, --seqs sequences each --context keys long, the KV pool on huge pages
and 8x the live blocks with 8 random block tables, so K/V come from memory as in a decode step (its
30 layers' caches fit in no cache). Levels: the engine's entry (cpu_ops.paged_attention) on each
level this CPU runs: `portable` the plain loops of kernels/cpu/ops.cpp, `avx2` its AVX2 + FMA decode
kernel, `avx512bf16` the two-pass VDPBF16PS kernel, `amx` the AMX tiles of attention_amx.cpp.
GEMM: SmolLM2's layer shapes with random blocks (benchmarks/quant/gemm_shapes.py). Decode: the
GEMMs of a whole decode step in order, 30 layers' qkv, o_proj, gate_up and down and the LM head
with random weights of their own (bf16 or a GGUF format: 98-270 MB, read from memory as a real step
reads them), on --rows rows. Prints the median (attention, decode) or best (GEMM) time of each
side, old / new, and whether the outputs are the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.cpu.malloc import keep_freed_memory, zeros_on_huge_pages

ROOT = Path(__file__).resolve().parent.parent
KERNELS = Path(cpu_ops.__file__).parent
# SmolLM2-135M's attention: 9 query heads, 3 KV heads, head_dim 64; 16-token blocks
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def sources(side: str, scratch: Path) -> Path:
    """The kernel source directory for a commit or a directory."""
    if Path(side).is_dir():
        return Path(side).resolve()
    out = scratch / side.replace("/", "_")
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", side, "nanoserve/kernels/cpu"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "nanoserve" / "kernels" / "cpu"


def build(source_dir: Path, output: Path, isa: str) -> ctypes.CDLL:
    command = [
        str(source_dir / Path(part).name) if part.startswith(str(KERNELS)) else part
        for part in cpu_ops.build_command(cpu_ops.compiler(), output)
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"building {source_dir} failed:\n{result.stderr[-2000:]}")
    lib = cpu_ops.load(output)
    if lib.ns_set_isa(cpu_ops.ISA_LEVELS.index(isa)) != 0:
        raise SystemExit(f"this CPU can't run the {isa} kernels")
    return lib


@dataclass
class AttentionInputs:
    """One decode-attention call's tensors: K/V in a pool 8x the live blocks, on huge pages, and 8
    random block tables, so each call reads K/V from memory as a decode step does."""

    caches: list[torch.Tensor]  # key, value: (blocks, kv heads, block, head dim)
    tables: list[torch.Tensor]
    query: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor


def attention_inputs(seqs: int, context: int, generator: torch.Generator) -> AttentionInputs:
    blocks = (context + BLOCK - 1) // BLOCK
    pool = seqs * blocks * 8
    caches = []
    for _ in range(2):
        cache = zeros_on_huge_pages((pool, KV_HEADS, BLOCK, HEAD_DIM), torch.bfloat16)
        cache.copy_(torch.randn(pool, KV_HEADS, BLOCK, HEAD_DIM, generator=generator))
        caches.append(cache)
    tables = [
        torch.randperm(pool, generator=generator)[: seqs * blocks]
        .to(torch.int32)
        .reshape(seqs, blocks)
        for _ in range(8)
    ]
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    cu_seqlens = torch.arange(seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    return AttentionInputs(caches, tables, query, cu_seqlens, seq_lens)


def time_attention(
    sides: dict[str, Callable[[torch.Tensor, torch.Tensor], None]],
    query: torch.Tensor,
    rounds: int,
    tables: list[torch.Tensor],
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Each side's median microseconds a call, batches of 16 calls alternating between the sides
    (the order reversed every other round), and each side's last output."""
    outs = {name: torch.empty_like(query) for name in sides}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in list(sides) if round_ % 2 == 0 else list(reversed(sides)):
            start = time.perf_counter()
            for index in range(16):
                sides[name](outs[name], tables[index % 8])
            times[name].append((time.perf_counter() - start) / 16 * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}, outs


def attention(libs: dict[str, ctypes.CDLL], seqs: int, rounds: int, contexts: list[int]) -> None:
    """Two builds' decode attention kernel (ns_paged_attention) at one ISA level."""
    generator = torch.Generator().manual_seed(0)
    for context in contexts:
        inputs = attention_inputs(seqs, context, generator)
        query, (key_cache, value_cache) = inputs.query, inputs.caches

        def side(lib: ctypes.CDLL) -> Callable[[torch.Tensor, torch.Tensor], None]:
            def call(out: torch.Tensor, table: torch.Tensor) -> None:
                lib.ns_paged_attention(
                    cpu_ops._DTYPES[torch.bfloat16],
                    out.data_ptr(),
                    query.data_ptr(),
                    query.stride(0),
                    query.stride(1),
                    key_cache.data_ptr(),
                    value_cache.data_ptr(),
                    KV_HEADS,
                    BLOCK,
                    HEAD_DIM,
                    table.data_ptr(),
                    table.stride(0),
                    inputs.cu_seqlens.data_ptr(),
                    inputs.seq_lens.data_ptr(),
                    seqs,
                    HEADS,
                    HEAD_DIM**-0.5,
                    cpu_ops._ROWS_PER_ITEM,
                )

            return call

        medians, outs = time_attention(
            {name: side(lib) for name, lib in libs.items()}, query, rounds, inputs.tables
        )
        old, new = medians["old"], medians["new"]
        print(
            f"decode attention, {seqs} sequences x {context} keys: old {old:.0f} us, new {new:.0f} us, "
            f"{old / new:.2f}x; same bits: {torch.equal(outs['old'], outs['new'])}",
            flush=True,
        )


def attention_levels(seqs: int, rounds: int, contexts: list[int]) -> None:
    """This build's decode attention (cpu_ops.paged_attention, the engine's entry: AMX tiles
    where it takes them) on each ISA level this CPU runs, against the lowest."""
    levels = cpu_ops.supported_isas()
    chosen = cpu_ops.isa()
    generator = torch.Generator().manual_seed(0)
    try:
        for context in contexts:
            inputs = attention_inputs(seqs, context, generator)
            # the engine's cache layout: (blocks, block, kv heads, head dim) over head-major memory
            key_cache, value_cache = (cache.permute(0, 2, 1, 3) for cache in inputs.caches)

            def side(level: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
                def call(out: torch.Tensor, table: torch.Tensor) -> None:
                    cpu_ops.set_isa(level)
                    cpu_ops.paged_attention(
                        inputs.query,
                        key_cache,
                        value_cache,
                        table,
                        inputs.cu_seqlens,
                        inputs.seq_lens,
                        HEAD_DIM**-0.5,
                        out=out,
                    )

                return call

            medians, _ = time_attention(
                {level: side(level) for level in levels}, inputs.query, rounds, inputs.tables
            )
            base = medians[levels[0]]
            print(
                f"context {context}: "
                + ", ".join(
                    f"{level} {us:.0f} us ({base / us:.2f}x {levels[0]})"
                    for level, us in medians.items()
                ),
                flush=True,
            )
    finally:
        cpu_ops.set_isa(chosen)


def gemm(libs: dict[str, ctypes.CDLL], rows: int, formats: list[str], rounds: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks" / "quant"))
    from gemm_shapes import SHAPES, random_blocks

    from nanoserve.kernels.gguf_formats import format_code
    from nanoserve.kernels.quant import QuantWeight, pack_weight

    generator = torch.Generator().manual_seed(0)
    for qtype in formats:
        for name, (n, k) in SHAPES.items():
            if name == "lm_head" and rows > 1:
                continue
            x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
            weight = QuantWeight(qtype, n, k, random_blocks(qtype, n, k, generator))
            weight.packed = pack_weight(weight)
            outs = {side: torch.empty(rows, n, dtype=torch.bfloat16) for side in libs}
            calls = max(3, int(1e8 / (rows * n * k)))
            times: dict[str, list[float]] = {side: [] for side in libs}
            for round_ in range(rounds):
                for side in list(libs) if round_ % 2 == 0 else list(reversed(libs)):

                    def call() -> None:
                        code = libs[side].ns_gemm_quant(
                            format_code(qtype),
                            outs[side].data_ptr(),
                            n,
                            x.data_ptr(),
                            x.stride(0),
                            1,
                            weight.packed.data_ptr(),
                            None,
                            rows,
                            n,
                            k,
                        )
                        assert code == 0, code

                    call()
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    times[side].append((time.perf_counter() - start) / calls * 1e6)
            old, new = min(times["old"]), min(times["new"])
            print(
                f"{qtype} {name} x {rows} rows: old {old:.1f} us, new {new:.1f} us, {old / new:.3f}x "
                f"({rows * n * k / new / 1e3:.0f} GMAC/s); same bits: {torch.equal(outs['old'], outs['new'])}",
                flush=True,
            )


def decode(
    libs: dict[str, ctypes.CDLL],
    rows: int,
    formats: list[str],
    rounds: int,
    layers: int = 30,
    model: str = "smollm2",
) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks" / "quant"))
    from gemm_shapes import SHAPES, random_blocks

    SHAPES = SHAPES[model]  # noqa: N806 (the model's layer shapes)

    from nanoserve.kernels.gguf_formats import format_code
    from nanoserve.kernels.quant import QuantWeight, pack_weight

    generator = torch.Generator().manual_seed(0)
    order = [name for name in SHAPES if name != "lm_head"] * layers + [
        name for name in SHAPES if name == "lm_head"
    ]
    for qtype in formats:
        weights = []
        for name in order:
            n, k = SHAPES[name]
            if qtype == "bf16":
                packed = cpu_ops.pack_gemm_weight(
                    (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
                )
            else:
                weight = QuantWeight(qtype, n, k, random_blocks(qtype, n, k, generator))
                packed = pack_weight(weight)
            weights.append((n, k, packed))
        xs = {
            k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for _, k, _ in weights
        }
        outs = {
            side: [torch.empty(rows, n, dtype=torch.bfloat16) for n, _, _ in weights]
            for side in libs
        }

        def step(side: str) -> None:
            lib = libs[side]
            for (n, k, packed), out in zip(weights, outs[side]):
                x = xs[k]
                code = (
                    lib.ns_gemm_bf16(
                        out.data_ptr(),
                        n,
                        x.data_ptr(),
                        x.stride(0),
                        packed.data_ptr(),
                        None,
                        rows,
                        n,
                        k,
                    )
                    if qtype == "bf16"
                    else lib.ns_gemm_quant(
                        format_code(qtype),
                        out.data_ptr(),
                        n,
                        x.data_ptr(),
                        x.stride(0),
                        1,
                        packed.data_ptr(),
                        None,
                        rows,
                        n,
                        k,
                    )
                )
                assert code == 0, code

        times: dict[str, list[float]] = {side: [] for side in libs}
        for side in libs:
            step(side)
        for round_ in range(rounds):
            for side in list(libs) if round_ % 2 == 0 else list(reversed(libs)):
                start = time.perf_counter()
                step(side)
                times[side].append((time.perf_counter() - start) * 1e3)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        # Bit patterns (random K-type blocks hold NaN scales: NaN != NaN as values).
        same = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(outs["old"], outs["new"])
        )
        megabytes = sum(p.numel() * p.element_size() for _, _, p in weights) / 1e6
        head = " + LM head" if "lm_head" in SHAPES else ""
        print(
            f"{qtype} decode step's GEMMs ({layers} layers{head}, {megabytes:.0f} MB) x {rows} rows: "
            f"old {old:.2f} ms, new {new:.2f} ms, {old / new:.3f}x; same bits: {same}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("attention", "gemm", "decode", "levels"))
    parser.add_argument("old", nargs="?", help="a commit, or a directory of kernel sources")
    parser.add_argument("new", nargs="?", help="a commit, or a directory of kernel sources")
    parser.add_argument(
        "--isa", default=None, help="the level both run (default: the best this CPU runs)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument(
        "--context", type=int, nargs="+", default=[64, 192, 512], help="attention: keys a sequence"
    )
    parser.add_argument("--rows", type=int, default=None, help="default: 64 (gemm), 1 (decode)")
    parser.add_argument("--formats", nargs="+", default=["q4_1"])
    parser.add_argument(
        "--model",
        default="smollm2",
        help="decode: the layer shapes (gemm_shapes.py: smollm2, 1b; "
        "1b's inputs are whole K-type super-blocks)",
    )
    parser.add_argument(
        "--layers", type=int, default=30, help="decode: layers of weights (read from memory)"
    )
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    if cpu_ops.library() is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu_ops.load_error()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    if args.kernel == "levels":
        print(f"# {cpu_ops.describe_isa()}; {torch.get_num_threads()} threads")
        attention_levels(args.seqs, args.rounds, args.context)
        return
    if args.old is None or args.new is None:
        parser.error(f"{args.kernel} compares two builds: OLD and NEW")
    isa = args.isa or cpu_ops.isa()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        libs = {
            side: build(sources(where, scratch), scratch / f"{side}.so", isa)
            for side, where in (("old", args.old), ("new", args.new))
        }
        print(
            f"# {cpu_ops.describe_isa()}; both at {isa}; {torch.get_num_threads()} threads; "
            f"old {args.old}, new {args.new}"
        )
        if args.kernel == "attention":
            attention(libs, args.seqs, args.rounds, args.context)
        elif args.kernel == "decode":
            decode(libs, args.rows or 1, args.formats, args.rounds, args.layers, args.model)
        else:
            gemm(libs, args.rows or 64, args.formats, max(2, args.rounds // 2))


if __name__ == "__main__":
    main()
