"""The C++ CPU kernels (kernels/cpu/ops.cpp through kernels/cpu/ops.py) against their torch
references, and the bit-for-bit invariances the CPU path promises: a query row's attention
output does not depend on how its prompt was split, nor on what else is in the batch.

Everything runs on the engine's head-major CPU pool: physical [blocks, kv_heads, block_size,
dim], seen as [blocks, block_size, kv_heads, dim] (ModelRunner._new_cache)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import greedy_argmax, silu_and_mul_reference
from nanoserve.kernels.attention import paged_attention_reference
from nanoserve.kernels.cpu import attention as cpu_attention
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.rmsnorm import fused_add_rms_norm_reference, rms_norm_reference
from tests.kernels.utils import make_paged_batch, naive_paged_attention

pytestmark = pytest.mark.skipif(
    cpu_ops.library() is None, reason=f"CPU kernels not built here: {cpu_ops.load_error()}"
)

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["float32", "bfloat16"]
# (atol, rtol) against the float64 definition. The kernel keeps probabilities in float32, so
# bf16 output carries one bf16 rounding (2^-9 relative) plus the bf16 rounding of q, k, v.
ORACLE_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Against the torch reference, which in bf16 also rounds the probabilities before P @ V.
REFERENCE_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
HEAD_SHAPES = [(4, 4, 32), (9, 3, 64), (8, 1, 128)]  # (num_heads, num_kv_heads, head_dim)
HEAD_IDS = ["mha-d32", "gqa3-d64", "mqa-d128"]


def close(actual, expected, tol):
    atol, rtol = tol[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values on the engine's CPU pool layout (a permuted view of a head-major tensor)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    physical = torch.empty((num_blocks, num_kv_heads, block_size, head_dim), dtype=cache.dtype)
    view = physical.permute(0, 2, 1, 3)
    view.copy_(cache)
    assert view.permute(0, 2, 1, 3).is_contiguous()
    return view


def paged_batch(
    q_lens,
    context_lens,
    *,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    seed=0,
):
    """make_paged_batch (shuffled blocks; every slot no sequence owns holds NaN, and so do the
    padding entries of the block table) on the head-major layout."""
    batch = make_paged_batch(
        q_lens,
        context_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        device=torch.device("cpu"),
    )
    batch.key_cache, batch.value_cache = head_major(batch.key_cache), head_major(batch.value_cache)
    return batch


def kernel(batch, query=None, block_table=None, cu_seqlens_q=None, seq_lens=None):
    """cpu_ops.paged_attention on the batch, with any of its per-sequence inputs replaced."""
    out = cpu_ops.paged_attention(
        batch.query if query is None else query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table if block_table is None else block_table,
        batch.cu_seqlens_q if cu_seqlens_q is None else cu_seqlens_q,
        batch.seq_lens if seq_lens is None else seq_lens,
        batch.scale,
    )
    assert out is not None, "the kernel refused the engine's own layout"
    return out


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---- paged attention: C++ kernel against the references ----------------------------------

MIXED = [
    ([1, 1, 1, 1], [0, 15, 16, 200]),  # decodes only, on and around block edges
    ([7, 1, 33, 1, 100], [0, 50, 17, 300, 0]),  # prompts, chunks behind a prefix, decodes
    ([16, 17, 1, 40], [16, 31, 63, 0]),
]


@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=HEAD_IDS)
@pytest.mark.parametrize("q_lens,context_lens", MIXED)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_paged_attention_matches_reference(dtype, q_lens, context_lens, heads, cpu_isa):
    num_heads, num_kv_heads, head_dim = heads
    batch = paged_batch(
        q_lens,
        context_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=len(q_lens) + head_dim,
    )
    out = kernel(batch)
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert not out.isnan().any(), "read a never-written (NaN) slot"
    close(out, paged_attention_reference(*batch.args()), REFERENCE_TOL)
    close(out, naive_paged_attention(batch), ORACLE_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_paged_attention_block_size_32_and_out_argument(dtype):
    batch = paged_batch([3, 1, 50], [40, 77, 20], block_size=32, dtype=dtype, seed=3)
    out = torch.full_like(batch.query, float("nan"))
    result = cpu_ops.paged_attention(*batch.args()[:7], out=out)
    assert result is not None and result.data_ptr() == out.data_ptr()
    close(out, naive_paged_attention(batch), ORACLE_TOL)


def test_paged_attention_single_key_returns_its_value():
    batch = paged_batch([1], [0], num_heads=4, num_kv_heads=1, head_dim=64, seed=8)
    out = kernel(batch)
    value = batch.value_cache[batch.block_table[0, 0], 0]  # [1, 64]
    assert torch.equal(out[0], value.expand(4, 64))


def test_paged_attention_declines_what_it_does_not_support():
    batch = paged_batch([2], [5])
    contiguous_k = batch.key_cache.contiguous()  # [blocks, block_size, heads, dim] underneath
    assert (
        cpu_ops.paged_attention(batch.query, contiguous_k, contiguous_k, *batch.args()[3:7]) is None
    )
    half = batch.query.half()
    assert (
        cpu_ops.paged_attention(
            half, batch.key_cache.half(), batch.value_cache.half(), *batch.args()[3:7]
        )
        is None
    )
    assert (
        cpu_ops.paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_table.long(),
            *batch.args()[4:7],
        )
        is None
    )


# ---- paged attention: a row's bits depend on that row alone --------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_row_same_bits_alone_as_inside_a_longer_span(dtype, cpu_isa):
    """Each row of a 45-row span (3 row tiles of 16 in the kernel) computed as a decode of its own
    (q_len 1, seq_len = its position + 1), and the span's tail computed as a shorter chunk.

    In bf16 a batch of decodes only takes the two-pass decode kernel, whose sums run in another
    order than the span kernel's online softmax: there a row alone agrees with the span's to
    rounding, not to the bit. The engine never computes a row both ways (prompt rows go through
    SDPA, generated tokens through the decode kernel); chunks of two rows or more stay exact."""
    context, q_len = 30, 45
    batch = paged_batch([q_len], [context], dtype=dtype, seed=11)
    whole = kernel(batch)
    for row in range(q_len):
        alone = kernel(
            batch,
            query=batch.query[row : row + 1],
            cu_seqlens_q=int32([0, 1]),
            seq_lens=int32([context + row + 1]),
        )
        if dtype == torch.bfloat16:
            close(alone[0], whole[row], REFERENCE_TOL)
        else:
            assert torch.equal(alone[0], whole[row]), f"row {row}"
    for start in (1, 7, 16, 29, 43):
        chunk = kernel(batch, query=batch.query[start:], cu_seqlens_q=int32([0, q_len - start]))
        assert torch.equal(chunk, whole[start:]), f"chunk from row {start}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rows_independent_of_the_rest_of_the_batch(dtype, cpu_isa):
    """Sequence 1's rows: alone, and among others of different lengths in other orders."""
    q_lens, context_lens = [5, 20, 1, 1, 64], [100, 13, 40, 250, 0]
    batch = paged_batch(q_lens, context_lens, dtype=dtype, seed=12)
    cu = batch.cu_seqlens_q.tolist()
    rows_of = [list(range(cu[i], cu[i + 1])) for i in range(len(q_lens))]

    def run(order):
        rows = [r for s in order for r in rows_of[s]]
        lens = [q_lens[s] for s in order]
        out = kernel(
            batch,
            query=batch.query[rows],
            block_table=batch.block_table[order].contiguous(),
            cu_seqlens_q=int32([0] + torch.tensor(lens).cumsum(0).tolist()),
            seq_lens=batch.seq_lens[order].contiguous(),
        )
        start = sum(q_lens[s] for s in order[: order.index(1)])
        return out[start : start + q_lens[1]]

    alone = run([1])
    for order in ([0, 1, 2, 3, 4], [4, 3, 1], [2, 1], [1, 0, 4]):
        assert torch.equal(run(order), alone), order


