"""CUDA: x @ W.T + bias with W in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K), dequantized in registers, 32 values of each weight row at a time, and multiplied with tl.dot.

Called by kernels/quant.quant_gemm for CUDA tensors. Each program computes a BLOCK_M x BLOCK_N
tile of the output, walking K in chunks of 32: a 32-value chunk is one block of the 32-value
formats and one sub-block of a K-quant's 256-value super-block, so every chunk has one scale (and
Q4_1 / Q5_1 / Q4_K / Q5_K one offset) per row. The activations are not quantized: the weight is
dequantized to fp32 (then to the activations' dtype for tl.dot), as `gguf_gemm_reference` does.

Byte layouts (per row, blocks after one another; d, m, dmin are f16):
  Q8_0  34 bytes / 32: d, 32 int8                                   w = d * q
  Q4_0  18 bytes / 32: d, 16 bytes: value i < 16 low nibble of byte i, else high nibble of i - 16
                                                                     w = d * (q - 8)
  Q4_1  20 bytes / 32: d, m, 16 bytes of nibbles as Q4_0             w = d * q + m
  Q5_0  22 bytes / 32: d, qh (4 bytes: value i's 5th bit is bit i % 8 of byte i // 8), 16 bytes
        of nibbles as Q4_0                                           w = d * (q - 16)
  Q5_1  24 bytes / 32: d, m, qh, 16 bytes of nibbles as Q5_0         w = d * q + m
  Q4_K 144 bytes / 256: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, 128 bytes:
        sub-blocks 2g and 2g + 1 are the low and high nibbles of bytes 32g .. 32g + 31
                                                                     w = d * sc * q - dmin * mn
  Q5_K 176 bytes / 256: d, dmin, 12 bytes of scales and mins as Q4_K, qh (32 bytes: sub-block j's
        value l has bit j of byte l as its 5th bit), 128 bytes of nibbles as Q4_K
                                                                     w = d * sc * q - dmin * mn
  Q6_K 210 bytes / 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d;
        value 128h + 32t + l: low nibble (t < 2) or high (t >= 2) of byte 64h + 32(t % 2) + l,
        2 high bits at bits 2t of byte 128 + 32h + l, scale 192 + 8h + l // 16 + 2t
                                                                     w = d * sc * (q - 32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels.gguf_formats import GGUF_QTYPES, format_code
from nanoserve.kernels.triton_utils import bind_helpers, cdiv, check_triton_device, lazy_jit

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)


@lazy_jit
def _gguf_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # QTYPE: kernels/gguf_formats.format_code (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K, 5 Q5_0, 6 Q5_1, 7 Q5_K).
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rows_m < M, rows_n < N
    kk = tl.arange(0, 32)
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * row_bytes  # [BLOCK_N, 1] row starts
    wmask = mask_n[:, None]
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(0, K // 32):
        x = tl.load(x_rows + chunk * 32 + kk[None, :], mask=mask_m[:, None], other=0.0)
        w = _gguf_chunk(w_rows, chunk, kk, wmask, QTYPE, BLOCK_BYTES)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@lazy_jit
def _gguf_chunk(w_rows, chunk, kk, wmask, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Values 32 * chunk .. 32 * chunk + 31 of the GGUF rows starting at `w_rows` (a [BLOCK_N, 1]
    tensor of row pointers), dequantized: [BLOCK_N, 32] fp32. QTYPE: kernels/gguf_formats.
    format_code; BLOCK_BYTES: the bytes of one block of QTYPE. Shared with kernels/
    fused_moe_quant.py's grouped GEMM over quantized experts."""
    if QTYPE < 3:  # one 32-value block per chunk
        base = w_rows + chunk * BLOCK_BYTES
        d = _f16(base, wmask)
        if QTYPE == 0:
            q = tl.load(base + 2 + kk[None, :], mask=wmask, other=0).to(tl.int8, bitcast=True)
            w = d * q.to(tl.float32)
        else:
            qs = 4 if QTYPE == 2 else 2
            byte = tl.load(base + qs + (kk[None, :] % 16), mask=wmask, other=0).to(tl.int32)
            q = tl.where(kk[None, :] < 16, byte & 15, byte >> 4).to(tl.float32)
            if QTYPE == 1:
                w = d * (q - 8.0)
            else:
                w = d * q + _f16(base + 2, wmask)
    elif QTYPE == 3:
        w = _q4_k_chunk(w_rows + (chunk // 8) * BLOCK_BYTES, chunk % 8, kk, wmask)
    elif QTYPE == 4:
        w = _q6_k_chunk(w_rows + (chunk // 8) * BLOCK_BYTES, chunk % 8, kk, wmask)
    elif QTYPE == 7:
        w = _q5_k_chunk(w_rows + (chunk // 8) * BLOCK_BYTES, chunk % 8, kk, wmask)
    else:  # Q5_0 / Q5_1: one 32-value block per chunk
        base = w_rows + chunk * BLOCK_BYTES
        d = _f16(base, wmask)
        if QTYPE == 5:
            w = d * (_q5_values(base + 2, kk, wmask) - 16.0)
        else:
            w = d * _q5_values(base + 4, kk, wmask) + _f16(base + 2, wmask)
    return w


@lazy_jit
def _f16(ptr, mask):
    """The little-endian f16 at `ptr` (a [BLOCK_N, 1] tensor of pointers), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@lazy_jit
def _k_scale_min(base, sub, wmask):
    """Sub-block `sub`'s 6-bit scale and min (Q4_K's and Q5_K's 12 bytes at base + 4), as fp32."""
    scale_at = base + 4
    this = tl.load(scale_at + sub, mask=wmask, other=0).to(tl.int32)
    after = tl.load(scale_at + sub + 4, mask=wmask, other=0).to(tl.int32)
    before = tl.load(scale_at + tl.maximum(sub - 4, 0), mask=wmask, other=0).to(tl.int32)
    low = sub < 4
    scale = tl.where(low, this & 63, (after & 15) | ((before >> 6) << 4)).to(tl.float32)
    offset = tl.where(low, after & 63, (after >> 4) | ((this >> 6) << 4)).to(tl.float32)
    return scale, offset


@lazy_jit
def _q4_k_chunk(base, sub, kk, wmask):
    """Sub-block `sub` (0..7) of the Q4_K super-blocks at `base`: [BLOCK_N, 32] fp32."""
    d = _f16(base, wmask)
    dmin = _f16(base + 2, wmask)
    scale, offset = _k_scale_min(base, sub, wmask)
    byte = tl.load(base + 16 + (sub // 2) * 32 + kk[None, :], mask=wmask, other=0).to(tl.int32)
    q = tl.where(sub % 2 == 0, byte & 15, byte >> 4).to(tl.float32)
    return d * scale * q - dmin * offset


@lazy_jit
def _q5_values(qh_at, kk, wmask):
    """Q5_0 / Q5_1's 32 5-bit values from qh (4 bytes at `qh_at`) and the 16 bytes after it:
    [BLOCK_N, 32] fp32."""
    high = tl.load(qh_at + kk[None, :] // 8, mask=wmask, other=0).to(tl.int32)
    byte = tl.load(qh_at + 4 + (kk[None, :] % 16), mask=wmask, other=0).to(tl.int32)
    low = tl.where(kk[None, :] < 16, byte & 15, byte >> 4)
    return (low | (((high >> (kk[None, :] % 8)) & 1) << 4)).to(tl.float32)


@lazy_jit
def _q5_k_chunk(base, sub, kk, wmask):
    """Sub-block `sub` (0..7) of the Q5_K super-blocks at `base`: [BLOCK_N, 32] fp32 (scales and
    mins as Q4_K's, 32 bytes of 5th bits, then the nibbles at 48)."""
    d = _f16(base, wmask)
    dmin = _f16(base + 2, wmask)
    scale, offset = _k_scale_min(base, sub, wmask)
    high = tl.load(base + 16 + kk[None, :], mask=wmask, other=0).to(tl.int32)
    byte = tl.load(base + 48 + (sub // 2) * 32 + kk[None, :], mask=wmask, other=0).to(tl.int32)
    q = tl.where(sub % 2 == 0, byte & 15, byte >> 4) | (((high >> sub) & 1) << 4)
    return d * scale * q.to(tl.float32) - dmin * offset


@lazy_jit
def _q6_k_chunk(base, sub, kk, wmask):
    """Values 32 * sub .. 32 * sub + 31 of the Q6_K super-blocks at `base`: [BLOCK_N, 32] fp32."""
    half, quarter = sub // 4, sub % 4
    low = tl.load(base + 64 * half + 32 * (quarter % 2) + kk[None, :], mask=wmask, other=0).to(
        tl.int32
    )
    high = tl.load(base + 128 + 32 * half + kk[None, :], mask=wmask, other=0).to(tl.int32)
    q = ((low >> (4 * (quarter // 2))) & 15) | (((high >> (2 * quarter)) & 3) << 4)
    scale = tl.load(base + 192 + 8 * half + kk[None, :] // 16 + 2 * quarter, mask=wmask, other=0)
    d = _f16(base + 208, wmask)
    return d * scale.to(tl.int8, bitcast=True).to(tl.float32) * (q - 32).to(tl.float32)


def _bind_helpers() -> None:
    bind_helpers(
        globals(),
        "_gguf_chunk",
        "_f16",
        "_k_scale_min",
        "_q4_k_chunk",
        "_q5_values",
        "_q5_k_chunk",
        "_q6_k_chunk",
    )


def gguf_gemm(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] (fp32 / fp16 / bf16) @ dequantized(w).T + bias -> [m, n] in x's dtype. `w`: a
    kernels/quant.QuantWeight (qtype, n, k, raw uint8 [n, row bytes]) on x's device."""
    if w.qtype not in GGUF_QTYPES:
        raise ValueError(f"no Triton kernel for {w.qtype!r} (have {', '.join(GGUF_QTYPES)})")
    code, (block, block_bytes) = format_code(w.qtype), GGUF_QTYPES[w.qtype]
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be [m, {w.k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    raw = w.raw
    if (
        raw.dtype != torch.uint8
        or tuple(raw.shape) != (w.n, w.k // block * block_bytes)
        or w.k % block
    ):
        raise ValueError(
            f"raw must be uint8 [{w.n}, {w.k // block * block_bytes}], got {raw.dtype} {tuple(raw.shape)}"
        )
    tensors = [x, raw] + ([bias] if bias is not None else [])
    check_triton_device(*tensors)
    if bias is not None and tuple(bias.shape) != (w.n,):
        raise ValueError(f"bias must be [{w.n}], got {tuple(bias.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    raw = raw if raw.is_contiguous() else raw.contiguous()
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _bind_helpers()
    block_m = 16 if x.shape[0] <= 16 else (32 if x.shape[0] <= 32 else 64)
    block_n = 64
    grid = (cdiv(x.shape[0], block_m), cdiv(w.n, block_n))
    _gguf_gemm_kernel[grid](
        x,
        raw,
        bias if bias is not None else x,
        out,
        x.shape[0],
        w.n,
        w.k,
        x.stride(0),
        out.stride(0),
        raw.shape[1],
        QTYPE=code,
        BLOCK_BYTES=block_bytes,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def gguf_gemm_reference(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch oracle with gguf_gemm's arithmetic: the weight dequantized by the gguf package
    (its own definition of the formats, independent of quant.dequantize), fp32 products and sums,
    rounded once to x's dtype."""
    import gguf
    import numpy as np

    ggml_type = getattr(gguf.GGMLQuantizationType, w.qtype.upper())
    values = gguf.quants.dequantize(w.raw.cpu().numpy(), ggml_type)
    weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(w.n, w.k)).to(x.device)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)
