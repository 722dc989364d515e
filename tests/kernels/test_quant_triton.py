"""The Triton dequantize-GEMM for GGUF blocks (kernels/quant_triton.py) against its torch
reference (the gguf package's dequantize, fp32 matmul); under the Triton interpreter on a CPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve.kernels.quant import QuantWeight
from nanoserve.kernels.quant_triton import gguf_gemm, gguf_gemm_reference
from tests.gguf_models import _random_k_blocks
from tests.kernels.utils import DEVICE, DTYPES, dtype_id

QTYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
# (atol, rtol) on outputs of magnitude ~1: fp32 sums in another order; fp16 / bf16 round x @ w
# products' inputs (the dequantized weight goes to the activations' dtype for tl.dot).
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 6e-2)}


def make_weight(qtype: str, n: int, k: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    if qtype.endswith("_k"):
        raw = _random_k_blocks(n, k, qtype, rng)
    else:
        values = rng.normal(0, 2 / np.sqrt(k), size=(n, k)).astype(np.float32)
        raw = gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, qtype.upper()))
    return QuantWeight(qtype, n, k, torch.from_numpy(np.ascontiguousarray(raw)).to(DEVICE))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_gguf_gemm_matches_reference(qtype, dtype, m):
    n, k = 80, 512  # n not a multiple of the tile: masked rows
    w = make_weight(qtype, n, k, seed=m)
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=generator).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=generator).to(dtype).to(DEVICE) if m == 5 else None
    expected = gguf_gemm_reference(x, w, bias)
    actual = gguf_gemm(x, w, bias)
    assert actual.shape == (m, n) and actual.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def test_shape_errors():
    w = make_weight("q8_0", 16, 64, seed=0)
    with pytest.raises(ValueError, match=r"x must be \[m, 64\]"):
        gguf_gemm(torch.zeros(2, 32, device=DEVICE), w, None)
    with pytest.raises(ValueError, match="no Triton kernel for 'q3_k'"):
        gguf_gemm(torch.zeros(2, 64, device=DEVICE), QuantWeight("q3_k", 16, 64, w.raw), None)
