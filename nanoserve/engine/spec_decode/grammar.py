"""Structured outputs under speculation: a proposal is cut at the first token its sequence's
grammar refuses, and each verification row gets the bitmask of the grammar's state after the
proposals before it (the matcher is walked along the proposal and rolled back; the output
processor advances it for real when the tokens are appended). The target's rows are masked as a
plain constrained decode's would be, so greedy output is the same and sampling keeps the
constrained distribution: n-gram proposals are deterministic (cutting one changes nothing drawn),
and a draft model draws from its own distribution under the same masks (draft.py)."""

from __future__ import annotations

import torch

from nanoserve.engine.sequence import Sequence


def bitmask_rows(rows: int, vocab_size: int) -> torch.Tensor:
    """`rows` all-allowed rows of a token bitmask (int32, 32 tokens a word)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def constrain_proposal(seq: Sequence, vocab_size: int) -> None:
    """Cut `seq.proposal.token_ids` where its grammar refuses a token, or after the token that
    completes it, and set `seq.proposal.bitmask` (one row per verification row)."""
    matcher = seq.grammar.matcher
    drafts = seq.proposal.token_ids
    masks = bitmask_rows(len(drafts) + 1, vocab_size)
    matcher.fill_next_token_bitmask(masks, 0)
    kept = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        kept += 1
        if not matcher.is_terminated():  # (a terminated grammar's next row is never appended)
            matcher.fill_next_token_bitmask(masks, kept)
    if kept:
        matcher.rollback(kept)
    del drafts[kept:]
    seq.proposal.bitmask = masks[: kept + 1]
