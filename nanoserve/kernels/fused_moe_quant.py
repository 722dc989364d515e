"""Quantized experts for the fused-MoE Triton kernel: every local expert's matrix kept in its
blocks on the device (`ExpertBlocks`), dequantized in registers, 32 inputs at a time, inside the
grouped GEMM of kernels/fused_moe.py (sorted (token, slot) rows, one tile of BLOCK_M rows of one
expert and BLOCK_N output columns per program).

Held forms (`ExpertBlocks.layout`), per expert and output row:
  0 GGUF rows   the file's bytes as they are (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K),
                dequantized by kernels/quant_triton.py's _gguf_chunk (the dense GEMM's helper)
  1 nibbles     4-bit integers u (value i < 16 the low nibble of byte i of its block of 16
                bytes, else the high nibble of byte i - 16, as Q4_0), an fp32 scale per group
                (32 inputs, or as many as the scales repeat over) and for Q4_1 an fp32 min:             w = scale * (u - offset) (+ min)
                (GPTQ / AWQ / compressed-tensors int4: Q4_0, Q4_1)
  2 bytes       8-bit integers u (Q8_0 from int8 checkpoints, offset 128), as 1
  3 FP8         E4M3 bytes and an fp32 scale per group: w = e4m3(u) * scale, decoded with integer
                operations (no fp8 type needed: any GPU, the interpreter)
  4 MXFP4       E2M1 codes as nibbles (as 1) and an E8M0 exponent byte per 32 (17 bytes a block,
                as a GGUF file's MXFP4 and gpt-oss's checkpoint hold them): w = 2^(e - 128) * 2v
                with 2v = 2 x the E2M1 value, an integer in -12..12
Each dequantized value is the fp32 operation kernels/quant.dequantize_weight does, so the kernel
multiplies exactly the weights the CPU path and the reference read.

`quant_grouped_gemm_reference` is the launcher's torch reference (same signature).
`quantized_expert_form` is the one place that decides, by device, how a quantized checkpoint's
experts are held: "cpu" (a QuantWeight per expert, packed for the C++ kernels), "triton" (an
ExpertBlocks on the device) or None (dequantized at load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kernels import quant, quant_triton
from nanoserve.kernels.choice import kernel_choice
from nanoserve.kernels.gguf_formats import FORMATS, GGUF_QTYPES, format_code
from nanoserve.kernels.triton_utils import bind_helpers, cdiv, check_triton_device, lazy_jit

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)
_gguf_chunk = quant_triton._gguf_chunk
BLOCK_N = 64  # output columns a program (BLOCK_M: by rows, as the float kernel; depth: 32)
GGUF, NIBBLES, BYTES, FP8, MXFP4 = range(5)  # ExpertBlocks.layout
_COMPONENT_LAYOUTS = {
    "q4_0": NIBBLES,
    "q4_1": NIBBLES,
    "q8_0": BYTES,
    "q5_0": BYTES,
    "q5_1": BYTES,
    quant.FP8: FP8,
    quant.MXFP4: MXFP4,
}
# Every kernel format a quantized checkpoint's experts come in (GGUF rows, or components).
TRITON_QTYPES = frozenset(GGUF_QTYPES) | frozenset(_COMPONENT_LAYOUTS)


def quantized_expert_form(device: torch.device, qtype: str) -> str | None:
    """How a quantized checkpoint's experts of kernel format `qtype` are held on `device`:
    "triton" on CUDA (and anywhere under NANOSERVE_KERNELS=triton, whose interpreter tests it
    on a CPU): one ExpertBlocks a matrix, multiplied by this module's kernel; "cpu" on a CPU: a
    QuantWeight per expert, packed for the C++ kernels (kernels/fused_moe.py's grouped path);
    None: dequantized into the float parameter at load."""
    if device.type == "cuda" or kernel_choice() == "triton":
        return "triton" if qtype in TRITON_QTYPES else None
    return "cpu" if device.type == "cpu" else None


@dataclass
class ExpertBlocks:
    """One matrix (gate/up or down) of every local expert, stacked, in its quantized blocks:
    `quants` uint8 [experts, n, row bytes] (GGUF rows, or the integers / codes / E4M3 bytes),
    `scales` ([experts, n, k / scale_group]: fp32, MXFP4's uint8 exponents; None for GGUF rows,
    which hold theirs) and `mins` (fp32, Q4_1 only). A checkpoint's scales per group of 128
    inputs, per row or per 128 x 128 block (GPTQ, AWQ, FP8), which the kernel formats repeat
    per 32, are held once per `scale_group` inputs: the largest power-of-two multiple of 32
    that every expert's scales (and mins) repeat over (32 for MXFP4)."""

    qtype: str
    n: int
    k: int
    layout: int
    quants: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    scale_group: int = 32

    @classmethod
    def empty(cls, experts: int, like: quant.QuantWeight, device: torch.device) -> ExpertBlocks:
        """Room for `experts` matrices of `like`'s format and shape on `device` (ExpertBlocks.put
        fills them, one expert at a time as a load reads them)."""
        one = _held_arrays(like)
        group = 32 if _layout(like) in (GGUF, MXFP4) else _scale_group(one, like.k)
        one = _grouped(one, group)
        stacked = {
            key: None if a is None else a.new_empty((experts, *a.shape), device=device)
            for key, a in one.items()
        }
        return cls(like.qtype, like.n, like.k, _layout(like), **stacked, scale_group=group)

    @classmethod
    def stack(cls, weights: list[quant.QuantWeight], device: torch.device) -> ExpertBlocks:
        blocks = cls.empty(len(weights), weights[0], device)
        for expert, weight in enumerate(weights):
            blocks.put(expert, weight)
        return blocks

    @property
    def num_experts(self) -> int:
        return self.quants.shape[0]

    @property
    def device(self) -> torch.device:
        return self.quants.device

    def put(self, expert: int, weight: quant.QuantWeight) -> None:
        """Expert `expert`'s matrix (a QuantWeight of this format and shape: GGUF rows or
        components) into its slot."""
        if (weight.qtype, weight.n, weight.k, _layout(weight)) != (
            self.qtype,
            self.n,
            self.k,
            self.layout,
        ):
            raise ValueError(
                f"expert {expert}: {weight.qtype} [{weight.n}, {weight.k}] among experts of "
                f"{self.qtype} [{self.n}, {self.k}]: a layer's experts must share one format"
            )
        arrays = _held_arrays(weight)
        group = _scale_group(arrays, self.k, self.scale_group) if self.layout in _GROUPED else 32
        if group < self.scale_group:  # this expert's scales vary more often: all held finer
            repeat = self.scale_group // group
            self.scales = self.scales.repeat_interleave(repeat, dim=-1)
            self.mins = None if self.mins is None else self.mins.repeat_interleave(repeat, dim=-1)
            self.scale_group = group
        for key, array in _grouped(arrays, self.scale_group).items():
            if array is not None:
                getattr(self, key)[expert].copy_(array)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.quants, self.scales, self.mins)
            if t is not None
        )

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[experts, n, k] in `dtype` (the values the kernel multiplies)."""
        return torch.stack(
            [quant.dequantize_weight(self.expert_weight(e)) for e in range(self.num_experts)]
        ).to(dtype)

    def expert_weight(self, expert: int) -> quant.QuantWeight:
        """Expert `expert`'s matrix as a kernels/quant.py QuantWeight (on the CPU)."""
        quants = self.quants[expert].cpu()
        if self.layout == GGUF:
            return quant.QuantWeight(self.qtype, self.n, self.k, quants)
        if self.layout in (NIBBLES, MXFP4):
            blocks = quants.reshape(self.n, -1, 16)
            quants = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(self.n, self.k)
        repeat = self.scale_group // 32
        scales = self.scales[expert].cpu().repeat_interleave(repeat, dim=-1)
        if self.layout == MXFP4:
            scales = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 128)
        mins = None if self.mins is None else self.mins[expert].cpu().repeat_interleave(repeat, -1)
        components = quant.QuantComponents(quants.contiguous(), scales.contiguous(), mins)
        return quant.QuantWeight(self.qtype, self.n, self.k, None, components=components)


