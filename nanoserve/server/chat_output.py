"""One chat choice's text read as the response shows it, when the server has a reasoning parser
or the request uses tools: the reasoning first (`reasoning_content`), then the rest read by the
tool-call parser (`content` and `tool_calls`); a tool parser that `reads_whole_output` (gpt-oss's
harmony) reads all of the text instead. Streamed and non-streamed responses go through the
same object, so a stream's pieces add up to the non-streamed message."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.server.reasoning_parsers import ReasoningParser
from nanoserve.server.schemas import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from nanoserve.server.tool_parsers import ToolCallDelta, ToolCallStream, ToolParser


@dataclass(slots=True)
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChatOutputReader:
    """What reads the choices of one request: the server's reasoning parser, the request's tool
    parser (None: no tool calls read), and at most how many calls (parallel_tool_calls=false: 1)."""

    reasoning_parser: ReasoningParser | None
    tool_parser: ToolParser | None
    tool_mode: str = "none"
    max_calls: int | None = None

    def new_choice(self) -> ChoiceOutput:
        return ChoiceOutput(self)

    def finish_reason(self, called_tools: bool, engine_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when auto found calls, or "required" ended normally; a named
        function ends as the engine ended it (as OpenAI answers a forced function)."""
        if self.tool_mode == "auto" and called_tools:
            return "tool_calls"
        if self.tool_mode == "required" and called_tools and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


class ChoiceOutput:
    """One choice read delta by delta. The reasoning parser's reader (or, without one, `split` on
    the whole text) and the tool stream keep their place, so a delta costs work in proportion to
    its length; the last delta is read with `split` on the whole text once."""

    def __init__(self, reader: ChatOutputReader) -> None:
        self.reader = reader
        self.chunks: list[str] = []  # the text so far
        self._reasoning: list[str] = []  # the reasoning sent so far
        self._reasoning_length = 0
        self._rest_seen = 0  # characters of the non-reasoning text handed to the tool stream
        parser = reader.reasoning_parser
        self.reasoning_reader = parser.reader() if parser is not None else None
        self.tool_stream = (
            ToolCallStream(reader.tool_parser, reader.max_calls)
            if reader.tool_parser is not None
            else None
        )
        self._content: list[str] = []

    @property
    def reasoning(self) -> str:
        return _joined(self._reasoning)

    @property
    def content(self) -> str:
        return _joined(self._content)

    def feed(self, delta: str, final: bool) -> ChoiceDelta:
        self.chunks.append(delta)
        reasoning, new_rest = self._split(delta, final)
        result = ChoiceDelta(reasoning)
        if self.tool_stream is None:
            result.content = new_rest
        elif self.tool_stream.parser.reads_whole_output:
            result.content, result.tool_calls = self.tool_stream.feed(delta, final)
        else:
            result.content, result.tool_calls = self.tool_stream.feed(new_rest, final)
        if result.content:
            self._content.append(result.content)
        return result

    def _split(self, delta: str, final: bool) -> tuple[str, str]:
        """The reasoning and the non-reasoning text this delta adds."""
        parser = self.reader.reasoning_parser
        if parser is None:
            return "", delta
        if self.reasoning_reader is not None and not final:
            reasoning, rest = self.reasoning_reader.feed(delta)
            if reasoning:
                self._reasoning.append(reasoning)
                self._reasoning_length += len(reasoning)
            self._rest_seen += len(rest)
            return reasoning, rest
        whole_reasoning, whole_rest = parser.split(_joined(self.chunks), final)
        reasoning = whole_reasoning[self._reasoning_length :]
        self._reasoning, self._reasoning_length = [whole_reasoning], len(whole_reasoning)
        rest = whole_rest[self._rest_seen :]
        self._rest_seen = len(whole_rest)
        return reasoning, rest

    @property
    def tool_calls(self) -> list[ToolCall]:
        if self.tool_stream is None:
            return []
        return [
            ToolCall(call.id, FunctionCall(call.name, call.arguments))
            for call in self.tool_stream.calls
        ]

    def message_fields(self) -> tuple[str | None, str | None]:
        """(content, reasoning_content) of the whole message: empty parts beside calls or
        reasoning are null."""
        content: str | None = self.content
        if not content and (self.tool_calls or self.reasoning):
            content = None
        return content, (self.reasoning or None) if self.reader.reasoning_parser else None


def _joined(pieces: list[str]) -> str:
    """The pieces as one string, kept as one piece from then on."""
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""


def delta_messages(delta: ChoiceDelta) -> list[DeltaMessage]:
    """The chunks one step's delta makes: reasoning and content together, then one chunk per
    tool-call piece (a call's first piece names it, the next ones carry argument text)."""
    messages = []
    if delta.reasoning or delta.content:
        messages.append(
            DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None)
        )
    for piece in delta.tool_calls:
        if piece.id is not None:
            call = DeltaToolCall(
                piece.index, DeltaFunctionCall(piece.name, piece.arguments), piece.id, "function"
            )
        else:
            call = DeltaToolCall(piece.index, DeltaFunctionCall(arguments=piece.arguments))
        messages.append(DeltaMessage(tool_calls=[call]))
    return messages
