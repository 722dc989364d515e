"""RMSNorm and fused add + RMSNorm: the Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.rmsnorm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from tests.kernels.utils import DEVICE, DTYPES, ELEMENTWISE_TOL, assert_close, dtype_id


def _tensors(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(dtype).to(DEVICE)
    return x, residual, weight


@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (2, 3, 256), (3, 4096)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm(dtype, shape):
    x, _, weight = _tensors(shape, dtype)
    expected = rms_norm_reference(x, weight, 1e-6)
    actual = rms_norm_triton(x, weight, 1e-6)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert_close(actual, expected, ELEMENTWISE_TOL)


@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (2, 3, 256), (3, 4096)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fused_add_rms_norm(dtype, shape):
    x, residual, weight = _tensors(shape, dtype, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    expected, expected_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    actual, actual_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    assert actual.dtype == expected.dtype and actual_residual.dtype == expected_residual.dtype
    torch.testing.assert_close(actual_residual, expected_residual, atol=0, rtol=0)
    assert_close(actual, expected, ELEMENTWISE_TOL)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # inputs untouched
    torch.testing.assert_close(residual, residual_before, atol=0, rtol=0)


def test_strided_rows_and_fp32_weight():
    x, residual, weight = _tensors((6, 2, 128), torch.float16, seed=2)
    x = x[:, 1]  # rows 256 elements apart
    residual = residual[:, 0]
    weight = weight.float()
    expected, expected_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    actual, actual_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual_residual, expected_residual, atol=0, rtol=0)
    assert_close(actual.half(), expected.half(), ELEMENTWISE_TOL)


def test_zero_rows():
    x, residual, weight = _tensors((0, 64), torch.float32)
    assert rms_norm_triton(x, weight, 1e-6).shape == (0, 64)
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    assert out.shape == new_residual.shape == (0, 64)


@pytest.mark.parametrize(
    "case", ["weight_size", "weight_2d", "residual_shape", "residual_dtype", "int_x"]
)
def test_bad_inputs_raise(case):
    x, residual, weight = _tensors((3, 64), torch.float32)
    if case == "weight_size":
        weight = weight[:32]
    elif case == "weight_2d":
        weight = weight[None]
    elif case == "residual_shape":
        residual = residual[:2]
    elif case == "residual_dtype":
        residual = residual.half()
    elif case == "int_x":
        x = x.long()
    with pytest.raises(ValueError):
        fused_add_rms_norm_triton(x, residual, weight, 1e-6)