def test_rows_independent_of_the_thread_count():
    batch = paged_batch([1, 1, 37, 1], [300, 5, 60, 17], dtype=torch.bfloat16, seed=13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernel(batch)
        torch.set_num_threads(max(2, threads))
        many = kernel(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, many)


def test_rows_of_one_sequence_do_not_read_another_sequences_blocks():
    batch = paged_batch([7, 5], [10, 30], seed=9)
    before = kernel(batch)
    for block in batch.block_table[1, :2].tolist():
        batch.key_cache[block] = batch.key_cache[block].flip(0)
    after = kernel(batch)
    assert torch.equal(after[:7], before[:7])
    assert not torch.allclose(after[7:], before[7:])


# ---- batches of decodes: the engine's only use of this kernel ------------------------------
# In bf16, at each ISA level this machine runs (the cpu_isa fixture): AMX's decode kernel
# (kernels/cpu/attention_amx.cpp, head_dim 64 or 128), ops.cpp's two-pass AVX-512 BF16 one,
# its two-pass AVX2 + FMA one, or its plain loops (portable level).

DECODE_LENS = [1, 15, 16, 17, 200, 333]  # context + the new token: on and around block edges


@pytest.mark.parametrize(
    "heads", HEAD_SHAPES + [(32, 8, 64), (16, 1, 64)], ids=HEAD_IDS + ["gqa4-d64", "mqa16-d64"]
)
def test_decodes_match_the_oracle(heads, cpu_isa):
    num_heads, num_kv_heads, head_dim = heads
    batch = paged_batch(
        [1] * len(DECODE_LENS),
        [n - 1 for n in DECODE_LENS],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=head_dim + num_heads,
    )
    out = kernel(batch)
    assert not out.isnan().any(), "read a never-written (NaN) slot"
    close(out, naive_paged_attention(batch), ORACLE_TOL)
    close(out, paged_attention_reference(*batch.args()), REFERENCE_TOL)


def test_decode_rows_independent_of_the_batch_and_threads(cpu_isa):
    """A decode row's bits alone, among other decodes in other orders, and on one thread."""
    lens = [40, 3, 250, 17, 64, 1]
    batch = paged_batch([1] * len(lens), [n - 1 for n in lens], dtype=torch.bfloat16, seed=21)

    def run(order):
        return kernel(
            batch,
            query=batch.query[order],
            block_table=batch.block_table[order].contiguous(),
            cu_seqlens_q=int32(list(range(len(order) + 1))),
            seq_lens=batch.seq_lens[order].contiguous(),
        )

    alone = [run([i])[0] for i in range(len(lens))]
    for order in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 0, 4]):
        out = run(order)
        for position, i in enumerate(order):
            assert torch.equal(out[position], alone[i]), (order, i)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(list(range(len(lens))))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(single[i], alone[i]) for i in range(len(lens)))


