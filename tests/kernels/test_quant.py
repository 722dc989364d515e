"""kernels/quant.py and kernels/cpu/gemm_quant.cpp: GGUF block-format weights.

Oracles: the `gguf` package's own dequantize (bit for bit, on random blocks of every type), and
quant.reference_gemm, the kernel's arithmetic written in torch: the C++ GEMM equals it bit for bit
at every ISA level this machine runs (cpu_isa fixture), and reference_gemm itself is checked
against the float64 product of x and the dequantized weights."""

import gguf
import numpy as np
import pytest
import torch

from nanoserve.kernels import quant
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.quant import GGUF_QTYPES, QuantWeight

QTYPES = list(GGUF_QTYPES)
# where each type keeps its fp16 scales (byte offsets inside a block)
_SCALE_FIELDS = {
    "q8_0": [0],
    "q4_0": [0],
    "q4_1": [0, 2],
    "q5_0": [0],
    "q5_1": [0, 2],
    "q4_k": [0, 2],
    "q5_k": [0, 2],
    "q6_k": [208],
}

needs_kernels = pytest.mark.skipif(
    not cpu_ops.gemm_available(), reason="the CPU kernels don't load here"
)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in GGUF rows, with sane fp16 scales (random quants, signs and sub-scales)."""
    elements, nbytes = GGUF_QTYPES[qtype]
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // elements, nbytes), generator=generator, dtype=torch.uint8)
    for offset in _SCALE_FIELDS[qtype]:
        scales = (torch.rand(n, k // elements, generator=generator) * 0.02 + 1e-4).to(torch.float16)
        if offset == 2:  # q4_1's / q5_1's min (and the K types' dmin) may be negative
            scales = (
                scales
                * torch.where(torch.rand(scales.shape, generator=generator) < 0.5, -1, 1).half()
                * 8
            )
        raw[..., offset : offset + 2] = scales.unsqueeze(-1).view(torch.uint8)
    return raw.reshape(n, -1)


def _weight(qtype, n, k, seed=0):
    return QuantWeight(qtype, n, k, random_blocks(qtype, n, k, seed))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype):
    k = 512
    raw = random_blocks(qtype, 24, k, seed=1)
    ours = quant.dequantize(raw, qtype, k)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype.upper()])
    assert ours.dtype == torch.float32 and ours.shape == (24, k)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(
        ValueError, match="Q3_K .*supported: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4$"
    ):
        quant.qtype_name(gguf.GGMLQuantizationType.Q3_K)
    assert quant.qtype_name(gguf.GGMLQuantizationType.Q4_K) == "q4_k"
    assert quant.qtype_name(gguf.GGMLQuantizationType.Q5_0) == "q5_0"
    with pytest.raises(ValueError, match="multiple of its block"):
        quant.dequantize(torch.zeros(2, 144, dtype=torch.uint8), "q4_k", 128)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_close_to_the_dequantized_product(qtype, dtype):
    n, k = 40, 512
    w = _weight(qtype, n, k, seed=2)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(n).to(dtype)
    out = quant.reference_gemm(x, w, bias)
    assert out.dtype == dtype and out.shape == (5, n)
    dense = quant.dequantize(w.raw, qtype, k).double()
    exact = x.double() @ dense.t() + bias.double()
    # int8 activations: each block's error is at most half a step (amax / 254) per element
    magnitude = x.double().abs() @ dense.abs().t()
    error = (out.double() - exact).abs()
    assert (error <= magnitude / 254 + exact.abs() * 2**-7 + 1e-3).all()
    assert error.mean() < 0.02 * magnitude.mean()


def _kernel(x, w, bias=None):
    out = cpu_ops.gemm_quant(x, w.packed, w.kernel_format, w.n, w.k, bias)
    assert out is not None
    return out


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_reference_bit_for_bit(qtype, dtype, cpu_isa):
    n, k = 72, 768  # n not a multiple of 16: padded columns cut
    w = _weight(qtype, n, k, seed=4)
    reference = QuantWeight(qtype, n, k, w.raw)  # the oracle reads the GGUF bytes, not the packing
    quant.pack_for_cpu(w)
    assert w.packed is not None and w.raw is None  # held once
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(67, k, generator=generator).to(dtype)
    x[3, 64:96] = 0  # an all-zero block
    bias = torch.randn(n, generator=generator).to(dtype)
    for m in (1, 2, 5, 67):
        for b in (None, bias):
            out = quant.quant_gemm(x[:m], w, b)
            assert out.dtype == dtype and out.shape == (m, n)
            assert torch.equal(out, quant.reference_gemm(x[:m], reference, b)), (m, b is None)


@needs_kernels
@pytest.mark.parametrize("qtype", [q for q in QTYPES if GGUF_QTYPES[q][0] == 32])
@pytest.mark.parametrize("blocks", [13, 16, 29])
def test_every_count_of_blocks_in_a_row(qtype, blocks, cpu_isa):
    """Rows of 13, 16 and 29 blocks of 32: the AVX-512 quantizer handles a row 16 blocks at a time
    and stores each run's scales, sums and offset corrections (two a block) with masks; a run of
    9-15 blocks fills the second half of the corrections' masked store in part."""
    n, k = 32, 32 * blocks
    w = _weight(qtype, n, k, seed=blocks)
    reference = QuantWeight(qtype, n, k, w.raw)
    quant.pack_for_cpu(w)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(blocks))
    x[2, -32:] = 0  # the last block all zeros
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(
            quant.quant_gemm(x.to(dtype), w, None),
            quant.reference_gemm(x.to(dtype), reference, None),
        )


