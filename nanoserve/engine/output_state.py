"""What the output processor keeps for one sequence (vLLM v1's per-request output state): its
detokenizer, its text, its logprobs as they are collected, and how much of it already went out.
The scheduler never reads it; only engine/output_processor.py writes it."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.outputs import Logprob
from nanoserve.tokenizer import IncrementalDetokenizer


@dataclass(eq=False, slots=True)
class OutputState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # DELTA outputs: how much of the output already went out
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    finish_sent: bool = False
