"""Quantized weights on CUDA (issue 57), two stages for scripts/gpu_check.sh; each writes
WORK/<stage>-<name>.json beside nanoserve.bench.gpu_e2e's.

    python3 -m nanoserve.bench.gpu_quant quant-kernels --work DIR
    python3 -m nanoserve.bench.gpu_quant quant-memory --shape llama-3.2-1b --work DIR

quant-kernels: every format the Triton kernels hold (GGUF's eight block types; GPTQ / AWQ /
  compressed-tensors integers as Q8_0 / Q4_0 / Q4_1 with zero points; FP8 with block and channel
  scales) at a Llama layer's shape, through the GEMV (1 and 4 rows) and the tiled GEMM (16 and 256
  rows), checked against the torch reference (kernels/quant_triton.quant_gemm_triton_reference),
  timed, with the weight bytes a GEMV reads per second and cuBLAS's bf16 GEMM beside it.
quant-memory: a Q4_K_M-shaped GGUF file of a real model's shape (random blocks, the mix llama.cpp
  writes: Q6_K for V and down in the layers its use_more_bits picks, Q4_K elsewhere, a Q6_K head)
  loaded on CUDA: torch.cuda.memory_allocated for the weights against the file's tensor bytes
  (checked within 5%), and the target of issue 57 (an 8B Q4_K_M under 5.2 GB).
--smoke: tiny shapes on a CPU under Triton's interpreter (NANOSERVE_KERNELS=triton and
TRITON_INTERPRET=1 set by the caller), to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

GB = 1e9
# name -> (hidden, intermediate, layers, heads, kv heads, vocab, tied)
SHAPES = {
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False),
    "smoke": (256, 512, 2, 4, 2, 512, True),
}
WEIGHT_BYTES_TARGET = {"llama-3.1-8b": 5.2e9}  # issue 57: an 8B Q4_K_M under 5.2 GB on the GPU
GGUF_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# a GGUF block type -> byte offsets of its f16 scales in a block (set to sane values)
_SCALE_FIELDS = {
    "q8_0": (0,),
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}


def device_of(args) -> torch.device:
    return torch.device("cpu" if args.smoke else "cuda")


def random_gguf_rows(qtype: str, rows: int, k: int, generator, device) -> torch.Tensor:
    """Random blocks of `qtype` (uint8 [rows, row bytes]) whose values are about 1 / sqrt(k)."""
    from nanoserve.kernels.gguf_formats import GGUF_QTYPES

    block, block_bytes = GGUF_QTYPES[qtype]
    raw = torch.randint(
        0, 256, (rows, k // block, block_bytes), generator=generator, dtype=torch.uint8
    ).to(device)
    scale = (1.0 / k**0.5) / (64.0 if qtype.endswith("_k") else 8.0)
    for at in _SCALE_FIELDS[qtype]:
        values = torch.full((rows, k // block, 1), scale, dtype=torch.float16, device=device)
        raw[..., at : at + 2] = values.view(torch.uint8)
    return raw.reshape(rows, -1)


def weights_for_check(shape: tuple[int, int], device, smoke: bool):
    """(label, QuantWeight held for the Triton kernels) of every format at `shape` (n, k)."""
    from nanoserve.kernels.quant import QuantWeight
    from nanoserve.kernels.quant_blocks import make_group_blocks

    n, k = shape
    generator = torch.Generator().manual_seed(0)
    for qtype in GGUF_TYPES:
        raw = random_gguf_rows(qtype, n, k, generator, device)
        yield f"gguf {qtype}", QuantWeight(qtype, n, k, raw, triton=True)
    nb = k // 32

    def group_scales(group: int) -> torch.Tensor:
        per_group = torch.rand(n, -(-k // group), generator=generator) * 0.01 + 1e-3
        return per_group.half().float().repeat_interleave(group // 32, 1)[:, :nb].contiguous()

    for label, qtype, top, group, zero in (
        ("gptq int8 g128 (q8_0)", "q8_0", 256, 128, False),
        ("gptq int4 g128 (q4_0)", "q4_0", 16, 128, False),
        ("awq int4 g128 zero points (q4_1)", "q4_1", 16, 128, True),
    ):
        u = torch.randint(0, top, (n, k), generator=generator, dtype=torch.uint8)
        scale = group_scales(group)
        mins = None
        if zero:
            points = torch.randint(0, 16, (n, -(-k // group)), generator=generator).float()
            mins = -(scale * points.repeat_interleave(group // 32, 1)[:, :nb])
        blocks = make_group_blocks(qtype, u, scale, mins).to(device)
        yield label, QuantWeight(qtype, n, k, None, blocks=blocks, triton=True)
    values = (torch.randn(n, k, generator=generator) * 64).clamp(-448, 448)
    e4m3 = values.to(torch.float8_e4m3fn).view(torch.uint8)
    for label, scale in (
        ("fp8 block 128x128", torch.rand(-(-n // 128), -(-k // 128), generator=generator)),
        ("fp8 channel", torch.rand(n, 1, generator=generator)),
    ):
        rows = scale.repeat_interleave(128 if scale.shape[0] < n else 1, 0)[:n]
        per_block = rows.repeat_interleave(4 if scale.shape[1] > 1 else nb, 1)[:, :nb]
        per_block = (per_block * 1e-3 + 1e-4).contiguous()
        blocks = make_group_blocks("fp8_e4m3", e4m3, per_block, None).to(device)
        yield label, QuantWeight("fp8_e4m3", n, k, None, blocks=blocks, triton=True)


def timed(fn, device, repeat: int) -> float:
    """Median microseconds of `fn` (CUDA events on a GPU; one call on the smoke CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def stage_kernels(args) -> dict:
    from nanoserve.kernels.quant_triton import quant_gemm_triton, quant_gemm_triton_reference

    device = device_of(args)
    shape = (64, 256) if args.smoke else (4096, 4096)
    rows = (
        ((1, "gemv"), (5, "gemm"))
        if args.smoke
        else ((1, "gemv"), (4, "gemv"), (16, "gemm"), (256, "gemm"))
    )
    dtype = torch.float32 if args.smoke else torch.bfloat16
    generator = torch.Generator().manual_seed(1)
    results, ok = [], True
    dense = torch.randn(shape, generator=generator).to(dtype).to(device) / shape[1] ** 0.5
    for label, weight in weights_for_check(shape, device, args.smoke):
        for m, kernel in rows:
            x = torch.randn(m, shape[1], generator=generator).to(dtype).to(device)
            got = quant_gemm_triton(x, weight, None, kernel=kernel).float()
            want = quant_gemm_triton_reference(x, weight, None).float()
            error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
            passed = error < (2e-2 if dtype == torch.bfloat16 else 1e-4)
            ok &= passed
            micros = timed(lambda: quant_gemm_triton(x, weight, None, kernel=kernel), device, 20)
            row = {
                "format": label,
                "m": m,
                "kernel": kernel,
                "max_relative_error": error,
                "ok": passed,
                "us": micros,
                "weight_bytes": weight.nbytes,
                "weight_gbps": weight.nbytes / micros / 1e3,
            }
            results.append(row)
            print(
                f"{label:34s} m={m:<4d} {kernel}: error {error:.2e} {'ok' if passed else 'FAILED'}"
                f"  {micros:9.1f} us  {row['weight_gbps']:7.1f} GB/s of weights",
                flush=True,
            )
    baseline = {}
    for m, _ in rows:
        x = torch.randn(m, shape[1], generator=generator).to(dtype).to(device)
        micros = timed(lambda: torch.nn.functional.linear(x, dense), device, 20)
        baseline[str(m)] = {
            "us": micros,
            "weight_gbps": dense.numel() * dense.element_size() / micros / 1e3,
        }
        print(
            f"{'dense ' + str(dtype).removeprefix('torch.') + ' (F.linear)':34s} m={m:<4d}        {micros:9.1f} us",
            flush=True,
        )
    return {
        "ok": ok,
        "shape": list(shape),
        "dtype": str(dtype),
        "results": results,
        "dense": baseline,
    }


def write_q4_k_m_gguf(path: Path, shape_name: str) -> int:
    """A GGUF file of `shape_name` with llama.cpp's Q4_K_M mix (random blocks; no tokenizer):
    the file's tensor bytes."""
    import gguf
    import numpy as np

    hidden, inter, layers, heads, kv_heads, vocab, tied = SHAPES[shape_name]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(vocab)
    generator = torch.Generator().manual_seed(0)
    total = 0

    def add(name: str, rows: int, k: int, qtype: str) -> None:
        nonlocal total
        template = random_gguf_rows(qtype, 16, k, generator, "cpu").numpy()
        data = np.tile(template, (rows // 16, 1))  # the bytes' values don't matter here
        writer.add_tensor(name, data, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype.upper()))
        total += data.nbytes

    def norm(name: str) -> None:
        nonlocal total
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))
        total += hidden * 4

    add("token_embd.weight", vocab, hidden, "q6_k" if tied else "q4_k")
    for layer in range(layers):
        more_bits = (
            layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        )
        prefix = f"blk.{layer}."
        norm(prefix + "attn_norm.weight")
        norm(prefix + "ffn_norm.weight")
        add(prefix + "attn_q.weight", hidden, hidden, "q4_k")
        add(prefix + "attn_k.weight", kv_heads * head_dim, hidden, "q4_k")
        add(prefix + "attn_v.weight", kv_heads * head_dim, hidden, "q6_k" if more_bits else "q4_k")
        add(prefix + "attn_output.weight", hidden, hidden, "q4_k")
        add(prefix + "ffn_gate.weight", inter, hidden, "q4_k")
        add(prefix + "ffn_up.weight", inter, hidden, "q4_k")
        add(prefix + "ffn_down.weight", hidden, inter, "q6_k" if more_bits else "q4_k")
    norm("output_norm.weight")
    if not tied:
        add("output.weight", vocab, hidden, "q6_k")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


