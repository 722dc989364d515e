"""Kernel microbenchmarks on a CUDA device: ``python3 -m nanoserve.bench.kernels``.

For each Triton kernel: a correctness check against its torch reference (bf16 and fp16, so the
result does not depend on pytest being installed), its time, achieved bandwidth against the
card's measured device-to-device copy bandwidth, and its time against the torch reference;
attention also against ``scaled_dot_product_attention`` on the same data, unpaged.
Writes ``kernels.json`` and ``kernels.md`` to ``--out``, else ``$OUT``, else ``benchmarks/gpu``.
Exit status: 0 all checks passed, 1 a check failed or a benchmark raised, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve import envs
from nanoserve.kernels.attention import paged_attention_reference, paged_attention_triton
from nanoserve.kernels.kv_cache import store_kvcache_reference, store_kvcache_triton
from nanoserve.kernels.rmsnorm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from nanoserve.kernels.rotary import (
    apply_rotary_reference,
    apply_rotary_triton,
    build_cos_sin_cache,
)

GB = 1e9
DEVICE = torch.device("cuda")  # main() switches to the CPU for --smoke without a GPU
# (atol, rtol) of the self-checks, per dtype.
TOLERANCE = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 1e-2)}
CHECK_DTYPES = (torch.bfloat16, torch.float16)
BENCH_DTYPE = torch.bfloat16  # (--smoke on a CPU: float16, as the interpreter has no bf16)


# ---- timing ---------------------------------------------------------------------------------
class Timer:
    """Median of CUDA-event timings, with the L2 cache flushed before every run."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.flush = torch.empty(
            (256 << 20) if DEVICE.type == "cuda" else 0, dtype=torch.int8, device=DEVICE
        )

    def __call__(self, fn: Callable[[], object], min_iters: int = 5, max_iters: int = 200) -> float:
        fn()  # compile / warm up
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        once = max(time.perf_counter() - start, 1e-6)
        if DEVICE.type != "cuda":  # --smoke on a CPU: the numbers mean nothing
            return once * 1e6
        iters = int(min(max_iters, max(min_iters, self.budget_s / once)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] * 1e3  # microseconds


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def measure_copy_bandwidth(size_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        target.copy_(source)
        return 2 * size_bytes / (time.perf_counter() - start) / GB
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del source, target
    return 2 * size_bytes / sorted(times)[len(times) // 2] / GB


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCE[dtype]
    actual, expected = actual.float(), expected.float()
    error = (actual - expected).abs()
    bad = error > atol + rtol * expected.abs()
    finite = bool(torch.isfinite(actual).all())
    return {
        "max_abs_error": float(error.max()) if error.numel() else 0.0,
        "mismatched": int(bad.sum()),
        "finite": finite,
        "ok": finite and not bool(bad.any()),
    }


# ---- inputs ---------------------------------------------------------------------------------
def paged_inputs(
    num_seqs, q_len, context_len, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0
):
    """Every sequence: context_len cached tokens then q_len new ones; shuffled block table;
    the pool is exactly the blocks the batch needs."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    seq_len = context_len + q_len
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator, device=DEVICE, dtype=dtype)
    value_cache = torch.randn(shape, generator=generator, device=DEVICE, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=generator, device=DEVICE).to(torch.int32)
    block_table = block_table.view(num_seqs, blocks_per_seq)
    query = torch.randn(
        num_seqs * q_len, num_heads, head_dim, generator=generator, device=DEVICE, dtype=dtype
    )
    cu_seqlens_q = torch.arange(0, num_seqs + 1, device=DEVICE, dtype=torch.int32) * q_len
    seq_lens = torch.full((num_seqs,), seq_len, device=DEVICE, dtype=torch.int32)
    return (
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        head_dim**-0.5,
        q_len,
        seq_len,
    )


def unpaged(key_cache, block_table, seq_len):
    """[num_seqs, num_kv_heads, seq_len, head_dim], contiguous, for SDPA."""
    num_seqs = block_table.shape[0]
    gathered = key_cache[block_table.long()]  # [S, blocks, block_size, H, D]
    gathered = gathered.reshape(num_seqs, -1, key_cache.shape[2], key_cache.shape[3])[:, :seq_len]
    return gathered.transpose(1, 2).contiguous()


def sdpa(query, key, value, scale, *, is_causal=False, attn_mask=None):
    try:
        return torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    except (TypeError, RuntimeError):  # no enable_gqa on this torch / backend: expand
        group = query.shape[1] // key.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            query,
            key.repeat_interleave(group, 1),
            value.repeat_interleave(group, 1),
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
        )


# ---- benchmarks -----------------------------------------------------------------------------
def bench_attention(
    timer: Timer,
    copy_gbps: float,
    *,
    name,
    num_seqs,
    q_len,
    context_len,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    target=None,
    sweep=False,
) -> dict:
    result = {
        "name": name,
        "shape": {
            "num_seqs": num_seqs,
            "q_len": q_len,
            "context_len": context_len,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "block_size": block_size,
        },
        "checks": {},
    }
    for dtype in CHECK_DTYPES:
        inputs = paged_inputs(
            num_seqs,
            q_len,
            context_len,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            dtype,
            seed=1,
        )
        result["checks"][str(dtype)] = compare(
            paged_attention_triton(*inputs), paged_attention_reference(*inputs), dtype
        )
        del inputs
    torch.cuda.empty_cache()

    dtype = BENCH_DTYPE
    inputs = paged_inputs(
        num_seqs, q_len, context_len, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    query, key_cache, value_cache, block_table, cu, seq_lens, scale, _, seq_len = inputs
    triton_us = timer(lambda: paged_attention_triton(*inputs))
    reference_us = timer(lambda: paged_attention_reference(*inputs), max_iters=20)
    keys = unpaged(key_cache, block_table, seq_len)
    values = unpaged(value_cache, block_table, seq_len)
    q = query.view(num_seqs, q_len, num_heads, head_dim).transpose(1, 2)
    sdpa_mask = None
    if q_len > 1 and context_len > 0:
        positions = torch.arange(seq_len, device=DEVICE)
        sdpa_mask = (
            positions[None, :] <= (context_len + torch.arange(q_len, device=DEVICE))[:, None]
        )

    def sdpa_fn():
        return sdpa(
            q, keys, values, scale, is_causal=q_len > 1 and context_len == 0, attn_mask=sdpa_mask
        )

    sdpa_us = timer(sdpa_fn)
    element = query.element_size()
    kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * head_dim * element
    io_bytes = kv_bytes + 2 * query.numel() * element
    causal_pairs = num_seqs * sum(context_len + j + 1 for j in range(q_len))
    flops = 4 * causal_pairs * num_heads * head_dim
    result.update(
        dtype=str(dtype),
        triton_us=triton_us,
        reference_us=reference_us,
        sdpa_unpaged_us=sdpa_us,
        bytes=io_bytes,
        gbps=io_bytes / triton_us / 1e3,
        fraction_of_copy_bandwidth=io_bytes / triton_us / 1e3 / copy_gbps,
        tflops=flops / triton_us / 1e6,
        sdpa_tflops=flops / sdpa_us / 1e6,
        speedup_vs_reference=reference_us / triton_us,
        time_vs_sdpa=triton_us / sdpa_us,
    )
    if target is not None:
        result["target_fraction"] = target
        result["meets_target"] = result["fraction_of_copy_bandwidth"] >= target
    if sweep:  # data for tuning the split heuristic and tile sizes
        variants = {f"splits={n}": {"num_splits": n} for n in (1, 2, 4, 8, 16)}
        variants.update(
            {
                "block_n=32": {"block_n": 32},
                "block_n=128": {"block_n": 128},
                "num_stages=3": {"num_stages": 3},
                "num_warps=8": {"num_warps": 8},
            }
        )
        result["sweep_us"] = {}
        for label, kwargs in variants.items():
            try:
                result["sweep_us"][label] = timer(
                    lambda: paged_attention_triton(*inputs, **kwargs), max_iters=50
                )
            except Exception as error:  # a variant that does not compile is data too
                result["sweep_us"][label] = f"error: {type(error).__name__}: {error}"[:200]
    return result


def bench_elementwise(
    timer, copy_gbps, *, name, make, triton_fn, reference_fn, outputs, io_bytes, target=None
) -> dict:
    """make(dtype) -> args; triton_fn/reference_fn(*args); outputs(result, args) -> tensors."""
    result = {"name": name, "checks": {}}
    for dtype in CHECK_DTYPES:
        args = make(dtype)
        expected_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        actual = outputs(triton_fn(*args), args)
        expected = outputs(reference_fn(*expected_args), expected_args)
        checks = [compare(a, e, dtype) for a, e in zip(actual, expected)]
        result["checks"][str(dtype)] = {
            "max_abs_error": max(c["max_abs_error"] for c in checks),
            "mismatched": sum(c["mismatched"] for c in checks),
            "finite": all(c["finite"] for c in checks),
            "ok": all(c["ok"] for c in checks),
        }
    args = make(BENCH_DTYPE)
    triton_us = timer(lambda: triton_fn(*args))
    reference_us = timer(lambda: reference_fn(*args), max_iters=50)
    gbps = io_bytes / triton_us / 1e3
    result.update(
        dtype=str(BENCH_DTYPE),
        triton_us=triton_us,
        reference_us=reference_us,
        bytes=io_bytes,
        gbps=gbps,
        fraction_of_copy_bandwidth=gbps / copy_gbps,
        speedup_vs_reference=reference_us / triton_us,
    )
    if target is not None:
        result["target_fraction"] = target
        result["meets_target"] = gbps / copy_gbps >= target
    return result


def bench_rmsnorm(timer, copy_gbps, rows=8192, hidden=4096) -> list[dict]:
    def make(dtype):
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype, generator=generator)
        residual = torch.randn(rows, hidden, device=DEVICE, dtype=dtype, generator=generator)
        weight = 1 + 0.1 * torch.randn(hidden, device=DEVICE, dtype=dtype, generator=generator)
        return x, residual, weight, 1e-6

    element = BENCH_DTYPE.itemsize
    fused = bench_elementwise(
        timer,
        copy_gbps,
        name=f"fused_add_rms_norm {rows}x{hidden}",
        make=make,
        triton_fn=fused_add_rms_norm_triton,
        reference_fn=fused_add_rms_norm_reference,
        outputs=lambda result, args: list(result),
        io_bytes=4 * rows * hidden * element,
        target=0.70,
    )
    plain = bench_elementwise(
        timer,
        copy_gbps,
        name=f"rms_norm {rows}x{hidden}",
        make=make,
        triton_fn=lambda x, r, w, eps: rms_norm_triton(x, w, eps),
        reference_fn=lambda x, r, w, eps: rms_norm_reference(x, w, eps),
        outputs=lambda result, args: [result],
        io_bytes=2 * rows * hidden * element,
    )
    return [fused, plain]


def bench_rotary(timer, copy_gbps, tokens=8192, num_heads=32, num_kv_heads=8, head_dim=128) -> dict:
    cache = build_cos_sin_cache(head_dim, 16384, 500000.0).to(DEVICE)

    def make(dtype):
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        qkv = torch.randn(
            tokens,
            (num_heads + 2 * num_kv_heads) * head_dim,
            device=DEVICE,
            dtype=dtype,
            generator=generator,
        )
        q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
            tokens, num_kv_heads, head_dim
        )
        positions = torch.randint(0, 16384, (tokens,), device=DEVICE, generator=generator)
        return q, k, positions, cache

    io_bytes = (
        2 * tokens * (num_heads + num_kv_heads) * head_dim * BENCH_DTYPE.itemsize
        + tokens * head_dim * 4
    )
    return bench_elementwise(
        timer,
        copy_gbps,
        name=f"rotary {tokens} tokens, {num_heads}/{num_kv_heads} heads x {head_dim}",
        make=make,
        triton_fn=apply_rotary_triton,
        reference_fn=apply_rotary_reference,
        outputs=lambda result, args: [args[0], args[1]],
        io_bytes=io_bytes,
    )


def bench_kv_store(
    timer, copy_gbps, tokens=8192, num_kv_heads=8, head_dim=128, block_size=16
) -> dict:
    num_blocks = 2 * tokens // block_size

    def make(dtype):
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        kv = torch.randn(
            tokens, 2 * num_kv_heads * head_dim, device=DEVICE, dtype=dtype, generator=generator
        )
        key = kv[:, : num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
        value = kv[:, num_kv_heads * head_dim :].view(tokens, num_kv_heads, head_dim)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.zeros(shape, device=DEVICE, dtype=dtype)
        value_cache = torch.zeros(shape, device=DEVICE, dtype=dtype)
        slots = torch.randperm(num_blocks * block_size, device=DEVICE, generator=generator)
        slots = slots[:tokens].to(torch.int64)
        slots[::97] = -1
        return key, value, key_cache, value_cache, slots

    io_bytes = 4 * tokens * num_kv_heads * head_dim * BENCH_DTYPE.itemsize
    return bench_elementwise(
        timer,
        copy_gbps,
        name=f"store_kvcache {tokens} tokens x {num_kv_heads} x {head_dim}",
        make=make,
        triton_fn=store_kvcache_triton,
        reference_fn=store_kvcache_reference,
        outputs=lambda result, args: [args[2], args[3]],
        io_bytes=io_bytes,
    )


# ---- report ---------------------------------------------------------------------------------
def to_markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Kernel microbenchmarks",
        "",
        f"{env['device']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}, "
        f"Python {env['python']}. Measured device-to-device copy bandwidth: "
        f"**{report['copy_bandwidth_gbps']:.0f} GB/s**. Times are medians with the L2 flushed; "
        f"{report['dtype']}.",
        "",
        f"| kernel | checks ({' / '.join(report['check_dtypes'])}) | Triton µs | GB/s | % of copy BW | target | torch reference µs "
        "| SDPA unpaged µs | TFLOP/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['name']} | ERROR | | | | | | | |")
            continue
        checks = " / ".join(
            "ok" if c["ok"] else f"FAIL ({c['max_abs_error']:.2g})" for c in r["checks"].values()
        )
        target = ""
        if "target_fraction" in r:
            target = f"≥{r['target_fraction']:.0%} {'met' if r['meets_target'] else 'MISSED'}"
        sdpa_us = f"{r['sdpa_unpaged_us']:.1f}" if "sdpa_unpaged_us" in r else ""
        tflops = f"{r['tflops']:.1f} (SDPA {r['sdpa_tflops']:.1f})" if "tflops" in r else ""
        lines.append(
            f"| {r['name']} | {checks} | {r['triton_us']:.1f} | {r['gbps']:.0f} | "
            f"{r['fraction_of_copy_bandwidth']:.0%} | {target} | {r['reference_us']:.1f} | "
            f"{sdpa_us} | {tflops} |"
        )
    for r in report["results"]:
        if r.get("sweep_us"):
            lines += ["", f"Variants of `{r['name']}` (µs):", ""]
            lines += [
                f"- {label}: {value if isinstance(value, str) else f'{value:.1f}'}"
                for label, value in r["sweep_us"].items()
            ]
    errors = [r for r in report["results"] if "error" in r]
    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            lines += [f"### {r['name']}", "```", r["error"], "```"]
    lines += ["", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global DEVICE, CHECK_DTYPES, BENCH_DTYPE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for kernels.json and kernels.md")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, only to exercise this script (on a CPU: under "
        "TRITON_INTERPRET=1, timings meaningless)",
    )
    parser.add_argument(
        "--time-per-measurement",
        type=float,
        default=0.15,
        help="seconds of timed runs per measurement",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            print(
                "nanoserve.bench.kernels: no CUDA device found; the kernel benchmarks need a "
                "GPU (the tests in tests/kernels run on a CPU under TRITON_INTERPRET=1).",
                file=sys.stderr,
            )
            return 2
        DEVICE, CHECK_DTYPES, BENCH_DTYPE = torch.device("cpu"), (torch.float16,), torch.float16
        envs.set_triton_interpret_default()  # before the first (lazy) triton.jit
    import triton

    out_dir = Path(args.out or envs.bench_out_dir() or "benchmarks/gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.time_per_measurement)
    copy_gbps = measure_copy_bandwidth((64 << 20) if args.smoke else (2 << 30))
    if DEVICE.type == "cuda":
        properties = torch.cuda.get_device_properties(0)
        device_name, sms = properties.name, properties.multi_processor_count
    else:
        device_name, sms = "CPU (Triton interpreter)", 0
    print(f"{device_name}: device-to-device copy {copy_gbps:.0f} GB/s", flush=True)
    if args.smoke:
        heads = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64}
        benches = [
            (
                "decode attention",
                lambda: bench_attention(
                    timer,
                    copy_gbps,
                    name="decode attention b3 ctx40",
                    num_seqs=3,
                    q_len=1,
                    context_len=39,
                    target=0.60,
                    sweep=True,
                    **heads,
                ),
            ),
            (
                "chunked prefill attention",
                lambda: bench_attention(
                    timer,
                    copy_gbps,
                    name="chunked prefill 2x9 after 20 cached",
                    num_seqs=2,
                    q_len=9,
                    context_len=20,
                    **heads,
                ),
            ),
            ("rmsnorm", lambda: bench_rmsnorm(timer, copy_gbps, rows=4, hidden=256)),
            ("rotary", lambda: bench_rotary(timer, copy_gbps, tokens=4, **heads)),
            (
                "kv store",
                lambda: bench_kv_store(timer, copy_gbps, tokens=8, num_kv_heads=2, head_dim=64),
            ),
        ]
    else:
        benches = [
            (
                "decode attention",
                lambda: bench_attention(
                    timer,
                    copy_gbps,
                    name="decode attention b64 ctx4096",
                    num_seqs=64,
                    q_len=1,
                    context_len=4095,
                    target=0.60,
                    sweep=True,
                ),
            ),
            (
                "long decode attention",
                lambda: bench_attention(
                    timer,
                    copy_gbps,
                    name="decode attention b8 ctx16384",
                    num_seqs=8,
                    q_len=1,
                    context_len=16383,
                    sweep=True,
                ),
            ),
            (
                "prefill attention",
                lambda: bench_attention(
                    timer,
                    copy_gbps,
                    name="prefill attention 4x2048",
                    num_seqs=4,
                    q_len=2048,
                    context_len=0,
                ),
            ),
            (
                "chunked prefill attention",
                lambda: bench_attention(
                    timer,
                    copy_gbps,
                    name="chunked prefill 8x512 after 3584 cached",
                    num_seqs=8,
                    q_len=512,
                    context_len=3584,
                ),
            ),
            ("rmsnorm", lambda: bench_rmsnorm(timer, copy_gbps)),
            ("rotary", lambda: bench_rotary(timer, copy_gbps)),
            ("kv store", lambda: bench_kv_store(timer, copy_gbps)),
        ]
    results = []
    for label, run in benches:
        started = time.perf_counter()
        try:
            produced = run()
            produced = produced if isinstance(produced, list) else [produced]
        except Exception:
            produced = [{"name": label, "error": traceback.format_exc()}]
        torch.cuda.empty_cache()
        for r in produced:
            if "error" in r:
                print(f"{r['name']}: ERROR\n{r['error']}", flush=True)
                continue
            ok = all(c["ok"] for c in r["checks"].values())
            sdpa_text = f", SDPA {r['sdpa_unpaged_us']:.1f} us" if "sdpa_unpaged_us" in r else ""
            print(
                f"{r['name']}: {'ok' if ok else 'CHECK FAILED'} {r['triton_us']:.1f} us, "
                f"{r['gbps']:.0f} GB/s ({r['fraction_of_copy_bandwidth']:.0%} of copy), "
                f"reference {r['reference_us']:.1f} us{sdpa_text} "
                f"[{time.perf_counter() - started:.0f}s]",
                flush=True,
            )
        results.extend(produced)
    command_args = sys.argv[1:] if argv is None else argv
    report = {
        "command": " ".join(["python3 -m nanoserve.bench.kernels", *command_args]),
        "environment": {
            "device": device_name,
            "sms": sms,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
        },
        "copy_bandwidth_gbps": copy_gbps,
        "dtype": str(BENCH_DTYPE).removeprefix("torch."),
        "check_dtypes": [str(d).removeprefix("torch.") for d in CHECK_DTYPES],
        "results": results,
    }
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=2))
    (out_dir / "kernels.md").write_text(to_markdown(report))
    print(f"wrote {out_dir / 'kernels.json'} and {out_dir / 'kernels.md'}")
    failed = [
        r["name"] for r in results if "error" in r or not all(c["ok"] for c in r["checks"].values())
    ]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
