"""POST /v1/responses (OpenAI's Responses API), streamed and not, over the chat path: the request
becomes chat messages (responses_input.py), the model's chat template renders them, the output is
read by the chat path's reader (reasoning, content, tool calls) and returned as Responses output
items: `reasoning`, `message` (output_text) and `function_call`. Streams send the Responses event
types (response.created ... response.completed), each with its sequence_number.
GET / DELETE /v1/responses/{id} read and drop stored responses."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from nanoserve.outputs import CompletionOutput
from nanoserve.server.chat import (
    constrain_for_tools,
    output_reader,
    render_chat_prompt,
    template_kwargs_with_effort,
)
from nanoserve.server.chat_output import ChatOutputReader, ChoiceOutput
from nanoserve.server.http.types import Response, StreamingResponse
from nanoserve.server.responses_input import (
    ResponsesRequest,
    ResponseStore,
    as_chat_request,
    check_unsupported,
    input_messages,
    reasoning_effort,
)
from nanoserve.server.schemas import APIError
from nanoserve.server.serving import (
    ServingContext,
    encode_json,
    random_id,
    response_id,
    to_api_error,
)
from nanoserve.server.tools import check_tool_use


class ResponseShell:
    """The fields of a response object that do not depend on what was generated."""

    def __init__(self, ctx: ServingContext, request: ResponsesRequest, rid: str) -> None:
        self.id, self.created = rid, int(time.time())
        self.fields = {
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": ctx.response_model(request.model),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "store": request.store is not False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "truncation": "disabled",
            "user": request.user,
        }

    def build(
        self, status: str, output: list[dict], usage: dict | None, reason: str | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "output": output,
            "usage": usage,
            **self.fields,
        }


def _usage(
    ctx: ServingContext, prompt_tokens: int, output_tokens: int, cached: int, reasoning: str
) -> dict[str, Any]:
    reasoning_tokens = (
        len(ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    )
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _output_items(reader: ChatOutputReader | None, text: str) -> tuple[list[dict], str]:
    """The output items of a whole answer, and its reasoning text."""
    if reader is None:
        return [_message_item(random_id("msg"), text, "completed")], ""
    output = reader.new_choice()
    output.feed(text, True)
    items = []
    if output.reasoning:
        items.append(_reasoning_item(random_id("rs"), output.reasoning, "completed"))
    if output.content or not output.tool_calls:
        items.append(_message_item(random_id("msg"), output.content, "completed"))
    for call in output.tool_calls:
        items.append(
            _call_item(
                random_id("fc"), call.id, call.function.name, call.function.arguments, "completed"
            )
        )
    return items, output.reasoning


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _as_messages(items: list[dict]) -> list[dict[str, Any]]:
    """A response's output as chat messages, for a later request's previous_response_id."""
    messages: list[dict[str, Any]] = []
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    if text or calls:
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
    return messages


async def create_response(ctx: ServingContext, store: ResponseStore, request: ResponsesRequest):
    lora = ctx.check_model(request.model)
    check_unsupported(request)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        previous = store.get(request.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"Response with id '{request.previous_response_id}' not found "
                "(it was not stored, or it expired).",
                "previous_response_id",
            )
        history = previous.conversation()
    messages = input_messages(request, history)
    chat = as_chat_request(request, messages)
    tool_use = check_tool_use(
        chat.tools, chat.tool_choice, chat.parallel_tool_calls, ctx.auto_tool_parser is not None
    )
    # Every check before the prompt is rendered and tokenized, the costly part.
    params = ctx.sampling_params(chat, request.max_output_tokens, None)
    reader = output_reader(ctx, tool_use)
    constrain_for_tools(params, tool_use, reader)
    effort = template_kwargs_with_effort(None, reasoning_effort(request), "reasoning")
    prompt = await render_chat_prompt(
        ctx, messages, True, False, None, effort, False, tools=tool_use.tools
    )
    shell = ResponseShell(ctx, request, response_id("resp", request.request_id))
    stream = (await ctx.submit(shell.id, [prompt], params, request.priority, lora))[0]
    conversation = messages[1:] if request.instructions else messages
    prompt_tokens = len(prompt.prompt_token_ids)
    if request.stream:
        writer = StreamWriter(ctx, shell, reader)
        return StreamingResponse(
            writer.run(
                stream, store if request.store is not False else None, conversation, prompt_tokens
            )
        )
    final = (await ctx.final_outputs([stream]))[0]
    choice = final.outputs[0]
    items, reasoning = _output_items(reader, choice.text)
    status, reason = _status(choice.finish_reason)
    usage = _usage(ctx, prompt_tokens, len(choice.token_ids), final.num_cached_tokens, reasoning)
    response = shell.build(status, items, usage, reason)
    if request.store is not False:
        return Response(200, _keep(store, response, conversation + _as_messages(items))[1])
    return Response(200, encode_json(response))


def _keep(
    store: ResponseStore, response: dict[str, Any], conversation: list[dict[str, Any]]
) -> tuple[dict[str, Any], bytes]:
    """Stores the response; one larger than the store's whole byte budget is not kept, and
    the response returned says so (`store: false`), as a later previous_response_id gets 404."""
    body = encode_json(response)
    if store.put(response["id"], body, conversation):
        return response, body
    response = dict(response, store=False)
    return response, encode_json(response)


class StreamWriter:
    """One streamed response: opens an output item when its kind of text starts (reasoning,
    message, each function call), closes the open one when another kind starts, and ends with
    response.completed (or response.incomplete) holding the whole response."""

    def __init__(
        self, ctx: ServingContext, shell: ResponseShell, reader: ChatOutputReader | None
    ) -> None:
        self.ctx, self.shell, self.reader = ctx, shell, reader
        self.sequence = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item whose deltas are being sent
        self.calls: dict[int, dict] = {}  # tool call index -> its item

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode_json(payload) + b"\n\n"

    def _index(self, item: dict) -> int:
        return self.items.index(item)

    def _start(self, item: dict) -> list[bytes]:
        events = self.close()
        self.items.append(item)
        self.open = item
        events.append(
            self.event(
                "response.output_item.added",
                output_index=self._index(item),
                item=dict(item, content=[]) if "content" in item else dict(item),
            )
        )
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(item),
                    content_index=0,
                    part=_text_part(""),
                )
            )
        return events

    def text(self, kind: str, delta: str) -> list[bytes]:
        events: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            maker = _message_item if kind == "message" else _reasoning_item
            prefix = "msg" if kind == "message" else "rs"
            events += self._start(maker(random_id(prefix), "", "in_progress"))
        item = self.open
        item["content"][0]["text"] += delta
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(
                name,
                item_id=item["id"],
                output_index=self._index(item),
                content_index=0,
                delta=delta,
                **extra,
            )
        )
        return events

    def tool_piece(self, piece) -> list[bytes]:
        events: list[bytes] = []
        if piece.id is not None:
            item = _call_item(random_id("fc"), piece.id, piece.name or "", "", "in_progress")
            self.calls[piece.index] = item
            events += self._start(item)
        item = self.calls[piece.index]
        if piece.arguments:
            item["arguments"] += piece.arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._index(item),
                    delta=piece.arguments,
                )
            )
        return events

    def close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = self._index(item), []
        item["status"] = "completed"
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=item["content"][0],
                )
            )
        elif item["type"] == "reasoning":
            events.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def feed(self, choice: CompletionOutput, output: ChoiceOutput | None) -> list[bytes]:
        final = choice.finish_reason is not None
        if output is None:
            return self.text("message", choice.text) if choice.text else []
        delta = output.feed(choice.text, final)
        events = []
        if delta.reasoning:
            events += self.text("reasoning", delta.reasoning)
        if delta.content:
            events += self.text("message", delta.content)
        for piece in delta.tool_calls:
            events += self.tool_piece(piece)
        return events

    async def run(
        self, stream, store: ResponseStore | None, conversation: list[dict], prompt_tokens: int
    ) -> AsyncGenerator[bytes, None]:
        shell = self.shell
        output = self.reader.new_choice() if self.reader is not None else None
        try:
            yield (
                self.event("response.created", response=shell.build("in_progress", [], None))
                + self.event("response.in_progress", response=shell.build("in_progress", [], None))
            )
            tokens, cached, finish_reason = 0, 0, None
            async for delta in stream:
                cached = delta.num_cached_tokens
                choice = delta.outputs[0] if delta.outputs else None
                if choice is None:
                    continue
                tokens += len(choice.token_ids)
                finish_reason = choice.finish_reason or finish_reason
                events = self.feed(choice, output)
                if events:
                    yield b"".join(events)
            yield self._finish(
                store, conversation, prompt_tokens, tokens, cached, finish_reason, output
            )
        except Exception as error:  # after the 200 went out: report in-band, then end the stream
            api_error = to_api_error(error) or APIError(500, "internal error")
            yield self.event(
                "error",
                code=str(api_error.status),
                message=api_error.message,
                param=api_error.param,
            )
        finally:
            self.ctx.abort_unfinished([stream])

    def _finish(
        self, store, conversation, prompt_tokens, tokens, cached, finish_reason, output
    ) -> bytes:
        events = []
        if not self.items:  # nothing was generated: an empty message, as the non-streamed answer
            events += self.text("message", "")
        events += self.close()
        status, reason = _status(finish_reason)
        reasoning = output.reasoning if output is not None else ""
        body = self.shell.build(
            status, self.items, _usage(self.ctx, prompt_tokens, tokens, cached, reasoning), reason
        )
        if store is not None:
            body = _keep(store, body, conversation + _as_messages(self.items))[0]
        name = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self.event(name, response=body))
        return b"".join(events)
