"""The fp8 KV cache on the CPU (--kv-cache-dtype fp8 / fp8_e5m2; kernels/kv_dtype.py,
kernels/cpu/fp8.h, kernels/cpu/kv_fp8.cpp) against torch: the store rule against torch's own
float8 conversion on every bf16 value, the widening exact on every byte, and attention over an fp8
pool equal bit for bit to the same kernels over a pool of the query's dtype holding the same
values, at every ISA level this machine runs."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import apply_rotary_reference, build_cos_sin_cache, store_kvcache
from nanoserve.kernels.attention import paged_attention_reference
from nanoserve.kernels.cpu import attention as cpu_attention
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.kv_cache import store_kvcache_reference
from nanoserve.kernels.kv_dtype import FP8_CODES, FP8_MAX, cache_dtype, to_cache
from tests.kernels.test_cpu_ops import REFERENCE_TOL, close, head_major, paged_batch

pytestmark = pytest.mark.skipif(
    cpu_ops.library() is None, reason=f"CPU kernels not built here: {cpu_ops.load_error()}"
)

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
FORMAT_IDS = ["e4m3", "e5m2"]


def kernel_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8.h's store rule on fp32 values, through ns_fp8_from_float."""
    x = x.float().contiguous()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    assert (
        cpu_ops.library().ns_fp8_from_float(
            FP8_CODES[dtype], x.data_ptr(), out.data_ptr(), x.numel()
        )
        == 0
    )
    return out


def same_bytes_or_both_nan(
    actual: torch.Tensor, expected: torch.Tensor, values: torch.Tensor
) -> None:
    nan = torch.isnan(values)
    wrong = (actual != expected) & ~nan
    assert not bool(wrong.any()), (
        f"{int(wrong.sum())} values stored differently, e.g. "
        f"{values[wrong][:5].tolist()}: {actual[wrong][:5].tolist()} vs "
        f"{expected[wrong][:5].tolist()}"
    )
    assert bool(((actual[nan] & 0x7F) == 0x7F).all()), "NaN must stay NaN"


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_store_rule_on_every_bf16_value(dtype):
    """Every bf16 bit pattern (subnormals, both infinities, NaNs, values past the largest fp8)."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    expected = to_cache(values, dtype).view(torch.uint8)
    same_bytes_or_both_nan(kernel_store(values, dtype), expected, values.float())
    assert to_cache(torch.tensor([1e30, -float("inf")]), dtype).float().tolist() == [
        FP8_MAX[dtype],
        -FP8_MAX[dtype],
    ]


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_store_rule_on_fp32_values_and_exact_ties(dtype):
    """fp32 inputs over the whole range, and the midpoints between neighbouring fp8 values (ties
    to even), which bf16 inputs don't reach for every pair."""
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(200_000, generator=generator) * torch.exp2(
        torch.randint(-30, 20, (200_000,), generator=generator).float()
    )
    finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = finite[torch.isfinite(finite)].unique().sort().values.double()
    midpoints = ((finite[1:] + finite[:-1]) / 2).float()
    nudged = torch.cat(
        [
            midpoints,
            torch.nextafter(midpoints, torch.tensor(float("inf"))),
            torch.nextafter(midpoints, torch.tensor(-float("inf"))),
        ]
    )
    for values in (spread, nudged):
        same_bytes_or_both_nan(
            kernel_store(values, dtype), to_cache(values, dtype).view(torch.uint8), values
        )


