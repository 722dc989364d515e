"""Triton kernels for linear layers whose weights stay quantized (kernels/quant.py's QuantWeight
held in the Triton form: `kernels/quant.place`): x @ W.T + bias with W dequantized in registers,
32 values of each weight row at a time, and the GGUF token embedding's row gather.

Two sources of weights: a GGUF file's bytes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K;
kernels/gguf_triton.py decodes them) and kernels/quant_blocks.GroupBlocks (GPTQ's, AWQ's and
compressed-tensors' integers as Q8_0 / Q4_0 / Q4_1 components, FP8 E4M3 bytes widened exactly
through fp16), each
32-value chunk with one scale (and Q4_1 / Q5_1 / Q4_K / Q5_K one offset) per row: a chunk is one
block of the 32-value formats and one sub-block of a K-quant's 256-value super-block.

Two kernels, chosen by the number of rows (kernels/choice.gemv_rows): decode rows (M <= 4) go
through `_quant_gemv_kernel`, one program per tile of output rows that reads each weight once and
multiplies it into every activation row with a broadcast product and a sum (no tl.dot, whose
16-row minimum tile would waste most of its work); prompt rows through `_quant_gemm_kernel`, a
BLOCK_M x BLOCK_N tile per program and tl.dot (the weight rounded to the activations' dtype for it).
The activations are never quantized: both equal `quant_gemm_triton_reference` (the weight
dequantized, fp32 products and sums) to fp32 rounding (tl.dot: the dtype's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import gguf_triton
from nanoserve.kernels.choice import gemv_rows
from nanoserve.kernels.gguf_formats import GGUF_QTYPES, format_code
from nanoserve.kernels.gguf_triton import gguf_chunk
from nanoserve.kernels.quant_blocks import KERNEL_FORMATS, OFFSETS, dequantize_group_blocks
from nanoserve.kernels.triton_utils import bind_helpers, cdiv, check_triton_device, lazy_jit

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)
_gguf_chunk = gguf_chunk  # kernels/fused_moe_quant.py's name for it (bound by _bind_helpers)


@lazy_jit
def _quant_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    row_bytes,
    scale_stride,
    group_blocks,
    row_group,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    FORMAT: tl.constexpr,
    OFFSET: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rows_m < M, rows_n < N
    kk = tl.arange(0, 32)
    wmask = mask_n[:, None]
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(0, K // 32):
        x = tl.load(x_rows + chunk * 32 + kk[None, :], mask=mask_m[:, None], other=0.0)
        w = _weight_chunk(
            w_ptr,
            scale_ptr,
            zero_ptr,
            rows_n,
            wmask,
            chunk,
            kk,
            row_bytes,
            scale_stride,
            group_blocks,
            row_group,
            QTYPE,
            BLOCK_BYTES,
            FORMAT,
            OFFSET,
            ZERO_MODE,
        )
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@lazy_jit
def _quant_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    row_bytes,
    scale_stride,
    group_blocks,
    row_group,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    FORMAT: tl.constexpr,
    OFFSET: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Every activation row (BLOCK_M >= M, a handful) against one tile of weight rows, read once.
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rows_m < M, rows_n < N
    kk = tl.arange(0, 32)
    wmask = mask_n[:, None]
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(0, K // 32):
        x = tl.load(x_rows + chunk * 32 + kk[None, :], mask=mask_m[:, None], other=0.0)
        w = _weight_chunk(
            w_ptr,
            scale_ptr,
            zero_ptr,
            rows_n,
            wmask,
            chunk,
            kk,
            row_bytes,
            scale_stride,
            group_blocks,
            row_group,
            QTYPE,
            BLOCK_BYTES,
            FORMAT,
            OFFSET,
            ZERO_MODE,
        )
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@lazy_jit
def _gguf_rows_kernel(
    w_ptr,
    ids_ptr,
    out_ptr,
    T,
    row_bytes,
    stride_out,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Chunk program_id(1) of the GGUF rows ids[t] for a tile of BLOCK_T tokens t, dequantized.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = tokens < T
    chunk = tl.program_id(1)
    kk = tl.arange(0, 32)
    ids = tl.load(ids_ptr + tokens, mask=mask_t, other=0)
    w_rows = w_ptr + ids.to(tl.int64)[:, None] * row_bytes
    w = gguf_chunk(w_rows, chunk, kk, mask_t[:, None], QTYPE, BLOCK_BYTES)
    out = out_ptr + tokens.to(tl.int64)[:, None] * stride_out + chunk * 32 + kk[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_t[:, None])


@lazy_jit
def _weight_chunk(
    w_ptr,
    scale_ptr,
    zero_ptr,
    rows,
    wmask,
    chunk,
    kk,
    row_bytes,
    scale_stride,
    group_blocks,
    row_group,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    FORMAT: tl.constexpr,
    OFFSET: tl.constexpr,
    ZERO_MODE: tl.constexpr,
):
    """Values 32 * chunk .. 32 * chunk + 31 of weight rows `rows`: [len(rows), 32] fp32. QTYPE >= 0:
    GGUF bytes of that format_code, rows of row_bytes at w_ptr; -1: a GroupBlocks (FORMAT,
    OFFSET and ZERO_MODE as kernels/quant_blocks.py names them, qs rows of row_bytes)."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * row_bytes
    if QTYPE < 0:
        w = _group_chunk(
            w_rows,
            scale_ptr,
            zero_ptr,
            rows,
            wmask,
            chunk,
            kk,
            scale_stride,
            group_blocks,
            row_group,
            FORMAT,
            OFFSET,
            ZERO_MODE,
        )
    else:
        w = gguf_chunk(w_rows, chunk, kk, wmask, QTYPE, BLOCK_BYTES)
    return w


