"""Rotary embedding in place: the Triton kernel against the torch reference."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.rotary import apply_rotary_reference, apply_rotary_triton, \
    build_cos_sin_cache
from tests.kernels.utils import DEVICE, DTYPES, ELEMENTWISE_TOL, assert_close, dtype_id

MAX_POSITION = 300


def _qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q and k as strided views into one packed qkv tensor, as the model produces them."""
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=generator).to(dtype).to(DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
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
    expected_k = expected_qkv[:, q.shape[1] * head_dim: (q.shape[1] + k.shape[1]) * head_dim]
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
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cache = build_cos_sin_cache(64, 200, 500000.0, scaling).to(DEVICE)
    _, q, k = _qk(4, 4, 2, 64, torch.float32, seed=2)
    expected_q, expected_k = q.clone(), k.clone()
    positions = torch.tensor([3, 70, 150, 199], device=DEVICE)
    apply_rotary_reference(expected_q, expected_k, positions, cache)
    apply_rotary_triton(q, k, positions, cache)
    assert_close(q, expected_q, ELEMENTWISE_TOL)
    assert_close(k, expected_k, ELEMENTWISE_TOL)


@pytest.mark.parametrize("case", ["odd_head_dim", "cache_width", "positions_length",
                                  "positions_float", "key_tokens"])
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
