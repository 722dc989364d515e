"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) over the chat
path, as vLLM's anthropic entrypoint: the request becomes chat messages, tools and a tool choice
(`any` and `tool` are chat's "required" and named function, held by the same grammar), the
model's chat template renders them, the chat path's reader splits the output into thinking, text
and tool calls, and the answer goes out as Anthropic's content blocks, or as its SSE events over
the shared streaming frame (streaming.py). Errors take Anthropic's shape and statuses."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.server.anthropic_schemas import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from nanoserve.server.chat import constrain_for_tools, output_reader, render_chat_prompt
from nanoserve.server.chat_output import ChatOutputReader, ChoiceOutput
from nanoserve.server.http.types import Response, StreamingResponse
from nanoserve.server.schemas import APIError, ChatCompletionRequest, OverloadedError
from nanoserve.server.schemas import Usage as ChatUsage
from nanoserve.server.serving import (
    INTERNAL_ERROR,
    ChoiceProgress,
    ServingContext,
    encode_json,
    to_api_error,
)
from nanoserve.server.streaming import stream_response
from nanoserve.server.tools import ToolUse, check_tool_use

logger = logging.getLogger("nanoserve.server")

PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# Anthropic's error types by status; any other 4xx is an invalid request, any other 5xx api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "try again later"; its clients retry it


def is_anthropic_path(path: str) -> bool:
    """The paths whose errors take Anthropic's shape (an unknown path below them too)."""
    return path == PATH or path.startswith(PATH + "/")


def _status_and_type(error: APIError) -> tuple[int, str]:
    if isinstance(error, OverloadedError):  # the waiting queue is full
        return OVERLOADED, ERROR_TYPES[OVERLOADED]
    status = error.status
    default = "invalid_request_error" if status < 500 else "api_error"
    return status, ERROR_TYPES.get(status, default)


def _error_payload(error: APIError) -> dict[str, Any]:
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": _status_and_type(error)[1], "message": message}}


def error_response(error: APIError) -> Response:
    """{"type": "error", "error": {"type", "message"}} with Anthropic's status."""
    status = _status_and_type(error)[0]
    return Response(status, encode_json(_error_payload(error)), headers=list(error.headers))


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + encode_json({"type": kind, **payload}) + b"\n\n"
    )


def _error_event(error: BaseException) -> bytes:
    """A failure after the 200 went out: Anthropic's `error` event, which ends the stream."""
    api_error = to_api_error(error)
    if api_error is None:  # a bug: the client gets no detail of it
        logger.error("a messages stream failed", exc_info=error)
        api_error = APIError(500, INTERNAL_ERROR)
    payload = _error_payload(api_error)
    return _event("error", {"error": payload["error"]})


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param)


# ---- the request as chat messages, tools and sampling fields ----


def _refuse_media(block: Any, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        raise _bad(
            f"{where}: {kind} content blocks are not supported (this server serves text only)",
            "messages",
        )


def _text_parts(blocks: list[TextBlock]) -> str | list[dict[str, str]]:
    """Text blocks as chat content: one string, or text parts as the chat endpoint takes them."""
    if len(blocks) == 1:
        return blocks[0].text
    return [{"type": "text", "text": block.text} for block in blocks]


def _tool_result(block: ToolResultBlock, where: str) -> dict[str, Any]:
    content = block.content
    if isinstance(content, list):
        for number, part in enumerate(content):
            _refuse_media(part, f"{where}.content[{number}]")
        content = "\n".join(part.text for part in content)
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""}


def _message(index: int, message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become `tool` messages
    (before its text, as Anthropic requires them first); an assistant's tool_use blocks its
    tool_calls and its thinking its reasoning_content."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    tools: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for number, block in enumerate(message.content):
        where = f"messages[{index}].content[{number}]"
        _refuse_media(block, where)
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise _bad(f"{where}: tool_result blocks belong in user messages", "messages")
            tools.append(_tool_result(block, where))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise _bad(f"{where}: tool_use blocks belong in assistant messages", "messages")
            arguments = json.dumps(block.input)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        else:  # redacted thinking: opaque, only another model could read it
            assert isinstance(block, RedactedThinkingBlock)
    if message.role == "user":
        return tools + ([{"role": "user", "content": _text_parts(texts)}] if texts else [])
    chat: dict[str, Any] = {
        "role": "assistant",
        "content": _text_parts(texts) if texts else (None if calls else ""),
    }
    if calls:
        chat["tool_calls"] = calls
    if thinking:
        chat["reasoning_content"] = "".join(thinking)
    return [chat]


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    if not request.messages:
        raise _bad("messages: at least one message is required", "messages")
    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, list):
        system = "".join(block.text for block in system)  # as vLLM joins them
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        messages += _message(index, message)
    if not messages or messages[-1]["role"] == "system":
        raise _bad("messages: no message has any content", "messages")
    return messages


