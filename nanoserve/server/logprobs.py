"""Logprobs in the shapes vLLM's OpenAI server writes: completions' parallel lists, chat's
per-token entries, and `prompt_logprobs` (one {token id: logprob} per prompt token)."""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.outputs import Logprob
from nanoserve.server.schemas import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

LOGPROB_FLOOR = -9999.0  # what OpenAI writes for -inf


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_string(token_id: int, logprob: Logprob | None, tokenizer, as_token_ids: bool) -> str:
    """A token as logprobs show it; "token_id:N" with return_tokens_as_token_ids."""
    if as_token_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    num_top: int,
    tokenizer,
    initial_offset: int = 0,
    as_token_ids: bool = False,
) -> CompletionLogProbs:
    """`entries[i]` belongs to `token_ids[i]` (None: no logprob, as the first prompt token).
    Each top_logprobs dict holds the token itself and then the `num_top` best (vLLM's order), so
    `logprobs: 0` still shows the chosen token; -1 shows every entry."""
    result = CompletionLogProbs([], [], [], [])
    offset = initial_offset
    for position, token_id in enumerate(token_ids):
        entry = entries[position] if position < len(entries) else None
        if entry is None:
            token = token_string(token_id, None, tokenizer, as_token_ids)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = entry.get(token_id)
            token = token_string(token_id, chosen, tokenizer, as_token_ids)
            result.token_logprobs.append(clamp(chosen.logprob) if chosen else LOGPROB_FLOOR)
            limit = len(entry) if num_top < 0 else num_top + 1
            top: dict[str, float] = {}
            for other_id, other in list(entry.items())[:limit]:
                top[token_string(other_id, other, tokenizer, as_token_ids)] = clamp(other.logprob)
            result.top_logprobs.append(top)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob]],
    num_top: int,
    tokenizer,
    as_token_ids: bool = False,
) -> ChatLogprobs:
    """One entry per token: its logprob and the `num_top` most likely tokens (-1: all)."""
    content = []
    for position, token_id in enumerate(token_ids):
        entry = entries[position] if position < len(entries) else {}
        chosen = entry.get(token_id)
        token = token_string(token_id, chosen, tokenizer, as_token_ids)
        ranked = sorted(
            entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0
        )
        top = []
        for other_id, other in ranked if num_top < 0 else ranked[:num_top]:
            text = token_string(other_id, other, tokenizer, as_token_ids)
            top.append(TopLogprob(text, clamp(other.logprob), list(text.encode("utf-8"))))
        value = clamp(chosen.logprob) if chosen else LOGPROB_FLOOR
        content.append(ChatLogprobEntry(token, value, list(token.encode("utf-8")), top))
    return ChatLogprobs(content)


def prompt_logprobs_body(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
) -> PromptLogprobs | None:
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            token_id: PromptLogprob(clamp(lp.logprob), lp.rank, lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
