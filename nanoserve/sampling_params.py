"""Per-request sampling settings, with vLLM's names and defaults. Bad values raise
InvalidRequestError (a ValueError) whose `param` names the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from nanoserve.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # counts and token ids: far above any real value, inside every index type

# The lists one request may carry. Each costs work per step (every stop string is searched for
# after each new token; the logit biases and stop ids are applied to every row of the request)
# or per compile (choices and schemas, on the one grammar thread), so their size is bounded,
# far above what a request needs (OpenAI allows 4 stop strings; vLLM's default is 4 too).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # OpenAI allows 300
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 256 * 1024  # a JSON schema's text, a regex, an EBNF grammar, the choices


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of a JSON schema (`json`, a dict or its
    text), any JSON object (`json_object=True`), a `regex`, one of the strings in `choice`, or
    an EBNF `grammar`. `field` names the request field it came from, for error messages."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        kinds = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"{self.field} must set exactly one of json, regex, choice, "
                f"grammar or json_object, got {kinds or 'none'}",
                self.field,
            )
        if isinstance(self.choice, (list, tuple)) and len(self.choice) > MAX_CHOICES:
            raise InvalidRequestError(
                f"{self.field} choice may hold at most {MAX_CHOICES} "
                f"strings, got {len(self.choice)}",
                self.field,
            )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or any(not isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError(
                f"{self.field} choice must be a non-empty list of strings", self.field
            )
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{self.field} {name} must be a string", self.field)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(
                f"{self.field} json must be a JSON schema (an object or its text)", self.field
            )
        size = len(self.key[1])
        if size > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"{self.field} is too large to compile: {size} characters "
                f"(at most {MAX_GRAMMAR_CHARS})",
                self.field,
            )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what compiles to the same grammar has the same key."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return ("json" if self.disable_any_whitespace else "json_any_whitespace", text)
        if self.json_object:
            return ("json_object", "")
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        if self.regex is not None:
            return ("regex", self.regex)
        return ("grammar", self.grammar)


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
    # Accepted as vLLM accepts it, and like vLLM with a fast (tokenizer.json) tokenizer, which is
    # the only kind nanoserve loads, it changes nothing: special tokens are decoded as the
    # tokenizer writes them, with no spaces added around them.
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_sizes()
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

    def _check_sizes(self) -> None:
        """The lists' sizes first: everything after walks them."""
        for name, limit, what in (
            ("stop", MAX_STOP_STRINGS, "strings"),
            ("stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids"),
            ("logit_bias", MAX_LOGIT_BIAS, "entries"),
        ):
            value = getattr(self, name)
            if isinstance(value, (list, tuple, dict)) and len(value) > limit:
                raise InvalidRequestError(
                    f"{name} may hold at most {limit} {what}, got {len(value)}", name
                )
        for stop in self.stop if isinstance(self.stop, (list, tuple)) else [self.stop]:
            if isinstance(stop, str) and len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings may be at most {MAX_STOP_STRING_CHARS} "
                    f"characters long, got one of {len(stop)}",
                    "stop",
                )

    def _validate(self) -> None:
        self._check_sizes()

        def fail(name: str, message: str) -> None:
            raise InvalidRequestError(f"{name} {message}, got {getattr(self, name)!r}", name)

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def check_int(name: str, low: int, high: int, message: str) -> None:
            value = getattr(self, name)
            if not is_int(value) or not low <= value <= high:
                fail(name, message)

        def check_float(name: str) -> float:
            value = getattr(self, name)
            if is_int(value):
                value = float(value)
            if not isinstance(value, float) or not math.isfinite(value):
                fail(name, "must be a finite number")
            return value

        check_int("n", 1, INT32_MAX, f"must be an integer in [1, {INT32_MAX}]")
        if check_float("temperature") < 0.0:
            fail("temperature", "must be >= 0")
        if not 0.0 < check_float("top_p") <= 1.0:
            fail("top_p", "must be in (0, 1]")
        check_int(
            "top_k", 0, INT32_MAX, f"must be -1 (off), 0 (off) or an integer in [1, {INT32_MAX}]"
        )
        if not 0.0 <= check_float("min_p") <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not -2.0 <= check_float("presence_penalty") <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= check_float("frequency_penalty") <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if check_float("repetition_penalty") <= 0.0:
            fail("repetition_penalty", "must be > 0")
        if self.max_tokens is not None:
            check_int("max_tokens", 1, INT32_MAX, f"must be an integer in [1, {INT32_MAX}]")
        check_int("min_tokens", 0, INT32_MAX, f"must be an integer in [0, {INT32_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        # Token ids are checked against the vocabulary by the engine, which knows its size.
        if any(not is_int(t) for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of integer token ids")
        # -1: the whole vocabulary (as vLLM); the engine resolves it and checks max_logprobs.
        if self.logprobs is not None:
            check_int("logprobs", -1, INT32_MAX, f"must be -1 or an integer in [0, {INT32_MAX}]")
        if self.prompt_logprobs is not None:
            check_int(
                "prompt_logprobs", -1, INT32_MAX, f"must be -1 or an integer in [0, {INT32_MAX}]"
            )
        if self.seed is not None:
            # Any signed 64-bit value seeds a generator (each of the n outputs adds its index).
            # The bound it broke is named as pydantic names it (vLLM's test_long_seed reads it).
            broken = (
                "greater_than_equal"
                if is_int(self.seed) and self.seed < INT64_MIN
                else "less_than_equal"
            )
            check_int(
                "seed",
                INT64_MIN,
                INT64_MAX,
                f"must be an integer in [{INT64_MIN}, {INT64_MAX}] (signed 64-bit; {broken})",
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            fail("structured_outputs", "must be a StructuredOutputsParams")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a mapping of token id to bias")
            for token, bias in self.logit_bias.items():
                if not is_int(token):
                    raise InvalidRequestError(
                        f"logit_bias keys must be integer token ids, got {token!r}", "logit_bias"
                    )
                if (
                    isinstance(bias, bool)
                    or not isinstance(bias, (int, float))
                    or not -100.0 <= bias <= 100.0
                ):
                    raise InvalidRequestError(
                        f"logit_bias values must be in [-100, 100], got {bias!r} for {token}",
                        "logit_bias",
                    )

    def clone(self) -> SamplingParams:
        from dataclasses import replace

        return replace(self)
