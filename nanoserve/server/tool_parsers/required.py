"""Output constrained by tool_choice (server/tools.py builds the grammars): "required" writes a
JSON array `[{"name": ..., "parameters": {...}}, ...]`, a named function writes its arguments
object alone."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import (
    NO_ARGUMENTS,
    ToolCallParse,
    ToolCallReader,
    ToolCallSoFar,
    ToolParser,
    calls_in_json_array,
)
from nanoserve.server.tool_parsers.incremental import CallArrayReader, first_non_whitespace
from nanoserve.server.tool_parsers.json_reader import DEAD, OPEN
from nanoserve.server.tool_parsers.json_scan import WHITESPACE, skip_whitespace


class RequiredToolParser(ToolParser):
    name = "required"

    def reader(self) -> RequiredReader:
        return RequiredReader()

    def parse(self, text: str, final: bool) -> ToolCallParse:
        start = skip_whitespace(text, 0)
        if start >= len(text) or text[start] != "[":
            return ToolCallParse(text if final else "")
        calls = calls_in_json_array(text, start, final)
        return ToolCallParse("", calls) if calls is not None else ToolCallParse(text)


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def reader(self) -> NamedReader:
        return NamedReader(self.function_name)

    def parse(self, text: str, final: bool) -> ToolCallParse:
        arguments = text.strip() if final else text.lstrip().rstrip(WHITESPACE)
        if final:
            return ToolCallParse(
                "", [ToolCallSoFar(self.function_name, arguments or NO_ARGUMENTS, True)]
            )
        return ToolCallParse("", [ToolCallSoFar(self.function_name, arguments, False)])


class RequiredReader(ToolCallReader):
    """`RequiredToolParser.parse(text, False)` a delta at a time: no content until the array is
    read, its call objects as they come; once something in it is not an object, all of the output
    is content (and nothing more is read)."""

    def __init__(self) -> None:
        super().__init__()
        self.array: CallArrayReader | None = None
        self.waiting = True  # for the first non-whitespace character
        self.plain = False

    def feed(self, delta: str) -> str:
        self.seen.append(delta)
        if self.plain:
            return delta
        index = 0
        if self.waiting:
            index = first_non_whitespace(delta, index)
            if index >= len(delta):
                return ""
            self.waiting = False
            if delta[index] == "[":
                self.array = CallArrayReader(
                    self.calls, ("arguments", "parameters"), self.drop_if_nameless
                )
                index += 1
        if self.array is None or self.array.status != OPEN:
            return ""
        self.array.feed(delta, index)
        if self.array.status == DEAD:
            self.no_more_calls = True
            self.plain = True
            return self.text_so_far()
        return ""


class NamedCall:
    """A named function's call: its arguments are the whole output, whitespace around it left
    out (trailing whitespace waits, as it may be inside the arguments)."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.arguments: list[str] = []
        self.arguments_length = 0
        self.generation = 0
        self.status = OPEN
        self.steps = 0


class NamedReader(ToolCallReader):
    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.call = NamedCall(function_name)
        self.calls.append(self.call)
        self.started = False  # a character that str.lstrip() keeps has come
        self.trailing: list[str] = []  # whitespace at the end, not sent yet

    def feed(self, delta: str) -> str:
        if not self.started:
            delta = delta.lstrip()
            self.started = bool(delta)
        shown = delta.rstrip(WHITESPACE)
        if shown:
            self.trailing.append(shown)
            piece = "".join(self.trailing)
            self.call.arguments.append(piece)
            self.call.arguments_length += len(piece)
            self.trailing = []
        if len(shown) < len(delta):
            self.trailing.append(delta[len(shown) :])
        self.call.steps += len(delta)
        return ""