def assert_extreme_rows_equal_reference(w: QuantWeight, reference: QuantWeight) -> None:
    """w packed for the CPU kernel against reference_gemm on `reference` (the same values), on rows
    of all +1, all -1, alternating signs and a ramp: the sums at their bounds, bit for bit."""
    quant.pack_for_cpu(w)
    k = w.k
    x = torch.ones(4, k)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = torch.linspace(-3, 3, k)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(
            quant.quant_gemm(x.to(dtype), w, None),
            quant.reference_gemm(x.to(dtype), reference, None),
        )


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES)
def test_largest_integer_sums_equal_the_reference(qtype, cpu_isa):
    """Every quant at its largest magnitude (u = 15 / 31 / 63, Q8_0's q = -128) against activations
    that all quantize to +-127: the integer sums at their bound (the AVX2 level adds several steps
    in int16 before widening them), still bit for bit the reference's."""
    n, k = 32, 512
    elements, nbytes = GGUF_QTYPES[qtype]
    raw = torch.full(
        (n, k // elements, nbytes), 0x80 if qtype == "q8_0" else 0xFF, dtype=torch.uint8
    )
    for offset in _SCALE_FIELDS[qtype]:
        raw[..., offset : offset + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    w = QuantWeight(qtype, n, k, raw.reshape(n, -1))
    reference = QuantWeight(qtype, n, k, w.raw)
    assert_extreme_rows_equal_reference(w, reference)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_the_batch(qtype, cpu_isa):
    w = _weight(qtype, 576, 1536, seed=6)
    quant.pack_for_cpu(w)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    full = _kernel(x, w)
    for start, m in [(0, 1), (5, 1), (63, 1), (0, 3), (10, 17), (1, 63)]:
        assert torch.equal(_kernel(x[start : start + m], w), full[start : start + m]), (start, m)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_kernel(x, w), full)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_strided_rows_and_what_it_refuses():
    w = _weight("q4_0", 32, 256, seed=8)
    quant.pack_for_cpu(w)
    wide = torch.randn(9, 300).to(torch.bfloat16)
    strided = wide[:, 10:266]
    assert torch.equal(_kernel(strided, w), _kernel(strided.contiguous(), w))
    code = quant.format_code("q4_0")
    assert (
        cpu_ops.gemm_quant(torch.zeros(2, 128, dtype=torch.bfloat16), w.packed, code, 32, 256, None)
        is None
    )
    assert (
        cpu_ops.gemm_quant(torch.zeros(2, 256, dtype=torch.float16), w.packed, code, 32, 256, None)
        is None
    )
    assert _kernel(torch.zeros(0, 256, dtype=torch.bfloat16), w).shape == (0, 32)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [16, 37])
def test_unpack_reads_the_packing_back(qtype, n):
    """unpack_weight is pack_weight's inverse (a weight given as components keeps only its
    packing once packed): the components of GGUF rows, bit for bit, padding columns left out;
    and such a weight multiplies as the same weight from its bytes."""
    weight = _weight(qtype, n, 256, seed=n)
    u, _, scale, mins = quant.weight_components(weight)
    unpacked = quant.unpack_weight(quant.pack_weight(weight), qtype, n, 256)
    assert torch.equal(unpacked.u, u) and torch.equal(unpacked.scale, scale)
    assert (unpacked.mins is None) == (mins is None) and (
        mins is None or torch.equal(unpacked.mins, mins)
    )
    packed_only = QuantWeight(qtype, n, 256, None, packed=quant.pack_weight(weight))
    x = torch.randn(3, 256)
    assert torch.equal(
        quant.reference_gemm(x, packed_only, None), quant.reference_gemm(x, weight, None)
    )
    assert packed_only.nbytes == packed_only.packed.numel()


