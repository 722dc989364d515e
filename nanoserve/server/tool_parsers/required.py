"""Output constrained by tool_choice (server/tools.py builds the grammars): "required" writes a
JSON array `[{"name": ..., "parameters": {...}}, ...]`, a named function writes its arguments
object alone."""
from __future__ import annotations

from nanoserve.server.tool_parsers.base import (NO_ARGUMENTS, ToolCallParse, ToolCallSoFar,
                                                ToolParser, calls_in_json_array)
from nanoserve.server.tool_parsers.json_scan import WHITESPACE, skip_whitespace


class RequiredToolParser(ToolParser):
    name = "required"

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

    def parse(self, text: str, final: bool) -> ToolCallParse:
        arguments = text.strip() if final else text.lstrip().rstrip(WHITESPACE)
        if final:
            return ToolCallParse("", [ToolCallSoFar(self.function_name,
                                                    arguments or NO_ARGUMENTS, True)])
        return ToolCallParse("", [ToolCallSoFar(self.function_name, arguments, False)])
