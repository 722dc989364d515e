"""`--speculative-config` / `LLM(speculative_config=...)`, with vLLM's field names:
'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
or '{"model": "/path/to/draft", "num_speculative_tokens": 4}' (method "draft_model", implied by
"model").
As vLLM: when only one of prompt_lookup_min / _max is given the other takes its value, and with
neither both are 5. A field nanoserve does not know, or a method it does not serve, is a
ValueError naming it (the CLI prints it on one line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.json_flags import json_object_flag

METHODS = ("ngram", "draft_model")
FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    model: str | None = None  # draft_model: the draft's directory (same vocabulary as the target)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        if value is None:
            return None
        value = json_object_flag(value, "--speculative-config", FIELDS)
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in METHODS:
            raise ValueError(
                f"--speculative-config: method {method!r} is not supported (supported: "
                f"{list(METHODS)})"
            )
        if method == "draft_model" and not isinstance(value.get("model"), str):
            raise ValueError(
                '--speculative-config: method draft_model needs "model", the draft\'s directory'
            )
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(
                "--speculative-config: num_speculative_tokens must be an integer from 1 to 16"
            )
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (
            (5, 5)
            if low is None and high is None
            else (low if low is not None else high, high if high is not None else low)
        )
        for name, number in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer")
        if low > high:
            raise ValueError("--speculative-config: prompt_lookup_min must be <= prompt_lookup_max")
        return cls(method, k, low, high, value.get("model") if method == "draft_model" else None)
