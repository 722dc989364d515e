"""RMSNorm and fused residual-add + RMSNorm. Statistics are computed in fp32."""

from __future__ import annotations

import torch

from nanoserve.kernels.triton_utils import (
    check_float_dtype,
    check_triton_device,
    lazy_jit,
    next_power_of_2,
)

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)


@lazy_jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_stride,
    residual_stride,
    out_stride,
    new_residual_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One row per program. Rounding mirrors the reference: the sum is rounded to the input
    # dtype before its statistics are taken, and the normalized row is rounded to the input
    # dtype before the weight multiplies it.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_stride + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ValueError(f"{name} must end in the hidden size {hidden_size}, got {tuple(x.shape)}")
    rows = x.reshape(-1, hidden_size)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x, residual, weight, eps):
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D, got {tuple(weight.shape)}")
    hidden_size = weight.shape[0]
    check_float_dtype("x", x)
    check_float_dtype("weight", weight)
    rows = _rows("x", x, hidden_size)
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
        residual_rows = _rows("residual", residual, hidden_size)
        tensors.append(residual)
    check_triton_device(*tensors)
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(rows) if residual is not None else out
    if rows.shape[0] > 0:
        block = next_power_of_2(hidden_size)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows if residual is not None else rows,
            weight,
            out,
            new_residual,
            rows.stride(0),
            residual_rows.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0),
            hidden_size,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out.view(x.shape), new_residual.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual)."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual
