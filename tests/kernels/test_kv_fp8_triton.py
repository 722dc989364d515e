"""fp8 KV cache on the Triton path (kernels/kv_dtype.py's rule): the store writes kv_dtype.to_cache's
bytes, and attention on an fp8 cache is, bit for bit, attention on that cache converted to the
query's dtype. Natively on CUDA, under the Triton interpreter on a CPU (tests/kernels/conftest.py), which
reads an fp8 NaN back as a number: a NaN in a live cache slot is checked on CUDA only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoserve.kernels.attention import paged_attention_reference, paged_attention_triton
from nanoserve.kernels.kv_cache import store_kvcache_triton
from nanoserve.kernels.kv_dtype import FP8_DTYPES, FP8_MAX, to_cache
from tests.kernels.utils import (
    ATTENTION_TOL,
    DEVICE,
    DTYPES,
    ON_CUDA,
    assert_close,
    dtype_id,
    make_paged_batch,
)

# bf16 activations on a CPU too: the store only widens them to fp32, which the interpreter does exactly.
STORE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _skip_without_fp8e4nv(cache_dtype):
    """Triton has no float8_e4m3fn before compute capability 8.9 (Ada)."""
    if (
        ON_CUDA
        and cache_dtype == torch.float8_e4m3fn
        and torch.cuda.get_device_capability(DEVICE) < (8, 9)
    ):
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9 in Triton")


def _store_values(cache_dtype, dtype, count, generator):
    """Values that exercise every branch of the store's rounding: normal draws over many magnitudes,
    the exact midpoints between neighbouring fp8 values (ties), fp8 subnormals and what rounds to or
    from them, values past the largest finite one, infinities, zeros, fp32 subnormals and NaN."""
    finite = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    grid = finite[torch.isfinite(finite)].unique()  # sorted, -max..max
    midpoints = (grid[1:] + grid[:-1]) / 2
    limit = FP8_MAX[cache_dtype]
    smallest = grid[grid > 0].min().item()
    special = torch.tensor(
        [
            0.0,
            -0.0,
            limit,
            -limit,
            500.0,
            -500.0,
            1e5,
            -1e5,
            7e4,
            float("inf"),
            float("-inf"),
            smallest,
            -smallest,
            smallest / 2,
            smallest * 0.5001,
            smallest * 1.5,
            smallest * 2.5,
            smallest / 4,
            1e-30,
            -1e-39,
            float("nan"),
            -float("nan"),
        ]
    )
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
    rows.view(-1)[written.repeat_interleave(row).nonzero().flatten()[: values.numel()]] = values
    # key and value as strided views of one [tokens, 2 * kv_heads * head_dim] projection.
    kv = rows.to(DEVICE)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[~written] = -1
    shape = (
        (num_blocks, num_kv_heads, block_size, head_dim)
        if head_major
        else (num_blocks, block_size, num_kv_heads, head_dim)
    )
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
        store_kvcache_triton(
            key,
            torch.randn(3, 2, 16, device=DEVICE),
            key_cache,
            value_cache,
            torch.arange(3, device=DEVICE),
        )


def _fp8_and_converted(batch, cache_dtype, outliers):
    """The batch with an fp8 cache (kv_dtype.to_cache of its values; unwritten slots stay NaN),
    and the same batch with that cache converted back to the query's dtype."""
    key_cache, value_cache = batch.key_cache.float(), batch.value_cache.float()
    if outliers:
        # Dims scaled by 1e-3 (e4m3fn) and 1e-5 (e5m2) land on subnormals or round to 0; with an fp32
        # query, those scaled by 1e5 saturate (an fp16 query's reference would overflow on them).
        big = 1e5 if batch.query.dtype == torch.float32 else 2.0
        head_dim = key_cache.shape[-1]
        key_cache = key_cache * torch.tensor([1.0, 1e-5, 1e-3, big]).repeat(head_dim // 4).to(
            key_cache.device
        )
        value_cache = value_cache * torch.tensor([1e-5, 1.0, big, 1e-3]).repeat(head_dim // 4).to(
            key_cache.device
        )
    fp8 = dataclasses.replace(
        batch,
        key_cache=to_cache(key_cache, cache_dtype),
        value_cache=to_cache(value_cache, cache_dtype),
    )
    dtype = batch.query.dtype
    converted = dataclasses.replace(
        batch, key_cache=fp8.key_cache.to(dtype), value_cache=fp8.value_cache.to(dtype)
    )
    return fp8, converted


