"""POST /v1/completions, streamed and not."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, AsyncIterator

from nanoserve.engine.async_engine import RequestStream
from nanoserve.inputs import TokensPrompt
from nanoserve.server.beam_completions import create_beam_completion
from nanoserve.server.http_types import Response, StreamingResponse
from nanoserve.server.logprobs import completion_logprobs, prompt_logprobs_body
from nanoserve.server.schemas import (CompletionChoice, CompletionRequest, CompletionResponse,
                                      CompletionStreamChoice, CompletionStreamResponse)
from nanoserve.server.serving import (DONE, ChoiceProgress, ServingContext, bad_request,
                                      encode_json, fold, response_id, sse, sse_error)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several request streams, as they arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output, None))
        except BaseException as error:  # delivered to the reader, which re-raises it
            queue.put_nowait((index, None, error))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


async def normalize_prompts(ctx: ServingContext, request: CompletionRequest) -> list[TokensPrompt]:
    """str | list[str] | list[int] | list[list[int]] → engine prompts with token ids, truncated
    as the request asks (a truncated prompt keeps no text: echo shows its tokens' text)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        texts: list = [prompt]
    elif _is_token_list(prompt) and prompt:
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (_is_token_list(p) and p) for p in prompt):
        texts = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                          "list of token-id lists (non-empty)", "prompt")
    side = ctx.truncation_side_of(request)
    result = []
    for item in texts:
        if isinstance(item, str):
            ids = await ctx.encode(item, request.add_special_tokens, side)
            text = item
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


async def create_completion(ctx: ServingContext, request: CompletionRequest):
    ctx.check_model(request.model)
    if request.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    ctx.check_fields(request, "logprobs", request.logprobs)
    prompts = await normalize_prompts(ctx, request)
    if request.use_beam_search:
        return await create_beam_completion(ctx, request, prompts)
    if request.length_penalty != 1.0:
        raise bad_request("length_penalty needs use_beam_search", "length_penalty")
    max_tokens = 16 if request.max_tokens is None else request.max_tokens  # null means 16
    echo_only = bool(request.echo) and max_tokens == 0  # vLLM: return the prompt, generate 1
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs  # echo shows the prompt tokens' logprobs too
    params = ctx.sampling_params(request, 1 if echo_only else max_tokens, request.logprobs,
                                 prompt_logprobs)
    base_id = response_id("cmpl", request.request_id)
    created = int(time.time())
    cache_key, streams = ctx.cached_streams(base_id, prompts, params)
    if streams is None:
        streams = await ctx.submit(base_id, prompts, params, request.priority)
    if request.stream:
        return StreamingResponse(_stream(ctx, request, base_id, created, prompts, streams,
                                         echo_only, cache_key))
    try:
        finals: list = [None] * len(streams)
        async for index, output in merge_streams(streams):
            finals[index] = fold(finals[index], output)
    except BaseException:
        ctx.abort_unfinished(streams)
        raise
    ctx.store_response(cache_key, finals)
    choices = []
    completion_tokens = 0
    for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
        prompt_ids = prompt.prompt_token_ids
        for output in final.outputs:
            token_ids, entries, text = output.token_ids, output.logprobs or [], output.text
            if request.echo:
                prompt_text = _prompt_text(ctx, request, prompt)
                prompt_entries = _prompt_entries(final, prompt_ids)
                if echo_only:
                    token_ids, entries, text = prompt_ids, prompt_entries, prompt_text
                else:
                    token_ids, entries = prompt_ids + token_ids, prompt_entries + entries
                    text = prompt_text + text
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(token_ids, entries, request.logprobs, ctx.tokenizer,
                                               as_token_ids=bool(request.return_tokens_as_token_ids))
            completion_tokens += len(output.token_ids)
            choices.append(CompletionChoice(
                index=prompt_index * request.n + output.index, text=text, logprobs=logprobs,
                finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                token_ids=list(output.token_ids) if request.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
                prompt_token_ids=prompt_ids if request.return_token_ids else None))
    prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    usage = ctx.usage(prompt_tokens, completion_tokens, sum(f.num_cached_tokens for f in finals))
    body = CompletionResponse(base_id, "text_completion", created, ctx.served_model_name,
                              choices, usage)
    return Response(200, encode_json(body))


async def _stream(ctx: ServingContext, request: CompletionRequest, base_id: str, created: int,
                  prompts: list[TokensPrompt], streams, echo_only: bool,
                  cache_key: bytes | None) -> AsyncGenerator[bytes, None]:
    model = ctx.served_model_name
    n = request.n
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous_usage = bool(include_usage and options.continuous_usage_stats)
    as_token_ids = bool(request.return_tokens_as_token_ids)
    shows_tokens = request.logprobs is not None or bool(request.return_token_ids)
    progress: dict[int, ChoiceProgress] = {}  # per choice index
    cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the prefix cache
    finals: list = [None] * len(streams)  # the whole answers, for the response cache
    try:
        async for prompt_index, output in merge_streams(streams):
            cached[prompt_index] = output.num_cached_tokens
            prompt = prompts[prompt_index]
            prompt_ids = prompt.prompt_token_ids
            events = []
            for choice in output.outputs:
                index = prompt_index * n + choice.index
                state = progress.get(index)
                if state is None:
                    state = progress[index] = ChoiceProgress()
                first = not state.started
                if not state.take(choice, shows_tokens) and not (first and request.echo):
                    continue
                text, ids, entries = choice.text, choice.token_ids, choice.logprobs or []
                if request.echo and first:  # the prompt leads the first chunk
                    prompt_text = _prompt_text(ctx, request, prompt)
                    prompt_entries = _prompt_entries(output, prompt_ids)
                    if echo_only:
                        text, ids, entries = prompt_text, prompt_ids, prompt_entries
                    else:
                        text, ids, entries = prompt_text + text, prompt_ids + ids, prompt_entries + entries
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(ids, entries, request.logprobs, ctx.tokenizer,
                                                   state.chars_sent, as_token_ids)
                state.started = True
                state.chars_sent += len(text)
                send_prompt_ids = first and bool(request.echo or request.return_token_ids)
                events.append(sse(CompletionStreamResponse(
                    base_id, "text_completion", created, model,
                    [CompletionStreamChoice(
                        index, text, logprobs, choice.finish_reason, choice.stop_reason,
                        prompt_ids if send_prompt_ids else None,
                        list(choice.token_ids) if request.return_token_ids else None)],
                    state.usage(len(prompt_ids)) if continuous_usage else None)))
            if cache_key is not None:
                finals[prompt_index] = fold(finals[prompt_index], output)
            if events:
                yield b"".join(events)
        ctx.store_response(cache_key, finals)
        if include_usage:
            completion_tokens = sum(p.num_tokens for p in progress.values())
            prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
            usage = ctx.usage(prompt_tokens, completion_tokens, sum(cached.values()))
            yield sse(CompletionStreamResponse(base_id, "text_completion", created, model, [],
                                               usage))
        yield DONE
    except Exception as error:  # after the 200 went out: report in-band, then end the stream
        yield sse_error(error) + DONE
    finally:
        ctx.abort_unfinished(streams)
