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
) -> torch.Tensor:
    """Batched over sequences with padding and one masked attention call (no Python loop)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    device = query.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_lens = seq_lens.long()
    if max_seqlen_q is None:
        max_seqlen_q = int(q_lens.max()) if num_seqs else 0
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max()) if num_seqs else 0
    if num_seqs == 0 or num_tokens == 0:
        return query.new_zeros(query.shape)

    num_blocks_needed = (max_seqlen_k + block_size - 1) // block_size
    table = block_table[:, :num_blocks_needed].long()
    max_k = num_blocks_needed * block_size
    # Gather each sequence's cache into [num_seqs, num_kv_heads, max_k, head_dim].
    keys = key_cache[table].reshape(num_seqs, max_k, num_kv_heads, head_dim)
    values = value_cache[table].reshape(num_seqs, max_k, num_kv_heads, head_dim)
    key_positions = torch.arange(max_k, device=device)
    key_valid = key_positions[None, :] < seq_lens[:, None]  # [S, K]
    # Unwritten slots may hold NaN, and softmax weight 0 times NaN is NaN: zero them.
    values = values.masked_fill(~key_valid[:, :, None, None], 0)
    keys = keys.masked_fill(~key_valid[:, :, None, None], 0)
    keys = keys.permute(0, 2, 1, 3)
    values = values.permute(0, 2, 1, 3)

    if max_seqlen_q == 1 and num_tokens == num_seqs:
        padded_q = query.view(num_seqs, 1, num_heads, head_dim)
        token_seq = token_offset = None
    else:
        token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
        token_offset = torch.arange(num_tokens, device=device) - cu_seqlens_q.long()[token_seq]
        padded_q = query.new_zeros(num_seqs, max_seqlen_q, num_heads, head_dim)
        padded_q[token_seq, token_offset] = query

    query_positions = (seq_lens - q_lens)[:, None] + torch.arange(max_seqlen_q, device=device)[None, :]
    allowed = (key_positions[None, None, :] <= query_positions[:, :, None]) & key_valid[:, None, :]
    # Padded query rows would be fully masked (NaN after softmax); let them see key 0.
    allowed[:, :, 0] = True
    group = num_heads // num_kv_heads
    q = padded_q.permute(0, 2, 1, 3)  # [S, H, Q, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=allowed[:, None, :, :],
        scale=scale,
        enable_gqa=group > 1,
    )  # [S, H, Q, D]
    out = out.permute(0, 2, 1, 3)
    if token_seq is None:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out[token_seq, token_offset]