def stage_memory(args) -> dict:
    from nanoserve.models.config import ModelConfig
    from nanoserve.models.registry import build_model, model_weight_bytes

    device = device_of(args)
    shape_name = "smoke" if args.smoke else args.shape
    directory = Path(args.work) / f"gguf-{shape_name}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.Q4_K_M.gguf"
    started = time.perf_counter()
    file_bytes = write_q4_k_m_gguf(path, shape_name)
    written = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = build_model(ModelConfig.from_dir(directory), torch.bfloat16, device, directory)
    loaded = time.perf_counter() - started
    held = model_weight_bytes(model)
    allocated = peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        # (the layers are built with their float weights before a loader gives them the blocks)
        peak = torch.cuda.max_memory_allocated() - before
    measured = allocated if allocated is not None else held
    ratio = measured / file_bytes
    result = {
        "shape": shape_name,
        "file_tensor_bytes": file_bytes,
        "file_bytes": path.stat().st_size,
        "weights_held_bytes": held,
        "cuda_memory_allocated_bytes": allocated,
        "cuda_peak_during_load_bytes": peak,
        "weights_bytes": measured,
        "ratio_to_file": ratio,
        "write_s": written,
        "load_s": loaded,
        "ok": abs(ratio - 1) < 0.05,
    }
    target = WEIGHT_BYTES_TARGET.get(shape_name)
    if target is not None:
        result["target_bytes"] = target
        result["meets_target"] = measured < target
    print(
        f"{shape_name} Q4_K_M: weights {measured / GB:.3f} GB on {device.type} "
        f"(held {held / GB:.3f} GB), the file's tensors {file_bytes / GB:.3f} GB: {ratio:.4f}x"
        + (f"; target < {target / GB:.1f} GB: {result['meets_target']}" if target else ""),
        flush=True,
    )
    path.unlink()
    return result


