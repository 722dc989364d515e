"""KV-cache store: the Triton kernel against the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.kv_cache import store_kvcache_reference, store_kvcache_triton
from tests.kernels.utils import DEVICE, DTYPES, dtype_id


def _inputs(num_kv_heads, head_dim, block_size, dtype, *, num_blocks=5, num_tokens=11, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Key and value as strided views of one packed qkv projection, as the model produces them.
    row = 4 * num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, row, generator=generator).to(dtype).to(DEVICE)
    key = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    value = qkv[:, 3 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    num_slots = num_blocks * block_size
    slots = torch.randperm(num_slots - 1, generator=generator)[:num_tokens]
    slots[1] = slots[6] = -1  # padding tokens
    slots[-1] = num_slots - 1  # the very last slot
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return key, value, key_cache, value_cache, slots.to(DEVICE)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 24), (8, 128), (12, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_store_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    key, value, key_cache, value_cache, slots = _inputs(num_kv_heads, head_dim, block_size, dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kvcache_reference(key, value, expected_k, expected_v, slots)
    store_kvcache_triton(key, value, key_cache, value_cache, slots.to(torch.int32))
    torch.testing.assert_close(key_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_v, atol=0, rtol=0, equal_nan=True)
    # Padding tokens wrote nothing: exactly the non-padding tokens' slots changed.
    written = ~torch.isnan(key_cache).all(dim=(2, 3)).flatten()
    assert written.sum().item() == (slots >= 0).sum().item()


def test_store_converts_to_cache_dtype():
    key, value, _, _, slots = _inputs(2, 64, 16, torch.float32)
    key_cache = torch.zeros(5, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kvcache_reference(key, value, expected_k, expected_v, slots)
    store_kvcache_triton(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_v, atol=0, rtol=0)


def test_store_no_tokens():
    key, value, key_cache, value_cache, slots = _inputs(2, 64, 16, torch.float32)
    store_kvcache_triton(key[:0], value[:0], key_cache, value_cache, slots[:0])
    assert torch.isnan(key_cache).all()


@pytest.mark.parametrize(
    "case", ["key_shape", "value_heads", "slots_length", "slots_float", "cache_shapes", "int_key"]
)
def test_store_bad_inputs_raise(case):
    key, value, key_cache, value_cache, slots = _inputs(2, 64, 16, torch.float32)
    if case == "key_shape":
        key = key[:, :, :32]
    elif case == "value_heads":
        value = value[:, :1]
    elif case == "slots_length":
        slots = slots[:-1]
    elif case == "slots_float":
        slots = slots.float()
    elif case == "cache_shapes":
        value_cache = value_cache[:, :8]
    elif case == "int_key":
        key = key.long()
    with pytest.raises(ValueError):
        store_kvcache_triton(key, value, key_cache, value_cache, slots)
