"""A choice's tool calls as the model writes them. Each delta goes to the parser's reader, which
keeps its place between deltas (so a delta costs work in proportion to its own length, not to the
text so far), and what it adds goes out: content, a call's first delta (index, id, type, name,
empty arguments), then argument fragments. The pieces concatenate to exactly what the same
parser's `parse` gives for the whole output: the last delta (final) is read with `parse` on the
whole text once, and what it adds to what was sent goes out too. The non-streamed response feeds
the whole text once. A parser without a reader is re-parsed on the whole text after each delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.server.tool_parsers.base import ToolCallReader, ToolParser
from nanoserve.server.tool_parsers.json_reader import OPEN


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    """A call as sent so far: its arguments are the pieces sent."""

    id: str
    name: str
    pieces: list[str] = field(default_factory=list)
    length: int = 0
    # Which of the reader's arguments values the pieces follow, whether it extends what was sent
    # (None: not known until it is longer), and how many of its pieces have been sent.
    generation: int = -1
    extends: bool | None = None
    cursor: int = 0

    @property
    def arguments(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def send(self, piece: str) -> str:
        self.pieces.append(piece)
        self.length += len(piece)
        return piece


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.reader: ToolCallReader | None = parser.reader()
        self.chunks: list[str] = []  # the text so far
        self.content_pieces: list[str] = []  # the content sent so far
        self.content_length = 0
        self.calls: list[ToolCall] = []  # the calls sent so far, their arguments as sent
        self._settled = 0  # the reader's calls before this one are read and sent

    @property
    def content(self) -> str:
        if len(self.content_pieces) > 1:
            self.content_pieces[:] = ["".join(self.content_pieces)]
        return self.content_pieces[0] if self.content_pieces else ""

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Add text; returns the new content and the tool-call deltas it completes."""
        self.chunks.append(delta)
        if final or self.reader is None:
            return self._feed_whole(final)
        content = self._send_content(self.reader.feed(delta))
        deltas: list[ToolCallDelta] = []
        if self.reader.no_more_calls:
            return content, deltas
        calls = self.reader.calls
        limit = len(calls) if self.max_calls is None else min(len(calls), self.max_calls)
        for index in range(self._settled, limit):
            call = calls[index]
            if call.name is None:
                break  # only the last call can be waiting for its name
            self._send_call(index, call, deltas)
            if call.status != OPEN:
                self._settled = index + 1
        return content, deltas

    def _send_content(self, content: str) -> str:
        if content:
            self.content_pieces.append(content)
            self.content_length += len(content)
        return content

    def _send_call(self, index: int, call, deltas: list[ToolCallDelta]) -> None:
        """The call's first delta if it is new, then its arguments beyond what was sent, when
        they extend it (a repeated key can start them over)."""
        if index == len(self.calls):
            self.calls.append(ToolCall(self.parser.new_call_id(), call.name))
            deltas.append(ToolCallDelta(index, self.calls[index].id, call.name, ""))
        sent = self.calls[index]
        if call.generation != sent.generation:
            sent.generation, sent.extends, sent.cursor = call.generation, None, 0
        if call.arguments_length <= sent.length:
            return
        pieces = call.arguments
        if sent.extends is None:
            sent.extends = True
            if sent.length:
                whole = "".join(pieces)
                sent.extends = whole.startswith(sent.arguments)
                if sent.extends:
                    sent.cursor = len(pieces)
                    deltas.append(ToolCallDelta(index, arguments=sent.send(whole[sent.length :])))
                return
        if sent.extends:
            new = "".join(pieces[sent.cursor :])
            sent.cursor = len(pieces)
            deltas.append(ToolCallDelta(index, arguments=sent.send(new)))

    def _feed_whole(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Parse the whole text and send what it adds to what was sent."""
        if len(self.chunks) > 1:
            self.chunks[:] = ["".join(self.chunks)]
        parsed = self.parser.parse(self.chunks[0], final)
        content = ""
        if len(parsed.content) > self.content_length and parsed.content.startswith(self.content):
            content = self._send_content(parsed.content[self.content_length :])
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(parsed.calls[: self.max_calls]):
            if index == len(self.calls):
                self.calls.append(ToolCall(self.parser.new_call_id(), call.name))
                deltas.append(ToolCallDelta(index, self.calls[index].id, call.name, ""))
            sent = self.calls[index]
            if len(call.arguments) > sent.length and call.arguments.startswith(sent.arguments):
                deltas.append(
                    ToolCallDelta(index, arguments=sent.send(call.arguments[sent.length :]))
                )
        return content, deltas