# ---- cpu_attention.paged_attention_cpu: prompt rows however the prompt is split ------------


def prompt_pool(
    prompt_len: int, dtype, *, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=0
):
    """One prompt's queries and its K/V already stored in a shuffled head-major pool (the
    engine writes the cache before attending), never-written slots NaN."""
    batch = paged_batch(
        [prompt_len],
        [0],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    return batch


def cpu_attention_chunk(batch, start: int, end: int, *, decodes=None, extra_prompt=None, padding=0):
    """Rows [start, end) of the prompt as one step of paged_attention_cpu. decodes: a list of
    (query row, block table row, seq_len) placed first, as the engine does; extra_prompt: (query
    rows, block table row, seq_len) of another prompt span placed after ours; padding rows last."""
    decodes = decodes or []
    queries = [d[0] for d in decodes] + [batch.query[start:end]]
    tables = [d[1] for d in decodes] + [batch.block_table[0]]
    seq_lens = [d[2] for d in decodes] + [end]
    q_lens = [1] * len(decodes) + [end - start]
    if extra_prompt is not None:
        queries.append(extra_prompt[0])
        tables.append(extra_prompt[1])
        seq_lens.append(extra_prompt[2])
        q_lens.append(extra_prompt[0].shape[0])
    if padding:
        queries.append(torch.zeros((padding, *batch.query.shape[1:]), dtype=batch.query.dtype))
    width = max(t.shape[0] for t in tables)
    table = torch.stack(
        [torch.cat([t, t.new_zeros(width - t.shape[0])]) for t in tables]
    ).contiguous()
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    spans = cpu_attention.prefill_spans(cu, seq_lens, len(decodes))
    out = cpu_attention.paged_attention_cpu(
        torch.cat(queries).contiguous(),
        batch.key_cache,
        batch.value_cache,
        table,
        int32(cu),
        int32(seq_lens),
        batch.scale,
        len(decodes),
        spans,
    )
    first = len(decodes)
    return out, out[first : first + end - start]


# Split points (chunk boundaries) per prompt length: single last row, block edges, the 128 /
# 256 / 512 key-length buckets and the 160-row call limit, several chunks.
SPLITS = {
    100: [[99], [1], [16], [37, 64], [32, 64, 96]],
    200: [[199], [127], [128], [129], [160], [50, 161, 190]],
    700: [[699], [255], [256], [257], [511], [512], [320, 513], [100, 300, 500, 650]],
}


@pytest.mark.parametrize("prompt_len", sorted(SPLITS))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prompt_rows_same_bits_however_split(dtype, prompt_len, cpu_isa):
    batch = prompt_pool(prompt_len, dtype, seed=prompt_len)
    _, whole = cpu_attention_chunk(batch, 0, prompt_len)
    close(whole, paged_attention_reference(*batch.args()), REFERENCE_TOL)
    for splits in SPLITS[prompt_len]:
        bounds = [0, *splits, prompt_len]
        pieces = [cpu_attention_chunk(batch, a, b)[1] for a, b in zip(bounds, bounds[1:])]
        chunked = torch.cat(pieces)
        if not torch.equal(chunked, whole):
            bad = (chunked != whole).flatten(1).any(1).nonzero().flatten().tolist()
            pytest.fail(
                f"split at {splits}: rows {bad[:10]} (of {len(bad)}) differ from the whole prompt"
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prompt_rows_same_bits_with_decodes_another_prompt_and_padding(dtype, cpu_isa):
    """A chunk of the 300-token prompt behind a 200-token cached prefix, stepped with three
    decodes of other sequences, another prompt's chunk and the engine's padding rows."""
    batch = prompt_pool(300, dtype, seed=21)
    other = paged_batch([1, 1, 1, 90], [40, 255, 600, 30], dtype=dtype, seed=22)
    # Both batches' K/V in one pool: the other batch's blocks follow ours.
    offset = batch.key_cache.shape[0]
    key_cache = head_major(torch.cat([batch.key_cache, other.key_cache]))
    value_cache = head_major(torch.cat([batch.value_cache, other.value_cache]))
    batch.key_cache, batch.value_cache = key_cache, value_cache
    table = other.block_table + offset
    decodes = [(other.query[i : i + 1], table[i], int(other.seq_lens[i])) for i in range(3)]
    extra = (other.query[3:], table[3], int(other.seq_lens[3]))
    _, alone = cpu_attention_chunk(batch, 200, 300)
    out, mixed = cpu_attention_chunk(
        batch, 200, 300, decodes=decodes, extra_prompt=extra, padding=27
    )
    assert torch.equal(mixed, alone)
    assert torch.equal(out[-27:], torch.zeros_like(out[-27:])), "padding rows must come back zero"
    # The decode rows went through the C++ kernel: same bits as calling it directly.
    direct = cpu_ops.paged_attention(
        other.query[:3].contiguous(),
        key_cache,
        value_cache,
        table[:3].contiguous(),
        int32([0, 1, 2, 3]),
        other.seq_lens[:3].contiguous(),
        other.scale,
    )
    assert torch.equal(out[:3], direct)
    expected_other = paged_attention_reference(
        other.query[3:],
        key_cache,
        value_cache,
        table[3:4].contiguous(),
        int32([0, 90]),
        other.seq_lens[3:].contiguous(),
        other.scale,
    )
    close(out[103:193], expected_other, REFERENCE_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("q_len, context", [(120, 0), (300, 0), (40, 200)])
def test_prompt_rows_same_bits_batched_with_same_shape_prompts(dtype, q_len, context, cpu_isa):
    """Spans of the same shape go through one batched SDPA call; each row must come out as it
    does when its span is the only one in the step."""
    batch = paged_batch([q_len] * 3, [context] * 3, dtype=dtype, seed=q_len + context)
    cu = batch.cu_seqlens_q.tolist()
    seq_lens = batch.seq_lens.tolist()
    together = cpu_attention.paged_attention_cpu(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.scale,
        0,
        cpu_attention.prefill_spans(cu, seq_lens, 0),
    )
    for i in range(3):
        alone = cpu_attention.paged_attention_cpu(
            batch.query[cu[i] : cu[i + 1]].contiguous(),
            batch.key_cache,
            batch.value_cache,
            batch.block_table[i : i + 1].contiguous(),
            int32([0, q_len]),
            batch.seq_lens[i : i + 1].contiguous(),
            batch.scale,
            0,
            cpu_attention.prefill_spans([0, q_len], [seq_lens[i]], 0),
        )
        assert torch.equal(together[cu[i] : cu[i + 1]], alone), f"sequence {i}"
    close(together, paged_attention_reference(*batch.args()), REFERENCE_TOL)


@pytest.mark.parametrize(
    "heads", HEAD_SHAPES + [(32, 8, 64), (8, 8, 64)], ids=HEAD_IDS + ["gqa4-d64", "mha-d64"]
)
def test_prompt_rows_match_the_oracle(heads, cpu_isa):
    """bf16 prompt rows (fresh, behind a cached prefix, single rows, past 16-row tiles) next to
    decodes, at each ISA level: on AMX tiles (kernels/cpu/attention_amx.cpp) or, below AMX or
    with head_dim 32, through SDPA: against the float64 definition."""
    num_heads, num_kv_heads, head_dim = heads
    q_lens, context_lens = [1, 1, 37, 1, 16, 100, 5], [20, 70, 0, 3, 33, 150, 0]
    batch = paged_batch(
        q_lens,
        context_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=num_heads + head_dim,
    )
    cu = batch.cu_seqlens_q.tolist()
    # Decodes first, as the engine orders a step.
    order = [0, 1, 3, 2, 4, 5, 6]
    rows = [r for i in order for r in range(cu[i], cu[i + 1])]
    lens = [q_lens[i] for i in order]
    new_cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    seq_lens = [int(batch.seq_lens[i]) for i in order]
    out = cpu_attention.paged_attention_cpu(
        batch.query[rows].contiguous(),
        batch.key_cache,
        batch.value_cache,
        batch.block_table[order].contiguous(),
        int32(new_cu),
        int32(seq_lens),
        batch.scale,
        3,
        cpu_attention.prefill_spans(new_cu, seq_lens, 3),
    )
    assert not out.isnan().any(), "read a never-written (NaN) slot"
    expected = naive_paged_attention(batch)[rows]
    close(out, expected, ORACLE_TOL)


@pytest.mark.skipif(
    "avx512bf16" not in cpu_ops.supported_isas(), reason="this CPU has no AVX512_BF16"
)
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (8, 1, 128), (32, 8, 64)], ids=["gqa3-d64", "mqa-d128", "gqa4-d64"]
)
def test_prompt_attention_gives_the_same_bits_on_vdpbf16ps_and_on_fmas(heads):
    """The AVX-512 BF16 level's prompt attention multiplies on VDPBF16PS or, where that is measured
    slow, on fp32 FMAs adding each pair's products in VDPBF16PS's order (attention_amx.cpp): every
    row the same bits either way (fresh prompts, behind a cached prefix, short last tiles, lone
    rows, past 16-row tiles), so a row's answer can't depend on which one a machine runs."""
    num_heads, num_kv_heads, head_dim = heads
    q_lens, context_lens = [37, 16, 100, 5, 1, 300], [0, 33, 150, 0, 20, 0]
    batch = paged_batch(
        q_lens,
        context_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=num_heads + head_dim,
    )
    spans = cpu_attention.prefill_spans(batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), 0)
    previous = cpu_ops.set_isa("avx512bf16")
    outs = {}
    try:
        for variant in cpu_ops.BF16_DOT_VARIANTS:
            assert cpu_ops.bf16_dot_variant(variant) == variant
            out = torch.zeros_like(batch.query)
            assert cpu_ops.prefill_attention(
                batch.query,
                batch.key_cache,
                batch.value_cache,
                batch.block_table,
                spans,
                batch.scale,
                out,
            )
            outs[variant] = out
    finally:
        cpu_ops.bf16_dot_variant("measured")
        cpu_ops.set_isa(previous)
    dot, fma = outs.values()
    assert not fma.isnan().any(), "read a never-written (NaN) slot"
    if not torch.equal(dot.view(torch.int16), fma.view(torch.int16)):
        bad = (dot != fma).flatten(1).any(1).nonzero().flatten().tolist()
        pytest.fail(f"rows {bad[:10]} (of {len(bad)}) differ between VDPBF16PS and FMA")
    close(fma, naive_paged_attention(batch), ORACLE_TOL)


