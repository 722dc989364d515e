"""Pieces the parsers' readers share: a marker looked for across deltas (what may be its start is
held back, as `held_back` does for the whole text), whitespace skipped across deltas, a JSON array
of call objects and one raw JSON value read as they arrive. Each reads a character once."""

from __future__ import annotations

import re

from nanoserve.server.tool_parsers.json_reader import CLOSED, DEAD, OPEN, CallObjectReader
from nanoserve.server.tool_parsers.json_scan import held_back

_NOT_WHITESPACE = re.compile(r"[^ \t\n\r]")
_VALUE_STOP = re.compile(r'["\\{}\[\]]')


def first_non_whitespace(text: str, index: int) -> int:
    """The index of the first JSON non-whitespace character from `index`, len(text) if none."""
    found = _NOT_WHITESPACE.search(text, index)
    return len(text) if found is None else found.start()


class MarkerSearch:
    """Finds `marker` in text that arrives in pieces."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.tail = ""  # the end of what came, which may be the marker's start
        self.steps = 0  # characters looked at

    def feed(self, delta: str) -> tuple[str, str | None]:
        """(the text before the marker that can be shown now, the text after the marker: None
        while it has not come)."""
        text = self.tail + delta
        self.steps += len(text)
        found = text.find(self.marker)
        if found >= 0:
            self.tail = ""
            return text[:found], text[found + len(self.marker) :]
        held = held_back(text, self.marker)
        self.tail = text[len(text) - held :]
        return text[: len(text) - held], None


class CallArrayReader:
    """`calls_in_json_array` (non-final) for text that arrives in pieces, after the `[`: the call
    objects go to `calls`; `status` is CLOSED after `]` or an object that stops being JSON, DEAD
    when something else than an object comes (then the whole output is plain text)."""

    def __init__(self, calls: list, argument_keys: tuple[str, ...], drop_if_nameless) -> None:
        self.calls = calls
        self.argument_keys = argument_keys
        self.drop_if_nameless = drop_if_nameless
        self.status = OPEN
        self.current: CallObjectReader | None = None

    def feed(self, text: str, index: int) -> None:
        while self.status == OPEN and index < len(text):
            if self.current is not None:
                index = self.current.feed(text, index)
                if self.current.status == OPEN:
                    return
                if self.current.status == DEAD:
                    self.status = CLOSED
                    return
                self.current = None
                self.drop_if_nameless()
                continue
            index = first_non_whitespace(text, index)
            if index >= len(text):
                return
            char = text[index]
            if char == "]":
                self.status = CLOSED
            elif char == "{":
                self.current = CallObjectReader(self.argument_keys)
                self.calls.append(self.current)
            elif char != ",":
                self.status = DEAD
            index += 1


class RawValueCall:
    """A call whose name came before its arguments' `{`, the arguments read raw up to the
    matching bracket (`value_end`); `text` is all of them, for the check once they are whole."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.arguments: list[str] = []
        self.arguments_length = 0
        self.generation = 0
        self.status = OPEN
        self.steps = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str, index: int) -> int:
        """Read from `index` (the `{` first); returns the index after the value, or len(text)."""
        start = index
        while index < len(text):
            if self._escaped:
                self._escaped = False
                index += 1
                continue
            found = _VALUE_STOP.search(text, index)
            if found is None:
                index = len(text)
                break
            index = found.start() + 1
            char = text[index - 1]
            if char == "\\":
                self._escaped = self._in_string
            elif char == '"':
                self._in_string = not self._in_string
            elif self._in_string:
                continue
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.status = CLOSED
                    break
        self.arguments.append(text[start:index])
        self.arguments_length += index - start
        self.steps += index - start
        return index

    def text(self) -> str:
        return "".join(self.arguments)
