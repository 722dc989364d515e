"""What the engine returns per step, with vLLM's names."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names). CUMULATIVE: everything so far,
    every step. DELTA: only what is new since the previous output (the server's streams;
    stop-string hold-back applied, so no text that a stop string may still take back goes
    out). FINAL_ONLY: one cumulative output, when the request finishes (`LLM.generate`)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""  # cumulative, or new since the last output (DELTA)
    token_ids: list[int] = field(default_factory=list)  # likewise
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append a later delta of the same output."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Tokens generated so far: all n outputs together, and the longest one (whatever the
    # output kind: a DELTA output's token_ids hold only the new ones).
    num_generation_tokens: int = 0
    max_num_generation_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # One entry per prompt token (the first is None) once the prompt is scored; None when the
    # request did not ask for prompt_logprobs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: object | None = None  # the LoRARequest it ran with (nanoserve.lora), if any

    def add(self, delta: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one (vLLM's
        `RequestOutput.add`): a reader that fell behind, or one that wants the whole answer,
        sees the deltas so far as one. A delta names only the outputs that changed."""
        by_index = {output.index: output for output in self.outputs}
        for output in delta.outputs:
            known = by_index.get(output.index)
            if known is None:
                by_index[output.index] = output
            else:
                known.add(output)
        if len(by_index) != len(self.outputs):
            self.outputs = sorted(by_index.values(), key=lambda output: output.index)
        self.finished = delta.finished
        self.metrics = delta.metrics or self.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result (vLLM's): `data` is the embedding (task embed), the class
    probabilities (classify) or `[score]` (score), as float32 values in a list."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def hidden_size(self) -> int:
        return len(self.data)


# vLLM's name for an embedding's output: the same object (`.embedding` is `.data`).
EmbeddingOutput = PoolingOutput


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's: a sequence classifier's class probabilities (logits with activation=False)."""

    probs: list[float]

    @property
    def data(self) -> list[float]:
        return self.probs

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's: one (text_1, text_2) pair's score."""

    score: float

    @property
    def data(self) -> list[float]:
        return [self.score]


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling request's one (final) output from the engine (vLLM's PoolingRequestOutput):
    `outputs.data` holds the result whatever the task. `embedding` is `outputs.data`, kept for
    the readers of the engine's earlier output."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    @property
    def embedding(self) -> list[float]:
        return self.outputs.data


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's: what LLM.embed returns per prompt."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ClassificationRequestOutput:
    """vLLM's: what LLM.classify returns per prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringRequestOutput:
    """vLLM's: what LLM.score returns per (text_1, text_2) pair."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


# What LLMEngine.step returns per request: a generating request's output, or a pooling
# request's final one.
StepOutput = RequestOutput | PoolingRequestOutput
