"""Paged attention on the CPU: decode rows through the C++ kernels (kernels/cpu/attention_amx.cpp
at the AMX level, else ops.cpp), which read K/V where they lie in the pool; prompt rows through
attention_amx.cpp's prefill kernel, on AMX tiles (2-3x torch's flash SDPA there) or at the AVX-512
BF16 level with VDPBF16PS (2-4x SDPA on a Zen 5 EPYC), else through torch's flash SDPA (the AVX2
and portable levels, fp32, head_dim other than 64 / 128).

Every prompt row gives the same bits however its prompt was split (fresh, behind a cached
prefix, across chunked-prefill steps). The AMX kernel does so by construction (each row's sums
run over its own keys only). The flash kernel's arithmetic for a row depends on the shape of
the tiles it lands in, so on the SDPA path the tiles are made a function of the row alone:
- query rows go in calls of at most 160 rows padded to a multiple of 32 (below 192 query rows
  the kernel tiles queries by 32, so every tile is a full 32 rows);
- the keys of a call are padded with masked zero keys to a length set by the row's own
  position: 128 or 256 for rows below those positions, else a multiple of 512 (the kernel's
  key tile), so every key tile a row sees has the same length; keys past a row's position are
  masked, and a masked tile adds exact zeros.
Decode rows are one query each; the C++ kernel's result for a row never depends on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels.attention import paged_attention_reference
from nanoserve.kernels.cpu import ops as cpu_ops

QUERY_TILE = 32
MAX_QUERY_ROWS = 160
KEY_TILE = 512
SHORT_KEY_LENGTHS = (128, 256)


@dataclass(slots=True)
class PrefillSpan:
    """Rows [row_start, row_start + q_len) of the batch are the last q_len tokens of sequence
    seq_index, whose KV length (these tokens included) is seq_len."""

    seq_index: int
    row_start: int
    q_len: int
    seq_len: int


def prefill_spans(
    cu_seqlens_q: list[int], seq_lens: list[int], num_decode_seqs: int
) -> list[PrefillSpan]:
    return [
        PrefillSpan(i, cu_seqlens_q[i], cu_seqlens_q[i + 1] - cu_seqlens_q[i], seq_lens[i])
        for i in range(num_decode_seqs, len(seq_lens))
    ]


def key_length_for(position: int) -> int:
    """The padded key length of a call holding a query row at this position."""
    for length in SHORT_KEY_LENGTHS:
        if position < length:
            return length
    return -(-(position + 1) // KEY_TILE) * KEY_TILE


def _calls(context: int, q_len: int) -> list[tuple[int, int, int]]:
    """(first row, rows, padded key length) per SDPA call for rows 0..q_len of a span whose
    first row sits at position `context`. A call never mixes rows of two key-length classes."""
    calls = []
    row = 0
    while row < q_len:
        position = context + row
        end = min(q_len, row + MAX_QUERY_ROWS)
        bucket = key_length_for(position)
        if bucket in SHORT_KEY_LENGTHS:
            end = min(end, bucket - context)
        calls.append((row, end - row, max(bucket, key_length_for(context + end - 1))))
        row = end
    return calls


def _gather_keys(
    cache: torch.Tensor, tables: torch.Tensor, key_length: int, seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """[B, kv_heads, key_length, dim] in `dtype`: the cached rows of B sequences of the same length
    (one block table row each; an fp8 pool's values exactly), zero past seq_len."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    batch = tables.shape[0]
    num_blocks = -(-seq_len // block_size)
    physical = cache.permute(0, 2, 1, 3)  # [blocks, kv_heads, block_size, dim], contiguous
    out = torch.zeros((batch, num_kv_heads, key_length, head_dim), dtype=dtype)
    rows = physical.index_select(0, tables[:, :num_blocks].reshape(-1).long())
    out[:, :, : num_blocks * block_size].view(
        batch, num_kv_heads, num_blocks, block_size, head_dim
    ).copy_(rows.view(batch, num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2))
    if num_blocks * block_size > seq_len:  # slots after the last written one
        out[:, :, seq_len : num_blocks * block_size] = 0
    return out


def _prefill(
    query, out, key_cache, value_cache, tables, spans: list[PrefillSpan], scale: float
) -> None:
    """Spans of the same shape (context and q_len), batched: each row's tiles are the same as
    alone (the flash kernel works on each batch entry and head separately)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    span = spans[0]
    context = span.seq_len - span.q_len
    calls = _calls(context, span.q_len)
    max_keys = max(keys for _, _, keys in calls)
    keys = _gather_keys(key_cache, tables, max_keys, span.seq_len, query.dtype)
    values = _gather_keys(value_cache, tables, max_keys, span.seq_len, query.dtype)
    batch = len(spans)
    for first, rows, key_length in calls:
        padded = -(-rows // QUERY_TILE) * QUERY_TILE
        q = query.new_zeros((batch, num_heads, padded, head_dim))
        for index, item in enumerate(spans):
            start = item.row_start + first
            q[index, :, :rows] = query[start : start + rows].transpose(0, 1)
        positions = torch.arange(context + first, context + first + rows)
        mask = torch.zeros((padded, key_length), dtype=torch.bool)
        mask[:rows] = torch.arange(key_length)[None, :] <= positions[:, None]
        mask[rows:, 0] = True  # padding rows see one key (their output is dropped)
        result = F.scaled_dot_product_attention(
            q,
            keys[:, :, :key_length],
            values[:, :, :key_length],
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        for index, item in enumerate(spans):
            start = item.row_start + first
            out[start : start + rows] = result[index, :, :rows].transpose(0, 1)


def _reference_over_real_rows(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    num_decode_seqs,
    spans,
    max_seqlen_q,
    max_seqlen_k,
    sliding_window,
    softcap,
    sinks,
) -> torch.Tensor:
    """A windowed or capped layer, or one with sinks (the C++ kernels do none of them): the torch
    reference over the real rows; the padding rows come back zero."""
    real = spans[-1].row_start + spans[-1].q_len if spans else num_decode_seqs
    out = paged_attention_reference(
        query[:real],
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale,
        max_seqlen_q,
        max_seqlen_k,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )
    if real == query.shape[0]:
        return out
    return torch.cat([out, out.new_zeros((query.shape[0] - real, *out.shape[1:]))])


def paged_attention_cpu(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    num_decode_seqs: int,
    spans: list[PrefillSpan],
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first num_decode_seqs sequences are decodes (one query row each, rows 0..n); `spans`
    are the others. Rows past the last span are padding and come back zero."""
    if sliding_window or softcap or sinks is not None:
        return _reference_over_real_rows(
            query,
            key_cache,
            value_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            num_decode_seqs,
            spans,
            max_seqlen_q,
            max_seqlen_k,
            sliding_window,
            softcap,
            sinks,
        )
    out = query.new_empty(query.shape)
    n = num_decode_seqs
    if n:
        args = (
            query[:n],
            key_cache,
            value_cache,
            block_table[:n],
            cu_seqlens_q[: n + 1],
            seq_lens[:n],
            scale,
        )
        if not cpu_ops.available() or cpu_ops.paged_attention(*args, out=out[:n]) is None:
            out[:n] = paged_attention_reference(*args, 1, None)
    # At the AMX and AVX-512 BF16 levels: every prompt row in one call (kernels/cpu/attention_amx.cpp);
    # else torch's SDPA below.
    on_tiles = cpu_ops.available() and cpu_ops.prefill_attention(
        query, key_cache, value_cache, block_table, spans, scale, out
    )
    groups: dict[tuple[int, int], list[PrefillSpan]] = {}
    for span in [] if on_tiles else spans:  # fresh prompts of one length go together
        groups.setdefault((span.seq_len, span.q_len), []).append(span)
    for group in groups.values():
        tables = block_table[torch.tensor([span.seq_index for span in group])]
        _prefill(query, out, key_cache, value_cache, tables, group, scale)
    real = spans[-1].row_start + spans[-1].q_len if spans else num_decode_seqs
    if real < out.shape[0]:
        out[real:] = 0
    return out
