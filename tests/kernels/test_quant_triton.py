"""The Triton kernels of quantized linear layers (kernels/quant_triton.py): the dequantize-GEMV for
decode rows and the tiled dequantize-GEMM for prompt rows, on GGUF blocks and on the component
form of GPTQ / AWQ / compressed-tensors integers and FP8 bytes (kernels/quant_blocks.py), and the
GGUF embedding's row gather, each against its torch reference; under the Triton interpreter on a
CPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve.kernels import choice, quant
from nanoserve.kernels.quant import QuantComponents, QuantWeight
from nanoserve.kernels.quant_blocks import make_group_blocks
from nanoserve.kernels.quant_triton import (
    gguf_rows,
    quant_gemm_triton,
    quant_gemm_triton_reference,
)
from tests.gguf_models import _random_k_blocks
from tests.kernels.utils import DEVICE, DTYPES, dtype_id

QTYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
# (atol, rtol) on outputs of magnitude ~1: fp32 sums in another order; fp16 / bf16 round x @ w
# products' inputs (the dequantized weight goes to the activations' dtype for tl.dot).
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 6e-2)}
# (dtype, m, kernel): decode rows through the GEMV, and the tiled GEMM on one row and on prompts;
# the half-precision dtypes on fewer shapes (the interpreter is slow).
ROWS = [(1, "gemv"), (3, "gemv"), (1, "gemm"), (5, "gemm"), (33, "gemm")]
CASES = [(torch.float32, m, kernel) for m, kernel in ROWS] + [
    (dtype, m, kernel) for dtype in DTYPES[1:] for m, kernel in [(3, "gemv"), (5, "gemm")]
]
CASE_IDS = [f"{dtype_id(dtype)}-{m}-{kernel}" for dtype, m, kernel in CASES]


def make_weight(qtype: str, n: int, k: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    if qtype.endswith("_k"):
        raw = _random_k_blocks(n, k, qtype, rng)
    else:
        values = rng.normal(0, 2 / np.sqrt(k), size=(n, k)).astype(np.float32)
        raw = gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, qtype.upper()))
    raw = torch.from_numpy(np.ascontiguousarray(raw)).to(DEVICE)
    return QuantWeight(qtype, n, k, raw, triton=True)


def check_gemm(w: QuantWeight, dtype, m: int, kernel: str, seed: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, w.k, generator=generator).to(dtype).to(DEVICE)
    bias = torch.randn(w.n, generator=generator).to(dtype).to(DEVICE) if with_bias else None
    expected = quant_gemm_triton_reference(x, w, bias)
    actual = quant_gemm_triton(x, w, bias, kernel=kernel)
    assert actual.shape == (m, w.n) and actual.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype,m,kernel", CASES, ids=CASE_IDS)
def test_gguf_gemm_and_gemv_match_reference(qtype, dtype, m, kernel):
    n, k = 80, 256  # n not a multiple of the tiles: masked rows
    w = make_weight(qtype, n, k, seed=m)
    check_gemm(w, dtype, m, kernel, seed=m, with_bias=m in (3, 5))


def component_weight(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    """A weight as a checkpoint loader gives it (components, a scale per block of 32 repeated
    over the checkpoint's group), in the Triton kernels' form. kind: q8_0 / q4_0 (symmetric, groups
    of 128), q4_1 (zero points, groups of 64), q4_1-mins (mins that are no zero point), fp8 (128 x
    128 block scales), fp8-tensor (one scale)."""
    generator = torch.Generator().manual_seed(seed)
    qtype = kind.split("-")[0]
    nb = k // 32
    if qtype == "fp8_e4m3":
        values = torch.randn(n, k, generator=generator) * 100
        u = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        if kind.endswith("tensor"):
            scale = torch.full((n, nb), 0.003)
        else:
            blocks = torch.rand(-(-n // 128), k // 128, generator=generator) * 0.01 + 1e-3
            scale = blocks.repeat_interleave(128, 0)[:n].repeat_interleave(4, 1)
    else:
        group = 64 if qtype == "q4_1" else 128
        top = 256 if qtype == "q8_0" else 16
        u = torch.randint(0, top, (n, k), generator=generator, dtype=torch.uint8)
        scale = (torch.rand(n, k // group, generator=generator) * 0.02 + 0.001).half().float()
        scale = scale.repeat_interleave(group // 32, 1)
    mins = None
    if qtype == "q4_1":
        zero = torch.randint(0, 16, (n, k // 64), generator=generator).float()
        zero = zero.repeat_interleave(2, 1)
        mins = -(scale * zero)
        if kind.endswith("mins"):
            mins = mins + torch.rand(mins.shape, generator=generator) * 1e-3
    components = QuantComponents(u.contiguous(), scale.contiguous(), mins)
    dense = QuantWeight(qtype, n, k, None, components=components)
    blocks = make_group_blocks(qtype, u, scale, mins)
    w = QuantWeight(qtype, n, k, None, blocks=blocks.to(DEVICE), triton=True)
    # The form is exact: the same weight values as the components the CPU kernels take.
    torch.testing.assert_close(
        quant.dequantize_weight(w), quant.dequantize_weight(dense), atol=1e-6, rtol=1e-6
    )
    return w


KINDS = ["q8_0", "q4_0", "q4_1", "q4_1-mins", "fp8_e4m3", "fp8_e4m3-tensor"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,m,kernel", CASES, ids=CASE_IDS)
def test_component_gemm_and_gemv_match_reference(kind, dtype, m, kernel):
    w = component_weight(kind, 144, 256, seed=m)
    if w.qtype == "fp8_e4m3":  # outputs of magnitude ~100 x scale: scale the tolerance
        w.blocks.scale /= 4
    check_gemm(w, dtype, m, kernel, seed=m, with_bias=m == 3)


def test_component_form_holds_a_scale_per_group():
    """A GPTQ-like layer's scales once per group of 128 in fp16 (4.125 bits a weight, not the CPU
    components' 5 in fp32 per 32); Q4_1's mins as uint8 zero points; FP8 block and tensor scales
    once per block / tensor."""
    n, k = 144, 256
    q4 = component_weight("q4_0", n, k, 0).blocks
    assert q4.group_blocks == 4 and q4.scale.shape == (n, 2) and q4.scale.dtype == torch.float16
    assert q4.nbytes == n * k // 2 + n * 2 * 2
    q41 = component_weight("q4_1", n, k, 0).blocks
    assert q41.zero.dtype == torch.uint8 and q41.zero.shape == (n, 4) and q41.mins is None
    assert component_weight("q4_1-mins", n, k, 0).blocks.mins is not None
    fp8 = component_weight("fp8_e4m3", n, k, 0).blocks
    assert (fp8.row_group, fp8.group_blocks, tuple(fp8.scale.shape)) == (128, 4, (2, 2))
    tensor = component_weight("fp8_e4m3-tensor", n, k, 0).blocks
    assert tuple(tensor.scale.shape) == (1, 1)


def test_the_kernel_is_chosen_by_rows():
    assert choice.gemv_rows(1) and choice.gemv_rows(choice.GEMV_MAX_ROWS)
    assert not choice.gemv_rows(choice.GEMV_MAX_ROWS + 1)
    w = make_weight("q8_0", 16, 64, seed=0)
    with pytest.raises(ValueError, match="the GEMV takes at most 4 rows"):
        quant_gemm_triton(torch.zeros(5, 64, device=DEVICE), w, None, kernel="gemv")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gguf_rows_match_dequantize(qtype, dtype):
    """The embedding's gather: only the looked-up rows, each the torch dequantization's value."""
    w = make_weight(qtype, 40, 512, seed=3)
    ids = torch.tensor([[7, 0, 39], [7, 12, 5]], device=DEVICE)
    rows = gguf_rows(w.raw, qtype, 512, ids, dtype)
    expected = quant.dequantize(w.raw.cpu(), qtype, 512)[ids.cpu()].to(dtype)
    assert rows.shape == (2, 3, 512) and rows.dtype == dtype
    torch.testing.assert_close(rows.cpu().float(), expected.float(), atol=1e-6, rtol=1e-6)


def test_shape_errors():
    w = make_weight("q8_0", 16, 64, seed=0)
    with pytest.raises(ValueError, match=r"x must be \[m, 64\]"):
        quant_gemm_triton(torch.zeros(2, 32, device=DEVICE), w, None)
    with pytest.raises(ValueError, match="no Triton kernel for 'q3_k'"):
        quant_gemm_triton(
            torch.zeros(2, 64, device=DEVICE), QuantWeight("q3_k", 16, 64, w.raw), None
        )
    parts = QuantComponents(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2))
    with pytest.raises(ValueError, match="as GGUF bytes or GroupBlocks"):
        quant_gemm_triton(
            torch.zeros(2, 64), QuantWeight("q8_0", 16, 64, None, components=parts), None
        )
