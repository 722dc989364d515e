"""Prompts as the engine takes them, with vLLM's names: `TextPrompt` (text the engine tokenizes)
and `TokensPrompt` (token ids, with the text they came from when it is known, for echo and logs).
`LLM.generate` also takes what vLLM users pass: a string, a list of token ids, or a dict
`{"prompt": ...}` / `{"prompt_token_ids": [...]}`; `parse_prompt` turns each into one of the two.

A cross-encoder scores a pair of texts as one prompt: `TextPairPrompt(text, text_pair)` (or the
dict `{"text": a, "text_pair": b}`), which the model's tokenizer encodes as a pair, as
transformers' `tokenizer(a, b)` does: `[CLS] a [SEP] b [SEP]` with token type ids 0 then 1
(BERT), `<s> a </s></s> b </s>` (XLM-RoBERTa). A caller that tokenized the pair itself passes a
TokensPrompt with its `token_type_ids`.

A vision-language model's prompt carries its images as vLLM's offline API does:
`{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": image}}`
(a PIL image or a list of them, one per image placeholder, in order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import InvalidRequestError


@dataclass(slots=True)
class TextPrompt:
    prompt: str
    multi_modal_data: dict | None = None  # {"image": PIL image or list of them}


@dataclass(slots=True)
class TokensPrompt:
    prompt_token_ids: list[int]
    prompt: str | None = None  # the text the ids came from, when known
    # Encoder models: each token's segment (0 first text, 1 the pair's second); None: all 0.
    token_type_ids: list[int] | None = None
    multi_modal_data: dict | None = None  # {"image": PIL image or list of them}


@dataclass(slots=True)
class TextPairPrompt:
    """A (query, document) pair for a cross-encoder, tokenized together as one prompt."""

    text: str
    text_pair: str


PromptType = str | list[int] | dict | TextPrompt | TokensPrompt | TextPairPrompt


def parse_prompt(prompt: Any) -> TextPrompt | TokensPrompt | TextPairPrompt:
    if isinstance(prompt, (TextPrompt, TokensPrompt, TextPairPrompt)):
        return prompt
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            types = prompt.get("token_type_ids")
            return TokensPrompt(
                list(prompt["prompt_token_ids"]),
                prompt.get("prompt"),
                list(types) if types is not None else None,
                prompt.get("multi_modal_data"),
            )
        if "text" in prompt and "text_pair" in prompt:
            return TextPairPrompt(str(prompt["text"]), str(prompt["text_pair"]))
        if "prompt" in prompt:
            return TextPrompt(prompt["prompt"], prompt.get("multi_modal_data"))
        raise InvalidRequestError(
            "a prompt dict needs 'prompt', 'prompt_token_ids', or 'text' and 'text_pair'"
        )
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return TokensPrompt(list(prompt))
    raise InvalidRequestError(
        "a prompt is a string, a list of token ids, {'prompt_token_ids': "
        "[...]}, a TextPrompt or a TokensPrompt"
    )
