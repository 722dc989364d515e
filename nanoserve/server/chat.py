"""POST /v1/chat/completions, streamed and not. The model's jinja chat template renders the
messages and tools (on a worker thread when they are large); with tools or a reasoning parser
the output is read by chat_output.py into content, reasoning_content and tool_calls."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from nanoserve.engine.async_engine import RequestStream
from nanoserve.inputs import TokensPrompt
from nanoserve.multimodal.chat import chat_images, has_images, has_remote_images
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.server.chat_output import ChatOutputReader, ChoiceOutput, delta_messages
from nanoserve.server.http.types import Response, StreamingResponse
from nanoserve.server.logprobs import chat_logprobs, prompt_logprobs_body
from nanoserve.server.preprocess import SMALL_INPUT
from nanoserve.server.schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
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
from nanoserve.server.streaming import stream_response, usage_options
from nanoserve.server.tools import ToolUse, check_tool_messages, check_tool_use

REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def template_kwargs_with_effort(kwargs: dict | None, effort: str | None, param: str) -> dict | None:
    """chat_template_kwargs with OpenAI's reasoning effort as `reasoning_effort` (the name
    gpt-oss's template reads; a template that reads none ignores it), unless already set there."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(
            f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param
        )
    return {"reasoning_effort": effort, **(kwargs or {})}


def render_size(messages: list[dict], tools: list[dict] | None) -> int:
    """What decides where the template renders: the bytes of every part of every message
    (content parts, tool_calls' names and arguments, reasoning_content, names, ids) and of the
    tools, since a template may print any of them. One C-speed pass, linear in the input."""
    return len(encode_json(messages)) + (len(encode_json(tools)) if tools else 0)