def _check_fp8_attention(batch, cache_dtype, outliers=False, **kwargs):
    _skip_without_fp8e4nv(cache_dtype)
    fp8, converted = _fp8_and_converted(batch, cache_dtype, outliers)
    actual = paged_attention_triton(*fp8.args(), **kwargs)
    same_values = paged_attention_triton(*converted.args(), **kwargs)
    assert torch.isfinite(actual).all(), "NaN/inf leaked from unwritten cache slots"
    assert torch.equal(actual, same_values)
    reference_kwargs = {k: kwargs[k] for k in ("sliding_window", "softcap") if k in kwargs}
    expected = paged_attention_reference(*converted.args(), **reference_kwargs)
    if outliers:  # the weights' rounding errors come out multiplied by |V|, up to FP8_MAX here
        atol, rtol = ATTENTION_TOL[expected.dtype]
        v_max = torch.nan_to_num(converted.value_cache.float()).abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol * v_max, rtol=rtol)
    else:
        assert_close(actual, expected, ATTENTION_TOL)


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_id)
def test_decode_fp8_cache_equals_converted_cache(cache_dtype, dtype, num_splits):
    # Decode only (the split-KV configuration when num_splits is not 1), 4 query heads per KV head.
    batch = make_paged_batch(
        [1, 1, 1],
        [150, 2, 67],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=21,
    )
    _check_fp8_attention(batch, cache_dtype, num_splits=num_splits)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_id)
def test_mixed_batch_fp8_cache_equals_converted_cache(cache_dtype, dtype, group):
    # A new prompt, a decode, a chunk after a multi-block prefix; head_dim 40 pads to 64.
    batch = make_paged_batch(
        [5, 1, 19],
        [0, 37, 35],
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=40,
        block_size=16,
        dtype=dtype,
        seed=group,
    )
    _check_fp8_attention(batch, cache_dtype)


# Saturated keys make exp(2 * score / softcap) overflow to inf in the kernel's tanh, which is then
# exactly 1 (as it should be); numpy warns about the overflow.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_id)
def test_fp8_cache_extreme_values_window_and_softcap(cache_dtype, dtype):
    """Subnormal and saturated cache values, under a sliding window and a softcap."""
    batch = make_paged_batch(
        [3, 1],
        [20, 40],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        seed=5,
    )
    _check_fp8_attention(batch, cache_dtype, outliers=True, sliding_window=24, softcap=30.0)


@pytest.mark.parametrize("case", ["fp8_query", "mixed_cache_dtypes", "fp16_cache_fp32_query"])
def test_attention_bad_dtypes_raise(case):
    batch = make_paged_batch(
        [1], [3], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32
    )
    fp8, _ = _fp8_and_converted(batch, torch.float8_e5m2, outliers=False)
    if case == "fp8_query":
        fp8 = dataclasses.replace(fp8, query=fp8.query.to(torch.float8_e5m2))
    elif case == "mixed_cache_dtypes":
        fp8 = dataclasses.replace(fp8, value_cache=fp8.value_cache.view(torch.float8_e4m3fn))
    elif case == "fp16_cache_fp32_query":
        fp8 = dataclasses.replace(
            fp8, key_cache=fp8.key_cache.half(), value_cache=fp8.value_cache.half()
        )
    with pytest.raises(ValueError):
        paged_attention_triton(*fp8.args())


@pytest.mark.skipif(
    not ON_CUDA,
    reason="the Triton interpreter reads an fp8 NaN back as a number (float8_e4m3fn's 0x7f as 480)",
)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_id)
def test_nan_in_live_fp8_slot_reaches_output(cache_dtype):
    """NaN stays NaN: stored (kv_dtype's rule) and read back, as from a cache in the query's dtype."""
    _skip_without_fp8e4nv(cache_dtype)
    batch = make_paged_batch(
        [2, 1],
        [5, 9],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.bfloat16,
        seed=7,
    )
    fp8, converted = _fp8_and_converted(batch, cache_dtype, outliers=False)
    block = batch.block_table[0, 0]
    fp8.key_cache[block, 3, 0, 0] = float("nan")  # sequence 0's position 3, KV head 0
    converted.key_cache[block, 3, 0, 0] = float("nan")
    actual = paged_attention_triton(*fp8.args())
    torch.testing.assert_close(
        actual, paged_attention_triton(*converted.args()), atol=0, rtol=0, equal_nan=True
    )
    assert torch.isnan(actual[:2, :2]).all()  # its query rows, the query heads of KV head 0
    assert torch.isfinite(actual[:2, 2:]).all() and torch.isfinite(actual[2]).all()
