"""Reading JSON that a model is still writing: where a value ends (None while it may go on), and
the members of an object seen so far as spans of the raw text. A span of a growing value is a
prefix of its final span, which is what lets streamed argument fragments concatenate to exactly
the arguments of the whole output."""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_LITERAL_ENDS = ",}] \t\n\r"


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (and so must wait
    before they are shown as plain text)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def string_end(text: str, position: int) -> int | None:
    """`text[position]` is a quote: the index after the closing quote, None if not closed yet."""
    index = position + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


def value_end(text: str, position: int) -> int | None:
    """The index after the JSON value starting at `position`; None while it may still grow."""
    first = text[position]
    if first == '"':
        return string_end(text, position)
    if first in "{[":
        depth = 0
        index = position
        while index < len(text):
            char = text[index]
            if char == '"':
                end = string_end(text, index)
                if end is None:
                    return None
                index = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    index = position  # a number, true, false or null: it ends where a delimiter starts
    while index < len(text) and text[index] not in _LITERAL_ENDS:
        index += 1
    return index if index < len(text) else None


@dataclass(slots=True)
class Span:
    """A member's value in the raw text: [start, end), end None while the value may grow."""

    start: int
    end: int | None


def scan_object(text: str, position: int) -> tuple[dict[str, Span], int | None]:
    """The members of the object whose `{` is at `position`, as far as the text goes, and the
    index after its `}` (None when it is not closed yet, or stops being JSON)."""
    members: dict[str, Span] = {}
    index = skip_whitespace(text, position + 1)
    while index < len(text):
        char = text[index]
        if char == "}":
            return members, index + 1
        if char == ",":
            index = skip_whitespace(text, index + 1)
            continue
        if char != '"':
            return members, None
        key_end = string_end(text, index)
        if key_end is None:
            return members, None
        try:
            key = json.loads(text[index:key_end])
        except ValueError:
            return members, None
        index = skip_whitespace(text, key_end)
        if index >= len(text) or text[index] != ":":
            return members, None
        index = skip_whitespace(text, index + 1)
        if index >= len(text):
            return members, None
        end = value_end(text, index)
        members[key] = Span(index, end)
        if end is None:
            return members, None
        index = skip_whitespace(text, end)
    return members, None
