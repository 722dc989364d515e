"""What one step is given about each sequence it runs: a frozen SeqInput (its tokens, positions,
blocks, adapter, proposal, prompt-logprob targets) holding a SamplingInput (what the sampler's
processing of its rows reads). The scheduler's side builds them from its live Sequences
(engine/seq_inputs.py); the model runner, the sampler's batch and the verification read only
these, and what a step produced goes back to the sequences through the engine core, by seq_id.
So nothing below the engine core can change a sequence's state (tests/engine/test_state_writers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.engine.structured_output import SequenceGrammar
from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True, eq=False)
class ImageSlice:
    """Rows of one image's embeddings a step places: its embedding rows from `offset` on, `count`
    of them, at the sequence's rows from `row` on (a chunk of the prompt may cut the image)."""

    image_hash: str  # the encoder cache's key
    pixel_values: torch.Tensor  # encoded when the cache lacks the image ([3, H, W]; Qwen: rows)
    row: int  # among the SeqInput's token_ids
    offset: int
    count: int
    grid_thw: tuple[int, int, int] | None = None  # Qwen2.5-VL: the image's grid in patches


# frozen: nothing that reads one can change it; eq=False: compared by identity (tensors inside).
@dataclass(frozen=True, slots=True, eq=False)
class SamplingInput:
    """One sequence's sampling: its parameters and what its penalties and min_tokens count."""

    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own; None: the engine's
    num_output_tokens: int  # generated so far (min_tokens holds stop and EOS tokens back)
    # Penalties (presence, frequency, repetition) only: its generated tokens and its prompt's;
    # empty for a sequence whose parameters apply none (its counts then change nothing).
    output_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    # Structured outputs: the matcher that fills its row's token bitmask (None: unconstrained).
    grammar: SequenceGrammar | None = None


# --async-scheduling: in a SeqInput's token_ids, the token its sequence sampled in the step
# before, not yet known on the host; the model runner takes it from that step's sampled tokens
# on the device (PreviousTokens), as SGLang resolves its future token ids.
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True, slots=True, eq=False)
class PreviousTokens:
    """The tokens the step before sampled, still on the device ([S] int64), and each sampling
    sequence's row among them, by seq_id."""

    token_ids: torch.Tensor
    row_of: dict[int, int]


@dataclass(frozen=True, slots=True, eq=False)
class SeqInput:
    """One scheduled sequence's part of a step."""

    seq_id: int
    # The tokens this step computes, from position `start` on (a verification: its last token
    # then the proposed ones).
    token_ids: tuple[int, ...]
    start: int  # tokens whose K/V are in the cache already
    block_table: tuple[int, ...]  # its blocks in its scheduler's share of the pool
    lora_id: int  # its adapter (0: the base model)
    is_decode: bool  # one generated token (prompt rows never count as one)
    completes_prompt: bool  # it has computed every token it holds after this step: it samples
    sampling: SamplingInput
    # Speculative decoding: the proposed tokens (empty: no verification this step), a draft
    # model's distributions for them ([k, V]; None: deterministic) and a constrained sequence's
    # verification rows' bitmasks ([k + 1, words]; None: unconstrained).
    proposal: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None
    # Prompt logprobs: its rows from `start + prompt_logprob_offset` on score the next prompt
    # token, one target each (empty: none to score this step).
    prompt_logprob_offset: int = 0
    prompt_logprob_targets: tuple[int, ...] = ()
    # Encoder models: the token type of each of token_ids (a cross-encoder's pair; empty: all 0).
    token_type_ids: tuple[int, ...] = ()
    # Vision-language models: the images whose tokens are among token_ids (empty: none).
    images: tuple[ImageSlice, ...] = ()
    # M-RoPE (Qwen2.5-VL, multimodal/mrope.py): rows that hold image tokens get their
    # (temporal, height, width) positions [3, num_new_tokens]; the others' rotary position is
    # their position plus position_shift (how much earlier the images before them put them).
    position_shift: int = 0
    mrope_positions: torch.Tensor | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)