def test_key_length_buckets():
    assert [
        cpu_attention.key_length_for(p) for p in (0, 127, 128, 255, 256, 511, 512, 1023, 1024)
    ] == [128, 128, 256, 256, 512, 512, 1024, 1024, 1536]


# ---- fused add + RMSNorm -----------------------------------------------------------------


def norm_inputs(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(dtype)
    return x, residual, weight


def assert_bf16_near_exact(
    actual: torch.Tensor, expected: torch.Tensor, max_fraction: float
) -> None:
    """Equal except a few elements one bf16 step apart: the kernel rounds where the reference
    rounds, and only the float32 sum of squares may sum in another order (flipping a rounding
    that sat on a tie's edge)."""
    differ = actual != expected
    if not differ.any():
        return
    a, e = actual[differ].float(), expected[differ].float()
    ulp = torch.ldexp(torch.ones_like(e), torch.frexp(e.abs().maximum(a.abs()))[1] - 8)
    assert bool(((a - e).abs() <= ulp).all()), (
        f"a difference of more than one bf16 step: {a[:5]} vs {e[:5]}"
    )
    fraction = differ.float().mean().item()
    assert fraction <= max_fraction, f"{fraction:.2%} of elements differ"


@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (33, 1536), (2, 3, 4096)])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fused_add_rms_norm_matches_reference(dtype, shape, cpu_isa):
    x, residual, weight = norm_inputs(shape, dtype, seed=shape[-1])
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = cpu_ops.rms_norm(x, residual, weight, 1e-5)
    expected, expected_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert out.shape == expected.shape and out.dtype == dtype and new_residual.dtype == dtype
    assert torch.equal(new_residual, expected_residual), "x + residual must round as the reference"
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs modified"
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        assert_bf16_near_exact(out, expected, max_fraction=0.01)


