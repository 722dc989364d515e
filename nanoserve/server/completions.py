"""POST /v1/completions, streamed and not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from nanoserve.engine.async_engine import RequestStream
from nanoserve.inputs import TokensPrompt
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.server.beam_completions import beam_params, create_beam_completion
from nanoserve.server.http.types import Response, StreamingResponse
from nanoserve.server.logprobs import completion_logprobs, prompt_logprobs_body
from nanoserve.server.schemas import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    Usage,
)
from nanoserve.server.serving import (
    ChoiceProgress,
    ServingContext,
    bad_request,
    encode_json,
    fold,
    response_id,
    sse,
)
from nanoserve.server.streaming import merge_streams, stream_response, usage_options


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_items(ctx: ServingContext, request: CompletionRequest) -> list:
    """The prompt as a list of strings and token-id lists. Every count is checked before the
    lists are walked (the number of prompts against n x prompts; a token list longer than the
    context, when nothing truncates it), so a huge list costs no more than its decoding."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    bad = bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists (non-empty)",
        "prompt",
    )
    if not isinstance(prompt, list) or not prompt:
        raise bad
    items = [prompt] if isinstance(prompt[0], int) else prompt
    ctx.check_num_sequences(request.n, len(items))
    for item in items:
        if isinstance(item, list):
            if request.truncate_prompt_tokens is None:
                ctx.check_prompt_tokens(len(item))
            if not item or not _is_token_list(item):
                raise bad
        elif not isinstance(item, str):
            raise bad
    return items


async def normalize_prompts(ctx: ServingContext, request: CompletionRequest) -> list[TokensPrompt]:
    """str | list[str] | list[int] | list[list[int]] → engine prompts with token ids, truncated
    as the request asks (a truncated prompt keeps no text: echo shows its tokens' text). The
    number of prompts is checked before any is tokenized; texts are tokenized in slices."""
    texts = _prompt_items(ctx, request)
    side = ctx.truncation_side_of(request)
    strings = [item for item in texts if isinstance(item, str)]
    if len(strings) == 1:
        encoded = iter([await ctx.encode(strings[0], request.add_special_tokens, side)])
    else:
        encoded = iter(await ctx.encode_many(strings, request.add_special_tokens, side))
    result = []
    for item in texts:
        if isinstance(item, str):
            ids, text = next(encoded), item
        else:
            ids, text = list(item), None
        ids, cut = ctx.truncate(ids, request)
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        result.append(TokensPrompt(ids, None if cut else text))
    return result


def _prompt_text(ctx: ServingContext, request: CompletionRequest, prompt: TokensPrompt) -> str:
    if request.return_token_ids:  # vLLM echoes no prompt text then: the ids say it
        return ""
    if prompt.prompt is not None:
        return prompt.prompt
    return ctx.tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)


def _prompt_entries(output, prompt_ids: list[int]) -> list:
    return output.prompt_logprobs or [None] * len(prompt_ids)


def _with_prompt(
    ctx: ServingContext,
    request: CompletionRequest,
    prompt: TokensPrompt,
    output: RequestOutput,
    echo_only: bool,
    text: str,
    ids: list[int],
    entries: list,
) -> tuple[str, list[int], list]:
    """echo: the prompt's text, ids and logprob entries before the output's (instead of them
    when only the prompt was asked for)."""
    prompt_ids = prompt.prompt_token_ids
    prompt_text = _prompt_text(ctx, request, prompt)
    prompt_entries = _prompt_entries(output, prompt_ids)
    if echo_only:
        return prompt_text, prompt_ids, prompt_entries
    return prompt_text + text, prompt_ids + ids, prompt_entries + entries


def _choices(
    ctx: ServingContext,
    request: CompletionRequest,
    prompts: list[TokensPrompt],
    finals: list[RequestOutput],
    echo_only: bool,
) -> tuple[list[CompletionChoice], int]:
    """The response's choices, n per prompt, and the tokens they generated."""
    choices = []
    completion_tokens = 0
    for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
        prompt_ids = prompt.prompt_token_ids
        for output in final.outputs:
            text, token_ids, entries = output.text, output.token_ids, output.logprobs or []
            if request.echo:
                text, token_ids, entries = _with_prompt(
                    ctx, request, prompt, final, echo_only, text, token_ids, entries
                )
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(
                    token_ids,
                    entries,
                    request.logprobs,
                    ctx.tokenizer,
                    as_token_ids=bool(request.return_tokens_as_token_ids),
                )
            completion_tokens += len(output.token_ids)
            choices.append(
                CompletionChoice(
                    index=prompt_index * request.n + output.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                    token_ids=list(output.token_ids) if request.return_token_ids else None,
                    prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
                    prompt_token_ids=prompt_ids if request.return_token_ids else None,
                )
            )
    return choices, completion_tokens


