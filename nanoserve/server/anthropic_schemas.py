"""Anthropic's Messages API request shapes (POST /v1/messages and /v1/messages/count_tokens) as
msgspec Structs. Unlike the OpenAI shapes, unknown fields are refused (a 400 naming them): a
field a client counts on and the server would drop is an error, not a silent change of meaning.
Content blocks are a tagged union on `type`; an unknown type is a 400 naming its path. Block
fields nanoserve has no use for but clients send (`cache_control`, `citations`) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from nanoserve.server.schemas import StopStrings


class _Block(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    """A content block; `cache_control` is accepted on every block (the prefix cache needs no
    breakpoints: every shared prefix is reused)."""

    cache_control: dict[str, Any] | None = None


class TextBlock(_Block, tag="text"):
    text: str = ""
    citations: list[Any] | None = None


class ImageBlock(_Block, tag="image"):
    source: Any = None


class DocumentBlock(_Block, tag="document"):
    source: Any = None
    title: str | None = None
    context: str | None = None
    citations: Any = None


class ToolUseBlock(_Block, tag="tool_use"):
    id: str = ""
    name: str = ""
    input: dict[str, Any] = {}


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str = ""
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str = ""


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    """A client tool; Anthropic's server tools (web search, code execution...) have no
    `input_schema` and are refused by the decoder."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class CountTokensRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: StopStrings | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    stream: bool = False
    cache_control: dict[str, Any] | None = None  # automatic caching: the prefix cache does it
    request_id: str | None = None  # X-Request-Id sets it, as on the OpenAI routes


class Usage(msgspec.Struct):
    """input_tokens counts the prompt tokens the prefix cache did not hold (Anthropic's
    meaning): input_tokens + cache_read_input_tokens is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
