"""Paged attention: the Triton kernel (prefill, decode, split-KV) against the torch reference,
and the reference against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.attention import (
    MAX_NUM_SPLITS,
    _choose_num_splits,
    paged_attention_reference,
    paged_attention_triton,
)
from tests.kernels.utils import (
    ATTENTION_TOL,
    DEVICE,
    DTYPES,
    assert_close,
    dtype_id,
    make_paged_batch,
    naive_paged_attention,
)

NUM_KV_HEADS = 2


def check(batch, **kwargs):
    expected = paged_attention_reference(*batch.args())
    actual = paged_attention_triton(*batch.args(), **kwargs)
    assert torch.isfinite(actual).all(), "NaN/inf leaked from unwritten cache slots"
    assert_close(actual, expected, ATTENTION_TOL)
    return actual


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(
    "q_lens,context_lens",
    [
        ([4, 1, 7], [0, 9, 21]),  # new prompt, a decode, a chunk after a multi-block prefix
        ([1, 1], [30, 2]),  # decode only
    ],
)
def test_reference_matches_naive_loop(group, q_lens, context_lens):
    batch = make_paged_batch(
        q_lens,
        context_lens,
        num_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=16,
        block_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    expected = naive_paged_attention(batch)
    actual = paged_attention_reference(*batch.args())
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    # Without max_seqlen_* the reference computes them itself.
    again = paged_attention_reference(*batch.args()[:7])
    torch.testing.assert_close(again, actual)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mixed_prefill_and_decode(dtype, head_dim, group, block_size):
    # An empty prefix, a decode, a chunk after a multi-block prefix; no length is a multiple
    # of the block size.
    context_lens = [0, 37, 2 * block_size + 3]
    batch = make_paged_batch(
        [5, 1, 19],
        context_lens,
        num_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group,
    )
    check(batch)


@pytest.mark.parametrize("num_splits", [None, 1, 5, MAX_NUM_SPLITS])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_split_kv(dtype, group, num_splits):
    # Long contexts use several splits; the 3-token one leaves most splits empty.
    batch = make_paged_batch(
        [1, 1, 1, 1],
        [199, 2, 76, 128],
        num_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=10 + group,
    )
    check(batch, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_head_dim_128_split(dtype):
    batch = make_paged_batch(
        [1, 1],
        [150, 33],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=32,
        dtype=dtype,
        seed=3,
    )
    check(batch, num_splits=4)


def test_split_kv_also_handles_prefill_rows():
    batch = make_paged_batch(
        [6, 1, 17],
        [40, 60, 9],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=4,
    )
    check(batch, num_splits=3)


@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_key_tile_independent_of_cache_block(block_size, block_n):
    batch = make_paged_batch(
        [9, 1],
        [50, 44],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        seed=5,
    )
    check(batch, block_n=block_n)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_query_tile_sizes(block_m):
    batch = make_paged_batch(
        [23, 3, 1],
        [0, 20, 5],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        seed=6,
    )
    check(batch, block_m=block_m)


def test_sequence_without_new_tokens():
    batch = make_paged_batch(
        [3, 0, 2],
        [4, 11, 0],
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=7,
    )
    check(batch)


def test_single_sequence_single_token():
    batch = make_paged_batch(
        [1],
        [0],
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=8,
    )
    out = check(batch)
    # One key: attention returns its value exactly.
    torch.testing.assert_close(out[0], batch.value_cache[batch.block_table[0, 0], 0].repeat(4, 1))


def test_output_rows_depend_on_their_own_sequence_only():
    """Changing sequence 1's cache must not move sequence 0's output (catches wrong
    program-to-sequence mapping that equal-looking random data could hide)."""
    batch = make_paged_batch(
        [7, 5],
        [10, 30],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=9,
    )
    before = paged_attention_triton(*batch.args())
    for block in batch.block_table[1, :3].tolist():
        batch.key_cache[block] = batch.key_cache[block].flip(0)
    after = paged_attention_triton(*batch.args())
    torch.testing.assert_close(after[:7], before[:7], atol=0, rtol=0)
    assert not torch.allclose(after[7:], before[7:])


def test_empty_batch():
    batch = make_paged_batch(
        [1], [3], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    empty = batch.query[:0]
    out = paged_attention_triton(
        empty,
        batch.key_cache,
        batch.value_cache,
        batch.block_table[:0],
        batch.cu_seqlens_q[:1],
        batch.seq_lens[:0],
        batch.scale,
    )
    assert out.shape == empty.shape


def test_num_splits_heuristic():
    cuda_like = torch.device("cpu")  # 4 stand-in SMs
    assert _choose_num_splits(cuda_like, 1, 1, None, 16) == 16
    assert _choose_num_splits(cuda_like, 64, 8, None, 16) == 1
    assert _choose_num_splits(cuda_like, 1, 2, 70, 16) == 2  # >= 4 key tiles per split
    assert 1 <= _choose_num_splits(cuda_like, 1, 1, 1, 64) <= MAX_NUM_SPLITS


def _bad_inputs():
    def batch():
        return make_paged_batch(
            [2, 1],
            [3, 5],
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            dtype=torch.float32,
        )

    def with_(**changes):
        b = batch()
        for name, value in changes.items():
            setattr(b, name, value(b) if callable(value) else value)
        return b

    return {
        "query_2d": with_(query=lambda b: b.query[:, 0]),
        "heads_not_multiple": with_(query=lambda b: b.query[:, :3]),
        "dtype_mismatch": with_(query=lambda b: b.query.half()),
        "int_query": with_(query=lambda b: b.query.long()),
        "cache_shapes_differ": with_(value_cache=lambda b: b.value_cache[:, :8]),
        "head_dim_mismatch": with_(query=lambda b: b.query[..., :32]),
        "seq_lens_int64": with_(seq_lens=lambda b: b.seq_lens.long()),
        "cu_seqlens_wrong_length": with_(cu_seqlens_q=lambda b: b.cu_seqlens_q[:2]),
        "block_table_int64": with_(block_table=lambda b: b.block_table.long()),
        "block_table_rows": with_(block_table=lambda b: b.block_table[:1]),
        "block_table_strided": with_(
            block_table=lambda b: b.block_table.repeat_interleave(2, dim=1)[:, ::2]
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_bad_inputs_raise(case):
    batch = _bad_inputs()[case]
    with pytest.raises(ValueError):
        paged_attention_triton(*batch.args())


def test_bad_tile_override_raises():
    batch = make_paged_batch(
        [2], [3], num_heads=16, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32
    )
    with pytest.raises(ValueError):
        paged_attention_triton(*batch.args(), block_m=8)
    with pytest.raises(ValueError):
        paged_attention_triton(*batch.args(), num_splits=MAX_NUM_SPLITS + 1)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU-only error path")
def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    batch = make_paged_batch(
        [1], [3], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        paged_attention_triton(*batch.args())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_as_a_cuda_graph_calls_it(dtype):
    """A captured decode step: the batch padded with rows of KV length 1, a block table as wide
    as the longest sequence allowed with stale block ids past each sequence's blocks, and the
    static upper bound max_seqlen_k (so the split count, fixed at capture, is the largest and
    most splits are empty). The real rows must equal the plain decode of the real batch."""
    real = make_paged_batch(
        [1, 1, 1],
        [199, 2, 76],
        num_heads=8,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=12,
    )
    num_blocks = real.key_cache.shape[0]
    width, padded = 64, 4  # up to 1024 tokens; 3 rows padded to 4
    stale = torch.randint(
        0,
        num_blocks,
        (padded, width),
        generator=torch.Generator().manual_seed(1),
        dtype=torch.int32,
    ).to(DEVICE)
    table = stale.clone()
    table[:3, : real.block_table.shape[1]] = real.block_table
    query = torch.cat([real.query, real.query[:1]])
    seq_lens = torch.cat([real.seq_lens, real.seq_lens.new_ones(1)])
    cu_seqlens_q = torch.arange(padded + 1, dtype=torch.int32, device=DEVICE)
    out = paged_attention_triton(
        query,
        real.key_cache,
        real.value_cache,
        table,
        cu_seqlens_q,
        seq_lens,
        real.scale,
        1,
        width * 16,
    )
    expected = paged_attention_reference(*real.args())
    assert torch.isfinite(out[:3]).all()
    assert_close(out[:3], expected, ATTENTION_TOL)
