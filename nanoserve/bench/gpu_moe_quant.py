"""The fused-MoE Triton kernel on quantized experts, on a CUDA device (a stage of
scripts/gpu_check.sh):

    python3 -m nanoserve.bench.gpu_moe_quant --work DIR [--smoke]

For each format (GGUF Q4_K, Q6_K, Q8_0; MXFP4; FP8 E4M3; GPTQ/AWQ-style Q4_1 integers), a MoE
layer of Qwen3-30B-A3B's shape (128 experts, hidden 2048, expert intermediate 768, top-8) with
random experts held as kernels/fused_moe_quant.ExpertBlocks: the GPU memory they take against
the checkpoint's bytes (within 5% for GGUF, MXFP4 and FP8; Q4_1's ratio reported), and the layer's output against the reference (the experts
dequantized, then the loop over experts in fp32) at one token and at 256; figures: the layer's
time at one token (a decode step) and 256, against the same layer in bf16, and the bandwidth of
the experts' bytes a decode step reads. Writes WORK/quant_moe-<name>.json (gpu_report lists it) and, with --out, OUT/quant_moe.md.
--smoke: a tiny layer on a CPU under the Triton interpreter (to check this script; timings mean
nothing). Exit status 0 when every check passed, 1 otherwise, 2 without CUDA (and no --smoke).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from nanoserve import envs

# (experts, hidden, expert intermediate, top-k)
SHAPE = (128, 2048, 768, 8)
SMOKE_SHAPE = (4, 64, 32, 2)
FORMATS = ("q4_k", "q6_k", "q8_0", "mxfp4", "fp8_e4m3", "q4_1")
SMOKE_FORMATS = ("q8_0", "mxfp4")
# The f16 scales in each GGUF block (byte offsets): random bytes elsewhere are valid codes.
_GGUF_HALVES = {"q4_k": (0, 2), "q6_k": (208,), "q8_0": (0,)}


def random_expert(qtype: str, n: int, k: int, generator: torch.Generator):
    """One expert's [n, k] matrix as a kernels/quant.QuantWeight of `qtype`, values ~1/sqrt(k),
    drawn on the generator's device."""
    from nanoserve.kernels import quant

    size = k**-0.5
    device = generator.device

    def randint(low, high, shape):
        return torch.randint(low, high, shape, generator=generator, device=device)

    def rand(*shape):
        return torch.rand(shape, generator=generator, device=device)

    if qtype in _GGUF_HALVES:
        values, nbytes = quant.GGUF_QTYPES[qtype]
        raw = randint(0, 256, (n, k // values, nbytes)).to(torch.uint8)
        # d (and dmin) so that a value is about `size` (the codes' ranges: 6-bit scales x 4-bit
        # values for the K types' d, 8-bit for Q8_0).
        unit = {"q4_k": size / (32 * 8), "q6_k": size / (32 * 32), "q8_0": size / 64}[qtype]
        for at in _GGUF_HALVES[qtype]:
            half = (rand(n, k // values) + 0.5) * unit
            raw[..., at : at + 2] = half.half().view(torch.uint8).reshape(n, k // values, 2)
        return quant.QuantWeight(qtype, n, k, raw.reshape(n, -1).contiguous())
    blocks = k // 32
    if qtype == quant.MXFP4:
        u = randint(0, 16, (n, k)).to(torch.uint8)
        exponents = randint(120, 123, (n, blocks)).to(torch.int32) - 128
        scale, mins = torch.ldexp(torch.ones(n, blocks, device=device), exponents), None
    elif qtype == quant.FP8:
        values = (torch.randn(n, k, generator=generator, device=device) * 64).clamp(-448, 448)
        u = values.to(torch.float8_e4m3fn).view(torch.uint8)
        scale, mins = torch.full((n, blocks), size / 64, device=device), None
    else:  # q4_1: 4-bit integers, a scale and a min per 128, repeated per 32 (AWQ's loader)
        u = randint(0, 16, (n, k)).to(torch.uint8)
        scale = ((rand(n, blocks // 4) + 0.5) * size / 8).repeat_interleave(4, dim=1)
        mins = -8 * scale
    components = quant.QuantComponents(u, scale, mins)
    return quant.QuantWeight(qtype, n, k, None, components=components)


def file_bytes(qtype: str, n: int, k: int) -> int:
    """The bytes one [n, k] matrix takes in its checkpoint: a GGUF file's blocks; MXFP4's 17 per
    32 (gpt-oss's _blocks and _scales); an FP8 checkpoint's byte a weight and an fp32 scale a row;
    an AWQ file's nibbles, an f16 scale and a 4-bit zero point per group of 128 (Q4_1)."""
    from nanoserve.kernels import quant

    if qtype == "q4_1":
        return n * k // 2 + n * (k // 128) * 5 // 2
    if qtype in quant.GGUF_QTYPES:
        values, nbytes = quant.GGUF_QTYPES[qtype]
        return n * k // values * nbytes
    return n * k // 32 * 17 if qtype == quant.MXFP4 else n * k + 4 * n


# Held within 5% of the checkpoint's bytes (GGUF and MXFP4 as stored; FP8's byte a weight and a
# scale a row, held once per row); Q4_1 reports its ratio (fp32 scale and min per 128 against
# AWQ's f16 scale and 4-bit zero point).
AS_STORED = ("q4_k", "q6_k", "q8_0", "mxfp4", "fp8_e4m3")


def timed(fn, device: torch.device, iterations: int) -> float:
    """Median seconds of `fn` over `iterations` runs after a warm-up."""
    fn()
    times = []
    for _ in range(iterations):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def check_format(qtype: str, shape, device: torch.device, smoke: bool) -> dict:
    from nanoserve.kernels import quant
    from nanoserve.kernels.fused_moe import fused_experts_reference, fused_experts_triton
    from nanoserve.kernels.fused_moe_quant import ExpertBlocks

    experts, hidden, inter, top_k = shape
    generator = torch.Generator(device=device).manual_seed(0)
    held, expected_bytes, matrices = [], 0, []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        weights = [random_expert(qtype, n, k, generator) for _ in range(experts)]
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        blocks = ExpertBlocks.stack(weights, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated() - before)
        else:
            held.append(blocks.nbytes)
        expected_bytes += experts * file_bytes(qtype, n, k)
        matrices.append(blocks)
        del weights
    result = {
        "held_bytes": sum(held),
        "file_bytes": expected_bytes,
        "held_over_file": sum(held) / expected_bytes,
    }
    dtype = torch.float32 if device.type != "cuda" else torch.bfloat16
    # The check routes among the first CHECKED experts only (their dequantization, on the CPU,
    # is the slow part); the timings route among all of them.
    checked = min(experts, 16)
    float13, float2 = (
        torch.stack([quant.dequantize_weight(m.expert_weight(e)) for e in range(checked)]).to(
            device
        )
        for m in matrices
    )
    meta13, meta2 = (torch.empty((experts, *m.shape[1:]), device="meta") for m in (float13, float2))
    errors, times = {}, {}
    for tokens in (1, 8 if smoke else 64):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=gen).to(device)
        logits = torch.randn(tokens, checked, generator=gen).to(device)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        want = fused_experts_reference(x, float13, float2, weights, ids)
        got = fused_experts_triton(x.to(dtype), meta13, meta2, weights, ids, tuple(matrices))
        # Relative to the output's size: bf16 activations and products, fp32 sums.
        errors[tokens] = float((got.float() - want).abs().max() / want.abs().max())
    del float13, float2
    if device.type == "cuda":
        bf13 = torch.randn((experts, 2 * inter, hidden), device=device, dtype=dtype) * hidden**-0.5
        bf2 = torch.randn((experts, hidden, inter), device=device, dtype=dtype) * inter**-0.5
    for tokens in (1, 8 if smoke else 256):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        logits = torch.randn(tokens, experts, generator=gen).to(device)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        quantized = lambda: fused_experts_triton(  # noqa: E731
            x, meta13, meta2, weights, ids, tuple(matrices)
        )
        times[tokens] = {"quantized_s": timed(quantized, device, 1 if smoke else 20)}
        if device.type == "cuda":
            floating = lambda: fused_experts_triton(x, bf13, bf2, weights, ids)  # noqa: E731
            times[tokens]["bf16_s"] = timed(floating, device, 20)
    # A decode step reads top_k experts' matrices (distinct experts for one token).
    read = top_k * sum(m.nbytes // experts for m in matrices)
    result.update(
        max_relative_error=errors,
        times=times,
        decode_bytes_read=read,
        decode_gbps=read / times[1]["quantized_s"] / 1e9,
        checks={
            "held_within_5pct_of_file": qtype not in AS_STORED
            or abs(result["held_over_file"] - 1) <= 0.05,
            "equals_reference": all(
                e <= (2e-2 if dtype == torch.bfloat16 else 1e-4) for e in errors.values()
            ),
        },
    )
    if device.type == "cuda":
        del bf13, bf2
        torch.cuda.empty_cache()
    return result


def to_markdown(result: dict) -> str:
    experts, hidden, inter, top_k = result["shape"]
    lines = [
        f"# Fused MoE on quantized experts ({result.get('device', 'CPU, interpreter')})",
        "",
        f"One layer: {experts} experts, hidden {hidden}, expert intermediate {inter}, top-{top_k}; "
        "times are medians of CUDA-event timings (bf16 activations); the bf16 column is the "
        "same kernel on bf16 experts.",
        "",
        "| format | held / file bytes | max rel. error (1, many tokens) | decode us (bf16) | "
        "many tokens us (bf16) | decode GB/s of experts read | checks |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for qtype, found in result["formats"].items():
        if "times" not in found:
            lines.append(f"| {qtype} | | | | | | error |")
            continue
        errors = ", ".join(f"{e:.1e}" for e in found["max_relative_error"].values())
        cells = []
        for tokens in sorted(found["times"]):
            t = found["times"][tokens]
            bf16 = f" ({1e6 * t['bf16_s']:.1f})" if "bf16_s" in t else ""
            cells.append(f"{1e6 * t['quantized_s']:.1f}{bf16}")
        met = "ok" if all(found["checks"].values()) else "FAILED"
        lines.append(
            f"| {qtype} | {found['held_over_file']:.3f} | {errors} | {cells[0]} | {cells[-1]} | "
            f"{found['decode_gbps']:.0f} | {met} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="directory for quant_moe-<name>.json")
    parser.add_argument("--name", default="qwen3-30b-a3b-layer")
    parser.add_argument("--out", help="directory for quant_moe.md (the figures as a table)")
    parser.add_argument("--smoke", action="store_true", help="a tiny layer on a CPU")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
        envs.set_triton_interpret_default()  # before the first (lazy) triton.jit
    else:
        print("nanoserve.bench.gpu_moe_quant: no CUDA device (--smoke: on a CPU)", file=sys.stderr)
        return 2
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    result = {"stage": "quant_moe", "name": args.name, "shape": shape, "formats": {}}
    started = time.perf_counter()
    for qtype in SMOKE_FORMATS if args.smoke else FORMATS:
        try:
            found = check_format(qtype, shape, device, args.smoke)
        except Exception:
            found = {"error": traceback.format_exc(), "checks": {"ran": False}}
            print(found["error"], file=sys.stderr)
        result["formats"][qtype] = found
        line = {
            k: v
            for k, v in found.items()
            if k in ("held_over_file", "max_relative_error", "decode_gbps", "checks")
        }
        if "times" in found:
            line["decode_us"] = {k: round(v * 1e6, 1) for k, v in found["times"][1].items()}
            line[f"{max(found['times'])} tokens_us"] = {
                k: round(v * 1e6, 1) for k, v in found["times"][max(found["times"])].items()
            }
        print(f"quant_moe {qtype}: {json.dumps(line)}", flush=True)
    result["ok"] = all(all(f["checks"].values()) for f in result["formats"].values())
    result["seconds"] = time.perf_counter() - started
    if device.type == "cuda":
        result["device"] = torch.cuda.get_device_name(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / f"quant_moe-{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "quant_moe.md").write_text(to_markdown(result))
    print(f"quant_moe {args.name}: {'ok' if result['ok'] else 'FAILED'}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
