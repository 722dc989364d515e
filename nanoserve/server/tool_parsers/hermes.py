"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
block per call, after optional text. The text before the first block is the content; text
between or after the blocks is dropped (as vLLM does). A last block may lack its closing tag."""
from __future__ import annotations

from nanoserve.server.tool_parsers.base import (ToolCallParse, ToolParser, call_in_object,
                                                is_valid_call_object)
from nanoserve.server.tool_parsers.json_scan import held_back, skip_whitespace

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(START)
        if first < 0:
            return ToolCallParse(text if final else text[:len(text) - held_back(text, START)])
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
