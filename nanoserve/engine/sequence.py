"""One generated sequence (a request with n > 1 owns n of them) as the scheduler sees it: its
tokens, KV blocks, status, priority, adapter and pipeline stage, and its speculative Proposal.
What goes back to the client (detokenizer, text, logprobs, what was sent) is the output
processor's OutputState (engine/output_state.py); tests/engine/test_state_writers.py lists which
module may change which field."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nanoserve.engine.structured_output import SequenceGrammar
from nanoserve.multimodal.inputs import PromptImage
from nanoserve.outputs import Logprob
from nanoserve.pooling import PoolingState
from nanoserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swapping: its KV blocks wait in the host pool
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Proposal:
    """Speculative decoding: the tokens proposed for one sequence's next step, made by one
    proposer (spec_decode/ngram.py or draft.py) and read by the verification."""

    token_ids: list[int] = field(default_factory=list)
    # A draft model's distributions for those tokens ([k, V], sampled requests only; None: the
    # proposal is deterministic, n-gram lookup or a greedy draft).
    draft_probs: torch.Tensor | None = None
    # A constrained sequence's verification rows' token bitmasks ([k + 1, words] int32; None:
    # unconstrained), from its grammar walked along the proposal (spec_decode/grammar.py).
    bitmask: torch.Tensor | None = None


@dataclass(eq=False, slots=True)  # slots: a field nobody declared cannot be set in passing
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    priority: int
    arrival_order: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # --async-scheduling: tokens sampled by steps launched but not yet collected (at most 2: the
    # step in flight and the one just launched). The scheduler counts them as the sequence's;
    # the next step's input refers to them on the device (engine/async_scheduling.py).
    num_output_placeholders: int = 0
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # while swapped out
    num_hashed_blocks: int = 0  # leading full blocks registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    generator: torch.Generator | None = None
    # Prompt logprobs collected so far (position 0 is None, as vLLM); None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    virtual_engine: int = 0  # which scheduler holds it (pipeline parallelism; else 0)
    lora_id: int = 0  # the LoRA adapter it runs with (its LoRARequest's lora_int_id; 0: none)
    # Speculative decoding: what is proposed for this step (verified with the last token, then
    # cleared); no tokens when the step decodes it as usual.
    proposal: Proposal = field(default_factory=Proposal)
    # Pooling models: the embedding being pooled from its prompt's hidden states, chunk by chunk.
    pooling: PoolingState | None = None
    # Encoder models: each prompt token's type id (a pair's second text is 1); None: all 0.
    token_type_ids: list[int] | None = None
    # Structured outputs: this sequence's grammar matcher (engine/structured_output.py).
    grammar: SequenceGrammar | None = None
    # Vision-language models: its prompt's images, in prompt order (kept through preemption).
    images: tuple[PromptImage, ...] = ()

    def clear_proposal(self) -> None:
        """Speculative decoding: no proposal (before a step proposes, after it verified)."""
        self.proposal = Proposal()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions still lack their logprobs: this sequence's prompt rows must be
        computed (not taken from the prefix cache) and their logits kept."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def is_schedulable(self) -> bool:
        """False while its grammar is still compiling: it waits in the queue, others go first.
        (And, never seen in practice, while a preempted sequence's last token is still coming:
        with --async-scheduling it is collected before the next schedule.)"""
        return (self.grammar is None or self.grammar.is_ready) and not self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
