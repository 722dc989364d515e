"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
block per call, after optional text. The text before the first block is the content; text
between or after the blocks is dropped (as vLLM does). A last block may lack its closing tag."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import (
    ToolCallParse,
    ToolCallReader,
    ToolParser,
    call_in_object,
    is_valid_call_object,
)
from nanoserve.server.tool_parsers.incremental import MarkerSearch, first_non_whitespace
from nanoserve.server.tool_parsers.json_reader import DEAD, OPEN, CallObjectReader
from nanoserve.server.tool_parsers.json_scan import held_back, skip_whitespace

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def reader(self) -> HermesReader:
        return HermesReader()

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(START)
        if first < 0:
            return ToolCallParse(text if final else text[: len(text) - held_back(text, START)])
        result = ToolCallParse(text[:first])
        start = first
        while start >= 0:
            body = skip_whitespace(text, start + len(START))
            if body >= len(text) or text[body] != "{":
                if final or body < len(text):  # not a call: plain text after all
                    return ToolCallParse(text) if final else result
                break
            call, end = call_in_object(text, body, ("arguments", "parameters"))
            if final and (end is None or call is None or not is_valid_call_object(text[body:end])):
                return ToolCallParse(text)
            if call is not None:
                result.calls.append(call)
            if end is None:
                break
            start = text.find(START, end)
        return result


_CONTENT, _BODY, _OBJECT, _BETWEEN, _DONE = range(5)


class HermesReader(ToolCallReader):
    """`parse(text, False)` a delta at a time: the content up to the first block, then each
    block's object; text between blocks is skipped while the next START is looked for."""

    def __init__(self) -> None:
        super().__init__()
        self.state = _CONTENT
        self.search = MarkerSearch(START)

    def feed(self, delta: str) -> str:
        content = ""
        text, index = delta, 0
        while True:
            if self.state in (_CONTENT, _BETWEEN):
                before, after = self.search.feed(text[index:])
                if self.state == _CONTENT:
                    content += before
                if after is None:
                    return content
                text, index, self.state = after, 0, _BODY
            elif self.state == _BODY:
                index = first_non_whitespace(text, index)
                if index >= len(text):
                    return content
                if text[index] != "{":  # not a call: what came stays as it is
                    self.state = _DONE
                    return content
                self.calls.append(CallObjectReader(("arguments", "parameters")))
                index, self.state = index + 1, _OBJECT
            elif self.state == _OBJECT:
                call = self.calls[-1]
                index = call.feed(text, index)
                if call.status == OPEN:
                    return content
                if call.status == DEAD:
                    self.state = _DONE
                    return content
                self.drop_if_nameless()
                self.state, self.search = _BETWEEN, MarkerSearch(START)
            else:
                return content