async def render_chat_prompt(
    ctx: ServingContext,
    messages: list[dict],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict | None,
    add_special_tokens: bool,
    truncation_side: str | None = None,
    tools: list[dict] | None = None,
) -> TokensPrompt:
    if not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(messages) > ctx.max_model_len:  # every template gives each message a token or more
        raise bad_request(
            f"messages may hold at most {ctx.max_model_len} messages (the context "
            f"length, in tokens), got {len(messages)}",
            "messages",
        )
    for message in messages:
        if not isinstance(message.get("role"), str):
            raise bad_request("each message needs a string 'role'", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(
                "message content must be a string or a list of text parts", "messages"
            )
    check_tool_messages(messages)
    if chat_template is not None and not ctx.trust_request_chat_template:
        raise bad_request(
            "A chat template was sent with the request, but the server does not "
            "run request-supplied templates (start it with "
            "--trust-request-chat-template to allow them).",
            "chat_template",
        )
    kwargs = dict(chat_template_kwargs or {})
    for reserved in (
        "messages",
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "deadline",
        "tools",
    ):
        kwargs.pop(reserved, None)
    size = render_size(messages, tools)
    if chat_template is not None:  # its cost is not bounded by the size of its input
        size = max(size, SMALL_INPUT)
    try:
        text = await ctx.off_loop(
            size,
            ctx.tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template or ctx.chat_template,
            continue_final_message=continue_final_message,
            tools=tools,
            deadline=ctx.preprocessor.deadline(),
            **kwargs,
        )
    except (ValueError, TypeError) as error:  # ChatTemplateError is a ValueError
        raise bad_request(str(error), getattr(error, "param", None) or "messages") from None
    ids = await ctx.encode(text, add_special_tokens, truncation_side)
    if not ids:
        raise bad_request("the rendered prompt is empty", "messages")
    if has_images(messages):  # decoded off the loop: an image may take a while
        if has_remote_images(messages):  # a fetch blocks: always on the pool
            size = max(size, SMALL_INPUT)
        images = await ctx.off_loop(size, chat_images, messages, ctx.image_limits, ctx.media_fetch)
        return TokensPrompt(ids, text, multi_modal_data={"image": images})
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
    lora = ctx.check_model(request.model)
    if request.top_logprobs and not request.logprobs:
        raise bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    ctx.check_fields(request, "top_logprobs", request.top_logprobs)
    tool_use = check_tool_use(
        request.tools,
        request.tool_choice,
        request.parallel_tool_calls,
        ctx.auto_tool_parser is not None,
    )
    max_tokens = request.max_completion_tokens or request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.top_logprobs  # as vLLM: echo also scores the prompt
    # Every check of the request before its prompt is rendered and tokenized, the costly part.
    params = ctx.sampling_params(request, max_tokens, logprobs, prompt_logprobs)
    reader = output_reader(ctx, tool_use)
    constrain_for_tools(params, tool_use, reader)
    prompt = await render_chat_prompt(
        ctx,
        request.messages,
        request.add_generation_prompt,
        request.continue_final_message,
        request.chat_template,
        template_kwargs_with_effort(
            request.chat_template_kwargs, request.reasoning_effort, "reasoning_effort"
        ),
        request.add_special_tokens,
        ctx.truncation_side_of(request),
        tool_use.tools,
    )
    prompt.prompt_token_ids, cut = ctx.truncate(prompt.prompt_token_ids, request)
    if cut:
        prompt.prompt = None
    if not prompt.prompt_token_ids:
        raise bad_request("the prompt is empty", "messages")
    base_id = response_id("chatcmpl", request.request_id)
    created = int(time.time())
    cache_key, streams = ctx.cached_streams(base_id, [prompt], params, lora)
    if streams is None:
        streams = await ctx.submit(base_id, [prompt], params, request.priority, lora)
    stream = streams[0]
    role = _response_role(request)
    if request.stream:
        return StreamingResponse(
            _stream(ctx, request, base_id, created, prompt, stream, role, cache_key, reader)
        )
    final = None
    try:
        async for output in stream:
            final = fold(final, output)
    except BaseException:
        ctx.abort_unfinished(streams)
        raise
    ctx.store_response(cache_key, [final])
    return _response(ctx, request, base_id, created, prompt, final, role, reader)


def _response(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    base_id: str,
    created: int,
    prompt: TokensPrompt,
    final: RequestOutput,
    role: str,
    reader: ChatOutputReader | None,
) -> Response:
    """The whole answer as one chat.completion body."""
    echo = _echo_text(request, role)
    as_token_ids = bool(request.return_tokens_as_token_ids)
    choices = []
    completion_tokens = 0
    for choice in final.outputs:
        completion_tokens += len(choice.token_ids)
        logprobs_body = None
        if request.logprobs:
            logprobs_body = chat_logprobs(
                choice.token_ids,
                choice.logprobs or [],
                request.top_logprobs or 0,
                ctx.tokenizer,
                as_token_ids,
            )
        message, finish_reason = ChatMessage(role, echo + choice.text), choice.finish_reason
        if reader is not None:
            message, finish_reason = _read_message(reader, role, echo, choice.text, finish_reason)
        choices.append(
            ChatChoice(
                choice.index,
                message,
                logprobs_body,
                finish_reason,
                choice.stop_reason,
                list(choice.token_ids) if request.return_token_ids else None,
            )
        )
    # the engine's ids: a prompt's image placeholders are its images' tokens there
    prompt_ids = final.prompt_token_ids or prompt.prompt_token_ids
    usage = ctx.usage(len(prompt_ids), completion_tokens, final.num_cached_tokens)
    return Response(
        200,
        encode_json(
            ChatCompletionResponse(
                base_id,
                "chat.completion",
                created,
                ctx.response_model(request.model),
                choices,
                usage,
                prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
                prompt_token_ids=prompt_ids if request.return_token_ids else None,
            )
        ),
    )


class _ChatChunks:
    """A streamed chat completion's chunks, output by output: each choice opens with a role
    chunk (and the echoed message) once its first token came; with a reader the text goes out
    as content, reasoning and tool-call deltas."""

    def __init__(
        self,
        ctx: ServingContext,
        request: ChatCompletionRequest,
        base_id: str,
        created: int,
        prompt: TokensPrompt,
        role: str,
        reader: ChatOutputReader | None,
        continuous_usage: bool,
    ) -> None:
        self.ctx, self.request, self.reader, self.role = ctx, request, reader, role
        self.base_id, self.created, self.model = base_id, created, ctx.response_model(request.model)
        self.prompt_ids = prompt.prompt_token_ids
        self.continuous_usage = continuous_usage
        self.as_token_ids = bool(request.return_tokens_as_token_ids)
        self.shows_tokens = bool(request.logprobs or request.return_token_ids)
        self.echo = _echo_text(request, role)
        self.progress: dict[int, ChoiceProgress] = {}  # per choice index
        self.outputs: dict[int, ChoiceOutput] = {}  # per choice index, with a reader
        self.first_chunk = True

    def _chunk(self, choice: ChatStreamChoice, state: ChoiceProgress) -> bytes:
        usage = state.usage(len(self.prompt_ids)) if self.continuous_usage else None
        ids = self.prompt_ids if self.first_chunk and self.request.return_token_ids else None
        self.first_chunk = False
        return sse(
            ChatCompletionStreamResponse(
                self.base_id,
                "chat.completion.chunk",
                self.created,
                self.model,
                [choice],
                usage,
                ids,
            )
        )

    def events(self, _: int, output: RequestOutput) -> list[bytes]:
        events: list[bytes] = []
        # the engine's ids: a prompt's image placeholders are its images' tokens there
        self.prompt_ids = output.prompt_token_ids or self.prompt_ids
        for choice in output.outputs:
            state = self.progress.get(choice.index)
            if state is None:
                if not choice.token_ids and choice.finish_reason is None:
                    continue  # the role chunk waits for the first token
                state = self.progress[choice.index] = ChoiceProgress()
                events.append(
                    self._chunk(
                        ChatStreamChoice(choice.index, DeltaMessage(role=self.role, content="")),
                        state,
                    )
                )
                if self.echo:
                    events.append(
                        self._chunk(
                            ChatStreamChoice(choice.index, DeltaMessage(content=self.echo)), state
                        )
                    )
            if state.take(choice, self.shows_tokens):
                self._choice_events(choice, state, events)
        return events

    def _choice_events(
        self, choice: CompletionOutput, state: ChoiceProgress, events: list[bytes]
    ) -> None:
        request = self.request
        finish_reason = choice.finish_reason
        messages = [DeltaMessage(content=choice.text)]
        if self.reader is not None:
            messages, finish_reason = self._read(choice)
            if not messages:  # all of it held back (maybe the start of a marker)
                if finish_reason is None and not (self.shows_tokens and choice.token_ids):
                    return
                messages = [DeltaMessage(content="")]
        logprobs = None
        if request.logprobs and choice.token_ids:
            logprobs = chat_logprobs(
                choice.token_ids,
                choice.logprobs or [],
                request.top_logprobs or 0,
                self.ctx.tokenizer,
                self.as_token_ids,
            )
        for message in messages[:-1]:
            events.append(self._chunk(ChatStreamChoice(choice.index, message), state))
        events.append(
            self._chunk(
                ChatStreamChoice(
                    choice.index,
                    messages[-1],
                    logprobs,
                    finish_reason,
                    choice.stop_reason,
                    list(choice.token_ids) if request.return_token_ids else None,
                ),
                state,
            )
        )

    def _read(self, choice: CompletionOutput) -> tuple[list[DeltaMessage], str | None]:
        """The reader's deltas for the choice's new text, and its finish reason."""
        output = self.outputs.get(choice.index)
        if output is None:
            output = self.outputs[choice.index] = self.reader.new_choice()
        finish_reason = choice.finish_reason
        messages = delta_messages(output.feed(choice.text, finish_reason is not None))
        if finish_reason is not None:
            finish_reason = self.reader.finish_reason(bool(output.tool_calls), finish_reason)
        return messages, finish_reason

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse(
            ChatCompletionStreamResponse(
                self.base_id, "chat.completion.chunk", self.created, self.model, [], usage
            )
        )


def _stream(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    base_id: str,
    created: int,
    prompt: TokensPrompt,
    stream: RequestStream,
    role: str,
    cache_key: bytes | None,
    reader: ChatOutputReader | None,
) -> AsyncGenerator[bytes, None]:
    include_usage, continuous_usage = usage_options(request)
    chunks = _ChatChunks(ctx, request, base_id, created, prompt, role, reader, continuous_usage)
    return stream_response(
        ctx,
        [stream],
        cache_key,
        len(prompt.prompt_token_ids),
        include_usage,
        chunks.progress,
        chunks.events,
        chunks.usage_chunk,
    )


def output_reader(ctx: ServingContext, tool_use: ToolUse) -> ChatOutputReader | None:
    """None when the text goes out as it is (no tools to read, no reasoning parser)."""
    tool_parser = tool_use.parser(ctx.auto_tool_parser)
    if tool_parser is None and ctx.reasoning_parser is None:
        return None
    return ChatOutputReader(
        ctx.reasoning_parser, tool_parser, tool_use.mode, None if tool_use.parallel else 1
    )


def constrain_for_tools(params, tool_use: ToolUse, reader: ChatOutputReader | None) -> None:
    """ "required" and a named function hold by constrained decoding; a parser (tool or
    reasoning) whose markers are special tokens needs them in the text."""
    constraint = tool_use.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise bad_request(
                'tool_choice "required" or a named function constrains the output '
                "itself; it cannot be combined with response_format or "
                "structured_outputs",
                "tool_choice",
            )
        params.structured_outputs = constraint
    if reader is not None and any(
        parser is not None and parser.keeps_special_tokens
        for parser in (reader.tool_parser, reader.reasoning_parser)
    ):
        params.skip_special_tokens = False


def _read_message(
    reader: ChatOutputReader, role: str, echo: str, text: str, finish_reason: str | None
) -> tuple[ChatMessage, str | None]:
    output = reader.new_choice()
    output.feed(text, True)
    content, reasoning = output.message_fields()
    if echo:
        content = echo + (content or "")
    calls = output.tool_calls
    return (
        ChatMessage(role, content, calls, reasoning),
        reader.finish_reason(bool(calls), finish_reason),
    )
