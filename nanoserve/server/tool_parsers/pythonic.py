"""Llama 3.2 small models (and Llama 4): the whole output is a Python list of calls,
`[get_weather(city="Paris"), now()]`, maybe inside `<|python_start|>...<|python_end|>`. Arguments
must be literals; they are sent as JSON. A call is streamed once its closing parenthesis is
there (its arguments are only JSON once the Python call is whole)."""
from __future__ import annotations

import ast
import json

from nanoserve.server.tool_parsers.base import ToolCallParse, ToolCallSoFar, ToolParser

START = "<|python_start|>"
END = "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START):].strip()
        elif not final and START.startswith(body):
            return ToolCallParse("")
        if body.endswith(END):
            body = body[:-len(END)].strip()
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
        if not (isinstance(element, ast.Call) and isinstance(element.func, ast.Name)
                and not element.args):
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
    return _calls_in(body[:last_closed + 1] + "]") or []