async def create_completion(ctx: ServingContext, request: CompletionRequest):
    lora = ctx.check_model(request.model)
    if request.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    ctx.check_fields(request, "logprobs", request.logprobs)
    if request.use_beam_search:  # checked before any prompt is tokenized
        params = beam_params(ctx, request)
        return await create_beam_completion(
            ctx, request, await normalize_prompts(ctx, request), params, lora
        )
    if request.length_penalty != 1.0:
        raise bad_request("length_penalty needs use_beam_search", "length_penalty")
    max_tokens = 16 if request.max_tokens is None else request.max_tokens  # null means 16
    echo_only = bool(request.echo) and max_tokens == 0  # vLLM: return the prompt, generate 1
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs  # echo shows the prompt tokens' logprobs too
    # Every check of the request before its prompts are tokenized, the costly part.
    params = ctx.sampling_params(
        request, 1 if echo_only else max_tokens, request.logprobs, prompt_logprobs
    )
    prompts = await normalize_prompts(ctx, request)
    base_id = response_id("cmpl", request.request_id)
    created = int(time.time())
    cache_key, streams = ctx.cached_streams(base_id, prompts, params, lora)
    if streams is None:
        streams = await ctx.submit(base_id, prompts, params, request.priority, lora)
    if request.stream:
        return StreamingResponse(
            _stream(ctx, request, base_id, created, prompts, streams, echo_only, cache_key)
        )
    try:
        finals: list = [None] * len(streams)
        async for index, output in merge_streams(streams):
            finals[index] = fold(finals[index], output)
    except BaseException:
        ctx.abort_unfinished(streams)
        raise
    ctx.store_response(cache_key, finals)
    choices, completion_tokens = _choices(ctx, request, prompts, finals, echo_only)
    prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    usage = ctx.usage(prompt_tokens, completion_tokens, sum(f.num_cached_tokens for f in finals))
    body = CompletionResponse(
        base_id, "text_completion", created, ctx.model_name(lora), choices, usage
    )
    return Response(200, encode_json(body))


class _CompletionChunks:
    """A streamed completion's chunks, output by output. The first chunk of each choice
    carries the echoed prompt (and its ids when asked for)."""

    def __init__(
        self,
        ctx: ServingContext,
        request: CompletionRequest,
        base_id: str,
        created: int,
        prompts: list[TokensPrompt],
        echo_only: bool,
        continuous_usage: bool,
    ) -> None:
        self.ctx, self.request, self.prompts = ctx, request, prompts
        self.base_id, self.created, self.model = base_id, created, ctx.response_model(request.model)
        self.echo_only, self.continuous_usage = echo_only, continuous_usage
        self.as_token_ids = bool(request.return_tokens_as_token_ids)
        self.shows_tokens = request.logprobs is not None or bool(request.return_token_ids)
        self.progress: dict[int, ChoiceProgress] = {}  # per choice index

    def events(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        events = []
        for choice in output.outputs:
            event = self._choice_event(prompt_index, output, choice)
            if event is not None:
                events.append(event)
        return events

    def _choice_event(
        self, prompt_index: int, output: RequestOutput, choice: CompletionOutput
    ) -> bytes | None:
        request = self.request
        index = prompt_index * request.n + choice.index
        state = self.progress.get(index)
        if state is None:
            state = self.progress[index] = ChoiceProgress()
        first = not state.started
        if not state.take(choice, self.shows_tokens) and not (first and request.echo):
            return None
        prompt_ids = self.prompts[prompt_index].prompt_token_ids
        text, ids, entries = choice.text, choice.token_ids, choice.logprobs or []
        if request.echo and first:  # the prompt leads the first chunk
            text, ids, entries = _with_prompt(
                self.ctx,
                request,
                self.prompts[prompt_index],
                output,
                self.echo_only,
                text,
                ids,
                entries,
            )
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(
                ids,
                entries,
                request.logprobs,
                self.ctx.tokenizer,
                state.chars_sent,
                self.as_token_ids,
            )
        state.started = True
        state.chars_sent += len(text)
        send_prompt_ids = first and bool(request.echo or request.return_token_ids)
        return sse(
            CompletionStreamResponse(
                self.base_id,
                "text_completion",
                self.created,
                self.model,
                [
                    CompletionStreamChoice(
                        index,
                        text,
                        logprobs,
                        choice.finish_reason,
                        choice.stop_reason,
                        prompt_ids if send_prompt_ids else None,
                        list(choice.token_ids) if request.return_token_ids else None,
                    )
                ],
                state.usage(len(prompt_ids)) if self.continuous_usage else None,
            )
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse(
            CompletionStreamResponse(
                self.base_id, "text_completion", self.created, self.model, [], usage
            )
        )


def _stream(
    ctx: ServingContext,
    request: CompletionRequest,
    base_id: str,
    created: int,
    prompts: list[TokensPrompt],
    streams: list[RequestStream],
    echo_only: bool,
    cache_key: bytes | None,
) -> AsyncGenerator[bytes, None]:
    include_usage, continuous_usage = usage_options(request)
    chunks = _CompletionChunks(ctx, request, base_id, created, prompts, echo_only, continuous_usage)
    prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    return stream_response(
        ctx,
        streams,
        cache_key,
        prompt_tokens,
        include_usage,
        chunks.progress,
        chunks.events,
        chunks.usage_chunk,
    )
