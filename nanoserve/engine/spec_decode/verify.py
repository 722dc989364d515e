"""One step's verification of proposed tokens: each sequence's k + 1 rows of target logits
become the tokens it emits (rejection_sampler.py), with the processing the sampler gives a plain
decode row (its own functions, on a batch with one row per verification row): the logit bias,
temperature, top-k / top-p / min-p. Logprobs, when the request asks for them, are the raw rows'
(before that processing), as layers/sampler.py reports.

Only sequences whose rows are the same function of the logits at every position are proposed
for (engine: LLMEngine._propose): no penalties, no min_tokens still to reach; a constrained
sequence's rows each get its grammar's bitmask for that position (grammar.py). So a greedy
sequence's tokens are exactly a plain decode's.
"""

from __future__ import annotations

import torch

from nanoserve.engine.spec_decode.rejection_sampler import SpecSequence, rejection_sample
from nanoserve.engine.step_input import SeqInput
from nanoserve.kernels import apply_token_bitmask
from nanoserve.layers.sampler import (
    SamplingBatch,
    gather_logprobs,
    processed_logits,
    sampling_probs,
)

# Per emitted token: (token id, (rank, [id, top ids...], [logprobs]) or None).
Emitted = list[tuple[int, tuple[int, list[int], list[float]] | None]]


def apply_bitmasks(logits: torch.Tensor, inputs: list[SeqInput], counts: list[int]) -> None:
    """In place: each constrained sequence's rows (counts[i] of them, in order) under its
    grammar's per-position bitmask."""
    row = 0
    for item, count in zip(inputs, counts):
        if item.bitmask is not None:
            apply_token_bitmask(
                logits,
                item.bitmask[:count].to(logits.device),
                torch.arange(row, row + count, device=logits.device),
            )
        row += count


def _draft_rows(item: SeqInput) -> torch.Tensor | None:
    """A draft model's q rows for the proposals kept by the scheduler (None: deterministic)."""
    probs = item.draft_probs
    if probs is None or item.sampling.params.temperature == 0:
        return None
    return probs[: len(item.proposal)].to(torch.float32)


def verify(logits: torch.Tensor, inputs: list[SeqInput], batch: SamplingBatch) -> list[Emitted]:
    """logits: [sum(k_i + 1), V], each sequence's rows in `inputs` order; `batch`: the sampler's
    batch over the same rows (each sequence once per row), whose processing (layers/sampler.py's
    processed_logits, sampling_probs) the rows get, as a plain decode row would."""
    counts = [len(item.proposal) + 1 for item in inputs]
    logits = logits.float()
    apply_bitmasks(logits, inputs, counts)
    raw = logits.log_softmax(dim=-1) if batch.max_logprobs >= 0 else None
    processed = processed_logits(logits, batch)
    probs = processed if batch.all_greedy else sampling_probs(processed, batch)
    out: list[Emitted] = []
    row = 0
    for item, count in zip(inputs, counts):
        params = item.sampling.params
        greedy = params.temperature == 0
        target = (processed if greedy else probs)[
            row : row + count
        ]  # greedy: only the argmax is read
        spec = SpecSequence(list(item.proposal), greedy, item.sampling.generator)
        tokens = rejection_sample(target, [spec], _draft_rows(item), batch.default_generator)[0]
        logprobs: list = [None] * len(tokens)
        if params.logprobs is not None:
            emitted = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            tensors = gather_logprobs(raw[row : row + len(tokens)], emitted, params.logprobs)
            logprobs = list(
                zip(tensors.ranks.tolist(), tensors.token_ids.tolist(), tensors.logprobs.tolist())
            )
        out.append(list(zip(tokens, logprobs)))
        row += count
    return out
