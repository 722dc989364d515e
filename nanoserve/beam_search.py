"""Beam search over the engine (vLLM's `LLM.beam_search` / `use_beam_search`), with the
arithmetic of Hugging Face transformers' `generate(num_beams=...)` so the two give the same
beams and scores.

Each step every running beam is one engine request for one token with the 2W (W = beam width;
more with several EOS ids) best next-token logprobs; the prefix cache shares the beams' common
blocks (the prompt's, and each parent's), so a step computes only each beam's last partial block
and new token. Of all (beam, token) continuations the K best by cumulative logprob are kept (K =
max(2, 1 + number of EOS ids) x W, as transformers); among them, those ending in EOS within the
first W, and all of the first W at the length limit, become finished hypotheses scored
cumulative logprob / generated_length ** length_penalty (the W best finished are kept); the W
best that did not finish run on. The search stops at max_tokens, or earlier once W hypotheses are
finished and the best running beam, at its current length, can no longer beat the worst of them
(transformers' default `early_stopping=False` heuristic).

`BeamSearch` is the state machine: `pending()` lists the token sequences to extend, `advance()`
takes their next-token logprobs; `LLM.beam_search` and the server drive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEG_INF = float("-inf")


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's names."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError("beam search is deterministic: temperature must be 0")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones (vLLM's shape)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)  # each generated token's logprob
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None
    score: float = 0.0  # cum_logprob / generated_length ** length_penalty, for finished beams


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


class BeamSearch:
    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int]
    ):
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.keep = max(2, 1 + len(self.eos)) * params.beam_width
        self.running = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    @property
    def num_logprobs(self) -> int:
        """How many next-token logprobs each pending beam needs."""
        return self.keep

    def pending(self) -> list[list[int]]:
        return [] if self.done else [beam.tokens for beam in self.running]

    def _generated(self, beam: BeamSearchSequence) -> int:
        return len(beam.tokens) - self.prompt_len

    def advance(self, next_logprobs: list[dict[int, float]]) -> None:
        """`next_logprobs[i]`: token id -> logprob for the i-th pending beam's next token (at
        least its `num_logprobs` best)."""
        width = self.params.beam_width
        candidates = [
            (beam.cum_logprob + logprob, index, token)
            for index, (beam, options) in enumerate(zip(self.running, next_logprobs))
            for token, logprob in options.items()
        ]
        # Best first; equal sums keep the lower (beam, token) first, as a flat topk scan would.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: self.keep]
        length = self._generated(self.running[0]) + 1
        at_limit = length >= self.params.max_tokens
        new_running = []
        for rank, (cum, index, token) in enumerate(candidates):
            parent = self.running[index]
            logprob = next_logprobs[index][token]
            child = BeamSearchSequence(parent.tokens + [token], parent.logprobs + [logprob], cum)
            ends = token in self.eos or at_limit
            if ends:
                if rank < width and self.improvable:
                    child.finish_reason = "stop" if token in self.eos else "length"
                    child.stop_reason = token if token in self.eos else None
                    child.score = cum / (length**self.params.length_penalty)
                    self.finished.append(child)
            elif len(new_running) < width:
                new_running.append(child)
        self.finished.sort(key=lambda beam: -beam.score)
        del self.finished[width:]
        self.running = new_running
        self._check_stop(length, at_limit)

    def _check_stop(self, length: int, at_limit: bool) -> None:
        width = self.params.beam_width
        if self.improvable and len(self.finished) >= width and self.running:
            best_possible = self.running[0].cum_logprob / (length**self.params.length_penalty)
            self.improvable = best_possible > self.finished[-1].score
        self.done = at_limit or not self.running or not self.improvable

    def output(self) -> BeamSearchOutput:
        return BeamSearchOutput(list(self.finished))
