"""Sliding-window and soft-capped attention, and attention sinks (gpt-oss): the torch reference
against the naive loop, and the Triton kernel (prefill, decode, split-KV) against the reference."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.attention import paged_attention_reference, paged_attention_triton
from tests.kernels.utils import (
    ATTENTION_TOL,
    DEVICE,
    assert_close,
    make_paged_batch,
    naive_paged_attention,
)

# A new prompt longer than the window, a decode far past it, a chunk behind a prefix, a short one.
Q_LENS = [40, 1, 9, 3]
CONTEXT_LENS = [0, 45, 30, 0]


def batch_of(dtype, device, group=2, seed=0):
    return make_paged_batch(
        Q_LENS,
        CONTEXT_LENS,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        dtype=dtype,
        device=device,
        seed=seed,
    )


def _sinks(num_heads: int, device) -> torch.Tensor:
    # Around the scores' own size, so that a sink takes a real share of each row's weight.
    return torch.linspace(-1.5, 2.0, num_heads, device=device)


@pytest.mark.parametrize(
    "window,softcap,with_sinks",
    [
        (7, None, False),
        (12, None, False),
        (16, None, False),
        (None, 5.0, False),
        (7, 2.0, False),
        (1, None, False),
        (None, None, True),
        (7, None, True),
    ],
)
def test_reference_matches_naive_loop(window, softcap, with_sinks):
    batch = batch_of(torch.float32, torch.device("cpu"))
    kwargs = dict(
        sliding_window=window, softcap=softcap, sinks=_sinks(4, "cpu") if with_sinks else None
    )
    expected = naive_paged_attention(batch, **kwargs)
    actual = paged_attention_reference(*batch.args(), **kwargs)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    # Decode rows alone (the batched-GEMM decode path; under a window it reads the window's
    # blocks only, and a window of 12 at position 45 reaches past the last block of the table).
    decode = make_paged_batch(
        [1, 1],
        [45, 3],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        seed=1,
    )
    expected = naive_paged_attention(decode, **kwargs)
    actual = paged_attention_reference(*decode.args(), **kwargs)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    if with_sinks:  # the sinks take weight away from every row: without them the result differs
        assert not torch.allclose(
            actual, paged_attention_reference(*decode.args(), sliding_window=window)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window,num_splits", [(None, 1), (None, 3), (7, 2)])
def test_triton_sinks_match_reference(dtype, window, num_splits):
    """Split-KV counts the sink once (in the first split) when the splits merge."""
    batch = batch_of(dtype, DEVICE, seed=5)
    sinks = _sinks(batch.query.shape[1], DEVICE)
    expected = paged_attention_reference(*batch.args(), sliding_window=window, sinks=sinks)
    actual = paged_attention_triton(
        *batch.args(), num_splits=num_splits, sliding_window=window, sinks=sinks
    )
    assert_close(actual, expected, ATTENTION_TOL)


def test_sinks_of_the_wrong_shape_are_a_clear_error():
    batch = batch_of(torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention_reference(*batch.args(), sinks=torch.zeros(3))


def test_window_changes_the_result():
    """The window test above could pass with a window ignored only if these were equal."""
    batch = batch_of(torch.float32, torch.device("cpu"))
    full = paged_attention_reference(*batch.args())
    windowed = paged_attention_reference(*batch.args(), sliding_window=7)
    assert not torch.allclose(full, windowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "window,softcap,num_splits",
    [(7, None, 1), (20, None, 1), (7, None, 3), (None, 5.0, 1), (9, 3.0, 2)],
)
def test_triton_matches_reference(dtype, window, softcap, num_splits):
    batch = batch_of(dtype, DEVICE, seed=3)
    expected = paged_attention_reference(*batch.args(), sliding_window=window, softcap=softcap)
    actual = paged_attention_triton(
        *batch.args(), num_splits=num_splits, sliding_window=window, softcap=softcap
    )
    assert torch.isfinite(actual).all()
    assert_close(actual, expected, ATTENTION_TOL)


def test_bad_window_is_a_clear_error():
    batch = batch_of(torch.float32, DEVICE)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_attention_triton(*batch.args(), sliding_window=0)
