"""Rotary embedding in place: the Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.rotary import (
    apply_rotary_reference,
    apply_rotary_triton,
    build_cos_sin_cache,
)
from tests.kernels.utils import DEVICE, DTYPES, ELEMENTWISE_TOL, assert_close, dtype_id

MAX_POSITION = 300


def _qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q and k as strided views into one packed qkv tensor, as the model produces them."""
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=generator).to(dtype).to(DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    return qkv, q, k


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (12, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rotary_matches_reference(dtype, head_dim, num_heads, num_kv_heads):
    cache = build_cos_sin_cache(head_dim, MAX_POSITION, 10000.0).to(DEVICE)
    qkv, q, k = _qk(7, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.tensor([0, 1, 5, 5, 100, 257, MAX_POSITION - 1], device=DEVICE)
    expected_qkv = qkv.clone()
    expected_q = expected_qkv[:, : q.shape[1] * head_dim].view_as(q)
    expected_k = expected_qkv[:, q.shape[1] * head_dim : (q.shape[1] + k.shape[1]) * head_dim]
    expected_k = expected_k.view_as(k)
    apply_rotary_reference(expected_q, expected_k, positions, cache)
    apply_rotary_triton(q, k, positions.int(), cache)
    assert_close(qkv, expected_qkv, ELEMENTWISE_TOL)  # v (the tail) must be untouched too
    v_start = (num_heads + num_kv_heads) * head_dim
    torch.testing.assert_close(qkv[:, v_start:], expected_qkv[:, v_start:], atol=0, rtol=0)


def test_rotary_position_zero_is_identity():
    cache = build_cos_sin_cache(64, 8, 10000.0).to(DEVICE)
    _, q, k = _qk(3, 4, 2, 64, torch.float32, seed=1)
    q_before, k_before = q.clone(), k.clone()
    apply_rotary_triton(q, k, torch.zeros(3, dtype=torch.long, device=DEVICE), cache)
    torch.testing.assert_close(q, q_before)
    torch.testing.assert_close(k, k_before)


def test_rotary_llama3_scaled_cache():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cache = build_cos_sin_cache(64, 200, 500000.0, scaling).to(DEVICE)
    _, q, k = _qk(4, 4, 2, 64, torch.float32, seed=2)
    expected_q, expected_k = q.clone(), k.clone()
    positions = torch.tensor([3, 70, 150, 199], device=DEVICE)
    apply_rotary_reference(expected_q, expected_k, positions, cache)
    apply_rotary_triton(q, k, positions, cache)
    assert_close(q, expected_q, ELEMENTWISE_TOL)
    assert_close(k, expected_k, ELEMENTWISE_TOL)


@pytest.mark.parametrize(
    "case", ["odd_head_dim", "cache_width", "positions_length", "positions_float", "key_tokens"]
)
def test_bad_inputs_raise(case):
    cache = build_cos_sin_cache(64, 8, 10000.0).to(DEVICE)
    _, q, k = _qk(3, 4, 2, 64, torch.float32)
    positions = torch.zeros(3, dtype=torch.long, device=DEVICE)
    if case == "odd_head_dim":
        q, k = q[..., :63], k[..., :63]
        cache = cache[:, :63]
    elif case == "cache_width":
        cache = cache[:, :32]
    elif case == "positions_length":
        positions = positions[:2]
    elif case == "positions_float":
        positions = positions.float()
    elif case == "key_tokens":
        k = k[:2]
    with pytest.raises(ValueError):
        apply_rotary_triton(q, k, positions, cache)


# YaRN as real checkpoints configure it: (head_dim, rope_theta, rope_scaling).
YARN_CASES = {
    # gpt-oss: transformers-5 rope_parameters, an untruncated correction range.
    "gpt-oss": (
        64,
        150000.0,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    ),
    # Qwen2.5 / Qwen3 long context: the older "type" key, defaults for the rest.
    "qwen": (
        128,
        1000000.0,
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    # DeepSeek-style: the attention factor from mscale / mscale_all_dim.
    "mscale": (
        64,
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 4096,
        },
    ),
    "attention_factor": (
        32,
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "attention_factor": 1.5,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 256,
        },
    ),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_cache_matches_transformers(case):
    """Frequencies and attention factor as transformers' own YaRN init computes them (in fp32)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta, scaling = YARN_CASES[case]
    original = scaling["original_max_position_embeddings"]
    shape = dict(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=int(original * scaling["factor"]),
    )
    if "type" in scaling:  # as config.json has it: rope_scaling beside rope_theta
        config = transformers.Qwen2Config(**shape, rope_theta=theta, rope_scaling=dict(scaling))
    else:
        config = transformers.LlamaConfig(
            **shape, head_dim=head_dim, rope_parameters={**scaling, "rope_theta": theta}
        )
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    inv_freq = inv_freq.double()

    max_position = 64  # fp32 frequencies: their rounding error grows with the position
    cache = build_cos_sin_cache(head_dim, max_position, theta, scaling)
    assert cache.dtype == torch.float32 and cache.shape == (max_position, head_dim)
    assert attention != 1.0 and not torch.allclose(
        cache, build_cos_sin_cache(head_dim, max_position, theta)
    )
    half = head_dim // 2
    # Position 1's angle is the frequency itself (all below pi); every row's norm, the attention factor.
    torch.testing.assert_close(
        torch.atan2(cache[1, half:], cache[1, :half]).double(), inv_freq, rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        torch.hypot(cache[:, :half], cache[:, half:]).double(),
        torch.full((max_position, half), float(attention), dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention
    torch.testing.assert_close(cache.double(), expected, rtol=1e-5, atol=1e-5)


def test_unsupported_rope_scaling_lists_yarn():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'.*yarn"):
        build_cos_sin_cache(64, 8, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
