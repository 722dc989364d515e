"""A choice's tool calls as the model writes them: the parser reads the whole text so far after
each delta and the differences go out, so the streamed pieces of each call (its first delta with
index, id, type, name and empty arguments, then argument fragments) concatenate to exactly what
the same parser gives for the whole output. The non-streamed response feeds the whole text once."""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.server.tool_parsers.base import ToolParser


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.text = ""
        self.content = ""  # the content sent so far
        self.calls: list[ToolCall] = []  # the calls sent so far, their arguments as sent

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Add text; returns the new content and the tool-call deltas it completes."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = ""
        if len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            content = parsed.content[len(self.content):]
            self.content = parsed.content
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(parsed.calls[:self.max_calls]):
            if index == len(self.calls):
                self.calls.append(ToolCall(self.parser.new_call_id(), call.name, ""))
                deltas.append(ToolCallDelta(index, self.calls[index].id, call.name, ""))
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                deltas.append(ToolCallDelta(index, arguments=call.arguments[len(sent.arguments):]))
                sent.arguments = call.arguments
        return content, deltas
