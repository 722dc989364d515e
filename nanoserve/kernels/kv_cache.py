"""KV-cache store: write the K and V of new tokens into the paged cache through a slot mapping.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is row
``s % block_size`` of block ``s // block_size``. A slot of -1 marks padding and is skipped.
"""

from __future__ import annotations

import torch

from nanoserve.kernels.kv_dtype import is_fp8, to_cache
from nanoserve.kernels.triton_utils import (
    bind_helpers,
    cdiv,
    check_cache_dtype,
    check_float_dtype,
    check_int_dtype,
    check_kv_cache_pair,
    check_triton_device,
    fp8_format,
    lazy_jit,
    next_power_of_2,
)

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)


@lazy_jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_stride_token,
    key_stride_head,
    key_stride_dim,
    value_stride_token,
    value_stride_head,
    value_stride_dim,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    cache_stride_dim,
    row_size,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_BIAS: tl.constexpr,
):
    # One program per (token, tile of the num_kv_heads * head_dim row); masked tiles so the
    # row need not be a power of two. FP8_MANTISSA > 0: an fp8 cache, passed as its bytes.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    # (A scalar `&` a tensor mask yields int32 in the interpreter: fold the slot test in.)
    mask = offs < tl.where(slot >= 0, row_size, 0)
    head = (offs // HEAD_DIM).to(tl.int64)
    dim = (offs % HEAD_DIM).to(tl.int64)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // BLOCK_SIZE
    cache_offs = (
        block * cache_stride_block
        + (safe_slot % BLOCK_SIZE) * cache_stride_offset
        + head * cache_stride_head
        + dim * cache_stride_dim
    )
    k = tl.load(
        key_ptr + token * key_stride_token + head * key_stride_head + dim * key_stride_dim,
        mask=mask,
    )
    v = tl.load(
        value_ptr + token * value_stride_token + head * value_stride_head + dim * value_stride_dim,
        mask=mask,
    )
    if FP8_MANTISSA > 0:
        k = _fp8_bits(k.to(tl.float32), FP8_MAX, FP8_MANTISSA, FP8_BIAS)
        v = _fp8_bits(v.to(tl.float32), FP8_MAX, FP8_MANTISSA, FP8_BIAS)
    tl.store(key_cache_ptr + cache_offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _fp8_bits(x, MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The fp8 byte (in an int32) that kv_dtype.to_cache stores for fp32 x: saturated to +-MAX, NaN
    kept, rounded to nearest even. Integer arithmetic on x's bits rather than .to(fp8): the
    interpreter's fp8 conversion rounds ties away from zero, truncates subnormals and loses NaN, so
    only this way do the CPU tests check the bytes the GPU writes."""
    x = tl.where(x > MAX, MAX, tl.where(x < -MAX, -MAX, x))  # NaN compares false: stays NaN
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # Normal: rebias the exponent, then drop 23 - MANTISSA mantissa bits rounding to nearest even;
    # a carry out of the mantissa steps the exponent, as it should (never past MAX, which is exact).
    rebiased = magnitude - ((127 - BIAS) << 23)
    normal = (rebiased + ((1 << (22 - MANTISSA)) - 1) + ((rebiased >> (23 - MANTISSA)) & 1)) >> (
        23 - MANTISSA
    )
    # Below the smallest normal 2^(1 - BIAS): fp32 addition of 2^(24 - BIAS - MANTISSA), whose ulp
    # is the smallest fp8 subnormal, rounds |x| to nearest even on the subnormal grid; what is
    # added above that power of two is the fp8 byte (2^MANTISSA when |x| rounds up to a normal).
    subnormal = (tl.abs(x) + (1 << (24 - BIAS - MANTISSA))).to(tl.int32, bitcast=True) - (
        (151 - BIAS - MANTISSA) << 23
    )
    byte = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    byte = tl.where(magnitude > 0x7F800000, 0x7F, byte)  # NaN: all exponent and mantissa bits set
    return byte | ((bits >> 24) & 0x80)


def _bind_helpers() -> None:
    bind_helpers(globals(), "_fp8_bits")


def store_kvcache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`store_kvcache_reference`; any strides on every tensor. An fp8 cache
    (both the same fp8 dtype) stores kv_dtype.to_cache's bytes."""
    check_kv_cache_pair(key_cache, value_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0] if key.dim() == 3 else -1
    expected = (num_tokens, num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must be [num_tokens, {num_kv_heads}, {head_dim}], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    check_int_dtype("slot_mapping", slot_mapping)
    check_float_dtype("key", key)
    check_float_dtype("value", value)
    check_cache_dtype("key_cache", key_cache)
    check_cache_dtype("value_cache", value_cache)
    fp8 = fp8_format(key_cache.dtype)
    if (fp8 or fp8_format(value_cache.dtype)) and key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"an fp8 key_cache and value_cache must share a dtype, got {key_cache.dtype} "
            f"and {value_cache.dtype}"
        )
    check_triton_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    if fp8:  # written as bytes (see _fp8_bits)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    fp8_max, mantissa, bias = fp8 or (0.0, 0, 0)
    _bind_helpers()
    row_size = num_kv_heads * head_dim
    tile = min(next_power_of_2(row_size), 1024)
    grid = (num_tokens, cdiv(row_size, tile))
    _store_kvcache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        row_size,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        TILE=tile,
        FP8_MAX=fp8_max,
        FP8_MANTISSA=mantissa,
        FP8_BIAS=bias,
        num_warps=4 if tile >= 512 else 1,
    )


def store_kvcache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int. An fp8
    cache stores kv_dtype.to_cache's values (saturated, rounded to nearest even).
    The caches may be any strided view of [num_blocks, block_size, num_kv_heads, head_dim]
    (the engine's CPU pool is head-major underneath; see model_runner)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    key, value = to_cache(key, key_cache.dtype), to_cache(value, value_cache.dtype)
    if is_fp8(key_cache.dtype):  # torch's indexed writes don't take fp8: write its bytes
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)
        return
    blocks, offsets = slots // block_size, slots % block_size
    head_major_k, head_major_v = key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)
    if head_major_k.is_contiguous() and head_major_v.is_contiguous():
        # [blocks, heads, block_size, dim] underneath: row (block * heads + head) * block_size + offset.
        heads = torch.arange(num_kv_heads, device=slots.device)
        rows = (
            (blocks[:, None] * num_kv_heads + heads[None, :]) * block_size + offsets[:, None]
        ).flatten()
        head_major_k.view(-1, head_dim).index_copy_(0, rows, key.reshape(-1, head_dim))
        head_major_v.view(-1, head_dim).index_copy_(0, rows, value.reshape(-1, head_dim))
        return
    key_cache.index_put_((blocks, offsets), key)
    value_cache.index_put_((blocks, offsets), value)
