"""Mistral: `[TOOL_CALLS]` (a special token, so the decoded text must keep special tokens) then
either a JSON array `[{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) or, from
v11, `name{...}` or `name[ARGS]{...}` after each `[TOOL_CALLS]`. The text before the first marker
is the content. Call ids are 9 letters and digits, the only kind Mistral's templates accept."""
from __future__ import annotations

import json
import random
import string

from nanoserve.server.tool_parsers.base import (ToolCallParse, ToolCallSoFar, ToolParser,
                                                calls_in_json_array)
from nanoserve.server.tool_parsers.json_scan import held_back, skip_whitespace, value_end

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(random.choices(ID_ALPHABET, k=9))

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(MARKER)
        if first < 0:
            return ToolCallParse(text if final else text[:len(text) - held_back(text, MARKER)])
        body = skip_whitespace(text, first + len(MARKER))
        if body >= len(text):
            return ToolCallParse(text) if final else ToolCallParse(text[:first])
        parsed = (calls_in_json_array(text, body, final) if text[body] == "["
                  else _named_calls(text, body, final))
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
            name = name[:-len(ARGS_MARKER)]
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
