"""The fused-MoE Triton kernel on quantized experts (kernels/fused_moe_quant.py; the interpreter
on a CPU, natively on CUDA) against a torch reference: each expert's matrix dequantized by an
independent definition of its format (the gguf package for GGUF rows, transformers-style tables
for MXFP4 and E4M3, kernels/quant.dequantize_weight for integer components), then the loop over
experts (fused_experts_reference). GGUF K types and 32-value types, MXFP4, FP8, Q4_0 / Q4_1
integers; top-2 of a few experts; one token and more rows than a block."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve.kernels import quant
from nanoserve.kernels.fused_moe import (
    fused_experts,
    fused_experts_reference,
    fused_experts_triton,
)
from nanoserve.kernels.fused_moe_quant import ExpertBlocks, quantized_expert_form
from tests.gguf_models import _random_k_blocks
from tests.kernels.utils import DEVICE

EXPERTS, TOP_K = 4, 2
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def gguf_expert(qtype: str, n: int, k: int, rng) -> tuple[quant.QuantWeight, torch.Tensor]:
    """(the QuantWeight of GGUF rows, its values by the gguf package)."""
    ggml_type = getattr(gguf.GGMLQuantizationType, qtype.upper())
    if qtype.endswith("_k"):
        raw = _random_k_blocks(n, k, qtype, rng)
    else:
        raw = gguf.quants.quantize(
            rng.normal(0, 2 / np.sqrt(k), size=(n, k)).astype(np.float32), ggml_type
        )
    values = np.array(gguf.quants.dequantize(raw, ggml_type), dtype=np.float32).reshape(n, k)
    raw = torch.from_numpy(np.ascontiguousarray(raw))
    return quant.QuantWeight(qtype, n, k, raw), torch.from_numpy(values)


def components_expert(
    qtype: str, n: int, k: int, rng, group: int = 32
) -> tuple[quant.QuantWeight, torch.Tensor]:
    """(a QuantWeight of kernel components, as a checkpoint's loader makes them, its values);
    `group`: inputs a scale (and min) covers, repeated per 32 as the loaders do."""
    blocks = k // group
    size = 2 / np.sqrt(k)
    if qtype == quant.MXFP4:  # codes and a power-of-two scale 2^(e - 128) per 32
        codes = torch.from_numpy(rng.integers(0, 16, size=(n, k), dtype=np.uint8))
        exponents = torch.from_numpy(rng.integers(118, 126, size=(n, blocks))).to(torch.int32)
        scale = torch.ldexp(torch.ones(n, blocks), exponents - 128)
        values = E2M1[codes.long()] * 2 * scale.repeat_interleave(32, dim=1)
        parts = quant.QuantComponents(codes, scale)
    elif qtype == quant.FP8:  # E4M3 bytes (no NaN), a scale per 32
        values = torch.from_numpy(rng.normal(0, 100, size=(n, k)).astype(np.float32))
        fp8 = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        fp8[0, :8] = torch.tensor([0.0, -0.0, 2**-9, -(2**-9), 7 * 2**-9, 2**-6, 448, -448])
        scale = torch.from_numpy(rng.uniform(0.5, 1.5, size=(n, blocks)).astype(np.float32))
        scale = scale * (size / 100)
        values = fp8.float() * scale.repeat_interleave(group, dim=1)
        parts = quant.QuantComponents(fp8.view(torch.uint8), scale)
    else:  # GPTQ / AWQ-style integers: Q4_0 (offset 8), Q4_1 (a min), Q8_0 (offset 128)
        top = 256 if qtype == "q8_0" else 16
        u = torch.from_numpy(rng.integers(0, top, size=(n, k), dtype=np.uint8))
        scale = torch.from_numpy(
            (rng.uniform(0.5, 1.5, size=(n, blocks)) * size / top * 2).astype(np.float32)
        )
        mins = None
        if qtype == "q4_1":
            mins = torch.from_numpy(rng.normal(0, size, size=(n, blocks)).astype(np.float32))
        parts = quant.QuantComponents(u, scale, mins)
        values = None
    if group != 32:
        repeat = group // 32
        parts = quant.QuantComponents(
            parts.u,
            parts.scale.repeat_interleave(repeat, dim=1),
            None if parts.mins is None else parts.mins.repeat_interleave(repeat, dim=1),
        )
    weight = quant.QuantWeight(qtype, n, k, None, components=parts)
    return weight, (quant.dequantize_weight(weight) if values is None else values)


def routing(tokens: int, seed: int):
    """Top-2 of EXPERTS: every expert but the last picked (an expert with no rows), one slot of
    another rank's (-1) when there are several tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:TOP_K] for _ in range(tokens)])
    if tokens > 1:
        ids[1, 1] = -1
    return torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1), ids