_GROUPED = (NIBBLES, BYTES, FP8)  # layouts whose fp32 scales (and mins) may be grouped


def _scale_group(arrays: dict[str, torch.Tensor | None], k: int, most: int | None = None) -> int:
    """The largest power-of-two multiple of 32 inputs (at most `most`, dividing k) over which
    the per-32 scales and mins of `arrays` repeat."""
    group, per_32 = 32, [arrays[key] for key in ("scales", "mins") if arrays[key] is not None]
    while k % (2 * group) == 0 and (most is None or 2 * group <= most):
        runs = [a.reshape(a.shape[0], -1, 2 * group // 32) for a in per_32]
        if not all(bool((run == run[..., :1]).all()) for run in runs):
            break
        group *= 2
    return group


def _grouped(arrays: dict[str, torch.Tensor | None], group: int) -> dict:
    """`arrays` with their per-32 scales and mins kept once per `group` inputs."""
    step = group // 32
    return {
        key: a if a is None or key == "quants" or step == 1 else a[:, ::step].contiguous()
        for key, a in arrays.items()
    }


def _layout(weight: quant.QuantWeight) -> int:
    if weight.raw is not None and weight.qtype in GGUF_QTYPES:
        return GGUF
    if weight.components is None or weight.qtype not in _COMPONENT_LAYOUTS:
        raise ValueError(
            f"{weight.qtype} experts have no Triton kernel here (GGUF rows, or components of "
            f"{', '.join(_COMPONENT_LAYOUTS)})"
        )
    return _COMPONENT_LAYOUTS[weight.qtype]


def _held_arrays(weight: quant.QuantWeight) -> dict[str, torch.Tensor | None]:
    """One expert's arrays as ExpertBlocks holds them (on the weight's device)."""
    layout = _layout(weight)
    if layout == GGUF:
        return {"quants": weight.raw, "scales": None, "mins": None}
    parts = weight.components
    u, scale = parts.u, parts.scale
    if weight.k % 32 or tuple(u.shape) != (weight.n, weight.k):
        raise ValueError(f"{weight.qtype} components must be [{weight.n}, k a multiple of 32]")
    if layout in (NIBBLES, MXFP4):
        blocks = u.reshape(weight.n, -1, 32)
        u = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(weight.n, -1)
    if layout == MXFP4:  # scale 2^(e - 128) -> e, a byte
        mantissa, exponent = torch.frexp(scale)
        if not bool((mantissa == 0.5).all()) or not bool(
            ((exponent >= -127) & (exponent <= 127)).all()
        ):
            raise ValueError("MXFP4 scales must be powers of two from 2^-128 to 2^126")
        scale = (exponent + 127).to(torch.uint8)
    return {"quants": u.contiguous(), "scales": scale.contiguous(), "mins": parts.mins}


@lazy_jit
def _component_chunk(
    q_rows,
    s_rows,
    m_rows,
    chunk,
    kk,
    wmask,
    scale_chunks,
    LAYOUT: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_MIN: tl.constexpr,
):
    """Inputs 32 * chunk .. 32 * chunk + 31 of the rows at `q_rows` (quants), `s_rows` (scales),
    `m_rows` (mins), [BLOCK_N, 1] pointers each: [BLOCK_N, 32] fp32 (layouts 1-4, see above).
    `scale_chunks`: chunks of 32 inputs a scale (and min) covers."""
    group = chunk // scale_chunks
    if LAYOUT == 1 or LAYOUT == 4:
        byte = tl.load(q_rows + chunk * 16 + (kk[None, :] % 16), mask=wmask, other=0).to(tl.int32)
        u = tl.where(kk[None, :] < 16, byte & 15, byte >> 4)
    else:
        u = tl.load(q_rows + chunk * 32 + kk[None, :], mask=wmask, other=0).to(tl.int32)
    if LAYOUT == 4:
        # E2M1: sign, exponent e (2 bits), mantissa m: 2v = m (e = 0), (2 + m) << (e - 1) else.
        magnitude = u & 7
        e, m = magnitude >> 1, magnitude & 1
        twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        twice = tl.where(u >= 8, -twice, twice).to(tl.float32)
        exponent = tl.load(s_rows + group, mask=wmask, other=0).to(tl.int32)
        # 2^(e - 128): the fp32 whose exponent field is e (2^(e - 127)), halved; e = 0: 2^-126 / 4
        power = (tl.maximum(exponent, 1) << 23).to(tl.float32, bitcast=True)
        scale = power * tl.where(exponent == 0, 0.25, 0.5)
        w = scale * twice
    elif LAYOUT == 3:
        # E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0: m * 2^-9.
        e, m = (u >> 3) & 15, u & 7
        normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        value = tl.where(u >= 128, -magnitude, magnitude)
        w = value * tl.load(s_rows + group, mask=wmask, other=0.0)
    else:
        w = tl.load(s_rows + group, mask=wmask, other=0.0) * (u - OFFSET).to(tl.float32)
        if HAS_MIN:
            w = w + tl.load(m_rows + group, mask=wmask, other=0.0)
    return w


@lazy_jit
def _quant_grouped_gemm_kernel(
    a_ptr,
    q_ptr,
    s_ptr,
    m_ptr,
    c_ptr,
    sorted_rows_ptr,
    block_experts_ptr,
    n,
    k,
    num_rows,
    a_rows_per_row,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_cm,
    num_experts,
    scale_chunks,
    LAYOUT: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # As kernels/fused_moe._grouped_gemm_kernel: c[row] = a[row // a_rows_per_row] @ w[expert].T
    # for this program's BLOCK_M sorted rows (one expert's) and BLOCK_N columns, w dequantized
    # 32 inputs at a time. Padding rows and blocks past the last expert's are skipped.
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    a_rows = a_ptr + (rows // a_rows_per_row)[:, None] * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    wmask = col_mask[:, None]
    q_rows = q_ptr + expert * stride_qe + cols.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + expert * stride_se + cols.to(tl.int64)[:, None] * stride_sn
    m_rows = m_ptr + expert * stride_se + cols.to(tl.int64)[:, None] * stride_sn
    kk = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(0, k // 32):
        a = tl.load(a_rows + chunk * 32 + kk[None, :], mask=row_mask[:, None], other=0.0)
        if LAYOUT == 0:
            w = _gguf_chunk(q_rows, chunk, kk, wmask, QTYPE, BLOCK_BYTES)
        else:
            w = _component_chunk(
                q_rows, s_rows, m_rows, chunk, kk, wmask, scale_chunks, LAYOUT, OFFSET, HAS_MIN
            )
        acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PRECISION)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def quant_grouped_gemm(
    a: torch.Tensor,
    blocks: ExpertBlocks,
    out: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_experts: torch.Tensor,
    a_rows_per_row: int,
    block_m: int,
) -> None:
    """out[row] = a[row // a_rows_per_row] @ dequantized(blocks[expert of row]).T for every row
    of sorted_rows (kernels/fused_moe.moe_align_block_size's, blocks of block_m rows)."""
    if a.dim() != 2 or a.shape[1] != blocks.k or a.stride(1) != 1:
        raise ValueError(f"a must be [rows, {blocks.k}], contiguous in its last dimension")
    if out.dim() != 2 or out.shape[1] != blocks.n or out.stride(1) != 1:
        raise ValueError(f"out must be [rows, {blocks.n}], contiguous in its last dimension")
    if blocks.k % 32:
        raise ValueError(f"quantized experts need inputs in whole blocks of 32, got {blocks.k}")
    held = [t for t in (blocks.quants, blocks.scales, blocks.mins) if t is not None]
    check_triton_device(a, out, sorted_rows, block_experts, *held)
    if any(not t.is_contiguous() for t in held):
        raise ValueError("the experts' blocks must be contiguous")
    quant_triton._bind_helpers()
    bind_helpers(globals(), "_gguf_chunk", "_component_chunk")
    scales = blocks.scales if blocks.scales is not None else blocks.quants
    mins = blocks.mins if blocks.mins is not None else scales
    gguf = blocks.layout == GGUF
    grid = (block_experts.shape[0], cdiv(blocks.n, BLOCK_N))
    _quant_grouped_gemm_kernel[grid](
        a,
        blocks.quants,
        scales,
        mins,
        out,
        sorted_rows,
        block_experts,
        blocks.n,
        blocks.k,
        out.shape[0],
        a_rows_per_row,
        a.stride(0),
        blocks.quants.stride(0),
        blocks.quants.stride(1),
        0 if gguf else scales.stride(0),
        0 if gguf else scales.stride(1),
        out.stride(0),
        blocks.num_experts,
        blocks.scale_group // 32,
        LAYOUT=blocks.layout,
        QTYPE=format_code(blocks.qtype) if gguf else 0,
        BLOCK_BYTES=GGUF_QTYPES[blocks.qtype][1] if gguf else 0,
        OFFSET=0 if gguf else FORMATS[blocks.qtype][2],
        HAS_MIN=blocks.mins is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def quant_grouped_gemm_reference(
    a: torch.Tensor,
    blocks: ExpertBlocks,
    out: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_experts: torch.Tensor,
    a_rows_per_row: int,
    block_m: int,
) -> None:
    """quant_grouped_gemm in torch: each block's rows (padding skipped) times its expert's
    matrix dequantized by kernels/quant.dequantize_weight, in fp32, rounded once to out's dtype."""
    rows = sorted_rows.reshape(-1, block_m).cpu()
    for block, expert in enumerate(block_experts.tolist()):
        if expert >= blocks.num_experts:
            continue
        valid = rows[block][rows[block] < out.shape[0]].to(out.device)
        if valid.numel() == 0:
            continue
        weight = quant.dequantize_weight(blocks.expert_weight(expert)).to(a.device)
        out[valid] = (a[valid // a_rows_per_row].float() @ weight.t()).to(out.dtype)
