"""The model hands rotary q and k as views of one fused QKV buffer; the reference rotates them in
one pass then. It must equal rotating separate contiguous copies, on both paths."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.rotary import (
    apply_rotary_reference,
    apply_rotary_triton,
    build_cos_sin_cache,
)
from tests.kernels.utils import DEVICE


@pytest.mark.parametrize("rotate", [apply_rotary_reference, apply_rotary_triton])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_qkv_views_equal_separate_tensors(rotate, dtype):
    tokens, heads, kv_heads, dim = 7, 6, 2, 32
    cache = build_cos_sin_cache(dim, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 10, 11, 40, 63], device=DEVICE)
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(0)
    ).to(DEVICE, dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    q_separate, k_separate = q.clone(), k.clone()
    apply_rotary_reference(q_separate, k_separate, positions, cache)
    rotate(q, k, positions, cache)
    torch.testing.assert_close(q, q_separate, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(k, k_separate, atol=1e-3, rtol=1e-3)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # V untouched


@pytest.mark.parametrize("rotate", [apply_rotary_reference, apply_rotary_triton])
def test_partial_rotary_views_leave_the_rest_of_each_head(rotate):
    """Phi-4-mini's partial_rotary_factor: q[..., :rot] and k[..., :rot] of the fused QKV rows
    rotate as heads of width rot; the rest of each head is untouched."""
    tokens, heads, kv_heads, dim, rot = 5, 4, 2, 32, 16
    cache = build_cos_sin_cache(rot, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 30, 63], device=DEVICE)
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(1)
    ).to(DEVICE, torch.float32)
    before = qkv.clone()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    q_expected, k_expected = q[..., :rot].clone(), k[..., :rot].clone()
    apply_rotary_reference(q_expected, k_expected, positions, cache)
    rotate(q[..., :rot], k[..., :rot], positions, cache)
    torch.testing.assert_close(q[..., :rot], q_expected)
    torch.testing.assert_close(k[..., :rot], k_expected)
    q_before = before[:, : heads * dim].view(tokens, heads, dim)
    k_before = before[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    assert not torch.equal(q[1:, :, :rot], q_before[1:, :, :rot])  # position 0 is the identity
    assert torch.equal(q[..., rot:], q_before[..., rot:])
    assert torch.equal(k[..., rot:], k_before[..., rot:])
