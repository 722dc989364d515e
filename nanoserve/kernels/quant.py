"""Linear layers whose weights stay in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K).

How the CPU kernel (kernels/cpu/gemm_quant.cpp) multiplies, as llama.cpp does: each row of the
activations is quantized per block of 32 to int8 with one fp32 scale, the weights stay integers
with their per-block scales, and each block's product is an exact integer dot product (VNNI,
AVX2 maddubs or plain C++) folded into an fp32 sum. `reference_gemm` is that arithmetic written
in torch, operation for operation, so the kernel's output equals it bit for bit at every ISA
level; `dequantize` is the format itself, bit-exact with the `gguf` package's own.

Every format is seen through the same components: unsigned integers `u` per element, an integer
`offset`, an fp32 `scale` per group of 16 or 32 elements and, for Q4_1 / Q5_1 / Q4_K / Q5_K, a `min` per
32, so that weight = scale * (u - offset) (+ min), each step the fp32 operation gguf's
dequantize does.

Other checkpoint formats whose integers and scales fit those components (compressed-tensors' int8
and 4-bit weights, models/compressed_tensors.py) bring them directly (`QuantWeight.components`):
the same packing, kernel and reference then multiply them, with no GGUF bytes in between.

MXFP4 (gpt-oss's experts, models/mxfp4.py) is a components-only format too: `u` holds the 4-bit
E2M1 codes, packed as nibbles like Q4_0, and the kernels decode each code through a table
(MXFP4_U: 12 + 2 x its value) so that weight = scale * (u - 12), scale 2^(exponent - 128); the
products are those of the same weight held as Q8_0, in 4 bits an element instead of 8.

FP8 (E4M3) weights (models/fp8.py: checkpoints of quant_method fp8 and compressed-tensors'
float-quantized) are the one format of floats, not integers: `u` holds the E4M3 bytes and
weight = e4m3 value * scale, a scale per block of 32 inputs. Its kernel (kernels/cpu/gemm_fp8.cpp)
keeps the activations in their float dtype (no int8 rounding); its reference is the
dequantize-then-matmul product in fp32, and the kernel agrees with it to fp32 rounding, not bit
for bit (tests/kernels/test_fp8_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kernels.choice import kernel_choice
from nanoserve.kernels.gguf_formats import FORMATS, GGUF_QTYPES, format_code
from nanoserve.kernels.quant_blocks import (
    KERNEL_FORMATS,
    GroupBlocks,
    group_blocks_components,
    make_group_blocks,
)

_COLS = 16  # output columns of a packed group (one AVX-512 register of int32 / fp32 lanes)
_BLOCK = 32  # activation elements sharing one int8 scale
FP8 = "fp8_e4m3"  # the FP8 weight format (see the module's docstring)
MXFP4 = "mxfp4"  # 4-bit E2M1 codes through MXFP4_U (see the module's docstring)
# An MXFP4 code (sign, 2 exponent bits, 1 mantissa bit) -> 12 + 2 x its value: gemm_quant.cpp's
# kMxfp4Table.
MXFP4_U = torch.tensor(
    [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8
)


def qtype_name(ggml_type) -> str:
    """gguf.GGMLQuantizationType -> our name ("q8_0", ..., "mxfp4": a GGUF file's MXFP4, which
    models/gguf/weights.py turns into the kernels' MXFP4 components); ValueError for any other type."""
    name = getattr(ggml_type, "name", str(ggml_type)).lower()
    if name not in GGUF_QTYPES and name != MXFP4:
        raise ValueError(
            f"GGUF tensor type {name.upper()} is not supported for linear layers; "
            f"supported: {', '.join(t.upper() for t in (*GGUF_QTYPES, MXFP4))}"
        )
    return name


@dataclass
class QuantComponents:
    """A weight as the kernel sees it, from a format other than GGUF's bytes: weight =
    scale * (u - offset) (+ min), offset the one its kernel format (`QuantWeight.qtype`) implies."""

    u: torch.Tensor  # uint8 [n, k] (0..255 for 8 bits, 0..15 for 4; MXFP4: codes)
    scale: torch.Tensor  # fp32 [n, k / 32]: one scale per block of 32 (repeated)
    mins: torch.Tensor | None = None  # fp32 [n, k / 32] (the Q4_1 format only)


@dataclass
class QuantWeight:
    """One linear layer's weight in a GGUF block format: the file's bytes (`raw`), or, for a
    checkpoint of another format, `components` in the kernel format named by `qtype` (q8_0:
    offset 128; q4_0: offset 8; q4_1: offset 0 and a min; fp8_e4m3; mxfp4: codes) and `raw` None. Once packed for the
    CPU kernel (pack_for_cpu) the packing is its only copy: `raw` and `components` are dropped.
    Held for the Triton kernels (`place`: on CUDA, or NANOSERVE_KERNELS=triton), `triton` is set
    and the weight is its GGUF bytes or, for components, `blocks` (kernels/quant_blocks.py)."""

    qtype: str
    n: int
    k: int
    raw: torch.Tensor | None  # uint8 [n, row_bytes]: GGUF bytes, rows in output order
    packed: torch.Tensor | None = None  # the CPU kernel's own layout (pack_for_cpu)
    components: QuantComponents | None = None
    planes: bool = False  # packed as nibbles and bit planes (PLANES; Q5_K, Q6_K)
    blocks: GroupBlocks | None = None  # the Triton kernels' form of components (`place`)
    triton: bool = False  # held for the Triton kernels (`place`)

    @property
    def kernel_format(self) -> int:
        """The format number the CPU kernels know the packing by."""
        return format_code(PLANES[self.qtype] if self.planes else self.qtype)

    @property
    def nbytes(self) -> int:
        """Bytes the weight's own data takes: GGUF bytes, components, or (either dropped once
        packed, see pack_for_cpu) the CPU packing."""
        if self.raw is not None:
            return self.raw.numel()
        if self.blocks is not None:
            return self.blocks.nbytes
        if self.components is None:
            return self.packed.numel()
        parts = self.components
        return sum(
            t.numel() * t.element_size()
            for t in (parts.u, parts.scale, parts.mins)
            if t is not None
        )

    @property
    def device(self) -> torch.device:
        if self.raw is not None:
            return self.raw.device
        if self.blocks is not None:
            return self.blocks.device
        return (self.components.u if self.components is not None else self.packed).device


# A GGUF file's MXFP4 block: 32 values in an E8M0 exponent byte and 16 bytes of codes.
_GGUF_MXFP4_BLOCK = (32, 17)


def gguf_block(qtype: str) -> tuple[int, int]:
    """(values, bytes) of one block of a GGUF file's tensor of type `qtype` (qtype_name's names)."""
    return _GGUF_MXFP4_BLOCK if qtype == MXFP4 else GGUF_QTYPES[qtype]


def _check(raw: torch.Tensor, qtype: str, k: int) -> tuple[int, int]:
    if qtype not in GGUF_QTYPES:
        qtype_name(qtype)
    elements, nbytes = GGUF_QTYPES[qtype]
    if k % elements:
        raise ValueError(f"{qtype}: k={k} is not a multiple of its block of {elements}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // elements * nbytes:
        raise ValueError(
            f"{qtype}: raw must be uint8 [n, {k // elements * nbytes}], got {raw.dtype} "
            f"{list(raw.shape)}"
        )
    return elements, nbytes


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per value at the end -> float32 from fp16."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """[..., span] bytes -> [..., 2 * span]: low nibbles are elements 0..span-1, high ones the next."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _components(raw: torch.Tensor, qtype: str, k: int):
    """(u uint8 [n, k], offset, scale fp32 [n, k / G], min fp32 [n, k / 32] or None)."""
    elements, nbytes = _check(raw, qtype, k)
    n = raw.shape[0]
    blocks = raw.reshape(n, k // elements, nbytes)
    if qtype == "q8_0":
        u = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return u.reshape(n, k), 128, _half(blocks[..., :2]).reshape(n, -1), None
    if qtype in ("q5_0", "q5_1"):
        return _q5_components(blocks, qtype, n, k)
    if qtype in ("q4_0", "q4_1"):
        start = 2 if qtype == "q4_0" else 4
        u = _nibbles(blocks[..., start:], 16).reshape(n, k)
        scale = _half(blocks[..., :2]).reshape(n, -1)
        if qtype == "q4_0":
            return u, 8, scale, None
        return u, 0, scale, _half(blocks[..., 2:4]).reshape(n, -1)
    u, offset, d, codes, dmin, min_codes = _k_parts(raw, qtype, k)
    return u, offset, *_k_scales(d, codes, dmin, min_codes)


def _k_parts(raw: torch.Tensor, qtype: str, k: int):
    """A K type's rows as the file keeps them: (u uint8 [n, k], offset, d fp32 [n, k / 256, 1],
    scale codes [n, k / 256, 8 or 16] (6-bit; Q6_K's int8), dmin and min codes (Q4_K, Q5_K; else
    None)). The CPU packing holds these (kernels/cpu/gemm_quant.cpp's compact Traits)."""
    _, nbytes = _check(raw, qtype, k)
    n = raw.shape[0]
    blocks = raw.reshape(n, k // 256, nbytes)
    if qtype in ("q4_k", "q5_k"):
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [n, nb, 1]
        codes, min_codes = _q4_k_scale_min(blocks[..., 4:16])  # [n, nb, 8] each
        if qtype == "q4_k":
            u = _nibbles(blocks[..., 16:].reshape(n, -1, 4, 32), 32).reshape(n, k)
        else:
            u = _q5_k_values(blocks, n, k)
        return u, 0, d, codes, dmin, min_codes
    # q6_k: ql [128], qh [64], scales int8 [16], d fp16
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    low = _nibbles(ql.reshape(n, -1, 2, 64), 64)  # [n, nb, 2, 128]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 2, 1, 32) >> shifts) & 3).reshape(n, -1, 2, 128)
    u = (low | (high << 4)).reshape(n, k)
    return (
        u,
        32,
        _half(blocks[..., 208:210]),
        blocks[..., 192:208].contiguous().view(torch.int8),
        None,
        None,
    )


def _k_scales(d, codes, dmin, min_codes):
    """(scale fp32 [n, k / group], min fp32 [n, k / 32] or None): d * code and -(dmin * code), the
    fp32 operations of gguf's dequantization (and of the CPU kernel on its compact packing)."""
    n = d.shape[0]
    scale = (d * codes.float()).reshape(n, -1)
    return scale, None if dmin is None else (-(dmin * min_codes.float())).reshape(n, -1)


def _q5_k_values(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q5_K's u: sub-block j's element l has bit j of qh[l] and the low (j even) or high nibble
    of qs[32 * (j // 2) + l]."""
    bits = torch.arange(8, dtype=torch.uint8)
    qh = blocks[..., 16:48].unsqueeze(-2)  # [n, nb, 1, 32]
    high = (qh >> bits.reshape(8, 1)) & 1  # [n, nb, 8, 32]
    low = _nibbles(blocks[..., 48:].reshape(n, -1, 4, 32), 32).reshape(high.shape)
    return (low | (high << 4)).reshape(n, k)


def _q5_components(blocks: torch.Tensor, qtype: str, n: int, k: int):
    """Q5_0 (d, qh 4, qs 16) and Q5_1 (d, m, qh 4, qs 16): u = low nibble | high bit << 4, as
    llama.cpp's dequantize_row_q5_*: element i's high bit is bit i of the little-endian qh word,
    its nibble the low one of qs[i] (i < 16) or the high one of qs[i - 16]."""
    bits = torch.arange(8, dtype=torch.uint8)
    start = 2 if qtype == "q5_0" else 4
    qh = blocks[..., start : start + 4].unsqueeze(-1)  # [n, nb, 4, 1]
    high = ((qh >> bits) & 1).reshape(n, -1, 32)
    u = (_nibbles(blocks[..., start + 4 :], 16) | (high << 4)).reshape(n, k)
    scale = _half(blocks[..., :2]).reshape(n, -1)
    if qtype == "q5_0":
        return u, 16, scale, None
    return u, 0, scale, _half(blocks[..., 2:4]).reshape(n, -1)


def _q4_k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's twelve bytes -> eight 6-bit scales and eight 6-bit mins (llama.cpp's get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def weight_components(w: QuantWeight):
    """(u, offset, scale, min) of any source: decoded from GGUF bytes, `components` as given, or
    read back from the CPU packing when the components were dropped (pack_for_cpu). MXFP4's
    codes come out as their integers (MXFP4_U)."""
    u, offset, scale, mins = _stored_components(w)
    return (MXFP4_U[u.long()] if w.qtype == MXFP4 else u), offset, scale, mins


def _stored_components(w: QuantWeight):
    """weight_components with `u` as the packing stores it (MXFP4: the codes)."""
    if w.raw is not None:
        return _components(w.raw.cpu(), w.qtype, w.k)
    if w.blocks is not None:
        u, scale, mins = group_blocks_components(w.blocks, w.n, w.k)
        return u.cpu(), FORMATS[w.qtype][2], scale.cpu(), None if mins is None else mins.cpu()
    parts = (
        w.components
        if w.components is not None
        else unpack_weight(w.packed, w.qtype, w.n, w.k, w.planes)
    )
    mins = None if parts.mins is None else parts.mins.cpu()
    return parts.u.cpu(), FORMATS[w.qtype][2], parts.scale.cpu(), mins


def dequantize(raw: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """GGUF rows uint8 [n, row_bytes] -> float32 [n, k], bit-exact with gguf.quants.dequantize."""
    return _dequantize_components(*_components(raw, qtype, k))


def dequantize_weight(w: QuantWeight) -> torch.Tensor:
    """float32 [n, k] of either source."""
    if w.qtype == FP8:
        u, _, scale, _ = weight_components(w)
        return fp8_values(u) * scale.repeat_interleave(_BLOCK, dim=1)
    return _dequantize_components(*weight_components(w))


def fp8_values(u: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) -> their float32 values."""
    return u.contiguous().view(torch.float8_e4m3fn).float()


def _dequantize_components(u, offset, scale, mins) -> torch.Tensor:
    k = u.shape[1]
    group = k // scale.shape[1]
    values = scale.repeat_interleave(group, dim=1) * (u.to(torch.int16) - offset).float()
    if mins is not None:
        values = values + mins.repeat_interleave(_BLOCK, dim=1)
    return values


# ---- activations, as the kernel quantizes them ----------------------------------------------


def quantize_activations(x: torch.Tensor):
    """Each row per block of 32: (q int8 [m, k], dx fp32 [m, k/32], sums int32 [m, k/16]).
    dx = amax / 127, q = round-half-even(x * (1 / dx)) (0 where the block is ~0), as the kernel."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // _BLOCK, _BLOCK)
    amax = blocks.abs().amax(dim=-1)
    dx = amax / 127.0
    inverse = torch.where(
        amax >= 2.0**-100, 1.0 / torch.where(dx > 0, dx, torch.ones_like(dx)), torch.zeros_like(dx)
    )
    q = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8)
    sums = q.reshape(m, -1, 16).to(torch.int32).sum(dim=-1, dtype=torch.int32)
    return q.reshape(m, k), dx, sums


def reference_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ dequantize(w)^T (+ bias) as the CPU kernel computes it, in x.dtype.

    Per output element, blocks in order from k = 0: with i the exact integer dot product of a
    scale group (u - offset against the int8 activations),
        acc = acc + (scale * dx) * float(i);  acc = acc + min * (dx * float(sum of the block's q))
    then acc + bias rounded once to x.dtype. The kernel does the same fp32 operations in the same
    order, so it equals this bit for bit; against the exact product of x and dequantize(w) the
    difference is the activations' int8 rounding (relative ~1/254 per block, averaging out).
    FP8 weights: x (in fp32) @ dequantize(w)^T, the oracle its kernel is tested against.
    """
    if w.qtype == FP8:
        out = x.cpu().float() @ dequantize_weight(w).t()
        if bias is not None:
            out = out + bias.cpu().float()
        return out.to(x.dtype).to(x.device)
    u, offset, scale, mins = weight_components(w)
    q, dx, sums = quantize_activations(x.cpu())
    m, n, k = x.shape[0], w.n, w.k
    group = k // scale.shape[1]
    out = torch.empty(m, n, dtype=torch.float32)
    step = max(1, (1 << 24) // max(1, m * (k // group)))  # columns at a time (bounds memory)
    for start in range(0, n, step):
        cols = slice(start, min(n, start + step))
        acc = torch.zeros(m, cols.stop - start)
        # exact integer dots of every scale group, as float64 (all well below 2^53)
        dots = torch.einsum(
            "mgc,ngc->mng",
            q.reshape(m, -1, group).double(),
            u[cols].reshape(-1, k // group, group).double(),
        )
        dots = dots - offset * sums.reshape(m, -1, group // 16).sum(-1).double().unsqueeze(1)
        dots = dots.float()
        for g in range(k // group):
            b = g * group // _BLOCK
            acc = acc + (scale[cols, g].unsqueeze(0) * dx[:, b].unsqueeze(1)) * dots[:, :, g]
            if mins is not None:
                block_sum = dx[:, b] * sums[:, 2 * b : 2 * b + 2].sum(-1).float()
                acc = acc + mins[cols, b].unsqueeze(0) * block_sum.unsqueeze(1)
        out[:, cols] = acc
    if bias is not None:
        out = out + bias.cpu().float()
    return out.to(x.dtype).to(x.device)


# ---- the CPU kernel's layout -----------------------------------------------------------------

# The K types keep the file's scale codes, and d (and dmin) once a super-block of 256 (kernels/cpu/
# gemm_quant.cpp's compact Traits): per super-block of a group of 16 columns, the 8 blocks' quants,
# then each block's scale codes [groups of the block][16 columns] (uint8; Q6_K's int8), the min
# codes [8][16] (Q4_K, Q5_K), then fp32 d [16] and dmin [16].
COMPACT = ("q4_k", "q5_k", "q6_k")
# The 5- and 6-bit K types packed in their own bits, as the file holds them: each element's low
# four bits as the 4-bit formats' nibbles, its fifth (and sixth) in bit planes, 5.75 and 6.6 bits a
# weight instead of a byte's 8.75 and 8.6 (a batch-1 decode reads every weight once a token, so
# that is its time); gguf_formats.py's "q5_k/planes" and "q6_k/planes" formats.
PLANES = {"q5_k": "q5_k/planes", "q6_k": "q6_k/planes"}


def _plane_bits(qtype: str, planes: bool) -> int:
    """High bits a packed element keeps in bit planes (0 unless packed as PLANES)."""
    return (2 if qtype == "q6_k" else 1) if planes else 0


def packed_layout(qtype: str, planes: bool = False) -> tuple[int, int, int]:
    """Bytes of one packed block of 16 columns x 32 elements: (quants, scales, mins); a compact
    type's (per super-block / 8): (quants, scale codes, min codes and the fp32 d / dmin)."""
    nibbles, group, _, has_min = FORMATS[qtype]
    quants = 256 + 64 * _plane_bits(qtype, planes) if nibbles or planes else 512
    if qtype in COMPACT:
        codes = _COLS * (_BLOCK // group)
        return (
            quants,
            codes,
            ((8 * _COLS if has_min else 0) + 4 * _COLS * (2 if has_min else 1)) // 8,
        )
    return quants, 4 * _COLS * (_BLOCK // group), (4 * _COLS if has_min else 0)


def _pack_steps(u: torch.Tensor, groups: int, nb: int, nibbles: bool) -> torch.Tensor:
    """u [groups * 16, k] -> [groups, nb, quant bytes]: each block's quants as the VNNI steps read
    them (see pack_weight)."""
    quants = u.reshape(groups, _COLS, nb, 8, 4).permute(
        0, 2, 3, 1, 4
    )  # [.., nb, 8 steps, 16 cols, 4]
    if nibbles:
        quants = quants[:, :, :4] | (quants[:, :, 4:] << 4)
    return quants.reshape(groups, nb, -1)


def _pack_planes(u: torch.Tensor, groups: int, nb: int, bits: int) -> torch.Tensor:
    """u [groups * 16, k] -> [groups, nb, 256 + 64 * bits]: per block, the low four bits as
    _pack_steps packs nibbles, then the high bits as planes of the 64 lanes (16 columns x 4
    elements) a step holds: one bit (Q5_K) has byte lane i's bit s = step s's fifth bit; two
    (Q6_K) take two planes, steps 0-3 then 4-7, bits 2s and 2s + 1 of step s's two high bits."""
    steps = u.reshape(groups, _COLS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 8, 64)
    low = steps & 0x0F
    high = (steps >> 4).to(torch.int32)
    per_plane = 8 // bits  # steps a plane holds
    shifts = (bits * torch.arange(per_plane, dtype=torch.int32)).reshape(1, 1, per_plane, 1)
    planes = (high.reshape(groups, nb, bits, per_plane, 64) << shifts).sum(dim=3).to(torch.uint8)
    return torch.cat(
        [
            (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(groups, nb, -1),
            planes.reshape(groups, nb, -1),
        ],
        dim=-1,
    )


def _unpack_planes(quants: torch.Tensor, groups: int, nb: int, bits: int) -> torch.Tensor:
    """_pack_planes' inverse: -> u [groups * 16, k]."""
    quants = quants.reshape(groups, nb, -1)
    low = _unpack_steps(quants[..., :256], groups, nb, True).reshape(groups, _COLS, nb, 8, 4)
    per_plane = 8 // bits
    planes = quants[..., 256:].reshape(groups, nb, bits, 1, 64).to(torch.int32)
    shifts = (bits * torch.arange(per_plane, dtype=torch.int32)).reshape(1, 1, 1, per_plane, 1)
    high = (
        ((planes >> shifts) & ((1 << bits) - 1))
        .reshape(groups, nb, 8, _COLS, 4)
        .permute(0, 3, 1, 2, 4)
    )
    return (low | (high.to(torch.uint8) << 4)).reshape(groups * _COLS, nb * _BLOCK)


def _unpack_steps(quants: torch.Tensor, groups: int, nb: int, nibbles: bool) -> torch.Tensor:
    """_pack_steps' inverse: -> u [groups * 16, k]."""
    steps = quants.reshape(groups, nb, -1, _COLS, 4)
    if nibbles:
        steps = torch.cat([steps & 0x0F, steps >> 4], dim=2)
    return steps.permute(0, 3, 1, 2, 4).reshape(groups * _COLS, nb * _BLOCK)


def _column_major(values: torch.Tensor, groups: int) -> torch.Tensor:
    """[groups * 16, supers, e] -> [groups, supers, e, 16] as bytes [groups, supers, e * 16 * size]."""
    per_column = values.reshape(groups, _COLS, values.shape[1], -1).permute(0, 2, 3, 1).contiguous()
    return per_column.view(torch.uint8).reshape(groups, values.shape[1], -1)


def _from_column_major(data: torch.Tensor, groups: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """_column_major's inverse: bytes [groups, supers, e * 16 * size] -> [n, supers, e] of dtype."""
    supers = data.shape[1]
    values = data.contiguous().view(dtype).reshape(groups, supers, -1, _COLS)
    return values.permute(0, 3, 1, 2).reshape(groups * _COLS, supers, -1)[:n]


def _pack_compact(w: QuantWeight) -> torch.Tensor:
    """A K type's packing from its GGUF rows (COMPACT's layout), [groups, k / 32, bytes a block]."""
    u, _, d, codes, dmin, min_codes = _k_parts(w.raw.cpu(), w.qtype, w.k)
    groups, nb = -(-w.n // _COLS), w.k // _BLOCK
    pad = groups * _COLS - w.n

    def padded(t):
        return t if not pad else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])

    if w.planes:
        quants = _pack_planes(padded(u), groups, nb, _plane_bits(w.qtype, True))
    else:
        quants = _pack_steps(padded(u), groups, nb, FORMATS[w.qtype][0])
    quants = quants.reshape(groups, nb // 8, -1)
    parts = [quants, _column_major(padded(codes.view(torch.uint8)), groups)]
    if dmin is not None:
        parts.append(_column_major(padded(min_codes), groups))
    parts.append(_column_major(padded(d), groups))
    if dmin is not None:
        parts.append(_column_major(padded(dmin), groups))
    return torch.cat(parts, dim=-1).reshape(groups, nb, -1).contiguous()


def _unpack_compact(
    packed: torch.Tensor, qtype: str, n: int, k: int, planes: bool
) -> QuantComponents:
    nibbles, group, _, has_min = FORMATS[qtype]
    groups, supers, nb = packed.shape[0], k // 256, k // _BLOCK
    quant_bytes, code_bytes, _ = packed_layout(qtype, planes)
    data = packed.reshape(groups, supers, -1)
    at = 8 * quant_bytes
    if planes:
        u = _unpack_planes(data[..., :at], groups, nb, _plane_bits(qtype, True))[:n]
    else:
        u = _unpack_steps(data[..., :at], groups, nb, nibbles)[:n]
    codes = _from_column_major(data[..., at : at + 8 * code_bytes], groups, n, torch.uint8)
    at += 8 * code_bytes
    if qtype == "q6_k":
        codes = codes.view(torch.int8)
    min_codes = dmin = None
    if has_min:
        min_codes = _from_column_major(data[..., at : at + 8 * _COLS], groups, n, torch.uint8)
        at += 8 * _COLS
    d = _from_column_major(data[..., at : at + 4 * _COLS], groups, n, torch.float32)
    if has_min:
        dmin = _from_column_major(data[..., at + 4 * _COLS :], groups, n, torch.float32)
    scale, mins = _k_scales(d, codes, dmin, min_codes)
    return QuantComponents(
        u.contiguous(), scale.contiguous(), None if mins is None else mins.contiguous()
    )


def pack_weight(w: QuantWeight) -> torch.Tensor:
    """uint8 [ceil(n / 16), k / 32, block bytes]: per group of 16 output columns and block of 32
    elements, the quants as one VNNI step reads them (64 bytes = 16 columns x 4 consecutive
    elements, eight such steps a block; 4-bit formats hold step j in the low nibbles and step
    j + 4 in the high ones), then fp32 scales [groups of the block][16 columns], then fp32 mins.
    FP8 (kernels/cpu/gemm_fp8.cpp, which widens one input's 16 columns at a time): the E4M3 bytes
    [32 inputs][16 columns] instead of VNNI steps, then the scales as the others'. The K types
    (COMPACT): per super-block of 8 blocks, their quants, then the file's codes and d / dmin."""
    if w.qtype in COMPACT:
        return _pack_compact(w)
    nibbles, group, _, has_min = FORMATS[w.qtype]
    u, _, scale, mins = _stored_components(w)
    groups, nb = -(-w.n // _COLS), w.k // _BLOCK
    pad = groups * _COLS - w.n
    if pad:
        u = torch.cat([u, u.new_zeros(pad, w.k)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        mins = None if mins is None else torch.cat([mins, mins.new_zeros(pad, mins.shape[1])])
    if w.qtype == FP8:  # [groups, 16 cols, nb, 32] -> [groups, nb, 32, 16 cols]
        quants = u.reshape(groups, _COLS, nb, _BLOCK).permute(0, 2, 3, 1)
    else:  # [groups, 16 cols, nb, 8 steps, 4] -> [groups, nb, 8 steps, 16 cols, 4]
        quants = _pack_steps(u, groups, nb, nibbles)
    parts = [quants.reshape(groups, nb, -1)]
    per_block = _BLOCK // group
    parts.append(
        scale.reshape(groups, _COLS, nb, per_block)
        .permute(0, 2, 3, 1)
        .contiguous()
        .view(torch.uint8)
        .reshape(groups, nb, -1)
    )
    if has_min:
        parts.append(
            mins.reshape(groups, _COLS, nb)
            .permute(0, 2, 1)
            .contiguous()
            .view(torch.uint8)
            .reshape(groups, nb, -1)
        )
    return torch.cat(parts, dim=-1).contiguous()


def unpack_weight(
    packed: torch.Tensor, qtype: str, n: int, k: int, planes: bool = False
) -> QuantComponents:
    """pack_weight's inverse: the components of the first n columns of a packing."""
    if qtype in COMPACT:
        return _unpack_compact(packed, qtype, n, k, planes)
    nibbles, group, _, has_min = FORMATS[qtype]
    groups, nb = packed.shape[0], k // _BLOCK
    quants, scales_bytes, _ = packed_layout(qtype)
    if qtype == FP8:  # [groups, nb, 32, 16 cols] -> [groups, 16 cols, nb, 32]
        u = packed[..., :quants].reshape(groups, nb, _BLOCK, _COLS).permute(0, 3, 1, 2)
    else:
        u = _unpack_steps(packed[..., :quants], groups, nb, nibbles)
    u = u.reshape(groups * _COLS, k)[:n]
    per_block = _BLOCK // group
    scale = (
        packed[..., quants : quants + scales_bytes]
        .contiguous()
        .view(torch.float32)
        .reshape(groups, nb, per_block, _COLS)
        .permute(0, 3, 1, 2)
        .reshape(groups * _COLS, -1)[:n]
    )
    mins = None
    if has_min:
        mins = (
            packed[..., quants + scales_bytes :]
            .contiguous()
            .view(torch.float32)
            .reshape(groups, nb, _COLS)
            .permute(0, 2, 1)
            .reshape(groups * _COLS, nb)[:n]
        )
    return QuantComponents(
        u.contiguous(), scale.contiguous(), None if mins is None else mins.contiguous()
    )


def pack_for_cpu(w: QuantWeight) -> None:
    """Fill w.packed when the C++ kernels load here and take this shape (no-op otherwise).
    The weight's source, GGUF bytes or components, is then dropped: the packing holds the same
    numbers (unpack_weight reads them back for reference_gemm and dequantize_weight), so the
    weight is held once (a Q4_1 file's bytes beside their packing were 2.2x the file)."""
    from nanoserve.kernels.cpu import ops as cpu_ops

    block = GGUF_QTYPES[w.qtype][0] if w.qtype in GGUF_QTYPES else _BLOCK  # FP8, MXFP4: 32
    if w.packed is not None or w.triton or w.device.type != "cpu" or w.k % block:
        return
    if not cpu_ops.available():
        return
    if w.qtype in COMPACT and w.raw is None:  # the compact packing is made from the file's codes
        return
    # Bit planes where the level's kernels read them at their best: AVX2 and the portable loops
    # (the AVX-512 VNNI level keeps a byte an element, its vpdpbusd steps' own operand).
    w.planes = w.qtype in PLANES and not cpu_ops.vnni_gemm_quant()
    w.packed = _pack_in_slices(w)
    w.components = None
    w.raw = None


_PACK_ROWS = 8192  # output rows packed at a time (a multiple of _COLS)


def _pack_in_slices(w: QuantWeight) -> torch.Tensor:
    """pack_weight a slice of _PACK_ROWS rows at a time into one packing: the same bytes (groups of
    16 rows pack on their own), with the intermediates of one slice at a time (a 128k-row LM head
    unpacked whole was several times its own size)."""
    if w.n <= _PACK_ROWS:
        return pack_weight(w)
    packed = None
    for start in range(0, w.n, _PACK_ROWS):
        end = min(start + _PACK_ROWS, w.n)
        parts = w.components
        piece = QuantWeight(
            w.qtype,
            end - start,
            w.k,
            None if w.raw is None else w.raw[start:end],
            components=None
            if parts is None
            else QuantComponents(
                parts.u[start:end],
                parts.scale[start:end],
                None if parts.mins is None else parts.mins[start:end],
            ),
            planes=w.planes,
        )
        slice_packing = pack_weight(piece)
        if packed is None:
            packed = slice_packing.new_empty((-(-w.n // _COLS), *slice_packing.shape[1:]))
        packed[start // _COLS : start // _COLS + slice_packing.shape[0]] = slice_packing
    return packed


def held_for_triton(device: torch.device) -> bool:
    """Whether quantized weights on `device` are held in the Triton kernels' form (`place`): on
    CUDA, and on a CPU under NANOSERVE_KERNELS=triton (the interpreter: the CUDA path's load and
    kernels, exercised without a GPU)."""
    return device.type == "cuda" or kernel_choice() == "triton"


def linear_keeps_blocks(qtype: str, device: torch.device) -> bool:
    """Whether a linear layer (or LM head) whose weight comes in kernel format `qtype` keeps it on
    `device` (else a loader dequantizes it into the activations' dtype): the CPU kernels take every
    format; the Triton kernels GGUF's block types, Q8_0 / Q4_0 / Q4_1 components and FP8."""
    if not held_for_triton(device):
        return True
    return qtype in GGUF_QTYPES or qtype in KERNEL_FORMATS


def place(w: QuantWeight, device: torch.device) -> QuantWeight:
    """`w` (on the CPU, as a loader made it) in the form its kernels hold on `device`, there: for
    the Triton kernels (held_for_triton) GGUF bytes as they are and components as GroupBlocks (a
    scale once per group, not per 32: about the checkpoint's bytes; made on the CPU, so the
    device never holds the byte-an-element components); else as given (pack_for_cpu packs it)."""
    if held_for_triton(device):
        if not linear_keeps_blocks(w.qtype, device):
            raise ValueError(f"no Triton kernel for {w.qtype!r}")
        if w.raw is None and w.blocks is None:
            parts = w.components
            w.blocks = make_group_blocks(w.qtype, parts.u, parts.scale, parts.mins)
            w.components = None
        w.triton = True
    if w.raw is not None:
        w.raw = w.raw.contiguous().to(device)
    if w.blocks is not None:
        w.blocks = w.blocks.to(device)
    if w.components is not None:
        parts = w.components
        w.components = QuantComponents(
            parts.u.contiguous().to(device),
            parts.scale.contiguous().to(device),
            None if parts.mins is None else parts.mins.contiguous().to(device),
        )
    return w


def looks_up_file_rows(device: torch.device) -> bool:
    """Whether a GGUF model's token embedding on `device` reads the file's rows where they lie
    (layers/embedding.FileRows over the mapped file, dequantizing the rows a step asks for): on a
    CPU, unless held for the Triton kernels, where the table's blocks are copied to the device
    (`lookup_rows` gathers and dequantizes the rows a step asks for there)."""
    return not held_for_triton(device)


def lookup_rows(
    data: torch.Tensor, qtype: str, k: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of a GGUF table's blocks uint8 [rows, row bytes]: [*ids.shape, k] in dtype, the
    bits of dequantizing the whole table to fp32 and rounding it to dtype. The Triton row gather
    where the table is held for it (CUDA, the interpreter), else the torch dequantization."""
    if (data.is_cuda or kernel_choice() == "triton") and kernel_choice() != "reference":
        from nanoserve.kernels.quant_triton import gguf_rows

        return gguf_rows(data, qtype, k, ids, dtype)
    rows = data[ids.reshape(-1).to(data.device)]
    values = dequantize(rows.cpu(), qtype, k).to(dtype).to(data.device)
    return values.reshape(*ids.shape, k)


def quant_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] (bf16 or fp32) @ w^T (+ bias) -> [m, n] in x.dtype: a weight held for Triton
    (`place`) through kernels/quant_triton.py (the GEMV for a few rows, the tiled dequantize-GEMM
    for more; NANOSERVE_KERNELS=reference: its torch reference), CPU through the C++ kernel when w
    is packed, else reference_gemm."""
    if w.triton or x.device.type == "cuda":
        from nanoserve.kernels import quant_triton

        if kernel_choice() == "reference":
            return quant_triton.quant_gemm_triton_reference(x, w, bias)
        return quant_triton.quant_gemm_triton(x, w, bias)
    if w.packed is not None:
        from nanoserve.kernels.cpu import ops as cpu_ops

        out = cpu_ops.gemm_quant(x, w.packed, w.kernel_format, w.n, w.k, bias)
        if out is not None:
            return out
    return reference_gemm(x, w, bias)


def quant_gemm_many(
    x: torch.Tensor,
    weights: list[QuantWeight],
    spans: list[tuple[int, int]],
    biases: list[torch.Tensor | None],
) -> torch.Tensor | None:
    """Rows start..end of x (span i) through weights[i] (+ biases[i]), all in one C++ call: [rows,
    n] in x.dtype, each row's bits those of quant_gemm on it. None where the C++ kernels can't take
    them all (not every weight packed, different n, n not a multiple of 16): then quant_gemm
    weight by weight."""
    if x.device.type != "cpu" or not weights or any(w.packed is None for w in weights):
        return None
    n = weights[0].n
    if any(w.n != n or w.k != x.shape[1] for w in weights):
        return None
    from nanoserve.kernels.cpu import ops as cpu_ops

    parts = [
        (w.kernel_format, w.packed, start, end, bias)
        for w, (start, end), bias in zip(weights, spans, biases)
    ]
    return cpu_ops.gemm_quant_many(x.contiguous(), parts, n)
