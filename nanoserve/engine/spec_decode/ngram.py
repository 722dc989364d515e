"""Prompt-lookup (n-gram) proposals: the tokens that followed the last place this sequence's
latest n tokens occurred before.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the sequence's last n tokens (prompt
and output together) are looked for earlier in the same sequence; at the most recent earlier
occurrence of the longest n that matches, the up to `num_speculative_tokens` tokens that followed
it are the proposal. No match: no proposal, and the step decodes that sequence as usual (so
speculation costs nothing where there is nothing to look up).

The search is one vectorised comparison per n over the sequence's tokens (numpy), about 10 us for
an 8k-token sequence; vLLM does the same with a compiled KMP scan.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode.grammar import constrain_proposal


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}"
            )
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(
        self, token_ids: np.ndarray | list[int], max_tokens: int | None = None
    ) -> list[int]:
        """Up to min(k, max_tokens) proposed next tokens for a sequence whose tokens so far are
        `token_ids`; [] when its last `prompt_lookup_min` tokens occur nowhere before."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if limit <= 0 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start at 0 .. length - n - 1: every earlier occurrence, not the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the token after the most recent earlier occurrence
                return tokens[start : start + limit].tolist()
        return []

    def propose_for(
        self, wanted: list[tuple[Sequence, int]], batch_for=None, vocab_size: int = 0
    ) -> None:
        """The engine's call, as DraftProposer's: each sequence's proposal (at most its limit),
        cut where a constrained sequence's grammar refuses it (engine/spec_decode/grammar.py)."""
        for seq, limit in wanted:
            seq.proposal.token_ids = self.propose(seq.token_ids, limit)
            if seq.grammar is not None and seq.proposal.token_ids:
                constrain_proposal(seq, vocab_size)

    def drop(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""