@pytest.mark.parametrize("qtype", list(quant.PLANES))
@pytest.mark.parametrize("n", [16, 37])
def test_planes_packing_reads_back_and_is_smaller(qtype, n):
    """Q5_K / Q6_K packed in nibbles and bit planes: unpack_weight gives the GGUF rows' components
    bit for bit, in fewer bytes than a byte an element (5.75 and 6.6 bits a weight at 16 columns)."""
    weight = _weight(qtype, n, 512, seed=n)
    u, _, scale, mins = quant.weight_components(weight)
    planes = QuantWeight(qtype, n, 512, weight.raw, planes=True)
    packed = quant.pack_weight(planes)
    unpacked = quant.unpack_weight(packed, qtype, n, 512, planes=True)
    assert torch.equal(unpacked.u, u) and torch.equal(unpacked.scale, scale)
    assert (mins is None) == (unpacked.mins is None) and (
        mins is None or torch.equal(unpacked.mins, mins)
    )
    bits = 8 * packed.numel() / (packed.shape[0] * 16 * 512)
    assert bits == {"q5_k": 5.75, "q6_k": 6.625}[qtype]  # the files: 5.5, 6.5625
    assert packed.numel() < quant.pack_weight(weight).numel()


@needs_kernels
@pytest.mark.parametrize("qtype", list(quant.PLANES))
def test_planes_packing_multiplies_as_the_reference_at_every_level(qtype, cpu_isa):
    """A planes packing at every level this machine runs (an AVX-512 VNNI level runs the AVX2
    kernels on it), bit for bit the reference, at the bounds of the int16 sums too."""
    n, k = 72, 768
    weight = _weight(qtype, n, k, seed=9)
    reference = QuantWeight(qtype, n, k, weight.raw)
    planes = QuantWeight(
        qtype,
        n,
        k,
        None,
        packed=quant.pack_weight(QuantWeight(qtype, n, k, weight.raw, planes=True)),
        planes=True,
    )
    x = torch.randn(67, k, generator=torch.Generator().manual_seed(10))
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 5, 67):
            assert torch.equal(
                _kernel(x[:m].to(dtype), planes),
                quant.reference_gemm(x[:m].to(dtype), reference, None),
            )
    elements, nbytes = GGUF_QTYPES[qtype]
    raw = torch.full((n, k // elements, nbytes), 0xFF, dtype=torch.uint8)
    for offset in _SCALE_FIELDS[qtype]:
        raw[..., offset : offset + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    raw = raw.reshape(n, -1)
    extreme = QuantWeight(
        qtype,
        n,
        k,
        None,
        packed=quant.pack_weight(QuantWeight(qtype, n, k, raw, planes=True)),
        planes=True,
    )
    signs = torch.ones(4, k)
    signs[1] = -1
    signs[2, ::2] = -1
    signs[3] = torch.linspace(-3, 3, k)
    assert torch.equal(
        _kernel(signs, extreme), quant.reference_gemm(signs, QuantWeight(qtype, n, k, raw), None)
    )


@needs_kernels
def test_pack_for_cpu_packs_k_types_in_planes_below_vnni(cpu_isa):
    weight = _weight("q6_k", 32, 256)
    quant.pack_for_cpu(weight)
    assert weight.planes == (not cpu_ops.vnni_gemm_quant())
    assert weight.kernel_format == quant.format_code("q6_k/planes" if weight.planes else "q6_k")


# ---- MXFP4: 4-bit E2M1 codes through a table (gpt-oss's experts, models/mxfp4.py) ----------


def _mxfp4_weight(n: int, k: int, seed: int, codes: torch.Tensor | None = None) -> QuantWeight:
    """Random codes (every one of the 16, +0 and -0 included) and power-of-two scales."""
    generator = torch.Generator().manual_seed(seed)
    if codes is None:
        codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    exponents = torch.randint(100, 140, (n, k // 32), generator=generator)
    scale = torch.ldexp(torch.ones(n, k // 32), exponents - 128)
    return QuantWeight("mxfp4", n, k, None, components=quant.QuantComponents(codes, scale))


def _as_q8_0(w: QuantWeight) -> QuantWeight:
    """The same weight as Q8_0 components (u = 128 + 2 x the E2M1 value), the format MXFP4 checkpoints
    loaded into before the 4-bit one: its products must be the same bits."""
    doubled = torch.tensor(
        [2 * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6)]
    )
    u = (doubled[w.components.u.long()] + 128).to(torch.uint8)
    return QuantWeight(
        "q8_0", w.n, w.k, None, components=quant.QuantComponents(u, w.components.scale.clone())
    )


def test_mxfp4_components_mean_the_e2m1_values():
    from nanoserve.models.mxfp4 import E2M1_VALUES

    w = _mxfp4_weight(16, 64, seed=0)
    values = (
        torch.tensor(E2M1_VALUES)[w.components.u.long()]
        * 2
        * w.components.scale.repeat_interleave(32, dim=1)
    )
    assert torch.equal(quant.dequantize_weight(w), values)
    assert torch.equal(quant.dequantize_weight(_as_q8_0(w)), values)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_kernel_equals_reference_and_q8_0(dtype, cpu_isa):
    """The kernel equals reference_gemm bit for bit (rows 1 to 67, bias or none, an all-zero block,
    columns not a multiple of 16), and both equal the same weight held as Q8_0."""
    n, k = 72, 768
    w = _mxfp4_weight(n, k, seed=4)
    reference = QuantWeight(
        "mxfp4",
        n,
        k,
        None,
        components=quant.QuantComponents(w.components.u.clone(), w.components.scale.clone()),
    )
    as_q8_0 = _as_q8_0(w)
    quant.pack_for_cpu(w)
    assert w.packed is not None and w.components is None
    assert (
        w.nbytes == -(-n // 16) * (k // 32) * 320
    )  # 4 bits a weight and an fp32 scale a block of 32
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(67, k, generator=generator).to(dtype)
    x[3, 64:96] = 0
    bias = torch.randn(n, generator=generator).to(dtype)
    for m in (1, 2, 5, 67):
        for b in (None, bias):
            out = quant.quant_gemm(x[:m], w, b)
            assert out.dtype == dtype and out.shape == (m, n)
            expected = quant.reference_gemm(x[:m], reference, b)
            assert torch.equal(out, expected), (m, b is None)
            assert torch.equal(expected, quant.reference_gemm(x[:m], as_q8_0, b))


@needs_kernels
@pytest.mark.parametrize("code", [7, 15])
def test_mxfp4_largest_integer_sums(code, cpu_isa):
    """Every weight +6 (u = 24, the table's largest) or -6 (u = 0) against activations at +-127: the
    AVX2 level's int16 sums at their bound (four steps before widening, not the 4-bit formats' eight)."""
    n, k = 32, 512
    w = _mxfp4_weight(n, k, seed=code, codes=torch.full((n, k), code, dtype=torch.uint8))
    reference = _as_q8_0(w)
    assert_extreme_rows_equal_reference(w, reference)


@needs_kernels
def test_mxfp4_rows_do_not_depend_on_the_batch(cpu_isa):
    w = _mxfp4_weight(576, 1536, seed=6)
    quant.pack_for_cpu(w)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    full = _kernel(x, w)
    for start, m in [(0, 1), (5, 1), (63, 1), (0, 3), (10, 17), (1, 63)]:
        assert torch.equal(_kernel(x[start : start + m], w), full[start : start + m]), (start, m)


@pytest.mark.parametrize("n", [16, 37])
def test_mxfp4_unpack_reads_the_codes_back(n):
    w = _mxfp4_weight(n, 256, seed=n)
    unpacked = quant.unpack_weight(quant.pack_weight(w), "mxfp4", n, 256)
    assert torch.equal(unpacked.u, w.components.u) and torch.equal(
        unpacked.scale, w.components.scale
    )
    u, offset, _, _ = quant.weight_components(w)
    assert offset == 12 and torch.equal(u, quant.MXFP4_U[w.components.u.long()])


@needs_kernels
def test_many_gemms_in_one_call_equal_each_alone(cpu_isa):
    """quant_gemm_many (a MoE layer's experts in one C++ call): each span of rows through its own
    weight and bias, the bits of quant_gemm on those rows; an empty span; None where one weight
    is not packed or the widths differ (the caller then goes weight by weight)."""
    weights = [
        _weight("q4_k", 48, 256, seed=1),
        _weight("q8_0", 48, 256, seed=2),
        _mxfp4_weight(48, 256, seed=3),
    ]
    for w in weights:
        quant.pack_for_cpu(w)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(9, 256, generator=generator).to(torch.bfloat16)
    biases = [torch.randn(48, generator=generator).to(torch.bfloat16), None, None]
    spans = [(0, 4), (4, 4), (4, 9)]
    out = quant.quant_gemm_many(x, weights, spans, biases)
    assert out.shape == (9, 48)
    for w, (start, end), bias in zip(weights, spans, biases):
        assert torch.equal(out[start:end], quant.quant_gemm(x[start:end], w, bias))
    assert (
        quant.quant_gemm_many(x, [weights[0], _weight("q8_0", 48, 256)], spans[:2], [None, None])
        is None
    )
    assert (
        quant.quant_gemm_many(x, [weights[0], _weight("q8_0", 32, 256)], spans[:2], [None, None])
        is None
    )
