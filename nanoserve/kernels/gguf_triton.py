"""The GGUF block formats decoded in Triton registers: `gguf_chunk` gives 32 values of each of a
tile of weight rows as fp32, the common step of kernels/quant_triton.py's GEMV, GEMM and
embedding row gather.

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

from nanoserve.kernels.triton_utils import bind_helpers, lazy_jit

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)


@lazy_jit
def gguf_chunk(w_rows, chunk, kk, wmask, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Chunk `chunk` of GGUF rows starting at `w_rows` ([rows, 1] pointers): [rows, 32] fp32.
    QTYPE: kernels/gguf_formats.format_code (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K, 5 Q5_0,
    6 Q5_1, 7 Q5_K)."""
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


def bind() -> None:
    """This module's helpers jitted under their names (before a kernel that calls them compiles)."""
    bind_helpers(
        globals(),
        "_f16",
        "_k_scale_min",
        "_q4_k_chunk",
        "_q5_values",
        "_q5_k_chunk",
        "_q6_k_chunk",
        "gguf_chunk",
    )