# (format, hidden, inter): the K types need inputs in whole super-blocks of 256.
CASES = [
    ("q4_k", 256, 256),
    ("q5_k", 256, 256),
    ("q6_k", 256, 256),
    ("q8_0", 64, 32),
    ("q4_0", 64, 32),
    ("q4_1", 64, 32),
    ("q5_0", 64, 32),
    (quant.MXFP4, 64, 32),
    (quant.FP8, 64, 32),
    ("q4_0 ints", 64, 32),
    ("q4_1 ints", 64, 32),
    ("q4_1 ints g64", 128, 64),  # a scale and min per 64 inputs (held once per 64)
    ("fp8_e4m3 g64", 128, 64),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("tokens", [1, 70])  # 70 x 2 rows: blocks of 64, several an expert
def test_quantized_experts_equal_the_dequantized_loop(case, tokens):
    qtype, hidden, inter = case
    qtype, components = qtype.split()[0], "ints" in case[0] or "g64" in case[0]
    group = 64 if case[0].endswith("g64") else 32
    rng = np.random.default_rng(tokens)

    def make(qtype, n, k, rng):
        if qtype in quant.GGUF_QTYPES and not components:
            return gguf_expert(qtype, n, k, rng)
        return components_expert(qtype, n, k, rng, group)

    (q13, v13), (q2, v2) = (
        ([w for w, _ in pairs], torch.stack([v for _, v in pairs]))
        for pairs in (
            [make(qtype, n, k, rng) for _ in range(EXPERTS)]
            for n, k in ((2 * inter, hidden), (hidden, inter))
        )
    )
    blocks13, blocks2 = (ExpertBlocks.stack(w, DEVICE) for w in (q13, q2))
    assert blocks13.scale_group == blocks2.scale_group == group
    hidden_states = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(tokens, seed=tokens)
    expected = fused_experts_reference(hidden_states, v13, v2, weights, ids)
    meta13, meta2 = (torch.empty(v.shape, device="meta") for v in (v13, v2))
    got = fused_experts_triton(
        hidden_states.to(DEVICE),
        meta13,
        meta2,
        weights.to(DEVICE),
        ids.to(DEVICE),
        (blocks13, blocks2),
    )
    assert expected.abs().max() > 0.1  # not trivially zero
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    # What the reference path (NANOSERVE_KERNELS=reference) reads back: the same values.
    assert torch.equal(blocks13.dequantized().cpu(), v13)
    assert torch.equal(blocks2.dequantized().cpu(), v2)


def test_bytes_held_are_the_formats_own():
    """GGUF rows as the file's bytes; MXFP4 17 bytes a block of 32 (as the checkpoint and a GGUF
    file hold it); 4-bit integers half a byte and an fp32 scale (and min) per 32."""
    rng = np.random.default_rng(0)
    for qtype, bytes_per_32 in (("q4_k", 144 / 8), ("q6_k", 210 / 8), ("q4_0", 18)):
        weight, _ = gguf_expert(qtype, 16, 256, rng)
        blocks = ExpertBlocks.stack([weight, weight], torch.device("cpu"))
        assert blocks.nbytes == 2 * weight.raw.numel() == 2 * 16 * 8 * bytes_per_32
    for qtype, bytes_per_32 in ((quant.MXFP4, 17), ("q4_0", 20), ("q4_1", 24), (quant.FP8, 36)):
        weight, _ = components_expert(qtype, 16, 64, rng)
        blocks = ExpertBlocks.stack([weight], torch.device("cpu"))
        assert blocks.nbytes == 16 * 2 * bytes_per_32, qtype


def test_scales_repeated_by_the_loader_are_held_once_per_group():
    """A GPTQ-style Q4_0 with a scale per 128 inputs holds 0.53 bytes a weight, not 0.625; an
    FP8 matrix with a scale per row about a byte a weight; an expert whose scales vary more
    often than the first's makes every expert's held at its finer group, values unchanged."""
    rng = np.random.default_rng(5)
    gptq, _ = components_expert("q4_0", 16, 256, rng, group=128)
    blocks = ExpertBlocks.stack([gptq], torch.device("cpu"))
    assert blocks.scale_group == 128 and blocks.nbytes == 16 * 256 // 2 + 16 * 2 * 4
    per_row, _ = components_expert(quant.FP8, 16, 256, rng, group=256)
    assert ExpertBlocks.stack([per_row], torch.device("cpu")).nbytes == 16 * 256 + 16 * 4
    coarse, coarse_values = components_expert("q4_1", 16, 256, rng, group=128)
    fine, fine_values = components_expert("q4_1", 16, 256, rng, group=64)
    blocks = ExpertBlocks.stack([coarse, fine], torch.device("cpu"))
    assert blocks.scale_group == 64 and blocks.scales.shape == (2, 16, 4)
    assert torch.equal(blocks.dequantized(), torch.stack([coarse_values, fine_values]))


def test_experts_of_another_format_are_refused():
    rng = np.random.default_rng(1)
    first, _ = gguf_expert("q4_0", 16, 64, rng)
    other, _ = gguf_expert("q8_0", 16, 64, rng)
    with pytest.raises(ValueError, match="must share one format"):
        ExpertBlocks.stack([first, other], torch.device("cpu"))


def test_held_form_by_device(monkeypatch):
    """The load's choice (kernels/fused_moe_quant.quantized_expert_form): blocks for the Triton
    kernel on CUDA, the C++ kernels' packing on a CPU, blocks on a CPU too when Triton is forced."""
    import nanoserve.kernels as kernels

    monkeypatch.delenv("NANOSERVE_KERNELS", raising=False)
    kernels.reset_kernel_choice()
    try:
        for qtype in ("q4_k", "q6_k", "q8_0", "q4_1", quant.MXFP4, quant.FP8):
            assert quantized_expert_form(torch.device("cuda"), qtype) == "triton"
            assert quantized_expert_form(torch.device("cpu"), qtype) == "cpu"
        assert quantized_expert_form(torch.device("cuda"), "q3_k") is None
        monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
        kernels.reset_kernel_choice()
        assert quantized_expert_form(torch.device("cpu"), "q4_k") == "triton"
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS", raising=False)
        kernels.reset_kernel_choice()


def test_dispatch_keeps_blocks_and_reference_reads_them(monkeypatch):
    """fused_experts: held blocks go to the Triton kernel whatever the choice but "reference",
    which multiplies them dequantized; a float down matrix beside quantized gate/up works."""
    import nanoserve.kernels as kernels

    rng = np.random.default_rng(2)
    pairs = [gguf_expert("q8_0", 64, 64, rng) for _ in range(EXPERTS)]
    blocks13 = ExpertBlocks.stack([w for w, _ in pairs], DEVICE)
    v13 = torch.stack([v for _, v in pairs])
    w2 = torch.randn(EXPERTS, 64, 32, generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(9, seed=9)
    expected = fused_experts_reference(hidden, v13, w2, weights, ids)
    meta13 = torch.empty(v13.shape, device="meta")
    calls = []
    real = fused_experts_triton
    import nanoserve.kernels.fused_moe as fused_moe

    monkeypatch.setattr(
        fused_moe, "fused_experts_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    try:
        for choice in ("triton", "reference"):
            monkeypatch.setenv("NANOSERVE_KERNELS", choice)
            kernels.reset_kernel_choice()
            got = fused_experts(
                hidden.to(DEVICE),
                meta13,
                w2.to(DEVICE),
                weights.to(DEVICE),
                ids.to(DEVICE),
                (blocks13, None),
            )
            torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS", raising=False)
        kernels.reset_kernel_choice()
    assert calls == [1]  # the Triton kernel for "triton", the loop for "reference"


def test_gpu_check_stage_runs_and_reports(tmp_path):
    """scripts/gpu_check.sh's quant-moe stage (nanoserve.bench.gpu_moe_quant) with --smoke: a
    tiny layer checked against its reference, held bytes equal to the checkpoint's, a table."""
    import json

    from nanoserve.bench import gpu_moe_quant

    if torch.cuda.is_available():
        pytest.skip("the full stage runs in scripts/gpu_check.sh on a GPU")
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--work", str(work), "--out", str(out), "--name", "tiny", "--smoke"]
    assert gpu_moe_quant.main(argv) == 0
    result = json.loads((work / "quant_moe-tiny.json").read_text())
    assert result["ok"] and set(result["formats"]) == set(gpu_moe_quant.SMOKE_FORMATS)
    for found in result["formats"].values():
        assert found["held_over_file"] == 1.0 and all(found["checks"].values())
        assert max(found["max_relative_error"].values()) < 1e-4
    assert "| mxfp4 | 1.000 |" in (out / "quant_moe.md").read_text()


def test_staging_fills_one_expert_blocks_as_experts_come_in(monkeypatch):
    """Where experts are held for the Triton kernel, the load's staging copies each expert into
    its matrix's ExpertBlocks once its gate and up parts are in (no QuantWeight kept), and an
    expert missing a part is still an error when the layer finishes."""
    import nanoserve.kernels as kernels
    from nanoserve.layers.quant_experts import QuantExpertStaging

    rng = np.random.default_rng(3)
    parts = [[gguf_expert("q4_0", 16, 64, rng) for _ in range(2)] for _ in range(2)]
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    try:
        staging = QuantExpertStaging(2, {"w13": 64, "w2": 32}, torch.device("cpu"))
        for expert, (gate, up) in enumerate(parts):
            staging.add("w13", expert, 0, "q4_0", {"raw": gate[0].raw})
            assert staging.weights.get("w13", [None, None])[expert] is None  # waits for up
            staging.add("w13", expert, 1, "q4_0", {"raw": up[0].raw})
            assert staging.weights["w13"][expert] is True
        blocks = staging.finish("w13")
        broken = QuantExpertStaging(2, {"w13": 64, "w2": 32}, torch.device("cpu"))
        broken.add("w13", 0, 0, "q4_0", {"raw": parts[0][0][0].raw})
        with pytest.raises(ValueError, match="every expert's gate, up and down"):
            broken.finish("w13")
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.reset_kernel_choice()
    assert isinstance(blocks, ExpertBlocks) and blocks.quants.shape == (2, 32, 36)
    for expert, (gate, up) in enumerate(parts):
        assert torch.equal(blocks.dequantized()[expert], torch.cat([gate[1], up[1]]))


@pytest.mark.parametrize("qtype", ["q5_1", "q4_1 ints"])
def test_one_grouped_gemm_equals_its_reference(qtype):
    """quant_grouped_gemm against quant_grouped_gemm_reference on one launch: rows of three
    experts in blocks of 16, padding rows left untouched."""
    from nanoserve.kernels.fused_moe import moe_align_block_size
    from nanoserve.kernels.fused_moe_quant import quant_grouped_gemm, quant_grouped_gemm_reference

    qtype, components = qtype.split()[0], qtype.endswith("ints")
    rng = np.random.default_rng(4)
    make = components_expert if components else gguf_expert
    blocks = ExpertBlocks.stack([make(qtype, 80, 64, rng)[0] for _ in range(3)], DEVICE)
    ids = torch.tensor([[0, 2], [2, 1], [0, -1], [2, 0]] * 5, device=DEVICE)
    sorted_rows, block_experts = moe_align_block_size(ids, 3, 16)
    a = torch.randn(20, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got, want = (torch.full((40, 80), 7.0, device=DEVICE) for _ in range(2))
    quant_grouped_gemm(a, blocks, got, sorted_rows, block_experts, 2, 16)
    quant_grouped_gemm_reference(a, blocks, want, sorted_rows, block_experts, 2, 16)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got[5] == 7.0).all() and not (got[0] == 7.0).any()  # row 5: expert -1, untouched