def _prefilled(messages: list[dict[str, Any]]) -> bool:
    """A last assistant message (without tool calls) is Anthropic's prefill: the answer goes on
    from its text, as chat's continue_final_message renders it, instead of a new turn."""
    return messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]


def _tool_use(request: CountTokensRequest, auto_tools_enabled: bool) -> ToolUse:
    """Anthropic's tools and tool_choice as the chat endpoint's, checked by the same code."""
    tools = None
    if request.tools is not None:
        tools = []
        for tool in request.tools:
            function: dict[str, Any] = {"name": tool.name}
            if tool.description is not None:
                function["description"] = tool.description
            function["parameters"] = tool.input_schema
            tools.append({"type": "function", "function": function})
    choice: Any = None
    parallel = True
    if request.tool_choice is not None:
        kind = request.tool_choice.type
        if kind == "tool":
            if not request.tool_choice.name:
                raise _bad("tool_choice: `name` is required with type `tool`", "tool_choice")
            choice = {"type": "function", "function": {"name": request.tool_choice.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        parallel = not request.tool_choice.disable_parallel_tool_use
    return check_tool_use(tools, choice, parallel, auto_tools_enabled)


def _template_kwargs(
    ctx: ServingContext, request: CountTokensRequest, max_tokens: int | None
) -> dict[str, Any] | None:
    """`thinking` as the template's enable_thinking (Qwen3's switch; other templates ignore it).
    Its budget is checked as Anthropic checks it (below max_tokens) but not enforced: the
    thinking counts toward max_tokens."""
    thinking = request.thinking
    if thinking is None:
        return None
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    if ctx.reasoning_parser is None:
        raise _bad(
            "thinking: this server has no reasoning parser to read thinking with (start it "
            "with --reasoning-parser)",
            "thinking",
        )
    budget = thinking.budget_tokens
    if budget is None or budget < 1:
        raise _bad("thinking.budget_tokens: a positive number is required", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("thinking.budget_tokens: must be less than max_tokens", "thinking")
    return {"enable_thinking": True}


def _chat_request(
    request: MessagesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The sampling fields, as the chat endpoint reads them."""
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=request.stop_sequences,
        stream=request.stream,
        request_id=request.request_id,
    )


async def count_tokens(ctx: ServingContext, request: CountTokensRequest) -> Response:
    """The prompt's tokens through the same template and tools as a message with them."""
    ctx.check_model(request.model)
    messages = chat_messages(request)
    tool_use = _tool_use(request, True)  # counting needs no parser, only the rendered tools
    prefill = _prefilled(messages)
    prompt = await render_chat_prompt(
        ctx,
        messages,
        not prefill,
        prefill,
        None,
        _template_kwargs(ctx, request, None),
        False,
        tools=tool_use.tools,
    )
    return Response(200, encode_json({"input_tokens": len(prompt.prompt_token_ids)}))


# ---- the answer ----


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _signature() -> str:
    """Anthropic signs thinking for its own checks; clients only carry it back. Nothing here
    reads it, so it is random."""
    return uuid.uuid4().hex


def _stop(
    choice: CompletionOutput, called_tools: bool, stop_sequences: list[str] | None
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    matched = choice.stop_reason
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:  # cut by max_tokens: the stream's partial JSON also parses to nothing
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(reader: ChatOutputReader | None, text: str) -> list[dict[str, Any]]:
    """A whole output as content blocks: thinking, text, then one tool_use per call."""
    if reader is None:
        return [{"type": "text", "text": text}] if text else []
    output = reader.new_choice()
    output.feed(text, True)
    blocks: list[dict[str, Any]] = []
    if output.reasoning:
        blocks.append({"type": "thinking", "thinking": output.reasoning, "signature": _signature()})
    if output.content:
        blocks.append({"type": "text", "text": output.content})
    for call in output.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": _tool_use_id(),
                "name": call.function.name,
                "input": _tool_input(call.function.arguments),
            }
        )
    return blocks


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens - cached_tokens, output_tokens, 0, cached_tokens)


def _message_body(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


async def create_message(ctx: ServingContext, request: MessagesRequest):
    lora = ctx.check_model(request.model)
    if request.max_tokens < 1:
        raise _bad("max_tokens: must be at least 1", "max_tokens")
    if request.metadata is not None and request.metadata.user_id is not None:
        logger.debug("messages request for user %r", request.metadata.user_id)
    messages = chat_messages(request)
    chat = _chat_request(request, messages)
    tool_use = _tool_use(request, ctx.auto_tool_parser is not None)
    kwargs = _template_kwargs(ctx, request, request.max_tokens)
    # Every check of the request before its prompt is rendered and tokenized, the costly part.
    params = ctx.sampling_params(chat, request.max_tokens, None)
    reader = output_reader(ctx, tool_use)
    constrain_for_tools(params, tool_use, reader)
    prefill = _prefilled(messages)
    prompt = await render_chat_prompt(
        ctx, messages, not prefill, prefill, None, kwargs, False, tools=tool_use.tools
    )
    message_id = f"msg_{request.request_id or uuid.uuid4().hex[:24]}"
    cache_key, streams = ctx.cached_streams(message_id, [prompt], params, lora)
    if streams is None:
        streams = await ctx.submit(message_id, [prompt], params, 0, lora)
    model = ctx.response_model(request.model)
    prompt_tokens = len(prompt.prompt_token_ids)
    if request.stream:
        events = _MessageEvents(message_id, model, reader, request.stop_sequences)
        return StreamingResponse(
            stream_response(
                ctx,
                streams,
                cache_key,
                prompt_tokens,
                True,
                events.progress,
                events.events,
                events.closing,
                opening=events.opening(prompt_tokens),
                closing=b"",
                error_event=_error_event,
            )
        )
    final = (await ctx.final_outputs(streams))[0]
    ctx.store_response(cache_key, [final])
    choice = final.outputs[0]
    content = _blocks(reader, choice.text)
    called = any(block["type"] == "tool_use" for block in content)
    usage = _usage(prompt_tokens, len(choice.token_ids), final.num_cached_tokens)
    stop = _stop(choice, called, request.stop_sequences)
    return Response(200, encode_json(_message_body(message_id, model, content, stop, usage)))


class _MessageEvents:
    """One streamed message's events: message_start and a ping at once, then a content block
    per kind of output as it starts (thinking, text, each tool call; the open one is stopped
    when another starts), and message_delta (stop reason, usage) and message_stop at the end."""

    def __init__(
        self,
        message_id: str,
        model: str,
        reader: ChatOutputReader | None,
        stop_sequences: list[str] | None,
    ) -> None:
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.output: ChoiceOutput | None = reader.new_choice() if reader is not None else None
        self.progress: dict[int, ChoiceProgress] = {}
        self.index = -1  # the last block started
        self.open: str | None = None  # the open block's type
        self.call_index: int | None = None  # the tool call whose block is open
        self.called = False
        self.cached = 0
        self.stop: tuple[str | None, str | None] = (None, None)

    def opening(self, prompt_tokens: int) -> bytes:
        usage = _usage(prompt_tokens, 0, 0)
        message = _message_body(self.message_id, self.model, [], (None, None), usage)
        return _event("message_start", {"message": message}) + _event("ping", {})

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop_block()
        self.index += 1
        self.open = block["type"]
        events.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return events

    def _stop_block(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": _signature()}
            events.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        events.append(_event("content_block_stop", {"index": self.index}))
        self.open = self.call_index = None
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def _text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self.open != kind:
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events += self._start(block)
        field = "thinking" if kind == "thinking" else "text"
        events.append(self._delta({"type": f"{kind}_delta", field: text}))
        return events

    def _tool_piece(self, piece) -> list[bytes]:
        events: list[bytes] = []
        if piece.id is not None:
            block = {"type": "tool_use", "id": _tool_use_id(), "name": piece.name, "input": {}}
            events += self._start(block)
            self.call_index, self.called = piece.index, True
        if piece.arguments and piece.index == self.call_index:
            events.append(
                self._delta({"type": "input_json_delta", "partial_json": piece.arguments})
            )
        return events

    def events(self, _: int, output: RequestOutput) -> list[bytes]:
        self.cached = output.num_cached_tokens
        events: list[bytes] = []
        for choice in output.outputs:
            state = self.progress.setdefault(choice.index, ChoiceProgress())
            if not state.take(choice, False):
                continue
            final = choice.finish_reason is not None
            if self.output is None:
                if choice.text:
                    events += self._text("text", choice.text)
            else:
                delta = self.output.feed(choice.text, final)
                if delta.reasoning:
                    events += self._text("thinking", delta.reasoning)
                if delta.content:
                    events += self._text("text", delta.content)
                for piece in delta.tool_calls:
                    events += self._tool_piece(piece)
            if final:
                self.stop = _stop(choice, self.called, self.stop_sequences)
        return events

    def closing(self, usage: ChatUsage) -> bytes:
        """The last events: the open block's stop, message_delta and message_stop."""
        events = self._stop_block()
        total = _usage(usage.prompt_tokens, usage.completion_tokens, self.cached)
        delta = {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}
        events.append(_event("message_delta", {"delta": delta, "usage": total}))
        events.append(_event("message_stop", {}))
        return b"".join(events)
