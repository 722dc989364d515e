"""kernels/cpu/gemm.cpp and gemm_levels.cpp: the bf16 GEMM that multiplies every row of a CPU
step, at every ISA level this machine runs (the cpu_isa fixture: AMX, AVX-512 BF16, AVX2,
portable; one weight packing for all).

Oracle: the same product in float64, rounded once to bf16. The property the engine relies on
(prompt rows are not padded to fixed-size GEMMs, decode rows don't depend on the batch) is
tested bit for bit at each level: a row's output is the same whatever M is, wherever the row
sits, whatever rows share its call and however many threads run it."""

import pytest
import torch

from nanoserve.kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.gemm_available(), reason="the CPU kernels don't load here (no compiler)"
)

SHAPES = [(576, 960), (576, 3072), (1536, 576), (64, 48), (32, 16), (96, 80)]


def _weights(n, k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=generator) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(300, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    return w, x, bias


def _oracle(x, w, bias=None):
    out = x.double() @ w.double().t()
    if bias is not None:
        out = out + bias.double()
    return out


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_product(k, n, with_bias, cpu_isa):
    w, x, bias = _weights(n, k)
    packed = cpu_ops.pack_gemm_weight(w)
    b = bias if with_bias else None
    for m in (1, 2, 3, 7, 16, 33, 300):
        out = cpu_ops.gemm(x[:m], packed, b)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        expected = _oracle(x[:m], w, b)
        # fp32 accumulation then one bf16 rounding: within a bf16 step of the exact value,
        # plus the fp32 accumulation error.
        tolerance = expected.abs() * 2**-8 + 1e-3 * k**0.5
        assert ((out.double() - expected).abs() <= tolerance).all()


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_do_not_depend_on_their_neighbours(k, n, cpu_isa):
    w, x, _ = _weights(n, k, seed=1)
    packed = cpu_ops.pack_gemm_weight(w)
    full = cpu_ops.gemm(x, packed, None)
    for start, m in [
        (0, 1),
        (0, 2),
        (3, 3),
        (0, 15),
        (0, 17),
        (5, 32),
        (37, 90),
        (100, 200),
        (299, 1),
        (64, 64),
    ]:
        part = cpu_ops.gemm(x[start : start + m], packed, None)
        assert torch.equal(part, full[start : start + m]), (start, m)
    # Other rows in the same call, in another order, change nothing either.
    mixed = torch.cat([x[200:230], x[3:4], torch.randn(50, k).to(torch.bfloat16)])
    out = cpu_ops.gemm(mixed, packed, None)
    assert torch.equal(out[:30], full[200:230]) and torch.equal(out[30], full[3])


def test_strided_rows_and_threads_give_the_same_bits(cpu_isa):
    w, x, _ = _weights(960, 576, seed=2)
    packed = cpu_ops.pack_gemm_weight(w)
    wide = torch.zeros(300, 1000, dtype=torch.bfloat16)
    wide[:, 100:676] = x
    strided = wide[:, 100:676]
    assert strided.stride(0) == 1000
    reference = cpu_ops.gemm(x, packed, None)
    assert torch.equal(cpu_ops.gemm(strided, packed, None), reference)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_ops.gemm(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, reference)


@pytest.mark.parametrize("with_bias", [False, True])
def test_columns_not_a_multiple_of_16_are_padded_and_cut(with_bias, cpu_isa):
    w, x, bias = _weights(1001, 64, seed=3)
    packed = cpu_ops.pack_gemm_weight(w)
    b = bias if with_bias else None
    out = cpu_ops.gemm(x, packed, b, n=1001)
    assert out.shape == (300, 1001)
    expected = _oracle(x, w, b)
    assert ((out.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-2).all()
    assert torch.equal(cpu_ops.gemm(x[7:9], packed, b, n=1001), out[7:9])


def test_shapes_it_does_not_take(cpu_isa):
    assert cpu_ops.pack_gemm_weight(torch.zeros(48, 40, dtype=torch.bfloat16)) is None  # K % 32
    assert cpu_ops.pack_gemm_weight(torch.zeros(48, 64, dtype=torch.float32)) is None
    packed = cpu_ops.pack_gemm_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    assert (
        cpu_ops.gemm(torch.zeros(3, 32, dtype=torch.bfloat16), packed, None) is None
    )  # K mismatch
    assert cpu_ops.gemm(torch.zeros(3, 64, dtype=torch.float32), packed, None) is None
    assert cpu_ops.gemm(torch.zeros(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 48)


def test_every_level_agrees_with_the_others_to_rounding():
    """One packing, several summation orders: the levels' results differ by accumulation
    rounding only (each is checked against float64 above; here against each other, on a
    long K where a wrong k-pair order or a dropped pair would show)."""
    w, x, bias = _weights(320, 3072, seed=4)
    packed = cpu_ops.pack_gemm_weight(w)
    previous = cpu_ops.isa()
    try:
        outs = {}
        for level in cpu_ops.supported_isas():
            cpu_ops.set_isa(level)
            outs[level] = cpu_ops.gemm(x[:40], packed, bias).double()
    finally:
        cpu_ops.set_isa(previous)
    expected = _oracle(x[:40], w, bias)
    for level, out in outs.items():
        assert ((out - expected).abs() <= expected.abs() * 2**-7 + 2e-3 * 3072**0.5).all(), level
    assert len(outs) >= 2, "every x86-64 machine runs at least the portable and one other level"


@pytest.mark.skipif(
    "avx512bf16" not in cpu_ops.supported_isas(), reason="this CPU has no AVX512_BF16"
)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_avx512_bf16_levels_two_kernels_give_the_same_bits(k, n, with_bias):
    """The AVX-512 BF16 level multiplies on VDPBF16PS or, where that instruction is measured slow,
    on fp32 FMAs adding each k-pair's products in VDPBF16PS's order: the same bits at every M (so
    the row invariance above holds whichever runs, and across the M <= 2 calls that always take
    VDPBF16PS)."""
    w, x, bias = _weights(n, k, seed=5)
    packed = cpu_ops.pack_gemm_weight(w)
    b = bias if with_bias else None
    previous = cpu_ops.set_isa("avx512bf16")
    try:
        outs = {}
        for variant in cpu_ops.BF16_DOT_VARIANTS:
            assert cpu_ops.bf16_dot_variant(variant) == variant
            outs[variant] = [cpu_ops.gemm(x[:m], packed, b) for m in (3, 4, 7, 16, 33, 65, 300)]
    finally:
        cpu_ops.bf16_dot_variant("measured")
        cpu_ops.set_isa(previous)
    for dot, fma in zip(*outs.values()):
        assert torch.equal(dot.view(torch.int16), fma.view(torch.int16))
