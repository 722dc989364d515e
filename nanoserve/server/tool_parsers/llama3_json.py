"""Llama 3.1-3.3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`, maybe
after `<|python_tag|>`, several separated by `;`. Output that does not start with `{` is plain
content."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import (
    ToolCallParse,
    ToolCallReader,
    ToolParser,
    call_in_object,
    is_valid_call_object,
)
from nanoserve.server.tool_parsers.incremental import first_non_whitespace
from nanoserve.server.tool_parsers.json_reader import DEAD, OPEN, CallObjectReader
from nanoserve.server.tool_parsers.json_scan import skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def reader(self) -> Llama3JsonReader:
        return Llama3JsonReader()

    def parse(self, text: str, final: bool) -> ToolCallParse:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return ToolCallParse("")  # still empty, or the tag arriving
        if start >= len(text):
            return ToolCallParse(text if final else "")
        if text[start] != "{":
            return ToolCallParse(text)
        result = ToolCallParse("")
        while True:
            call, end = call_in_object(text, start, ("parameters", "arguments"))
            if final and (end is None or call is None or not is_valid_call_object(text[start:end])):
                return ToolCallParse(text)
            if call is not None:
                result.calls.append(call)
            if end is None:
                return result
            start = skip_whitespace(text, end)
            if start < len(text) and text[start] == ";":
                start = skip_whitespace(text, start + 1)
            if start >= len(text):
                return result
            if text[start] != "{":  # something after the calls that is not one
                return ToolCallParse(text) if final else result


_START, _TAG, _AFTER_TAG, _OBJECT, _AFTER_CALL, _AFTER_SEMICOLON, _PLAIN, _DONE = range(8)
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonReader(ToolCallReader):
    """`parse(text, False)` a delta at a time: whitespace, maybe the tag, then either objects
    separated by `;` or plain text (all of it content, from its first character)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = _START
        self.tag_matched = 0

    def feed(self, delta: str) -> str:
        self.seen.append(delta)
        if self.state == _PLAIN:
            return delta
        index = 0
        while self.state != _DONE:
            if self.state == _OBJECT:
                call = self.calls[-1]
                index = call.feed(delta, index)
                if call.status == OPEN:
                    break
                if call.status == DEAD:
                    self.state = _DONE
                    break
                self.drop_if_nameless()
                self.state = _AFTER_CALL
                continue
            if self.state == _TAG:  # inside the tag whitespace is a character like others
                while (
                    index < len(delta)
                    and self.tag_matched < len(PYTHON_TAG)
                    and delta[index] == PYTHON_TAG[self.tag_matched]
                ):
                    self.tag_matched += 1
                    index += 1
                if self.tag_matched == len(PYTHON_TAG):
                    self.state = _AFTER_TAG
                    continue
                if index < len(delta):
                    return self._plain()
                break
            index = first_non_whitespace(delta, index)
            if index >= len(delta):
                break
            char = delta[index]
            if self.state == _START and char == PYTHON_TAG[0]:
                self.state = _TAG
                continue
            if self.state == _AFTER_CALL and char == ";":
                self.state, index = _AFTER_SEMICOLON, index + 1
                continue
            if char != "{":
                if self.state in (_START, _AFTER_TAG):
                    return self._plain()
                self.state = _DONE  # something after the calls that is not one
                break
            self.calls.append(CallObjectReader(ARGUMENT_KEYS))
            self.state, index = _OBJECT, index + 1
        return ""

    def _plain(self) -> str:
        """Not calls: all of the output is content."""
        self.state = _PLAIN
        return self.text_so_far()
