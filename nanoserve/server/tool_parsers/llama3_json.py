"""Llama 3.1-3.3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`, maybe
after `<|python_tag|>`, several separated by `;`. Output that does not start with `{` is plain
content."""
from __future__ import annotations

from nanoserve.server.tool_parsers.base import (ToolCallParse, ToolParser, call_in_object,
                                                is_valid_call_object)
from nanoserve.server.tool_parsers.json_scan import skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

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
