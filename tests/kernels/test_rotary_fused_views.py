"""The model hands rotary q and k as views of one fused QKV buffer; the reference rotates them in
one pass then. It must equal rotating separate contiguous copies, on both paths."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.rotary import apply_rotary_reference, apply_rotary_triton, build_cos_sin_cache
from tests.kernels.utils import DEVICE


@pytest.mark.parametrize("rotate", [apply_rotary_reference, apply_rotary_triton])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_qkv_views_equal_separate_tensors(rotate, dtype):
    tokens, heads, kv_heads, dim = 7, 6, 2, 32
    cache = build_cos_sin_cache(dim, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 10, 11, 40, 63], device=DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim,
                      generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    q_separate, k_separate = q.clone(), k.clone()
    apply_rotary_reference(q_separate, k_separate, positions, cache)
    rotate(q, k, positions, cache)
    torch.testing.assert_close(q, q_separate, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(k, k_separate, atol=1e-3, rtol=1e-3)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # V untouched
