"""Per-request sampling settings, with vLLM's names and defaults. Bad values raise ValueError
naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the remaining context
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    best_of: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            fail("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            fail("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            fail("prompt_logprobs", "must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not -100.0 <= float(bias) <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> "SamplingParams":
        from dataclasses import replace

        return replace(self)
