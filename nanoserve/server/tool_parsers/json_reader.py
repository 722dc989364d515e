"""json_scan.py's reading of a call object, resumable: the text arrives in pieces and each
character is examined once, whatever the deltas (the reader keeps its position's state: where in
the object it is, the depth, inside a string or after a backslash)."""

from __future__ import annotations

import json
import re

_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
_LITERAL_STOP = re.compile(r"[,}\] \t\n\r]")
_NOT_WHITESPACE = re.compile(r"[^ \t\n\r]")

OPEN, CLOSED, DEAD = "open", "closed", "dead"
NO_ARGUMENTS_TEXT = "{}"  # base.NO_ARGUMENTS: a call without parameters
_NOT_JSON = object()
# Where an object reader is: between members, in a key, before its colon, before a value, in a
# value (a string, a container, or a number / true / false / null).
_MEMBER, _KEY, _COLON, _VALUE, _STRING, _CONTAINER, _LITERAL = range(7)


class CallObjectReader:
    """`call_in_object` for text that arrives in pieces: the object after its `{`, read once.
    It keeps what `scan_object` and `arguments_of` would say of the text so far: the call's name
    (None until a "name" member's value is a whole JSON string) and its arguments' text so far,
    `arguments` (the pieces of the current arguments value; `generation` changes when a later
    member replaces it, as a repeated key does). `steps` counts the characters examined."""

    def __init__(self, argument_keys: tuple[str, ...]) -> None:
        self.argument_keys = argument_keys
        self.status = OPEN
        self.name: str | None = None
        self.arguments: list[str] = []
        self.arguments_length = 0
        self.generation = 0
        self.steps = 0
        self._state = _MEMBER
        self._key_parts: list[str] = []
        self._key = ""
        self._value_parts: list[str] | None = None  # kept for "name" and a non-object argument
        self._escaped = False
        self._depth = 0
        self._argument_rank: int | None = None
        self._argument_is_text = False  # the arguments member holds a container's raw text

    def feed(self, text: str, index: int) -> int:
        """Read `text` from `index`; returns where reading stopped: len(text) while the object is
        open, the index after its `}` once closed, the offending index when it stops being JSON."""
        while index < len(text) and self.status == OPEN:
            start = index
            index = self._step(text, index)
            self.steps += index - start
        return index

    def _step(self, text: str, index: int) -> int:
        state = self._state
        if state in (_MEMBER, _COLON, _VALUE):
            found = _NOT_WHITESPACE.search(text, index)
            if found is None:
                return len(text)
            index = found.start()
            char = text[index]
            if state == _MEMBER:
                return self._member(char, index)
            if state == _COLON:
                if char != ":":
                    self.status = DEAD
                    return index
                self._state = _VALUE
                return index + 1
            return self._value_start(char, index)
        if state in (_KEY, _STRING):
            return self._in_string(text, index)
        if state == _CONTAINER:
            return self._in_container(text, index)
        return self._in_literal(text, index)

    def _member(self, char: str, index: int) -> int:
        if char == "}":
            self.status = CLOSED
            if self._argument_rank is None:
                self._set_arguments(NO_ARGUMENTS_TEXT)
            return index + 1
        if char == ",":
            return index + 1
        if char != '"':
            self.status = DEAD
            return index
        self._state = _KEY
        self._key_parts = ['"']
        self._escaped = False
        return index + 1

    def _value_start(self, char: str, index: int) -> int:
        key = self._key
        if key == "name":
            self.name = None
        self._value_parts = [] if key == "name" else None
        if key in self.argument_keys:
            rank = self.argument_keys.index(key)
            if self._argument_rank is None or rank <= self._argument_rank:
                self._argument_rank = rank
                self.generation += 1
                self.arguments, self.arguments_length = [], 0
                self._argument_is_text = char in "{["
                if not self._argument_is_text:
                    self._value_parts = []
        self._escaped = False
        if char == '"':
            self._state = _STRING
            self._keep(char)
            return index + 1
        if char in "{[":
            self._state, self._depth = _CONTAINER, 1
            self._keep(char)
            return index + 1
        self._state = _LITERAL
        return index

    def _keep(self, piece: str) -> None:
        if self._state == _KEY:
            self._key_parts.append(piece)
            return
        if self._value_parts is not None:
            self._value_parts.append(piece)
        elif (
            self._argument_is_text
            and self._argument_rank is not None
            and self._key == self.argument_keys[self._argument_rank]
        ):
            self.arguments.append(piece)
            self.arguments_length += len(piece)

    def _string_piece(self, text: str, index: int) -> tuple[int, bool]:
        """Keeps a string's characters up to its closing quote (a backslash skips one character):
        where the scan stopped, and whether the string closed there."""
        if self._escaped:
            self._escaped = False
            self._keep(text[index])
            return index + 1, False
        found = _STRING_STOP.search(text, index)
        if found is None:
            self._keep(text[index:])
            return len(text), False
        end = found.start() + 1
        self._keep(text[index:end])
        if text[end - 1] == "\\":
            self._escaped = True
            return end, False
        return end, True

    def _in_string(self, text: str, index: int) -> int:
        """A key or a string value."""
        end, closed = self._string_piece(text, index)
        if closed and self._state == _KEY:
            self._end_key()
        elif closed:
            self._end_value()
        return end

    def _in_container(self, text: str, index: int) -> int:
        """An array or object value: brackets counted, strings inside skipped."""
        if self._escaped or self._depth < 0:  # _depth < 0: inside a string inside the value
            return self._in_inner_string(text, index)
        found = _CONTAINER_STOP.search(text, index)
        if found is None:
            self._keep(text[index:])
            return len(text)
        end = found.start() + 1
        self._keep(text[index:end])
        char = text[end - 1]
        if char == '"':
            self._depth = -self._depth
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()
        return end

    def _in_inner_string(self, text: str, index: int) -> int:
        """A string inside an array or object value: its close turns the depth positive again."""
        end, closed = self._string_piece(text, index)
        if closed:
            self._depth = -self._depth
        return end

    def _in_literal(self, text: str, index: int) -> int:
        found = _LITERAL_STOP.search(text, index)
        if found is None:
            self._keep(text[index:])
            return len(text)
        self._keep(text[index : found.start()])
        self._end_value()
        return found.start()

    def _end_key(self) -> None:
        try:
            self._key = json.loads("".join(self._key_parts))
        except ValueError:
            self.status = DEAD
            return
        self._state = _COLON

    def _end_value(self) -> None:
        self._state = _MEMBER
        if self._value_parts is None:
            return
        value_text = "".join(self._value_parts)
        self._value_parts = None
        try:
            value = json.loads(value_text)
        except ValueError:
            value = _NOT_JSON
        if self._key == "name":
            self.name = value if isinstance(value, str) else None
        elif value is None:
            self._set_arguments(NO_ARGUMENTS_TEXT)
        elif isinstance(value, str):
            self._set_arguments(value.strip() or NO_ARGUMENTS_TEXT)

    def _set_arguments(self, arguments: str) -> None:
        self.generation += 1
        self.arguments, self.arguments_length = [arguments], len(arguments)
