"""Rejection sampling for speculative decoding: which proposed tokens a sequence keeps, and the
one token the target model adds after them, such that the emitted tokens follow the target
model's distribution exactly (Leviathan et al. 2023, Chen et al. 2023; vLLM's RejectionSampler).

A sequence with k proposed tokens d_1..d_k has k + 1 rows of target probabilities: row j is the
target's distribution for the token after d_1..d_j (row 0: after the tokens before the proposal).
Proposal j + 1 is kept with probability min(1, p_j(d) / q_j(d)), q being the proposer's
distribution (one-hot for n-gram lookup and greedy drafts: kept with probability p_j(d)). At the
first rejection the sequence instead gets a token drawn from max(p_j - q_j, 0), renormalised, and
stops; when every proposal is kept, it gets a bonus token drawn from row k. Greedy sequences keep
proposals while they equal the target's argmax and then take the argmax.

Random draws come from the sequence's own generator when it has a seed (so its tokens do not
depend on its neighbours in the batch), else from the shared one; a categorical draw is the same
exponential race as layers/sampler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SpecSequence:
    """One sequence's share of a verification step."""

    draft_token_ids: list[int]  # the k proposed tokens (k may be 0: a plain decode row)
    greedy: bool
    generator: torch.Generator | None = None


def _categorical(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def _greedy(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    best = rows.argmax(dim=-1).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == best[kept]:
        kept += 1
    return drafts[:kept] + [best[kept]]


def _sampled(
    rows: torch.Tensor,
    drafts: list[int],
    draft_rows: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    for j, token in enumerate(drafts):
        p = float(rows[j, token])
        q = 1.0 if draft_rows is None else float(draft_rows[j, token])
        if q > 0 and _uniform(generator, rows.device) * q < p:  # u < p / q without dividing
            continue
        if draft_rows is None:
            residual = rows[j].clone()
            residual[token] = 0
        else:
            residual = (rows[j] - draft_rows[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: nothing left to correct towards
            residual = rows[j]
        return drafts[:j] + [_categorical(residual, generator)]
    return drafts + [_categorical(rows[len(drafts)], generator)]


def rejection_sample(
    target_probs: torch.Tensor,
    sequences: list[SpecSequence],
    draft_probs: torch.Tensor | None = None,
    default_generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The tokens each sequence emits this step: its kept proposals, then one more.

    target_probs: [sum(k_i + 1), V] float32, each sequence's k_i + 1 rows in order (for greedy
    sequences any monotone transform of the logits will do: only the argmax is read).
    draft_probs: [sum(k_i), V] the proposer's distributions, or None when proposals are
    deterministic (n-gram lookup)."""
    out, row, draft_row = [], 0, 0
    for seq in sequences:
        k = len(seq.draft_token_ids)
        rows = target_probs[row : row + k + 1]
        if seq.greedy:
            out.append(_greedy(rows, seq.draft_token_ids))
        else:
            drafts = None if draft_probs is None else draft_probs[draft_row : draft_row + k]
            out.append(
                _sampled(rows, seq.draft_token_ids, drafts, seq.generator or default_generator)
            )
        row += k + 1
        draft_row += k
    if row != target_probs.shape[0]:
        raise ValueError(f"{target_probs.shape[0]} target rows for sequences that need {row}")
    return out
