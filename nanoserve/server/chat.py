"""POST /v1/chat/completions, streamed and not. The model's jinja chat template renders the
messages and tools (on a worker thread when they are large); with tools or a reasoning parser
the output is read by chat_output.py into content, reasoning_content and tool_calls."""
from __future__ import annotations

import time
from typing import AsyncGenerator

from nanoserve.inputs import TokensPrompt
from nanoserve.server.chat_output import ChatOutputReader, ChoiceOutput, delta_messages
from nanoserve.server.http_types import Response, StreamingResponse
from nanoserve.server.logprobs import chat_logprobs, prompt_logprobs_body
from nanoserve.server.preprocess import SMALL_INPUT
from nanoserve.server.schemas import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatCompletionStreamResponse, ChatMessage, ChatStreamChoice,
                                      DeltaMessage)
from nanoserve.server.serving import (DONE, ChoiceProgress, ServingContext, bad_request,
                                      encode_json, fold, response_id, sse, sse_error)
from nanoserve.server.tools import ToolUse, check_tool_messages, check_tool_use


async def render_chat_prompt(ctx: ServingContext, messages: list[dict], add_generation_prompt: bool,
                             continue_final_message: bool, chat_template: str | None,
                             chat_template_kwargs: dict | None, add_special_tokens: bool,
                             truncation_side: str | None = None,
                             tools: list[dict] | None = None) -> TokensPrompt:
    if not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message.get("role"), str):
            raise bad_request("each message needs a string 'role'", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request("message content must be a string or a list of text parts",
                              "messages")
    check_tool_messages(messages)
    if chat_template is not None and not ctx.trust_request_chat_template:
        raise bad_request("A chat template was sent with the request, but the server does not "
                          "run request-supplied templates (start it with "
                          "--trust-request-chat-template to allow them).", "chat_template")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "chat_template", "continue_final_message",
                     "deadline", "tools"):
        kwargs.pop(reserved, None)
    size = sum(len(str(message.get("content") or "")) + 16 for message in messages)
    if chat_template is not None:  # its cost is not bounded by the size of its input
        size = max(size, SMALL_INPUT)
    if tools:
        size += len(str(tools))
    try:
        text = await ctx.off_loop(size, ctx.tokenizer.apply_chat_template, messages,
                                  add_generation_prompt=add_generation_prompt,
                                  chat_template=chat_template or ctx.chat_template,
                                  continue_final_message=continue_final_message, tools=tools,
                                  deadline=ctx.preprocessor.deadline(), **kwargs)
    except (ValueError, TypeError) as error:  # ChatTemplateError is a ValueError
        raise bad_request(str(error), "messages") from None
    ids = await ctx.encode(text, add_special_tokens, truncation_side)
    if not ids:
        raise bad_request("the rendered prompt is empty", "messages")
    return TokensPrompt(ids, text)


def _response_role(request: ChatCompletionRequest) -> str:
    """vLLM: "assistant" when a generation prompt is added, else the last message's role."""
    if request.add_generation_prompt:
        return "assistant"
    return str(request.messages[-1].get("role"))


