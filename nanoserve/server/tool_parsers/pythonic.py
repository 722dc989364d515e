"""Llama 3.2 small models (and Llama 4): the whole output is a Python list of calls,
`[get_weather(city="Paris"), now()]`, maybe inside `<|python_start|>...<|python_end|>`. Arguments
must be literals; they are sent as JSON. A call is streamed once its closing parenthesis is
there (its arguments are only JSON once the Python call is whole)."""

from __future__ import annotations

import ast
import json

from nanoserve.server.tool_parsers.base import (
    ToolCallParse,
    ToolCallReader,
    ToolCallSoFar,
    ToolParser,
)
from nanoserve.server.tool_parsers.json_reader import CLOSED

START = "<|python_start|>"
END = "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def reader(self) -> PythonicReader:
        return PythonicReader()

    def parse(self, text: str, final: bool) -> ToolCallParse:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].strip()
        elif not final and START.startswith(body):
            return ToolCallParse("")
        if body.endswith(END):
            body = body[: -len(END)].strip()
        if not body:
            return ToolCallParse(text if final else "")
        if body[0] != "[":
            return ToolCallParse(text)
        if final:
            calls = _calls_in(body)
            return ToolCallParse("", calls) if calls is not None else ToolCallParse(text)
        return ToolCallParse("", _whole_calls_so_far(body))


def _calls_in(source: str) -> list[ToolCallSoFar] | None:
    """The calls of a whole `[f(a=1), g()]`, or None when it is not one."""
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for element in tree.body.elts:
        if not (
            isinstance(element, ast.Call)
            and isinstance(element.func, ast.Name)
            and not element.args
        ):
            return None
        arguments = {}
        for keyword in element.keywords:
            if keyword.arg is None:
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError:
                return None
        try:
            text = json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError):  # a set, bytes or complex number has no JSON
            return None
        calls.append(ToolCallSoFar(element.func.id, text, True))
    return calls


def _whole_calls_so_far(body: str) -> list[ToolCallSoFar]:
    """The calls whose closing parenthesis has come: cut after the last call closed at the list's
    top level, close the list, and read that."""
    depth = 0
    quote = ""
    last_closed = -1
    index = 1
    while index < len(body):
        char = body[index]
        if quote:
            if char == "\\":
                index += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0 and char == ")":
                last_closed = index
            if depth < 0:
                break
        index += 1
    if last_closed < 0:
        return []
    return _calls_in(body[: last_closed + 1] + "]") or []


class WholeCall:
    """A call read once its closing parenthesis came: its arguments whole."""

    def __init__(self, call: ToolCallSoFar) -> None:
        self.name: str | None = call.name
        self.arguments = [call.arguments]
        self.arguments_length = len(call.arguments)
        self.generation = 0
        self.status = CLOSED


class PythonicReader(ToolCallReader):
    """`parse(text, False)` a delta at a time: the list's characters are scanned once (depth,
    quotes) and each call is read when its closing parenthesis comes at the list's top level,
    from its own text (the text since the previous one, after its comma), not the whole list."""

    def __init__(self) -> None:
        super().__init__()
        self.start: list[str] = []  # the output until its first characters decide its kind
        self.state = "start"
        self.depth = 0
        self.quote = ""
        self.escaped = False
        self.segment: list[str] = []  # the text since the last call read
        self.first_segment = True
        self.scanned = 0
        self.body: str | None = None  # plain text: its stripped body while it may be END alone
        self.spaced = False
        self.held: list[str] = []

    @property
    def steps(self) -> int:
        return self.scanned

    def feed(self, delta: str) -> str:
        self.seen.append(delta)
        if self.state == "plain":
            return self._plain(delta)
        if self.state == "start":
            self.start.append(delta)
            head = "".join(self.start).lstrip()
            if head.startswith(START):
                head = head[len(START) :].lstrip()
            elif START.startswith(head.rstrip()) or head.rstrip() == END:
                return ""
            if not head.rstrip():
                return ""
            if head[0] != "[":
                self.state, self.body = "plain", head.rstrip()
                self.spaced = len(self.body) < len(head)
                return self.text_so_far()
            self.state, self.start = "list", []
            delta = head[1:]
        if self.state == "list":
            self._scan(delta)
        return ""

    def _plain(self, delta: str) -> str:
        """All of the output is content, except while it is `<|python_end|>` alone (the body
        `parse` strips to nothing): held back until more comes."""
        if self.body is not None and delta.strip():
            self.body = None if self.spaced else self.body + delta.rstrip()
            if self.body is not None and len(self.body) > len(END):
                self.body = None
        if self.body is not None and delta:
            self.spaced = self.spaced or len(delta.rstrip()) < len(delta)
        if self.body == END:
            self.held.append(delta)
            return ""
        delta, self.held = "".join(self.held) + delta, []
        return delta

    def _scan(self, text: str) -> None:
        """Depth and quotes as `_whole_calls_so_far` counts them; a call is read at each `)`
        that closes at the top level."""
        begin = 0
        for index, char in enumerate(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = ""
            elif char in "'\"":
                self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}":
                self.depth -= 1
                if self.depth == 0 and char == ")":
                    self.segment.append(text[begin : index + 1])
                    begin = index + 1
                    self._read_call()
                if self.depth < 0:
                    self.state = "done"
                    break
        self.scanned += len(text)
        if self.state == "list":
            self.segment.append(text[begin:])

    def _read_call(self) -> None:
        source = "".join(self.segment).lstrip()
        self.segment = []
        if not self.first_segment:
            source = source[1:] if source.startswith(",") else "?"
        self.first_segment = False
        calls = _calls_in("[" + source + "]")
        if calls is None or self.no_more_calls:
            self.no_more_calls = True
            return
        self.calls.extend(WholeCall(call) for call in calls)