@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (5, 100)])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_without_residual_matches_reference(dtype, shape, cpu_isa):
    x, _, weight = norm_inputs(shape, dtype, seed=7)
    out, new_residual = cpu_ops.rms_norm(x, None, weight, 1e-6)
    assert new_residual is None
    expected = rms_norm_reference(x, weight, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        assert_bf16_near_exact(out, expected, max_fraction=0.01)


def test_rms_norm_rows_independent_of_row_count(cpu_isa):
    x, residual, weight = norm_inputs((64, 576), torch.bfloat16, seed=3)
    full, _ = cpu_ops.rms_norm(x, residual, weight, 1e-5)
    for rows in (1, 5, 17):
        part, _ = cpu_ops.rms_norm(
            x[-rows:].contiguous(), residual[-rows:].contiguous(), weight, 1e-5
        )
        assert torch.equal(part, full[-rows:])


def test_rms_norm_zero_rows_and_unsupported():
    x, residual, weight = norm_inputs((0, 64), torch.float32, seed=0)
    out, new_residual = cpu_ops.rms_norm(x, residual, weight, 1e-5)
    assert out.shape == (0, 64) and new_residual.shape == (0, 64)
    x, residual, weight = norm_inputs((4, 64), torch.float32, seed=0)
    assert cpu_ops.rms_norm(x.t(), residual.t(), weight, 1e-5) is None  # not contiguous
    assert cpu_ops.rms_norm(x.half(), residual.half(), weight.half(), 1e-5) is None


# ---- silu_and_mul --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 2 * 64), (9, 2 * 1536), (2, 3, 2 * 100)])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul_matches_reference(dtype, shape, cpu_isa):
    generator = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(shape, generator=generator) * 4).to(dtype)
    gate_up[..., :4] = torch.tensor([0.0, -30.0, 30.0, 80.0]).to(dtype)  # silu(0) = 0, tails
    out = cpu_ops.silu_and_mul(gate_up)
    expected = silu_and_mul_reference(gate_up)
    assert out.shape == expected.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=2e-6)
    else:
        assert_bf16_near_exact(out, expected, max_fraction=0.001)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul_saturated_negative_gate_as_reference(dtype, cpu_isa):
    gate_up = torch.tensor([[-88.0, -90.0, -200.0, -1e4, 1.0, 1.0, 1.0, 1.0]]).to(dtype)
    out = cpu_ops.silu_and_mul(gate_up)
    expected = silu_and_mul_reference(gate_up)
    # Where torch's exp overflows the result is exactly -0 (sign included); where it doesn't
    # (g = -88 in fp32 gives ~-5e-37) the polynomial exp agrees to fp32's last few bits.
    assert torch.equal(out == 0, expected == 0) and torch.equal(out.signbit(), expected.signbit())
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=0)
    else:
        assert torch.equal(out, expected), f"{out.tolist()} vs {expected.tolist()}"


