"""Paged attention over a batch of sequences, prefill chunks and decodes mixed.

Inputs (shared by the Triton kernels and the torch reference):
  query         [num_tokens, num_heads, head_dim]; the new tokens of all sequences, packed
  key_cache     [num_blocks, block_size, num_kv_heads, head_dim] (value_cache the same)
  block_table   [num_seqs, max_blocks_per_seq] int32
  cu_seqlens_q  [num_seqs + 1] int32; sequence i owns query rows cu[i]:cu[i+1]
  seq_lens      [num_seqs] int32; KV length of each sequence *including* its new tokens,
                which the caller has already stored in the cache
The new tokens of a sequence sit at its last positions: query row j of sequence i has position
seq_lens[i] - q_len[i] + j and attends causally to keys 0..position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels.kv_dtype import from_cache
from nanoserve.kernels.triton_utils import (
    cdiv,
    check_cache_dtype,
    check_float_dtype,
    check_kv_cache_pair,
    check_triton_device,
    fp8_format,
    lazy_jit,
    multiprocessor_count,
    next_power_of_2,
)

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)

_LOG2_E = 1.4426950408889634
MAX_NUM_SPLITS = 16


@lazy_jit
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    split_acc_ptr,
    split_max_ptr,
    split_sum_ptr,
    sinks_ptr,
    query_stride_token,
    query_stride_head,
    query_stride_dim,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    cache_stride_dim,
    out_stride_token,
    out_stride_head,
    out_stride_dim,
    block_table_stride,
    max_blocks_per_seq,
    num_seqs,
    num_heads,
    num_splits,
    scale_log2,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program: up to BLOCK_Q query tokens of one sequence times the GROUP query heads of
    one KV head (BLOCK_M rows), over the keys of one split (all keys when not SPLIT).
    HAS_WINDOW: a query at position p sees keys p - window + 1..p only, and tiles wholly
    before the block's first query's window are skipped. HAS_SOFTCAP: scores are
    softcap * tanh(scores / softcap) (Gemma 2). HAS_SINKS: each head's sink logit (gpt-oss) joins
    the softmax's denominator as one more score whose value row is zero: the running max and sum
    start from it (in the first split only) instead of -inf and 0. KV_FP8: an fp8 cache, whose tiles are read into the
    query's dtype (exact) and then go through the same arithmetic as a cache in that dtype."""
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The grid has an upper bound of query blocks (no host sync): sequence i owns program ids
    # from cu_seqlens_q[i] // BLOCK_Q + i on. Binary search for the last start <= program id.
    low = tl.load(cu_seqlens_q_ptr) * 0
    high = low + num_seqs - 1
    while low < high:
        mid = (low + high + 1) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_id:
            low = mid
        else:
            high = mid - 1
    seq = low
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_index = q_block * BLOCK_Q + rows // GROUP  # query token within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_index < q_len)
    q_position = context_len + q_index
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_index).to(tl.int64)
    q = tl.load(
        query_ptr
        + token[:, None] * query_stride_token
        + head[:, None].to(tl.int64) * query_stride_head
        + dims[None, :] * query_stride_dim,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Causal: no row of this block looks past its last query's position.
    last_position = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = tl.minimum(last_position + 1, seq_len)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    if HAS_WINDOW:
        first_key = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
        first_tile = first_key // BLOCK_N
    else:
        first_tile = 0
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
        tile_start = first_tile + split * tiles_per_split
        tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    else:
        tile_start = first_tile
        tile_end = num_tiles

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        row_max = tl.where(split == 0, sink, row_max)
        row_sum = tl.where(split == 0, 1.0, row_sum)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * block_table_stride
    head_offset = kv_head.to(tl.int64) * cache_stride_head
    for tile in range(tile_start, tile_end):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_len
        # Key tiles need not align with cache blocks: map each key through the block table.
        # (A table narrower than seq_lens claims reads block 0 rather than out of bounds.)
        table_index = keys // BLOCK_SIZE
        block = tl.load(
            table_row + table_index, mask=key_valid & (table_index < max_blocks_per_seq), other=0
        ).to(tl.int64)
        key_offset = (
            block * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_offset + head_offset
        )
        # Masked loads, not only masked scores: unwritten slots may hold NaN.
        k = tl.load(
            key_cache_ptr + key_offset[None, :] + dims[:, None] * cache_stride_dim,
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        if KV_FP8:
            # Through fp32: the interpreter's direct fp8e5 -> fp16 conversion gets subnormals wrong
            # (on a GPU both ways are exact).
            k = k.to(tl.float32).to(q.dtype)
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): core ops only (no libdevice in the interpreter).
            capped = tl.dot(q, k, input_precision=DOT_PRECISION) * (scale / softcap)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * 1.4426950408889634
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        allowed = key_valid[None, :] & (keys[None, :] <= q_position[:, None])
        if HAS_WINDOW:
            allowed = allowed & (keys[None, :] > q_position[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row with every key masked so far keeps max -inf: exponentiate against 0 instead,
        # so its weights are 0 rather than NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        v = tl.load(
            value_cache_ptr + key_offset[:, None] + dims[None, :] * cache_stride_dim,
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = v.to(tl.float32).to(q.dtype)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    if SPLIT:
        # Unnormalized partial results, merged by _merge_splits_kernel; an empty split writes
        # max -inf and sum 0.
        state = (token * num_heads + head) * num_splits + split
        tl.store(split_max_ptr + state, row_max, mask=row_valid)
        tl.store(split_sum_ptr + state, row_sum, mask=row_valid)
        tl.store(
            split_acc_ptr + state[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * out_stride_token
            + head[:, None].to(tl.int64) * out_stride_head
            + dims[None, :] * out_stride_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@lazy_jit
def _merge_splits_kernel(
    split_acc_ptr,
    split_max_ptr,
    split_sum_ptr,
    out_ptr,
    out_stride_token,
    out_stride_head,
    out_stride_dim,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    """Log-sum-exp merge of the splits of one (token, head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PADDED)
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    state = (token * num_heads + head) * num_splits + splits
    split_max = tl.load(split_max_ptr + state, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(split_sum_ptr + state, mask=split_valid, other=0.0)
    total_max = tl.max(split_max, axis=0)
    total_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.exp2(split_max - total_max)  # 0 for empty splits
    total_sum = tl.sum(split_sum * weight, axis=0)
    acc = tl.load(
        split_acc_ptr + state[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total_sum == 0.0, 1.0, total_sum)
    tl.store(
        out_ptr + token * out_stride_token + head * out_stride_head + dims * out_stride_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def _check_attention_inputs(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens):
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    check_kv_cache_pair(key_cache, value_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_float_dtype("query", query)
    check_cache_dtype("key_cache", key_cache)
    if value_cache.dtype != key_cache.dtype or (
        key_cache.dtype != query.dtype and fp8_format(key_cache.dtype) is None
    ):
        raise ValueError(
            f"query, key_cache and value_cache must share a dtype (or the caches an fp8 one), "
            f"got {query.dtype}, {key_cache.dtype} and {value_cache.dtype}"
        )
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens must be 1-D int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens_q must be int32 [{num_seqs + 1}], got "
            f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}"
        )
    if (
        block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] != num_seqs
    ):
        raise ValueError(
            f"block_table must be int32 [{num_seqs}, max_blocks_per_seq], got "
            f"{tuple(block_table.shape)} {block_table.dtype}"
        )
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    if not (cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("cu_seqlens_q and seq_lens must be contiguous")
    return check_triton_device(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)


def _choose_tiles(
    device: torch.device, dtype: torch.dtype, group: int, head_dim_padded: int, max_seqlen_q: int
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M rows = query tokens x group heads;
    every tl.dot dimension stays >= 16 (BLOCK_M, BLOCK_N, HEAD_DIM_PADDED)."""
    min_block_m = max(16, next_power_of_2(group))
    if device.type != "cuda":  # the interpreter: small tiles, several of them in short tests
        return min_block_m, 16, 4, 1
    wide = dtype == torch.float32 or head_dim_padded > 128
    block_n = 32 if wide else 64
    if max_seqlen_q * group >= 64 and not wide:
        return max(64, min_block_m), block_n, 4, 2
    return min_block_m, block_n, 4, 2


def _choose_num_splits(device, num_seqs, num_kv_heads, max_seqlen_k, block_n) -> int:
    """Split-KV for decode when batch x KV heads fills less than ~4 programs per SM; the count
    depends only on host-side ints, so a captured CUDA graph keeps its launch shape."""
    programs = max(1, num_seqs * num_kv_heads)
    splits = cdiv(4 * multiprocessor_count(device), programs)
    if max_seqlen_k is not None:  # at least 4 key tiles per split
        splits = min(splits, cdiv(max_seqlen_k, 4 * block_n))
    return max(1, min(splits, MAX_NUM_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`paged_attention_reference`. ``max_seqlen_q == 1`` selects the
    decode configuration (split-KV); any query lengths are computed correctly either way. An fp8
    cache gives, bit for bit, the output on ``cache.to(query.dtype)`` (kernels/kv_dtype.py).
    Rows of ``query`` past ``cu_seqlens_q[-1]`` are left unwritten in the output.
    ``num_splits``, ``block_m``, ``block_n``, ``num_warps``, ``num_stages`` override the
    heuristics (tests, benchmarks)."""
    device = _check_attention_inputs(
        query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens
    )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    _check_sinks(sinks, query)
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match query: {tuple(query.shape)} {query.dtype}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // num_kv_heads
    head_dim_padded = max(16, next_power_of_2(head_dim))
    tile_m, tile_n, default_warps, default_stages = _choose_tiles(
        device, query.dtype, group, head_dim_padded, max_seqlen_q
    )
    tile_m = block_m or tile_m
    tile_n = block_n or tile_n
    num_warps = num_warps or default_warps
    num_stages = num_stages or default_stages
    if (
        tile_m < group
        or tile_m < 16
        or tile_n < 16
        or tile_m & (tile_m - 1)
        or tile_n & (tile_n - 1)
    ):
        raise ValueError(
            f"block_m ({tile_m}) and block_n ({tile_n}) must be powers of two >= 16 "
            f"and block_m >= the query heads per KV head ({group})"
        )
    if num_splits is None:
        num_splits = (
            _choose_num_splits(device, num_seqs, num_kv_heads, max_seqlen_k, tile_n)
            if max_seqlen_q == 1
            else 1
        )
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")
    block_q = tile_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    split = num_splits > 1
    if split:
        split_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=device
        )
        split_max = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=device
        )
        split_sum = torch.empty_like(split_max)
    else:
        split_acc = split_max = split_sum = out  # unused
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        out,
        split_acc,
        split_max,
        split_sum,
        sinks if sinks is not None else out,
        *query.stride(),
        *key_cache.stride(),
        *out.stride(),
        block_table.stride(0),
        block_table.shape[1],
        num_seqs,
        num_heads,
        num_splits,
        float(scale) * _LOG2_E,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_M=tile_m,
        BLOCK_Q=block_q,
        BLOCK_N=tile_n,
        SPLIT=split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        KV_FP8=key_cache.dtype != query.dtype,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            split_acc,
            split_max,
            split_sum,
            out,
            *out.stride(),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            SPLITS_PADDED=next_power_of_2(num_splits),
            num_warps=4 if head_dim_padded >= 128 else 2,
        )
    return out


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sliding_window`` W: a query at position p sees keys max(0, p - W + 1)..p only.
    ``softcap`` c: scores become c * tanh(scores / c) before the mask (Gemma 2).
    ``sinks`` [num_heads]: a logit per head that joins each row's softmax as one more score
    whose value is zero (gpt-oss's attention sinks): the weights of the real keys sum to less
    than 1.

    Batched over sequences (no Python loop over them). This is also the CPU execution path,
    so it is written for speed there: decode sequences (one query) go through two batched
    GEMMs, the others through one masked SDPA over padded queries; a mixed batch is split so
    decodes are never padded to a prefill's length."""
    num_tokens = query.shape[0]
    num_seqs = seq_lens.shape[0]
    _check_sinks(sinks, query)
    if num_seqs == 0 or num_tokens == 0:
        return query.new_zeros(query.shape)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_lens = seq_lens.long()
    if max_seqlen_q is None:
        max_seqlen_q = int(q_lens.max())
    if max_seqlen_q == 1 and num_tokens == num_seqs:
        return _decode_reference(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            max_seqlen_k,
            sliding_window,
            softcap,
            sinks,
        )
    is_decode = q_lens == 1
    if not bool(is_decode.any()):
        return _prefill_reference(
            query,
            key_cache,
            value_cache,
            block_table,
            cu_seqlens_q.long(),
            q_lens,
            seq_lens,
            scale,
            max_seqlen_q,
            sliding_window,
            softcap,
            sinks,
        )
    out = query.new_empty(query.shape)
    starts = cu_seqlens_q[:-1].long()
    decode_seqs = is_decode.nonzero().flatten()
    decode_rows = starts[decode_seqs]
    out[decode_rows] = _decode_reference(
        query[decode_rows],
        key_cache,
        value_cache,
        block_table[decode_seqs],
        seq_lens[decode_seqs],
        scale,
        None,
        sliding_window,
        softcap,
        sinks,
    )
    prefill_seqs = (~is_decode).nonzero().flatten()
    prefill_lens = q_lens[prefill_seqs]
    prefill_cu = F.pad(prefill_lens.cumsum(0), (1, 0))
    owner = torch.repeat_interleave(
        torch.arange(prefill_seqs.numel(), device=query.device), prefill_lens
    )
    prefill_rows = (
        starts[prefill_seqs][owner]
        + torch.arange(owner.numel(), device=query.device)
        - prefill_cu[owner]
    )
    out[prefill_rows] = _prefill_reference(
        query[prefill_rows],
        key_cache,
        value_cache,
        block_table[prefill_seqs],
        prefill_cu,
        prefill_lens,
        seq_lens[prefill_seqs],
        scale,
        max_seqlen_q,
        sliding_window,
        softcap,
        sinks,
    )
    return out


def _gather_valid(key_cache, value_cache, block_table, seq_lens, max_seqlen_k, dtype):
    """K and V of each sequence as [num_seqs, num_kv_heads, max_k, head_dim] in `dtype`, with the
    positions past each sequence's length zeroed, and those positions' mask [num_seqs, max_k]."""
    block_size = key_cache.shape[1]
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max())
    num_blocks_needed = (max_seqlen_k + block_size - 1) // block_size
    table = block_table[:, :num_blocks_needed].long()
    max_k = num_blocks_needed * block_size
    keys = _gather_cache(key_cache, table, max_k, dtype)
    values = _gather_cache(value_cache, table, max_k, dtype)
    invalid = torch.arange(max_k, device=keys.device)[None, :] >= seq_lens[:, None]
    # Unwritten slots may hold NaN, and softmax weight 0 times NaN is NaN: zero them. Only a
    # few positions are invalid (the tail of each last block), so write just those.
    invalid_rows = invalid.nonzero(as_tuple=True)
    keys.transpose(1, 2).index_put_(invalid_rows, keys.new_zeros(()))
    values.transpose(1, 2).index_put_(invalid_rows, values.new_zeros(()))
    return keys, values, invalid


def _soft_cap_(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.device != query.device):
        raise ValueError(
            f"sinks must be [num_heads] = [{query.shape[1]}] on the query's device, got "
            f"{tuple(sinks.shape)} on {sinks.device}"
        )


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of fp32 scores [..., heads, rows, keys] (heads at dim -3),
    with each head's sink logit as one more column that is dropped after."""
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def _gather_window(key_cache, value_cache, block_table, seq_lens, window, dtype):
    """Like _gather_valid for decodes under a sliding window: only the blocks that hold a
    sequence's last `window` keys (its query sits at seq_len - 1), so a step reads O(window)
    keys, not the whole context; the mask also covers keys before the window."""
    block_size = key_cache.shape[1]
    width = block_table.shape[1]
    num_blocks = min(-(-(window - 1) // block_size) + 1, width)
    first_block = (seq_lens - window).clamp(min=0) // block_size
    steps = torch.arange(num_blocks, device=seq_lens.device)
    # Columns past the table only come with positions past seq_len, which are masked.
    columns = (first_block[:, None] + steps[None, :]).clamp(max=width - 1)
    table = block_table.long().gather(1, columns)
    max_k = num_blocks * block_size
    keys = _gather_cache(key_cache, table, max_k, dtype)
    values = _gather_cache(value_cache, table, max_k, dtype)
    positions = (
        first_block[:, None] * block_size + torch.arange(max_k, device=seq_lens.device)[None, :]
    )
    invalid = (positions >= seq_lens[:, None]) | (positions < seq_lens[:, None] - window)
    invalid_rows = invalid.nonzero(as_tuple=True)  # zeroed: unwritten slots may hold NaN
    keys.transpose(1, 2).index_put_(invalid_rows, keys.new_zeros(()))
    values.transpose(1, 2).index_put_(invalid_rows, values.new_zeros(()))
    return keys, values, invalid


def _decode_reference(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    scale,
    max_seqlen_k,
    sliding_window=None,
    softcap=None,
    sinks=None,
):
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if sliding_window:
        keys, values, invalid = _gather_window(
            key_cache, value_cache, block_table, seq_lens, sliding_window, query.dtype
        )
    else:
        keys, values, invalid = _gather_valid(
            key_cache, value_cache, block_table, seq_lens, max_seqlen_k, query.dtype
        )
    max_k = keys.shape[2]
    batch = num_seqs * num_kv_heads
    q = query.reshape(batch, group, head_dim)
    scores = torch.bmm(q, keys.reshape(batch, max_k, head_dim).transpose(1, 2)).float().mul_(scale)
    scores = _soft_cap_(scores, softcap).view(num_seqs, num_kv_heads, group, max_k)
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    if sinks is not None:  # [num_seqs, heads, 1, max_k]: the sink of each row's own head
        scores = scores.view(num_seqs, num_heads, 1, max_k)
    probs = _softmax_with_sinks(scores, sinks).to(values.dtype).view(batch, group, max_k)
    out = torch.bmm(probs, values.reshape(batch, max_k, head_dim))
    return out.view(num_seqs, num_heads, head_dim)


def _prefill_reference(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    q_lens,
    seq_lens,
    scale,
    max_seqlen_q,
    sliding_window=None,
    softcap=None,
    sinks=None,
):
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    device = query.device
    keys, values, invalid = _gather_valid(
        key_cache, value_cache, block_table, seq_lens, None, query.dtype
    )
    max_k = keys.shape[2]
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    token_offset = torch.arange(num_tokens, device=device) - cu_seqlens_q[token_seq]
    padded_q = query.new_zeros(num_seqs, max_seqlen_q, num_heads, head_dim)
    padded_q[token_seq, token_offset] = query
    query_positions = (seq_lens - q_lens)[:, None] + torch.arange(max_seqlen_q, device=device)[
        None, :
    ]
    key_positions = torch.arange(max_k, device=device)
    allowed = (key_positions[None, None, :] <= query_positions[:, :, None]) & ~invalid[:, None, :]
    if sliding_window:
        allowed &= key_positions[None, None, :] > query_positions[:, :, None] - sliding_window
    # Padded query rows would be fully masked (NaN after softmax); let them see key 0.
    allowed[:, :, 0] |= torch.arange(max_seqlen_q, device=device)[None, :] >= q_lens[:, None]
    if softcap or sinks is not None:
        out = _attention_explicit(
            padded_q.permute(0, 2, 1, 3), keys, values, allowed, scale, softcap, sinks
        )
    else:
        out = F.scaled_dot_product_attention(
            padded_q.permute(0, 2, 1, 3),
            keys,
            values,
            attn_mask=allowed[:, None, :, :],
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [S, H, Q, D]
    return out.permute(0, 2, 1, 3)[token_seq, token_offset]


def _attention_explicit(q, keys, values, allowed, scale, softcap, sinks):
    """SDPA with capped scores or sinks (SDPA has neither): q [S, H, Q, D], keys/values
    [S, KVH, K, D], allowed [S, Q, K] → [S, H, Q, D]; softmax in fp32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = _soft_cap_(torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale), softcap)
    scores.masked_fill_(~allowed[:, None], float("-inf"))
    return torch.matmul(_softmax_with_sinks(scores, sinks).to(values.dtype), values)


def _gather_cache(
    cache: torch.Tensor, table: torch.Tensor, max_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """Each sequence's cache rows as [num_seqs, num_kv_heads, max_k, head_dim] in `dtype` (an fp8
    pool's values exactly: kernels/kv_dtype.py). index_select
    with a flat index is the gather: on CPU it is far faster than advanced indexing. A head-major
    pool ([blocks, heads, block_size, dim] underneath) comes out contiguous with no permute."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    num_seqs = table.shape[0]
    head_major = cache.permute(0, 2, 1, 3)
    if head_major.is_contiguous():
        rows = (
            table[:, None, :] * num_kv_heads
            + torch.arange(num_kv_heads, device=table.device)[None, :, None]
        )
        flat = head_major.reshape(num_blocks * num_kv_heads, block_size * head_dim)
        gathered = from_cache(flat.index_select(0, rows.flatten()), dtype)
        return gathered.view(num_seqs, num_kv_heads, max_k, head_dim)
    gathered = from_cache(cache.reshape(num_blocks, -1).index_select(0, table.flatten()), dtype)
    return gathered.view(num_seqs, max_k, num_kv_heads, head_dim).transpose(1, 2)
