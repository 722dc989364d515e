"""Mistral: `[TOOL_CALLS]` (a special token, so the decoded text must keep special tokens) then
either a JSON array `[{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) or, from
v11, `name{...}` or `name[ARGS]{...}` after each `[TOOL_CALLS]`. The text before the first marker
is the content. Call ids are 9 letters and digits, the only kind Mistral's templates accept."""

from __future__ import annotations

import json
import random
import string

from nanoserve.server.tool_parsers.base import (
    ToolCallParse,
    ToolCallReader,
    ToolCallSoFar,
    ToolParser,
    calls_in_json_array,
)
from nanoserve.server.tool_parsers.incremental import (
    CallArrayReader,
    MarkerSearch,
    RawValueCall,
    first_non_whitespace,
)
from nanoserve.server.tool_parsers.json_reader import CLOSED, DEAD, OPEN
from nanoserve.server.tool_parsers.json_scan import held_back, skip_whitespace, value_end

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(random.choices(ID_ALPHABET, k=9))

    def reader(self) -> MistralReader:
        return MistralReader()

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(MARKER)
        if first < 0:
            return ToolCallParse(text if final else text[: len(text) - held_back(text, MARKER)])
        body = skip_whitespace(text, first + len(MARKER))
        if body >= len(text):
            return ToolCallParse(text) if final else ToolCallParse(text[:first])
        parsed = (
            calls_in_json_array(text, body, final)
            if text[body] == "["
            else _named_calls(text, body, final)
        )
        if parsed is None:
            return ToolCallParse(text) if final else ToolCallParse(text[:first])
        return ToolCallParse(text[:first], parsed)


def _named_calls(text: str, position: int, final: bool) -> list[ToolCallSoFar] | None:
    """`name{...}` / `name[ARGS]{...}`, each call after its own `[TOOL_CALLS]`."""
    calls: list[ToolCallSoFar] = []
    start = position
    while True:
        brace = text.find("{", start)
        if brace < 0:
            return None if final else calls
        name = text[start:brace]
        if name.endswith(ARGS_MARKER):
            name = name[: -len(ARGS_MARKER)]
        name = name.strip()
        if not name or not all(char.isalnum() or char in "_-." for char in name):
            return None
        end = value_end(text, brace)
        if end is None:
            if final:
                return None
            calls.append(ToolCallSoFar(name, text[brace:], False))
            return calls
        try:
            json.loads(text[brace:end])
        except ValueError:
            return None
        calls.append(ToolCallSoFar(name, text[brace:end], True))
        following = skip_whitespace(text, end)
        if not text.startswith(MARKER, following):
            return calls
        start = skip_whitespace(text, following + len(MARKER))


_CONTENT, _BODY, _ARRAY, _NAME, _ARGUMENTS, _AFTER_CALL, _DONE = range(7)


class MistralReader(ToolCallReader):
    """`parse(text, False)` a delta at a time: the content up to the first marker, then an array
    of call objects, or `name{...}` calls each after its own marker."""

    def __init__(self) -> None:
        super().__init__()
        self.state = _CONTENT
        self.search = MarkerSearch(MARKER)
        self.array: CallArrayReader | None = None
        self.name_pieces: list[str] = []
        self.marker_matched = 0

    def feed(self, delta: str) -> str:
        content = ""
        text, index = delta, 0
        while self.state != _DONE:
            if self.state == _CONTENT:
                content, text = self.search.feed(delta)
                if text is None:
                    return content
                self.state = _BODY
            elif self.state == _BODY:
                index = first_non_whitespace(text, index)
                if index >= len(text):
                    break
                if text[index] == "[":
                    self.array = CallArrayReader(
                        self.calls, ("arguments", "parameters"), self.drop_if_nameless
                    )
                    self.state, index = _ARRAY, index + 1
                else:
                    self.state = _NAME
            elif self.state == _ARRAY:
                self.array.feed(text, index)
                if self.array.status == DEAD:  # not calls: `parse` finds none from here on
                    self.no_more_calls = True
                if self.array.status != OPEN:
                    self.state = _DONE
                break
            elif self.state == _NAME:
                index = self._read_name(text, index)
            elif self.state == _ARGUMENTS:
                index = self._read_arguments(text, index)
            else:
                index = self._read_marker(text, index)
            if index >= len(text) and self.state != _BODY:
                break
        return content

    def _read_name(self, text: str, index: int) -> int:
        brace = text.find("{", index)
        if brace < 0:
            self.name_pieces.append(text[index:])
            return len(text)
        self.name_pieces.append(text[index:brace])
        name = "".join(self.name_pieces)
        self.name_pieces = []
        if name.endswith(ARGS_MARKER):
            name = name[: -len(ARGS_MARKER)]
        name = name.strip()
        if not name or not all(char.isalnum() or char in "_-." for char in name):
            self._give_up()
            return brace
        self.calls.append(RawValueCall(name))
        self.state = _ARGUMENTS
        return brace

    def _read_arguments(self, text: str, index: int) -> int:
        """A call's arguments as they come; whole ones that are not JSON end the reading."""
        call = self.calls[-1]
        index = call.feed(text, index)
        if call.status == CLOSED:
            try:
                json.loads(call.text())
            except ValueError:
                self._give_up()
                return index
            self.state, self.marker_matched = _AFTER_CALL, 0
        return index

    def _give_up(self) -> None:
        self.no_more_calls = True
        self.state = _DONE

    def _read_marker(self, text: str, index: int) -> int:
        """After a call: whitespace, then the next call's marker, or nothing more is read."""
        if self.marker_matched == 0:
            index = first_non_whitespace(text, index)
        while index < len(text) and self.marker_matched < len(MARKER):
            if text[index] != MARKER[self.marker_matched]:
                self.state = _DONE
                return index
            self.marker_matched += 1
            index += 1
        if self.marker_matched == len(MARKER):
            index = first_non_whitespace(text, index)
            self.state = _NAME
        return index
