"""kernels/cpu/gemm_fp8.cpp: the GEMM on FP8 (E4M3) weights, at every ISA level this machine runs
(the cpu_isa fixture), through kernels/quant.py's "fp8_e4m3" format (pack, unpack, dequantize).

Oracles: torch's own float8_e4m3fn -> float32 conversion for the weights' values (every byte),
and the product in float64 of x and the dequantized weights; bit for bit, a row's output the
same whatever rows share its call, and every level the same bits as the others."""

import pytest
import torch

from nanoserve.kernels import quant
from nanoserve.kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.available(), reason="the CPU kernels don't load here (no compiler)"
)

FP8 = quant.format_code(quant.FP8)
SHAPES = [(576, 960), (1536, 576), (64, 48), (96, 80)]  # (k, n): n not a multiple of 16 too


def _weight(n, k, seed=0, scale_block=128):
    """Random E4M3 bytes (every finite value possible: no NaN, 0x7F / 0xFF) with a scale per
    128 x 128 block, repeated per block of 32 inputs."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8)
    u = torch.where((u & 0x7F) == 0x7F, u ^ 0x01, u)
    blocks = (
        torch.rand(-(-n // scale_block), -(-k // scale_block), generator=generator) * 1e-3 + 1e-4
    )
    scale = blocks.repeat_interleave(scale_block, 0)[:n].repeat_interleave(scale_block // 32, 1)[
        :, : k // 32
    ]
    return quant.QuantWeight(
        quant.FP8, n, k, None, components=quant.QuantComponents(u, scale.contiguous())
    )


def _inputs(k, m=70, seed=1, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=generator).to(dtype)


def test_dequantize_is_torchs_conversion_times_the_scale():
    w = _weight(40, 64)
    expected = w.components.u.view(
        torch.float8_e4m3fn
    ).float() * w.components.scale.repeat_interleave(32, 1)
    assert torch.equal(quant.dequantize_weight(w), expected)
    packed = quant.pack_weight(w)
    back = quant.unpack_weight(packed, quant.FP8, 40, 64)
    assert torch.equal(back.u, w.components.u) and torch.equal(back.scale, w.components.scale)


def test_every_byte_widens_to_its_value(cpu_isa):
    """One input per byte value (subnormals, zeros of both signs, the largest, negative ones), a
    scale of 1 and x = 1 at that input: each output is the byte's value, exactly (fp32)."""
    values = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    k = 256
    u = torch.zeros(16, k, dtype=torch.uint8)
    u[0, : values.numel()] = values
    w = quant.QuantWeight(
        quant.FP8, 16, k, None, components=quant.QuantComponents(u, torch.ones(16, k // 32))
    )
    packed = quant.pack_weight(w)
    x = torch.eye(k)[: values.numel()]
    out = cpu_ops.gemm_quant(x, packed, FP8, 16, k, None)
    # (-0 comes out +0: every sum starts at +0, as any dot product's.)
    assert torch.equal(out[:, 0], values.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_product(k, n, dtype, with_bias, cpu_isa):
    w = _weight(n, k)
    dense = quant.dequantize_weight(w).double()
    packed = quant.pack_weight(w)
    x = _inputs(k, dtype=dtype)
    bias = (
        torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype) if with_bias else None
    )
    for m in (1, 2, 3, 4, 7, 70):
        out = quant.quant_gemm(x[:m], quant.QuantWeight(quant.FP8, n, k, None, packed=packed), bias)
        assert out.shape == (m, n) and out.dtype == dtype
        expected = x[:m].double() @ dense.t() + (0 if bias is None else bias.double())
        magnitude = x[:m].double().abs() @ dense.abs().t() + (
            0 if bias is None else bias.double().abs()
        )
        # fp32 sums (relative ~k 2^-24 of the magnitudes) and one rounding to the dtype
        rounding = 2**-8 if dtype == torch.bfloat16 else 2**-23
        assert (
            (out.double() - expected).abs() <= expected.abs() * rounding + magnitude * 2**-18
        ).all(), m
        reference = quant.reference_gemm(x[:m], w, bias)
        assert (
            (out.double() - reference.double()).abs()
            <= expected.abs() * 2 * rounding + magnitude * 2**-17
        ).all()


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_do_not_depend_on_their_neighbours(k, n, cpu_isa):
    w = _weight(n, k, seed=2)
    packed = quant.pack_weight(w)
    x = _inputs(k, m=150, seed=4)
    full = cpu_ops.gemm_quant(x, packed, FP8, n, k, None)
    for start, m in [(0, 1), (0, 2), (3, 3), (0, 4), (5, 17), (37, 90), (149, 1), (64, 64)]:
        assert torch.equal(
            cpu_ops.gemm_quant(x[start : start + m], packed, FP8, n, k, None),
            full[start : start + m],
        )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_ops.gemm_quant(x, packed, FP8, n, k, None), full)
    finally:
        torch.set_num_threads(threads)


def test_every_level_gives_the_same_bits():
    levels = cpu_ops.supported_isas()
    w = _weight(96, 576, seed=5)
    packed = quant.pack_weight(w)
    bias = torch.randn(96).to(torch.bfloat16)
    outputs = {}
    previous = cpu_ops.isa()
    try:
        for level in levels:
            cpu_ops.set_isa(level)
            for dtype in (torch.bfloat16, torch.float32):
                x = _inputs(576, m=9, dtype=dtype)
                for m in (1, 3, 9):
                    b = bias.to(dtype)
                    outputs.setdefault((dtype, m), []).append(
                        cpu_ops.gemm_quant(x[:m], packed, FP8, 96, 576, b)
                    )
    finally:
        cpu_ops.set_isa(previous)
    for key, outs in outputs.items():
        assert all(torch.equal(out, outs[0]) for out in outs[1:]), (key, levels)