@pytest.mark.parametrize("activations", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_widening_is_exact_on_every_byte(dtype, activations, cpu_isa):
    code = 1 if activations == torch.bfloat16 else 0
    every = torch.arange(256, dtype=torch.uint8).repeat(3)[
        : 256 * 3 - 5
    ]  # a tail past the 32-byte steps
    out = torch.empty(every.numel(), dtype=activations)
    assert (
        cpu_ops.library().ns_fp8_widen(
            FP8_CODES[dtype], code, every.data_ptr(), out.data_ptr(), every.numel()
        )
        == 0
    )
    expected = every.view(dtype).to(activations)
    both_nan = torch.isnan(out) & torch.isnan(expected)
    assert bool(((out == expected) | both_nan).all())
    assert bool((torch.isnan(out) == torch.isnan(expected)).all())


def fp8_pools(batch, dtype):
    """The batch's pools stored as fp8, and the same values in the query's dtype, both head-major."""
    keys, values = to_cache(batch.key_cache, dtype), to_cache(batch.value_cache, dtype)
    widened = head_major(keys.to(batch.query.dtype)), head_major(values.to(batch.query.dtype))
    return (head_major(keys), head_major(values)), widened


BATCHES = [
    ([1] * 40 + [7, 33, 100], [300] * 40 + [0, 17, 50]),  # decodes (several chunks) with prompts
    ([1] * 70, [i * 37 % 900 for i in range(70)]),  # decodes only, of many lengths: many chunks
    ([16, 17, 40], [16, 31, 0]),
    ([300, 200, 500], [300, 100, 700]),  # prompts over more blocks than one widened chunk holds
]


@pytest.mark.parametrize(
    "q_lens, context_lens", BATCHES, ids=["mixed", "decodes", "prompts", "long-prompts"]
)
@pytest.mark.parametrize("activations", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_attention_over_fp8_equals_attention_over_the_same_values(
    dtype, activations, q_lens, context_lens, cpu_isa
):
    """cpu_ops.paged_attention and the engine's CPU path (decode kernel, prompt kernel or SDPA,
    by level) on an fp8 pool: the bits they give on the widened pool; and near the reference."""
    batch = paged_batch(q_lens, context_lens, dtype=activations, seed=len(q_lens))
    (keys, values), (wide_keys, wide_values) = fp8_pools(batch, dtype)
    args = (batch.block_table, batch.cu_seqlens_q, batch.seq_lens, batch.scale)
    fp8 = cpu_ops.paged_attention(batch.query, keys, values, *args)
    assert fp8 is not None, "the kernels refused an fp8 pool"
    assert torch.equal(fp8, cpu_ops.paged_attention(batch.query, wide_keys, wide_values, *args))
    num_decodes = sum(1 for q in q_lens if q == 1) if q_lens[0] == 1 else 0
    spans = cpu_attention.prefill_spans(
        batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), num_decodes
    )
    engine = cpu_attention.paged_attention_cpu(batch.query, keys, values, *args, num_decodes, spans)
    assert torch.equal(
        engine,
        cpu_attention.paged_attention_cpu(
            batch.query, wide_keys, wide_values, *args, num_decodes, spans
        ),
    )
    close(engine, paged_attention_reference(batch.query, keys, values, *args), REFERENCE_TOL)


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_reference_attention_reads_fp8_as_its_values(dtype):
    batch = paged_batch([1, 1, 5], [20, 0, 40], dtype=torch.bfloat16)
    (keys, values), (wide_keys, wide_values) = fp8_pools(batch, dtype)
    args = (batch.block_table, batch.cu_seqlens_q, batch.seq_lens, batch.scale)
    assert torch.equal(
        paged_attention_reference(batch.query, keys, values, *args),
        paged_attention_reference(batch.query, wide_keys, wide_values, *args),
    )


@pytest.mark.parametrize("activations", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_rotary_store_into_fp8_matches_the_reference(dtype, activations):
    """The fused rotary + store (the engine's CPU write path) leaves the pool's bytes as rotary
    then store_kvcache_reference do; the q heads and slot -1 as in bf16. Values reach past the
    format's largest (saturation) and into its subnormals."""
    heads, kv_heads, dim, block_size, blocks, tokens = 6, 2, 64, 16, 5, 23
    generator = torch.Generator().manual_seed(1)
    scales = torch.exp2(torch.randint(-14, 17, (tokens, 1), generator=generator).float())
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator) * scales).to(
        activations
    )
    positions = torch.randint(0, 100, (tokens,), generator=generator)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    slots[3] = -1
    cos_sin = build_cos_sin_cache(dim, 128, 10000.0)

    def pools():
        physical = torch.zeros((blocks, kv_heads, block_size, dim), dtype=dtype)
        return physical.permute(0, 2, 1, 3)

    keys, values = pools(), pools()
    fused = qkv.clone()
    assert cpu_ops.rotary_store(
        fused, heads, kv_heads, dim, positions, cos_sin, keys, values, slots
    )
    ref_keys, ref_values = pools(), pools()
    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    apply_rotary_reference(q, k, positions, cos_sin)
    store_kvcache_reference(k, v.reshape(tokens, kv_heads, dim), ref_keys, ref_values, slots)
    assert torch.equal(fused[:, : heads * dim].view(tokens, heads, dim), q)
    assert torch.equal(keys.view(torch.uint8), ref_keys.view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    if dtype == torch.float8_e4m3fn:  # inputs up to ~2^18: some saturated
        assert bool((ref_keys.float().abs() == FP8_MAX[dtype]).any())


def test_store_kvcache_dispatch_and_the_dtype_names():
    key = torch.randn(3, 2, 16, dtype=torch.bfloat16) * 1000
    cache = torch.zeros((2, 16, 2, 16), dtype=torch.float8_e4m3fn)
    store_kvcache(key, key, cache, cache.clone(), torch.tensor([0, 5, 17]))
    assert torch.equal(
        cache[0, 5].view(torch.uint8), to_cache(key[1], torch.float8_e4m3fn).view(torch.uint8)
    )
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert (
        cache_dtype("fp8", torch.bfloat16)
        == cache_dtype("fp8_e4m3", torch.float32)
        == torch.float8_e4m3fn
    )
    assert cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int8'; supported: auto, fp8"):
        cache_dtype("int8", torch.bfloat16)