STAGES = {"quant-kernels": stage_kernels, "quant-memory": stage_memory}


def report_targets(stages: list[dict]) -> list[dict]:
    """nanoserve.bench.gpu_report's rows for these stages (target, value, met)."""
    rows = []
    for stage in stages:
        if stage.get("stage") == "quant-kernels" and "results" in stage:
            failed = [r for r in stage["results"] if not r["ok"]]
            rows.append(
                {
                    "target": "quantized GEMV / GEMM of every format = torch reference",
                    "value": f"{len(stage['results']) - len(failed)} of {len(stage['results'])}"
                    + (
                        f"; failed: {[(r['format'], r['m']) for r in failed][:4]}" if failed else ""
                    ),
                    "met": not failed,
                }
            )
        if stage.get("stage") == "quant-memory" and "ratio_to_file" in stage:
            gigabytes = stage["weights_bytes"] / GB
            rows.append(
                {
                    "target": f"{stage['shape']} Q4_K_M: memory for weights = file ± 5%",
                    "value": f"{gigabytes:.3f} GB, {stage['ratio_to_file']:.4f}x the file",
                    "met": stage["ok"],
                }
            )
            if "target_bytes" in stage:
                rows.append(
                    {
                        "target": f"{stage['shape']} Q4_K_M: weights < {stage['target_bytes'] / GB:.1f} GB",
                        "value": f"{gigabytes:.3f} GB",
                        "met": stage["meets_target"],
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--work", required=True, help="directory for <stage>-<name>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU (interpreter)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("nanoserve.bench.gpu_quant: no CUDA device (--smoke on a CPU)", file=sys.stderr)
        return 2
    name = "smoke" if args.smoke else (args.shape if args.stage == "quant-memory" else "formats")
    started = time.perf_counter()
    try:
        result = STAGES[args.stage](args)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr)
    result.update(stage=args.stage, name=name, seconds=time.perf_counter() - started)
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{args.stage}-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.stage} {name}: {'ok' if result['ok'] else 'FAILED'}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
