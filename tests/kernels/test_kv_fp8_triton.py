"""fp8 KV cache on the Triton path (kernels/kv_dtype.py's rule): the store writes kv_dtype.to_cache's
bytes. Natively on CUDA, under the Triton interpreter on a CPU (tests/kernels/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.kv_cache import store_kvcache_triton
from nanoserve.kernels.kv_dtype import FP8_DTYPES, FP8_MAX, to_cache
from tests.kernels.utils import DEVICE, dtype_id

# bf16 activations on a CPU too: the store only widens them to fp32, which the interpreter does exactly.
STORE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _store_values(cache_dtype, dtype, count, generator):
    """Values that exercise every branch of the store's rounding: normal draws over many magnitudes,
    the exact midpoints between neighbouring fp8 values (ties), fp8 subnormals and what rounds to or
    from them, values past the largest finite one, infinities, zeros, fp32 subnormals and NaN."""
    finite = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    grid = finite[torch.isfinite(finite)].unique()  # sorted, -max..max
    midpoints = (grid[1:] + grid[:-1]) / 2
    limit = FP8_MAX[cache_dtype]
    smallest = grid[grid > 0].min().item()
    special = torch.tensor([
        0.0, -0.0, limit, -limit, 500.0, -500.0, 1e5, -1e5, 7e4, float("inf"), float("-inf"),
        smallest, -smallest, smallest / 2, smallest * 0.5001, smallest * 1.5, smallest * 2.5,
        smallest / 4, 1e-30, -1e-39, float("nan"), -float("nan"),
    ])
    scales = torch.tensor([1e-6, 1e-3, 1e-1, 1.0, 30.0, 1e3, 1e5]).repeat_interleave(count)
    draws = torch.randn(scales.numel(), generator=generator) * scales
    values = torch.cat([draws, midpoints, grid, special])
    return values.to(dtype)


@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
@pytest.mark.parametrize("dtype", STORE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_id)
def test_store_writes_to_cache_bytes(cache_dtype, dtype, head_major):
    generator = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks = 2, 24, 16, 12
    values = _store_values(cache_dtype, dtype, 40, generator)
    row = 2 * num_kv_heads * head_dim
    num_written = -(-values.numel() // row)
    # Every fourth token is padding (slot -1, skipped), with values of its own.
    num_tokens = num_written + -(-num_written // 3)
    written = torch.arange(num_tokens) % 4 != 1
    rows = torch.randn(num_tokens * row, generator=generator).to(dtype).view(num_tokens, row)
    rows.view(-1)[written.repeat_interleave(row).nonzero().flatten()[:values.numel()]] = values
    # key and value as strided views of one [tokens, 2 * kv_heads * head_dim] projection.
    kv = rows.to(DEVICE)
    key = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[~written] = -1
    shape = (num_blocks, num_kv_heads, block_size, head_dim) if head_major else (
        num_blocks, block_size, num_kv_heads, head_dim)
    # Random bytes before the store: slots it must not write keep them.
    before = torch.randint(0, 256, (2, *shape), dtype=torch.uint8, generator=generator)
    key_cache, value_cache = before.clone().view(cache_dtype).to(DEVICE).unbind(0)
    if head_major:
        key_cache, value_cache = key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)
    store_kvcache_triton(key, value, key_cache, value_cache, slots.to(torch.int32).to(DEVICE))

    expected_k, expected_v = before.view(cache_dtype).unbind(0)
    if head_major:
        expected_k, expected_v = expected_k.permute(0, 2, 1, 3), expected_v.permute(0, 2, 1, 3)
    expected_k, expected_v = expected_k.view(torch.uint8), expected_v.view(torch.uint8)
    valid = slots >= 0
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
    expected_k[blocks, offsets] = to_cache(key.cpu()[valid], cache_dtype).view(torch.uint8)
    expected_v[blocks, offsets] = to_cache(value.cpu()[valid], cache_dtype).view(torch.uint8)
    assert torch.equal(key_cache.cpu().view(torch.uint8), expected_k)
    assert torch.equal(value_cache.cpu().view(torch.uint8), expected_v)


@pytest.mark.parametrize("case", ["fp8_key_input", "mixed_cache_dtypes", "int_cache"])
def test_store_bad_dtypes_raise(case):
    key = torch.randn(3, 2, 16, device=DEVICE)
    key_cache = torch.zeros(2, 16, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    if case == "fp8_key_input":
        key = key.to(torch.float8_e4m3fn)
    elif case == "mixed_cache_dtypes":
        value_cache = value_cache.view(torch.float8_e5m2)
    elif case == "int_cache":
        key_cache = value_cache = key_cache.view(torch.uint8)
    with pytest.raises(ValueError):
        store_kvcache_triton(key, torch.randn(3, 2, 16, device=DEVICE), key_cache, value_cache,
                             torch.arange(3, device=DEVICE))
