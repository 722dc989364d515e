"""The Responses API's request (POST /v1/responses) read into what the chat path takes: its
`input` items and `instructions` as chat messages, its function tools and `tool_choice` in the
chat shape, `text.format` as a `response_format`, and the fields nanoserve does not serve refused
with a 400 naming them. Also the bounded in-memory store behind `store` / `previous_response_id`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from nanoserve.server.schemas import (
    MAX_METADATA_KEY_CHARS,
    APIError,
    ChatCompletionRequest,
    Metadata,
)


class ResponsesRequest(msgspec.Struct):
    input: Any = None  # a string, or a list of items (messages, function calls and outputs)
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = (
        None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None  # OpenAI's limits: the decoder's, and check_unsupported's
    user: str | None = None
    service_tier: str | None = None  # accepted: one tier here
    truncation: str | None = None  # "disabled" (the default) only
    # vLLM's extensions, as on the chat endpoint
    request_id: str | None = None
    priority: int = 0
    seed: int | None = None
    top_k: int | None = None
    # OpenAI fields nanoserve does not serve: refused when set (see UNSUPPORTED)
    reasoning: Any = None
    background: bool | None = None
    include: list[Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None


UNSUPPORTED = {
    "background": "background responses are not supported",
    "include": "`include` is not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "`max_tool_calls` is not supported",
    "prompt": "prompt templates are not supported",
    "conversation": "conversations are not supported (use previous_response_id)",
}


def bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


def reasoning_effort(request: ResponsesRequest) -> str | None:
    """`reasoning: {"effort": ...}`, handed to the chat template as the chat endpoint's
    reasoning_effort; a reasoning summary is refused (nothing writes one)."""
    reasoning = request.reasoning
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {
        "effort",
        "summary",
        "generate_summary",
    }:
        raise bad("reasoning must be an object with `effort`", "reasoning")
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise bad("reasoning summaries are not supported", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad("reasoning.effort must be a string", "reasoning")
    return effort


def check_unsupported(request: ResponsesRequest) -> None:
    for name, why in UNSUPPORTED.items():
        value = getattr(request, name)
        if value is not None and value is not False and value != []:
            raise bad(why, name)
    if request.truncation not in (None, "disabled"):
        raise bad('only truncation "disabled" is supported', "truncation")
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise bad("max_output_tokens must be at least 1", "max_output_tokens")
    if request.metadata and max(map(len, request.metadata)) > MAX_METADATA_KEY_CHARS:
        raise bad(
            f"`metadata` keys may hold at most {MAX_METADATA_KEY_CHARS} characters", "metadata"
        )


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad(
                f"{where}: content parts of type {kind!r} are not supported (text only)", "input"
            )
        else:
            raise bad(f"{where}: unknown content part {kind!r}", "input")
    return "".join(texts)


def _item_messages(item: Any, index: int) -> list[dict[str, Any]]:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(
                f"{where}: role must be user, assistant, system or developer, got {role!r}", "input"
            )
        return [
            {
                "role": "system" if role == "developer" else role,
                "content": _text_of(item.get("content"), where),
            }
        ]
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise bad(f"{where}: a function_call item needs `name` and `call_id`", "input")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
        }
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad(f"{where}: a function_call_output item needs `call_id`", "input")
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, where)
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": text}]
    if kind == "reasoning":
        return []  # a previous turn's reasoning is not shown to the model again
    raise bad(f"{where}: items of type {kind!r} are not supported", "input")


def input_messages(
    request: ResponsesRequest, history: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """instructions (as a system message; they do not carry over from a previous response),
    then the previous response's conversation, then this request's input."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages.extend(history)
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    elif isinstance(request.input, list) and request.input:
        for index, item in enumerate(request.input):
            messages.extend(_item_messages(item, index))
    else:
        raise bad("input must be a string or a non-empty list of items", "input")
    # Consecutive assistant tool-call items are one assistant turn with several calls.
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if (
            previous is not None
            and message.get("tool_calls")
            and previous.get("tool_calls")
            and previous.get("content") is None
        ):
            # A new dict: `previous` may be the caller's (never change what was handed in).
            merged[-1] = dict(previous, tool_calls=previous["tool_calls"] + message["tool_calls"])
        else:
            merged.append(message)
    return merged


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(
                f'tools[{index}]: only tools of type "function" are supported, got {kind!r}',
                "tools",
            )
        function = {
            key: tool[key]
            for key in ("name", "description", "parameters", "strict")
            if tool.get(key) is not None
        }
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": N} is the chat API's {"type": "function", "function": {"name": N}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    spec = text.get("format") if isinstance(text, dict) else None
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise bad("text.format of type json_schema needs a `schema` object", "text")
        return {
            "type": "json_schema",
            "json_schema": {
                "name": spec.get("name", "response"),
                "schema": spec["schema"],
                "strict": spec.get("strict"),
            },
        }
    raise bad(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text"
    )


def as_chat_request(
    request: ResponsesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        tools=chat_tools(request.tools),
        tool_choice=chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=response_format(request.text),
        stream=bool(request.stream),
        user=request.user,
        priority=request.priority,
        request_id=request.request_id,
    )


DEFAULT_STORE_MAX_BYTES = 256 * 2**20  # --responses-store-max-bytes


@dataclass(slots=True)
class StoredResponse:
    """A response as bytes: its JSON as returned and its conversation's JSON. Bytes cannot be
    changed by a later request, and their length is what the store counts."""

    body: bytes  # the response object as returned
    conversation_json: bytes  # its input messages and its output, for continuations
    expires: float

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation_json)

    def conversation(self) -> list[dict[str, Any]]:
        """A fresh copy of the conversation, for one continuation to extend as it likes."""
        return msgspec.json.decode(self.conversation_json)


class ResponseStore:
    """Responses kept for `previous_response_id` and GET /v1/responses/{id}: at most
    `max_entries` and `max_bytes` (the stored JSON's bytes; the oldest go first), each for `ttl`
    seconds. A response larger than the whole budget is not kept. In memory: a restart forgets
    them (the error then says the id is unknown)."""

    def __init__(
        self,
        max_entries: int = 1000,
        ttl: float = 3600.0,
        clock=time.monotonic,
        max_bytes: int = DEFAULT_STORE_MAX_BYTES,
    ) -> None:
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self.total_bytes = 0  # the sizes of the entries held
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, body: bytes, conversation: list[dict[str, Any]]) -> bool:
        """Keeps the response, evicting the oldest while over a bound; False (nothing kept) when
        it alone is larger than `max_bytes`."""
        self.delete(response_id)
        entry = StoredResponse(body, msgspec.json.encode(conversation), self.clock() + self.ttl)
        if entry.size > self.max_bytes:
            return False
        self._entries[response_id] = entry
        self.total_bytes += entry.size
        self._drop_expired()
        while len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
            self._pop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires < self.clock():
            self._pop(response_id)
            return None
        return entry

    def delete(self, response_id: str) -> bool:
        return self._pop(response_id) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.total_bytes -= entry.size
        return entry

    def _drop_expired(self) -> None:
        """Entries expire in the order they were put (one ttl): drop them from the front, so
        that bytes nobody can read do not push out live entries."""
        now = self.clock()
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if entry.expires >= now:
                break
            self._pop(response_id)