def _echo_text(request: ChatCompletionRequest, role: str) -> str:
    """With echo, the last message's content when it has the response's role (the message that
    continue_final_message continues), else nothing."""
    last = request.messages[-1]
    if not request.echo or last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest):
    ctx.check_model(request.model)
    if request.top_logprobs and not request.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.",
                          "top_logprobs")
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` "
                          "to True.", "continue_final_message")
    ctx.check_fields(request, "top_logprobs", request.top_logprobs)
    tool_use = check_tool_use(request.tools, request.tool_choice, request.parallel_tool_calls,
                              ctx.auto_tool_parser is not None)
    prompt = await render_chat_prompt(
        ctx, request.messages, request.add_generation_prompt, request.continue_final_message,
        request.chat_template, request.chat_template_kwargs, request.add_special_tokens,
        ctx.truncation_side_of(request), tool_use.tools)
    prompt.prompt_token_ids, cut = ctx.truncate(prompt.prompt_token_ids, request)
    if cut:
        prompt.prompt = None
    if not prompt.prompt_token_ids:
        raise bad_request("the prompt is empty", "messages")
    max_tokens = request.max_completion_tokens or request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.top_logprobs  # as vLLM: echo also scores the prompt
    params = ctx.sampling_params(request, max_tokens, logprobs, prompt_logprobs)
    reader = output_reader(ctx, tool_use)
    constrain_for_tools(params, tool_use, reader)
    base_id = response_id("chatcmpl", request.request_id)
    created = int(time.time())
    cache_key, streams = ctx.cached_streams(base_id, [prompt], params)
    if streams is None:
        streams = await ctx.submit(base_id, [prompt], params, request.priority)
    stream = streams[0]
    role = _response_role(request)
    if request.stream:
        return StreamingResponse(_stream(ctx, request, base_id, created, prompt, stream, role,
                                         cache_key, reader))
    final = None
    try:
        async for output in stream:
            final = fold(final, output)
    except BaseException:
        ctx.abort_unfinished(streams)
        raise
    ctx.store_response(cache_key, [final])
    echo = _echo_text(request, role)
    as_token_ids = bool(request.return_tokens_as_token_ids)
    choices = []
    completion_tokens = 0
    for choice in final.outputs:
        completion_tokens += len(choice.token_ids)
        logprobs_body = None
        if request.logprobs:
            logprobs_body = chat_logprobs(choice.token_ids, choice.logprobs or [],
                                          request.top_logprobs or 0, ctx.tokenizer, as_token_ids)
        message, finish_reason = ChatMessage(role, echo + choice.text), choice.finish_reason
        if reader is not None:
            message, finish_reason = _read_message(reader, role, echo, choice.text, finish_reason)
        choices.append(ChatChoice(
            choice.index, message, logprobs_body, finish_reason, choice.stop_reason,
            list(choice.token_ids) if request.return_token_ids else None))
    prompt_ids = prompt.prompt_token_ids
    usage = ctx.usage(len(prompt_ids), completion_tokens, final.num_cached_tokens)
    return Response(200, encode_json(ChatCompletionResponse(
        base_id, "chat.completion", created, ctx.served_model_name, choices, usage,
        prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
        prompt_token_ids=prompt_ids if request.return_token_ids else None)))


async def _stream(ctx: ServingContext, request: ChatCompletionRequest, base_id: str, created: int,
                  prompt: TokensPrompt, stream, role: str, cache_key: bytes | None,
                  reader: ChatOutputReader | None) -> AsyncGenerator[bytes, None]:
    model = ctx.served_model_name
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous_usage = bool(include_usage and options.continuous_usage_stats)
    prompt_ids = prompt.prompt_token_ids
    prompt_tokens = len(prompt_ids)
    top = request.top_logprobs or 0
    as_token_ids = bool(request.return_tokens_as_token_ids)
    shows_tokens = bool(request.logprobs or request.return_token_ids)
    echo = _echo_text(request, role)
    progress: dict[int, ChoiceProgress] = {}  # per choice index
    outputs: dict[int, ChoiceOutput] = {}  # per choice index, with a reader
    cached_tokens = 0
    first_chunk = True

    def chunk(choice: ChatStreamChoice, state: ChoiceProgress) -> bytes:
        nonlocal first_chunk
        usage = state.usage(prompt_tokens) if continuous_usage else None
        ids = prompt_ids if first_chunk and request.return_token_ids else None
        first_chunk = False
        return sse(ChatCompletionStreamResponse(base_id, "chat.completion.chunk", created, model,
                                                [choice], usage, ids))
    final = None  # the whole answer, for the response cache
    try:
        async for output in stream:
            cached_tokens = output.num_cached_tokens
            events = []
            for choice in output.outputs:
                state = progress.get(choice.index)
                if state is None:
                    if not choice.token_ids and choice.finish_reason is None:
                        continue  # the role chunk waits for the first token
                    state = progress[choice.index] = ChoiceProgress()
                    events.append(chunk(ChatStreamChoice(
                        choice.index, DeltaMessage(role=role, content="")), state))
                    if echo:
                        events.append(chunk(ChatStreamChoice(
                            choice.index, DeltaMessage(content=echo)), state))
                if not state.take(choice, shows_tokens):
                    continue
                logprobs = None
                if request.logprobs and choice.token_ids:
                    logprobs = chat_logprobs(choice.token_ids, choice.logprobs or [], top,
                                             ctx.tokenizer, as_token_ids)
                finish_reason = choice.finish_reason
                messages = [DeltaMessage(content=choice.text)]
                if reader is not None:
                    output = outputs.get(choice.index)
                    if output is None:
                        output = outputs[choice.index] = reader.new_choice()
                    messages = delta_messages(output.feed(choice.text, finish_reason is not None))
                    if finish_reason is not None:
                        finish_reason = reader.finish_reason(bool(output.tool_calls),
                                                             finish_reason)
                    if not messages:  # all of it held back (maybe the start of a marker)
                        if finish_reason is None and not (shows_tokens and choice.token_ids):
                            continue
                        messages = [DeltaMessage(content="")]
                for message in messages[:-1]:
                    events.append(chunk(ChatStreamChoice(choice.index, message), state))
                events.append(chunk(ChatStreamChoice(
                    choice.index, messages[-1], logprobs, finish_reason, choice.stop_reason,
                    list(choice.token_ids) if request.return_token_ids else None), state))
            if cache_key is not None:
                final = fold(final, output)
            if events:
                yield b"".join(events)
        ctx.store_response(cache_key, [final])
        if include_usage:
            completion_tokens = sum(p.num_tokens for p in progress.values())
            yield sse(ChatCompletionStreamResponse(
                base_id, "chat.completion.chunk", created, model, [],
                ctx.usage(prompt_tokens, completion_tokens, cached_tokens)))
        yield DONE
    except Exception as error:  # after the 200 went out: report in-band, then end the stream
        yield sse_error(error) + DONE
    finally:
        ctx.abort_unfinished([stream])


def output_reader(ctx: ServingContext, tool_use: ToolUse) -> ChatOutputReader | None:
    """None when the text goes out as it is (no tools to read, no reasoning parser)."""
    tool_parser = tool_use.parser(ctx.auto_tool_parser)
    if tool_parser is None and ctx.reasoning_parser is None:
        return None
    return ChatOutputReader(ctx.reasoning_parser, tool_parser, tool_use.mode,
                            None if tool_use.parallel else 1)


def constrain_for_tools(params, tool_use: ToolUse, reader: ChatOutputReader | None) -> None:
    """"required" and a named function hold by constrained decoding; a parser whose markers are
    special tokens needs them in the text."""
    constraint = tool_use.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise bad_request("tool_choice \"required\" or a named function constrains the output "
                              "itself; it cannot be combined with response_format or "
                              "structured_outputs", "tool_choice")
        params.structured_outputs = constraint
    if reader is not None and reader.tool_parser is not None \
            and reader.tool_parser.keeps_special_tokens:
        params.skip_special_tokens = False


def _read_message(reader: ChatOutputReader, role: str, echo: str, text: str,
                  finish_reason: str | None) -> tuple[ChatMessage, str | None]:
    output = reader.new_choice()
    output.feed(text, True)
    content, reasoning = output.message_fields()
    if echo:
        content = echo + (content or "")
    calls = output.tool_calls
    return (ChatMessage(role, content, calls, reasoning),
            reader.finish_reason(bool(calls), finish_reason))
