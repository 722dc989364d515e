"""Prompts as the engine takes them, with vLLM's names: `TextPrompt` (text the engine tokenizes)
and `TokensPrompt` (token ids, with the text they came from when it is known, for echo and logs).
`LLM.generate` also takes what vLLM users pass: a string, a list of token ids, or a dict
`{"prompt": ...}` / `{"prompt_token_ids": [...]}`; `parse_prompt` turns each into one of the two."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import InvalidRequestError


@dataclass(slots=True)
class TextPrompt:
    prompt: str


@dataclass(slots=True)
class TokensPrompt:
    prompt_token_ids: list[int]
    prompt: str | None = None  # the text the ids came from, when known


PromptType = str | list[int] | dict | TextPrompt | TokensPrompt


def parse_prompt(prompt: Any) -> TextPrompt | TokensPrompt:
    if isinstance(prompt, (TextPrompt, TokensPrompt)):
        return prompt
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return TokensPrompt(list(prompt["prompt_token_ids"]), prompt.get("prompt"))
        if "prompt" in prompt:
            return TextPrompt(prompt["prompt"])
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return TokensPrompt(list(prompt))
    raise InvalidRequestError(
        "a prompt is a string, a list of token ids, {'prompt_token_ids': "
        "[...]}, a TextPrompt or a TokensPrompt"
    )
