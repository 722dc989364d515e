"""Batched sampling: penalties, temperature, top-k / top-p / min-p, then one draw per row.

Randomness is an exponential race (argmax of p / E with E ~ Exp(1)), which equals sampling
from p. Each seeded request draws its noise from its own generator, so its tokens do not depend
on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kernels import apply_token_bitmask, greedy_argmax


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32; 0 = greedy
    top_p: torch.Tensor | None  # [S] or None when unused by every row
    top_k: torch.Tensor | None  # [S] int64, 0 = off
    min_p: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [S, V] counts of generated tokens
    prompt_mask: torch.Tensor | None  # [S, V] bool: token occurs in the prompt
    logit_bias: torch.Tensor | None  # [S, V] additive, includes -inf masks (min_tokens)
    generators: list[torch.Generator | None]  # per-request seeded generators
    default_generator: torch.Generator | None
    all_greedy: bool
    max_logprobs: int  # -1: none requested; 0: the sampled token's only; k: plus the top k
    # Structured outputs: [C, ceil(V / 32)] int32 allowed-token bits for the C constrained rows,
    # and [C] which rows they are. None when no row is constrained.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing else asked for: once any bitmask is applied, the tokens are the
        logits' argmax."""
        return (
            self.all_greedy
            and self.max_logprobs < 0
            and self.logit_bias is None
            and self.repetition_penalty is None
            and self.frequency_penalty is None
            and self.presence_penalty is None
        )

    @property
    def plain_greedy(self) -> bool:
        """The tokens are the logits' argmax and nothing else is asked for (pipeline parallelism
        then takes the argmax on the last stage and sends only the token ids). A structured-
        output bitmask lives on rank 0, so its batches send their logits."""
        return self.argmax_only and self.token_bitmask is None


@dataclass(slots=True)
class LogprobsTensors:
    """Per row: a given token's logprob and rank, then the k most likely tokens."""

    logprobs: torch.Tensor  # [R, 1 + k] the given token's logprob, then the top k
    token_ids: torch.Tensor  # [R, 1 + k]
    ranks: torch.Tensor  # [R] rank of the given token (1 = best)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None  # [S, 1 + k] logprob of the sampled token, then the top k
    logprob_token_ids: torch.Tensor | None  # [S, 1 + k]
    ranks: torch.Tensor | None  # [S] rank of the sampled token (1 = best)
    # Logprobs of prompt tokens, for the sequences that asked (ModelInput.prompt_logprob_seqs).
    prompt_logprobs: LogprobsTensors | None = None
    # Speculative decoding, per verified sequence (ModelInput.spec_seqs): the tokens it emits
    # (its kept proposals, then one more), each with its logprob row when the request asked.
    spec: list | None = None


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """`token_ids[row]`'s logprob and rank in each row of `logprobs`, then the `num_top` best."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top <= 0:
        return LogprobsTensors(chosen, token_ids[:, None], ranks)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        torch.cat([chosen, top_values], dim=1),
        torch.cat([token_ids[:, None], top_ids], dim=1),
        ranks,
    )


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (batch.output_counts > 0)
        penalty = batch.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (batch.output_counts > 0).to(
            logits.dtype
        )
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp(max=vocab)
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if batch.top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= batch.top_p[:, None]
    remove[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 logits with the batch's logit biases (min_tokens masks included) and penalties:
    what greedy rows take the argmax of."""
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    return apply_penalties(logits, batch)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution sampled rows draw from: processed logits over the temperature, then
    top-k / top-p / min-p."""
    temperature = batch.temperature.clamp(min=1e-6)[:, None]
    return apply_top_k_top_p_min_p(logits / temperature, batch).softmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """`logits` are the step's own: a constrained row's forbidden tokens are set to -inf in
    place before anything else (as vLLM, logprobs then see the constrained distribution)."""
    if batch.token_bitmask is not None:
        apply_token_bitmask(logits, batch.token_bitmask, batch.bitmask_rows)
    if batch.argmax_only:
        return SamplerOutput(greedy_argmax(logits), None, None, None)
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs >= 0 else None
    logits = processed_logits(logits, batch)
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        probs = sampling_probs(logits, batch)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if len(unseeded) == len(batch.generators):
            # The same draws as below, without indexing by a host list: on CUDA that copy of
            # the indices would wait for the queued forward pass (--async-scheduling's overlap).
            noise.exponential_(generator=batch.default_generator)
        elif unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_(generator=batch.default_generator)
        for i, generator in enumerate(batch.generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(batch.temperature == 0, greedy_tokens, sampled)
    out = SamplerOutput(tokens, None, None, None)
    if batch.max_logprobs >= 0:
        gathered = gather_logprobs(raw_logprobs, tokens, batch.max_logprobs)
        out.logprobs, out.logprob_token_ids, out.ranks = (
            gathered.logprobs,
            gathered.token_ids,
            gathered.ranks,
        )
    return out
