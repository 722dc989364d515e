"""Shared helpers for the kernel tests: device, dtypes, tolerances, paged batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# bf16 arithmetic is not trustworthy in the interpreter: bf16 only on a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# (atol, rtol) for outputs of magnitude ~1 after one rounding to the dtype plus fp32 reordering.
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# Attention rounds the probabilities to the input dtype before P @ V.
ATTENTION_TOL = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict) -> None:
    atol, rtol = tol[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    max_seqlen_q: int
    max_seqlen_k: int

    def args(self):
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.cu_seqlens_q,
            self.seq_lens,
            self.scale,
            self.max_seqlen_q,
            self.max_seqlen_k,
        )


def make_paged_batch(
    q_lens,
    context_lens,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    seed=0,
    spare_blocks=2,
    device=DEVICE,
) -> PagedBatch:
    """Sequence i has context_lens[i] cached tokens followed by q_lens[i] new ones (all already
    in the cache). Blocks are handed out in a shuffled order; every slot that no sequence
    owns, and the spare block that pads the block table rows, holds NaN."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, context_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()
    pad_block = order.pop()  # never written: padding entries of the table point at NaN
    width = max(1, max(blocks_per_seq))
    block_table = torch.full((len(seq_lens), width), pad_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for seq, seq_len in enumerate(seq_lens):
        for index in range(blocks_per_seq[seq]):
            block = order.pop()
            block_table[seq, index] = block
            rows = min(block_size, seq_len - index * block_size)
            key_cache[block, :rows] = torch.randn(
                rows, num_kv_heads, head_dim, generator=generator
            ).to(dtype)
            value_cache[block, :rows] = torch.randn(
                rows, num_kv_heads, head_dim, generator=generator
            ).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return PagedBatch(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_table=block_table.to(device),
        cu_seqlens_q=cu_seqlens_q.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
    )


def naive_paged_attention(
    batch: PagedBatch,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row, one head at a time, in float64: the definition the kernels implement
    (a window W: keys position - W + 1..position; a softcap c: scores c * tanh(scores / c);
    sinks s [heads]: weights exp(score) / (sum exp(scores) + exp(s[head])), gpt-oss's)."""
    query = batch.query.cpu().double()
    key_cache = batch.key_cache.cpu().double()
    value_cache = batch.value_cache.cpu().double()
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    cu = batch.cu_seqlens_q.tolist()
    out = torch.zeros_like(query)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_table[seq].tolist()
        q_len = cu[seq + 1] - cu[seq]
        for j in range(q_len):
            position = seq_len - q_len + j
            first = max(0, position - sliding_window + 1) if sliding_window else 0
            keys = torch.stack(
                [
                    key_cache[table[p // block_size], p % block_size]
                    for p in range(first, position + 1)
                ]
            )  # [P, KVH, D]
            values = torch.stack(
                [
                    value_cache[table[p // block_size], p % block_size]
                    for p in range(first, position + 1)
                ]
            )
            for head in range(query.shape[1]):
                q = query[cu[seq] + j, head]
                scores = keys[:, head // group] @ q * batch.scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is None:
                    weights = torch.softmax(scores, dim=0)
                else:
                    exps = torch.exp(scores)
                    weights = exps / (exps.sum() + torch.exp(sinks[head].double().cpu()))
                out[cu[seq] + j, head] = weights @ values[:, head // group]
    return out
