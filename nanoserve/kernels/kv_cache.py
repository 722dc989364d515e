"""KV-cache store: write the K and V of new tokens into the paged cache through a slot mapping.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is row
``s % block_size`` of block ``s // block_size``. A slot of -1 marks padding and is skipped.
"""
from __future__ import annotations

import torch

from nanoserve.kernels.kv_dtype import is_fp8, to_cache
from nanoserve.kernels.triton_utils import (
    cdiv,
    check_float_dtype,
    check_int_dtype,
    check_kv_cache_pair,
    check_triton_device,
    lazy_jit,
    next_power_of_2,
)

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)


@lazy_jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_token, key_stride_head, key_stride_dim,
    value_stride_token, value_stride_head, value_stride_dim,
    cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
    row_size,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
):
    # One program per (token, tile of the num_kv_heads * head_dim row); masked tiles so the
    # row need not be a power of two.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    # (A scalar `&` a tensor mask yields int32 in the interpreter: fold the slot test in.)
    mask = offs < tl.where(slot >= 0, row_size, 0)
    head = (offs // HEAD_DIM).to(tl.int64)
    dim = (offs % HEAD_DIM).to(tl.int64)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // BLOCK_SIZE
    cache_offs = (block * cache_stride_block + (safe_slot % BLOCK_SIZE) * cache_stride_offset
                  + head * cache_stride_head + dim * cache_stride_dim)
    k = tl.load(key_ptr + token * key_stride_token + head * key_stride_head + dim * key_stride_dim,
                mask=mask)
    v = tl.load(value_ptr + token * value_stride_token + head * value_stride_head
                + dim * value_stride_dim, mask=mask)
    tl.store(key_cache_ptr + cache_offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`store_kvcache_reference`; any strides on every tensor."""
    check_kv_cache_pair(key_cache, value_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0] if key.dim() == 3 else -1
    expected = (num_tokens, num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(f"key and value must be [num_tokens, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    check_int_dtype("slot_mapping", slot_mapping)
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache),
                         ("value_cache", value_cache)):
        check_float_dtype(name, tensor)
    check_triton_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    tile = min(next_power_of_2(row_size), 1024)
    grid = (num_tokens, cdiv(row_size, tile))
    _store_kvcache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(),
        row_size,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, TILE=tile,
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
        rows = ((blocks[:, None] * num_kv_heads + heads[None, :]) * block_size + offsets[:, None]).flatten()
        head_major_k.view(-1, head_dim).index_copy_(0, rows, key.reshape(-1, head_dim))
        head_major_v.view(-1, head_dim).index_copy_(0, rows, value.reshape(-1, head_dim))
        return
    key_cache.index_put_((blocks, offsets), key)
    value_cache.index_put_((blocks, offsets), value)
