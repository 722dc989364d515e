"""POST /v1/completions, streamed and not."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator

from nanoserve.server.http_types import Response, StreamingResponse
from nanoserve.server.openai import (DONE, ServingContext, bad_request, encode_json, merge_streams,
                                     random_id, sse, sse_error, token_text, top_entries)
from nanoserve.server.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest,
                                       CompletionResponse, CompletionStreamChoice,
                                       CompletionStreamResponse)


@dataclass(slots=True)
class ChoiceProgress:
    """How much of one choice's cumulative output was already sent."""
    prompt_index: int
    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    num_tokens: int = 0
    finished: bool = False


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


async def normalize_prompts(ctx: ServingContext, prompt: Any,
                            add_special_tokens: bool) -> list[dict]:
    """str | list[str] | list[int] | list[list[int]] → engine prompts with token ids."""
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
    result = []
    for item in texts:
        if isinstance(item, str):
            ids = await ctx.encode(item, add_special_tokens)
            if not ids:
                raise bad_request("the prompt is empty", "prompt")
            result.append({"prompt": item, "prompt_token_ids": ids})
        else:
            result.append({"prompt": None, "prompt_token_ids": list(item)})
    return result


def _logprobs(ctx: ServingContext, output, start: int, progress: ChoiceProgress,
              limit: int) -> CompletionLogProbs:
    tokenizer = ctx.tokenizer
    result = CompletionLogProbs([], [], [], [])
    entries = output.logprobs or []
    for position in range(start, len(output.token_ids)):
        token_id = output.token_ids[position]
        entry = entries[position] if position < len(entries) else {}
        text, value = token_text(entry, token_id, tokenizer)
        result.text_offset.append(progress.text_offset)
        progress.text_offset += len(text)
        result.tokens.append(text)
        result.token_logprobs.append(value)
        result.top_logprobs.append(dict(top_entries(entry, limit, tokenizer)) if limit else {})
    return result


async def create_completion(ctx: ServingContext, request: CompletionRequest):
    ctx.check_model(request.model)
    if request.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    prompts = await normalize_prompts(ctx, request.prompt, request.add_special_tokens)
    max_tokens = 16 if request.max_tokens is None else request.max_tokens  # null means 16
    params = ctx.sampling_params(request, max_tokens, request.logprobs)
    base_id = random_id("cmpl")
    created = int(time.time())
    streams = await ctx.submit(base_id, prompts, params, request.priority)
    if request.stream:
        return StreamingResponse(_stream(ctx, request, base_id, created, prompts, streams))
    try:
        finals: list = [None] * len(streams)
        async for index, output in merge_streams(streams):
            finals[index] = output
    except BaseException:
        ctx.abort_unfinished(streams)
        raise
    choices = []
    completion_tokens = 0
    for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
        prompt_text = _prompt_text(ctx, prompt) if request.echo else ""
        for output in final.outputs:
            progress = ChoiceProgress(prompt_index, text_offset=len(prompt_text))
            logprobs = (_logprobs(ctx, output, 0, progress, request.logprobs)
                        if request.logprobs is not None else None)
            completion_tokens += len(output.token_ids)
            choices.append(CompletionChoice(
                index=prompt_index * request.n + output.index, text=prompt_text + output.text,
                logprobs=logprobs, finish_reason=output.finish_reason,
                stop_reason=output.stop_reason))
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    usage = ctx.usage(prompt_tokens, completion_tokens, sum(f.num_cached_tokens for f in finals))
    body = CompletionResponse(base_id, "text_completion", created, ctx.served_model_name,
                              choices, usage)
    return Response(200, encode_json(body))


def _prompt_text(ctx: ServingContext, prompt: dict) -> str:
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    return ctx.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)


async def _stream(ctx: ServingContext, request: CompletionRequest, base_id: str, created: int,
                  prompts: list[dict], streams) -> AsyncGenerator[bytes, None]:
    model = ctx.served_model_name
    n = request.n
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous_usage = bool(include_usage and options.continuous_usage_stats)
    stop = [] if request.include_stop_str_in_output else (request.stop or [])
    holdback = max((len(s) for s in ([stop] if isinstance(stop, str) else stop)), default=1) - 1
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    progress: dict[int, ChoiceProgress] = {}
    cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the prefix cache
    try:
        async for prompt_index, output in merge_streams(streams):
            cached[prompt_index] = output.num_cached_tokens
            events = []
            for choice in output.outputs:
                index = prompt_index * n + choice.index
                state = progress.get(index)
                if state is None:
                    state = progress[index] = ChoiceProgress(prompt_index)
                if state.finished:
                    continue
                finished = choice.finish_reason is not None
                end = len(choice.text) if finished else max(state.text_sent,
                                                            len(choice.text) - holdback)
                text = choice.text[state.text_sent:end]
                if request.echo and state.tokens_sent == 0 and state.text_sent == 0 and \
                        (text or choice.token_ids or finished):
                    prompt_text = _prompt_text(ctx, prompts[prompt_index])
                    text = prompt_text + text
                    state.text_offset = len(prompt_text)
                new_tokens = len(choice.token_ids) - state.tokens_sent
                if not text and not finished and not (new_tokens and request.logprobs is not None):
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(ctx, choice, state.tokens_sent, state, request.logprobs)
                state.text_sent = end
                state.tokens_sent = state.num_tokens = len(choice.token_ids)
                state.finished = finished
                usage = None
                if continuous_usage:
                    done = sum(p.num_tokens for p in progress.values())
                    usage = ctx.usage(prompt_tokens, done, sum(cached.values()))
                events.append(sse(CompletionStreamResponse(
                    base_id, "text_completion", created, model,
                    [CompletionStreamChoice(index, text, logprobs, choice.finish_reason,
                                            choice.stop_reason)], usage)))
            if events:
                yield b"".join(events)
        if include_usage:
            completion_tokens = sum(p.num_tokens for p in progress.values())
            usage = ctx.usage(prompt_tokens, completion_tokens, sum(cached.values()))
            yield sse(CompletionStreamResponse(base_id, "text_completion", created, model, [],
                                               usage))
        yield DONE
    except Exception as error:  # after the 200 went out: report in-band, then end the stream
        yield sse_error(error) + DONE
    finally:
        ctx.abort_unfinished(streams)

