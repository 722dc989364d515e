"""What every tool-call parser hands on: the plain text and the calls found in a model's output
so far. `parse(text, final=False)` is called again as the text grows; everything it returns must
only grow (content and each call's arguments are prefixes of what a later call returns), so the
stream can send differences. `final=True` is the whole output: a malformed call makes the whole
output plain content, as vLLM's parsers do. A stream does not call `parse` after every delta (that
is quadratic in the output): the parser's `reader()` gives the same answers a delta at a time,
reading each character once; `parse` is the oracle its tests compare it with."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from nanoserve.server.tool_parsers.json_scan import Span, scan_object, skip_whitespace

NO_ARGUMENTS = "{}"  # a call without parameters: "{}", never an empty string


@dataclass(slots=True)
class ToolCallSoFar:
    name: str
    arguments: str  # JSON text; while not complete, a prefix of the final text
    complete: bool


@dataclass(slots=True)
class ToolCallParse:
    content: str  # text outside the calls that can be shown now
    calls: list[ToolCallSoFar] = field(default_factory=list)


class ToolParser:
    """One output format of tool calls (vLLM's --tool-call-parser)."""

    name: ClassVar[str]
    # Formats whose markers are special tokens need them kept in the decoded text.
    keeps_special_tokens: ClassVar[bool] = False
    # Formats that hold their own reasoning (gpt-oss's harmony) read the whole output, not what
    # the reasoning parser leaves.
    reads_whole_output: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> ToolCallParse:
        raise NotImplementedError

    def reader(self) -> ToolCallReader | None:
        """What reads a stream's deltas as they come (the same answers as `parse(text so far,
        False)`, each character read once); None: the stream re-parses the whole text."""
        return None

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallReader:
    """A parser's non-final reading of a growing output, one delta at a time. `feed` returns the
    content the delta adds; `calls` are the calls so far (objects with `name`, None while it is
    not whole; `arguments`, the pieces of the arguments' text; `arguments_length`; `generation`,
    changed when the arguments start over; `status`, OPEN until the call is read), in order,
    only the last one open or without a name."""

    def __init__(self) -> None:
        self.calls: list = []
        self.seen: list[str] = []  # every delta, for the formats that turn back into plain text
        self._done_steps = 0  # of calls dropped (closed without a name)
        # `parse` finds no calls from this delta on (what was sent stays sent): where the output
        # turns out not to be calls after all
        self.no_more_calls = False

    def feed(self, delta: str) -> str:
        raise NotImplementedError

    @property
    def steps(self) -> int:
        """Characters the JSON scanners examined, to show each is read once."""
        return sum(getattr(call, "steps", 0) for call in self.calls) + self._done_steps

    def drop_if_nameless(self) -> None:
        """A call object that closed without a name is not a call (`parse` skips it)."""
        if self.calls and self.calls[-1].name is None:
            self._done_steps += getattr(self.calls.pop(), "steps", 0)

    def text_so_far(self) -> str:
        return "".join(self.seen)


def arguments_of(text: str, span: Span | None, object_closed: bool) -> tuple[str, bool] | None:
    """A call's arguments as raw JSON text and whether they are complete; None while nothing of
    them can be shown yet. A JSON string holding the arguments (some models quote them) counts
    once it is closed."""
    if span is None:
        return (NO_ARGUMENTS, True) if object_closed else None
    first = text[span.start]
    if first in "{[":
        return text[span.start : span.end], span.end is not None
    if span.end is None:
        return None
    try:
        value = json.loads(text[span.start : span.end])
    except ValueError:
        return None
    if value is None:
        return NO_ARGUMENTS, True
    if isinstance(value, str):
        return (value.strip() or NO_ARGUMENTS), True
    return None


def call_in_object(
    text: str, position: int, argument_keys: tuple[str, ...]
) -> tuple[ToolCallSoFar | None, int | None]:
    """The call written as {"name": ..., <argument key>: {...}} at `position`: the call so far
    (None until its name is whole) and the index after the object (None while it is open)."""
    members, end = scan_object(text, position)
    name_span = members.get("name")
    if name_span is None or name_span.end is None:
        return None, end
    try:
        name = json.loads(text[name_span.start : name_span.end])
    except ValueError:
        return None, end
    if not isinstance(name, str):
        return None, end
    span = next((members[key] for key in argument_keys if key in members), None)
    arguments = arguments_of(text, span, end is not None)
    if arguments is None:
        return ToolCallSoFar(name, "", False), end
    return ToolCallSoFar(name, arguments[0], arguments[1] and end is not None), end


def is_valid_call_object(text: str) -> bool:
    """The final check of one call's JSON: an object with a string name."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("name"), str)


def calls_in_json_array(text: str, position: int, final: bool) -> list[ToolCallSoFar] | None:
    """`[{"name": ..., "arguments" or "parameters": {...}}, ...]` with its `[` at `position`;
    None when it is not that (final: or not whole)."""
    calls: list[ToolCallSoFar] = []
    index = skip_whitespace(text, position + 1)
    while index < len(text):
        if text[index] == "]":
            return calls
        if text[index] == ",":
            index = skip_whitespace(text, index + 1)
            continue
        if text[index] != "{":
            return None
        call, end = call_in_object(text, index, ("arguments", "parameters"))
        if final and (end is None or call is None or not is_valid_call_object(text[index:end])):
            return None
        if call is not None:
            calls.append(call)
        if end is None:
            break
        index = skip_whitespace(text, end)
    return None if final else calls
