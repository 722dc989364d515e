"""What the chat, completions and Anthropic messages streams share: reading one or several
request streams as their outputs arrive, the SSE frame around each route's own chunks (the response cache's copy, the
closing usage chunk, [DONE], an in-band error after the 200 went out, and the abort of what is
left when the client goes away)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from nanoserve.engine.async_engine import RequestStream
from nanoserve.outputs import RequestOutput
from nanoserve.server.schemas import SamplingFields, Usage
from nanoserve.server.serving import DONE, ChoiceProgress, ServingContext, fold, sse_error


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def usage_options(request: SamplingFields) -> tuple[bool, bool]:
    """stream_options: (a usage chunk at the end, usage in every chunk)."""
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    return include_usage, bool(include_usage and options.continuous_usage_stats)


async def stream_response(
    ctx: ServingContext,
    streams: list[RequestStream],
    cache_key: bytes | None,
    prompt_tokens: int,
    include_usage: bool,
    progress: dict[int, ChoiceProgress],
    events_of: Callable[[int, RequestOutput], list[bytes]],
    usage_chunk: Callable[[Usage], bytes],
    *,
    opening: bytes = b"",
    closing: bytes = DONE,
    error_event: Callable[[BaseException], bytes] = sse_error,
) -> AsyncGenerator[bytes, None]:
    """The SSE body of a streamed response. `events_of(prompt index, output)`: the route's chunks
    for one output (they update `progress`, whose token counts make the final usage);
    `usage_chunk`: the route's closing chunk that carries only the usage. OpenAI's frame by
    default; a route with other framing (Anthropic's messages) gives its first events
    (`opening`, sent at once), its last bytes (`closing`, after the usage chunk and after an
    error event) and the event that reports an error after the 200 went out (`error_event`)."""
    finals: list = [None] * len(streams)  # the whole answers, for the response cache
    cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the prefix cache
    engine_prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens in the engine
    try:
        if opening:
            yield opening
        async for index, output in merge_streams(streams):
            cached[index] = output.num_cached_tokens
            if output.prompt_token_ids:  # the engine's count: images' tokens included
                engine_prompt_tokens[index] = len(output.prompt_token_ids)
            events = events_of(index, output)
            if cache_key is not None:
                finals[index] = fold(finals[index], output)
            if events:
                yield b"".join(events)
        ctx.store_response(cache_key, finals)
        if include_usage:
            completion_tokens = sum(p.num_tokens for p in progress.values())
            if len(engine_prompt_tokens) == len(streams):
                prompt_tokens = sum(engine_prompt_tokens.values())
            yield usage_chunk(ctx.usage(prompt_tokens, completion_tokens, sum(cached.values())))
        if closing:
            yield closing
    except Exception as error:  # after the 200 went out: report in-band, then end the stream
        yield error_event(error) + closing
    finally:
        ctx.abort_unfinished(streams)
