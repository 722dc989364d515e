"""One step's verification of proposed tokens: each sequence's k + 1 rows of target logits
become the tokens it emits (rejection_sampler.py), with the same processing the sampler applies
to a plain decode row: the logit bias, temperature, top-k / top-p / min-p. Logprobs, when the
request asks for them, are the raw rows' (before that processing), as layers/sampler.py reports.

Only sequences whose rows are the same function of the logits at every position are proposed
for (engine: LLMEngine._propose): no penalties, no min_tokens still to reach; a constrained
sequence's rows each get its grammar's bitmask for that position (grammar.py). So a greedy
sequence's tokens are exactly a plain decode's.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from nanoserve.engine.sequence import Sequence
from nanoserve.kernels import apply_token_bitmask
from nanoserve.layers.sampler import apply_top_k_top_p_min_p, gather_logprobs
from nanoserve.spec_decode.rejection_sampler import SpecSequence, rejection_sample

# Per emitted token: (token id, (rank, [id, top ids...], [logprobs]) or None).
Emitted = list[tuple[int, tuple[int, list[int], list[float]] | None]]


def _filters(seq: Sequence, rows: int, device: torch.device) -> SimpleNamespace:
    """The sampler's per-row filter settings for `rows` rows of one sequence."""
    params = seq.params

    def column(value, dtype, off):
        return None if value == off else torch.full((rows,), value, dtype=dtype, device=device)
    return SimpleNamespace(top_k=column(params.top_k or 0, torch.long, 0),
                           top_p=column(params.top_p, torch.float32, 1.0),
                           min_p=column(params.min_p, torch.float32, 0.0))


def target_probs(rows: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Processed rows: for greedy sequences the biased logits (only their argmax is read), else
    the probabilities the sampler would draw from."""
    params = seq.params
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=rows.device)
        values = torch.tensor(list(params.logit_bias.values()), dtype=rows.dtype, device=rows.device)
        rows = rows.index_add(1, ids, values.expand(rows.shape[0], -1))
    if params.temperature == 0:
        return rows
    filtered = apply_top_k_top_p_min_p(rows / params.temperature, _filters(seq, rows.shape[0], rows.device))
    return filtered.softmax(dim=-1)


def _draft_rows(seq: Sequence) -> torch.Tensor | None:
    """A draft model's q rows for the proposals kept by the scheduler (None: deterministic)."""
    probs = seq.spec_draft_probs
    if probs is None or seq.params.temperature == 0:
        return None
    return probs[:len(seq.spec_token_ids)].to(torch.float32)


def verify(logits: torch.Tensor, seqs: list[Sequence],
           default_generator: torch.Generator | None) -> list[Emitted]:
    """logits: [sum(k_i + 1), V], each sequence's rows in `seqs` order."""
    out: list[Emitted] = []
    row = 0
    for seq in seqs:
        count = len(seq.spec_token_ids) + 1
        rows = logits[row:row + count].float()
        row += count
        if seq.spec_bitmask is not None:  # a constrained sequence: each row under its grammar state
            apply_token_bitmask(rows, seq.spec_bitmask[:count].to(rows.device),
                                torch.arange(count, device=rows.device))
        spec = SpecSequence(list(seq.spec_token_ids), seq.params.temperature == 0, seq.generator)
        tokens = rejection_sample(target_probs(rows, seq), [spec], _draft_rows(seq), default_generator)[0]
        logprobs: list = [None] * len(tokens)
        if seq.params.logprobs is not None:
            emitted = torch.tensor(tokens, dtype=torch.long, device=rows.device)
            tensors = gather_logprobs(rows[:len(tokens)].log_softmax(dim=-1), emitted, seq.params.logprobs)
            logprobs = list(zip(tensors.ranks.tolist(), tensors.token_ids.tolist(), tensors.logprobs.tolist()))
        out.append(list(zip(tokens, logprobs)))
    return out