def test_silu_and_mul_unsupported_shapes():
    assert cpu_ops.silu_and_mul(torch.randn(3, 7)) is None  # odd last dim
    assert cpu_ops.silu_and_mul(torch.randn(8, 3).t()) is None  # not contiguous
    assert cpu_ops.silu_and_mul(torch.randn(0, 8)).shape == (0, 4)


# ---- argmax ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_argmax_matches_torch_on_random_rows(dtype, cpu_isa):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 49152, generator=generator) * 5).to(dtype)
    assert torch.equal(cpu_ops.argmax_rows(logits), logits.float().argmax(dim=-1))
    assert torch.equal(greedy_argmax(logits), logits.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_argmax_ties_pick_the_first_index(dtype, cpu_isa):
    rows = torch.full((6, 300), -3.0)
    rows[0, [5, 17, 299]] = 2.0  # exact ties
    rows[1, :] = 1.0  # every element ties
    rows[2, [0, 1]] = 4.0  # tie at the front
    rows[3, [298, 299]] = 7.0  # tie at the back
    rows[4] = float("-inf")  # nothing finite: index 0, as torch
    rows[5, [10, 20]] = torch.tensor([1.0 + 2**-12, 1.0])  # distinct in fp32, tie in bf16
    rows = rows.to(dtype)
    expected = rows.float().argmax(dim=-1)
    assert expected[:5].tolist() == [5, 0, 0, 298, 0]
    assert torch.equal(cpu_ops.argmax_rows(rows), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_argmax_nan_and_infinity_as_torch(dtype, cpu_isa):
    rows = torch.randn(4, 100)
    rows[0, 30] = float("nan")
    rows[1, [7, 60]] = float("nan")
    rows[1, 3] = float("inf")
    rows[2, 50] = float("inf")
    rows[3, [8, 90]] = float("inf")
    rows = rows.to(dtype)
    assert torch.equal(cpu_ops.argmax_rows(rows), rows.float().argmax(dim=-1))


def test_argmax_strided_rows():
    """The logits of the sampled rows can be a view with a row stride wider than the vocab."""
    wide = torch.randn(5, 512)
    view = wide[:, :400]
    assert view.stride(0) == 512
    wide[:, 400:] = 100.0  # past the row's end: must not be seen
    assert torch.equal(cpu_ops.argmax_rows(view), view.argmax(dim=-1))
    assert cpu_ops.argmax_rows(wide.t()) is None and cpu_ops.argmax_rows(wide[:, :0]) is None