@lazy_jit
def _group_chunk(
    qs_rows,
    scale_ptr,
    zero_ptr,
    rows,
    wmask,
    chunk,
    kk,
    scale_stride,
    group_blocks,
    row_group,
    FORMAT: tl.constexpr,
    OFFSET: tl.constexpr,
    ZERO_MODE: tl.constexpr,
):
    """A GroupBlocks chunk (kernels/quant_blocks.py): [len(rows), 32] fp32."""
    group = chunk // group_blocks
    scale_rows = (rows // row_group).to(tl.int64)[:, None] * scale_stride + group
    scale = tl.load(scale_ptr + scale_rows, mask=wmask, other=0.0).to(tl.float32)
    if FORMAT == 1:  # nibbles: value j low in byte j, j + 16 high
        byte = tl.load(qs_rows + chunk * 16 + (kk[None, :] % 16), mask=wmask, other=0)
        byte = byte.to(tl.int32)
        u = tl.where(kk[None, :] < 16, byte & 15, byte >> 4)
    else:
        u = tl.load(qs_rows + chunk * 32 + kk[None, :], mask=wmask, other=0).to(tl.int32)
    if FORMAT == 2:  # E4M3 -> fp16 (sign, then exponent and mantissa 7 bits up) x 2^8: exact
        bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
        w = scale * (bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0)
    elif ZERO_MODE == 1:
        zero_rows = rows.to(tl.int64)[:, None] * scale_stride + group
        zero = tl.load(zero_ptr + zero_rows, mask=wmask, other=0).to(tl.int32)
        w = scale * (u - zero).to(tl.float32)
    elif ZERO_MODE == 2:
        zero_rows = rows.to(tl.int64)[:, None] * scale_stride + group
        mins = tl.load(zero_ptr + zero_rows, mask=wmask, other=0.0).to(tl.float32)
        w = scale * u.to(tl.float32) + mins
    else:
        w = scale * (u - OFFSET).to(tl.float32)
    return w


def _bind_helpers() -> None:
    gguf_triton.bind()
    globals()["gguf_chunk"] = gguf_triton.gguf_chunk
    bind_helpers(globals(), "_group_chunk", "_weight_chunk")


def _weight_operands(w) -> dict:
    """The kernels' weight arguments for a QuantWeight held in the Triton form (GGUF bytes or
    GroupBlocks), its shapes checked."""
    if w.raw is not None:
        if w.qtype not in GGUF_QTYPES:
            raise ValueError(f"no Triton kernel for {w.qtype!r} (have {', '.join(GGUF_QTYPES)})")
        block, block_bytes = GGUF_QTYPES[w.qtype]
        raw = w.raw
        if (
            raw.dtype != torch.uint8
            or tuple(raw.shape) != (w.n, w.k // block * block_bytes)
            or w.k % block
        ):
            raise ValueError(
                f"raw must be uint8 [{w.n}, {w.k // block * block_bytes}], got {raw.dtype} "
                f"{tuple(raw.shape)}"
            )
        raw = raw if raw.is_contiguous() else raw.contiguous()
        return dict(
            tensors=(raw, raw, raw),
            row_bytes=raw.shape[1],
            scale_stride=0,
            group_blocks=1,
            row_group=1,
            QTYPE=format_code(w.qtype),
            BLOCK_BYTES=block_bytes,
            FORMAT=0,
            OFFSET=0,
            ZERO_MODE=0,
        )
    blocks = getattr(w, "blocks", None)
    if blocks is None or w.qtype not in KERNEL_FORMATS:
        raise ValueError(
            f"a {w.qtype!r} weight reaches the Triton kernels as GGUF bytes or GroupBlocks "
            "(kernels/quant.place), not as CPU components or packing"
        )
    if w.k % 32 or blocks.qs.shape[0] != w.n:
        raise ValueError(f"GroupBlocks of {tuple(blocks.qs.shape)} for a [{w.n}, {w.k}] weight")
    extra = blocks.zero if blocks.zero is not None else blocks.mins
    return dict(
        tensors=(blocks.qs, blocks.scale, blocks.qs if extra is None else extra),
        row_bytes=blocks.qs.shape[1],
        scale_stride=blocks.scale.shape[1],
        group_blocks=blocks.group_blocks,
        row_group=blocks.row_group,
        QTYPE=-1,
        BLOCK_BYTES=0,
        FORMAT=KERNEL_FORMATS[w.qtype],
        OFFSET=OFFSETS[w.qtype],
        ZERO_MODE=blocks.zero_mode,
    )


def quant_gemm_triton(
    x: torch.Tensor, w, bias: torch.Tensor | None, kernel: str | None = None
) -> torch.Tensor:
    """x [m, k] (fp32 / fp16 / bf16) @ dequantized(w).T + bias -> [m, n] in x's dtype. `w`: a
    kernels/quant.QuantWeight in the Triton form on x's device. `kernel` ("gemv" or "gemm")
    overrides kernels/choice.gemv_rows' choice by m (tests run both on every shape)."""
    operands = _weight_operands(w)
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be [m, {w.k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    weight, scale, zero = operands.pop("tensors")
    check_triton_device(x, weight, scale, zero, *([bias] if bias is not None else []))
    if bias is not None and tuple(bias.shape) != (w.n,):
        raise ValueError(f"bias must be [{w.n}], got {tuple(bias.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _bind_helpers()
    args = (x, weight, scale, zero, bias if bias is not None else x, out, m, w.n, w.k)
    args += (x.stride(0), out.stride(0))
    gemv = gemv_rows(m) if kernel is None else kernel == "gemv"
    if gemv:
        block_m = 1 if m == 1 else (2 if m == 2 else 4)
        if m > block_m:
            raise ValueError(f"the GEMV takes at most {block_m} rows, got {m}")
        block_n = 16 if w.n <= 4096 else 32
        _quant_gemv_kernel[(cdiv(w.n, block_n),)](
            *args,
            **operands,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=4,
        )
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    _quant_gemm_kernel[(cdiv(m, block_m), cdiv(w.n, 64))](
        *args,
        **operands,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=64,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def quant_gemm_triton_reference(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch oracle with the kernels' arithmetic: the weight dequantized (GGUF bytes by the
    gguf package, its own definition of the formats, independent of kernels/quant.dequantize;
    GroupBlocks by their formula), fp32 products and sums, rounded once to x's dtype."""
    if w.raw is not None:
        import gguf
        import numpy as np

        ggml_type = getattr(gguf.GGMLQuantizationType, w.qtype.upper())
        values = gguf.quants.dequantize(w.raw.cpu().numpy(), ggml_type)
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(w.n, w.k))
    else:
        weight = dequantize_group_blocks(w.blocks, w.n, w.k)
    out = F.linear(x.float(), weight.to(x.device), None if bias is None else bias.float())
    return out.to(x.dtype)


def gguf_rows(raw: torch.Tensor, qtype: str, k: int, ids: torch.Tensor, dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of a GGUF table raw uint8 [rows, row bytes], dequantized: [*ids.shape,
    k] in dtype, each value its fp32 dequantization rounded once."""
    if qtype not in GGUF_QTYPES:
        raise ValueError(f"no Triton kernel for {qtype!r} (have {', '.join(GGUF_QTYPES)})")
    block, block_bytes = GGUF_QTYPES[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // block * block_bytes:
        raise ValueError(f"raw must be uint8 [rows, {k // block * block_bytes}], got {raw.shape}")
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    check_triton_device(raw, flat)
    out = torch.empty((flat.shape[0], k), dtype=dtype, device=raw.device)
    if flat.shape[0]:
        _bind_helpers()
        block_t = 16
        _gguf_rows_kernel[(cdiv(flat.shape[0], block_t), k // 32)](
            raw if raw.is_contiguous() else raw.contiguous(),
            flat,
            out,
            flat.shape[0],
            raw.shape[1],
            out.stride(0),
            QTYPE=format_code(qtype),
            BLOCK_BYTES=block_bytes,
            BLOCK_T=block_t,
            num_warps=4,
        )
    return out.reshape(*ids.shape, k)
