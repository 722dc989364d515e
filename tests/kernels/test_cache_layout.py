"""The engine's CPU pool is head-major underneath ([blocks, kv_heads, block_size, dim]) and seen
through a permuted [blocks, block_size, kv_heads, dim] view. Every op must give the same result
on that layout as on the contiguous one, on both paths."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.attention import paged_attention_reference, paged_attention_triton
from nanoserve.kernels.kv_cache import store_kvcache_reference, store_kvcache_triton
from tests.kernels.utils import (
    ATTENTION_TOL,
    DEVICE,
    assert_close,
    make_paged_batch,
    naive_paged_attention,
)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    view = cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert not view.is_contiguous() and view.permute(0, 2, 1, 3).is_contiguous()
    return view


@pytest.mark.parametrize(
    "q_lens,context_lens", [([1, 1, 1], [20, 3, 40]), ([5, 1, 17], [0, 33, 16])]
)
@pytest.mark.parametrize("attention", [paged_attention_reference, paged_attention_triton])
def test_attention_on_head_major_cache(q_lens, context_lens, attention):
    batch = make_paged_batch(
        q_lens,
        context_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=5,
    )
    expected = naive_paged_attention(batch).float()
    batch.key_cache, batch.value_cache = head_major(batch.key_cache), head_major(batch.value_cache)
    out = attention(*batch.args())
    assert_close(out.cpu(), expected, ATTENTION_TOL)


@pytest.mark.parametrize("store", [store_kvcache_reference, store_kvcache_triton])
def test_store_on_head_major_cache(store):
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim = 6, 16, 3, 32
    key = torch.randn(10, heads, dim, generator=generator).to(DEVICE)
    value = torch.randn(10, heads, dim, generator=generator).to(DEVICE)
    slots = torch.tensor([0, 5, 17, -1, 40, 95, 63, -1, 33, 2], device=DEVICE)
    contiguous_k = torch.zeros(num_blocks, block_size, heads, dim, device=DEVICE)
    contiguous_v = torch.zeros_like(contiguous_k)
    store_kvcache_reference(key, value, contiguous_k, contiguous_v, slots)
    strided_k, strided_v = (
        head_major(torch.zeros_like(contiguous_k)),
        head_major(torch.zeros_like(contiguous_v)),
    )
    store(key, value, strided_k, strided_v, slots)
    assert torch.equal(strided_k, contiguous_k) and torch.equal(strided_v, contiguous_v)
    assert contiguous_k.view(-1, heads, dim)[17].equal(key[2])
