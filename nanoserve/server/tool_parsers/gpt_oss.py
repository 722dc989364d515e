"""gpt-oss (vLLM's `openai` tool parser): each harmony message to `functions.NAME` is a call of
NAME whose arguments are its body, streamed as it grows; final and preamble bodies are the
content; analysis messages are the reasoning parser's (tool_parsers/harmony.py).

A call's header names it beyond doubt, so a call stays a call when its body is not JSON (as vLLM
keeps it) or was cut by max_tokens: its arguments are the body as written, whitespace around it
dropped (vLLM re-serializes valid JSON; streamed fragments could not add up to that). This is the
exception to base.py's "a malformed call makes the whole output plain content": here that
content would be harmony markup, and the call's pieces have already been streamed."""

from __future__ import annotations

from nanoserve.server.tool_parsers import harmony
from nanoserve.server.tool_parsers.base import (
    NO_ARGUMENTS,
    ToolCallParse,
    ToolCallReader,
    ToolCallSoFar,
    ToolParser,
)
from nanoserve.server.tool_parsers.json_scan import WHITESPACE


class OpenAIToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True
    reads_whole_output = True

    def reader(self) -> HarmonyToolReader:
        return HarmonyToolReader()

    def parse(self, text: str, final: bool) -> ToolCallParse:
        messages = harmony.read_messages(text, final)
        if messages is None:
            return ToolCallParse(text)
        calls = [_call(message, final) for message in messages if message.kind == harmony.CALL_KIND]
        return ToolCallParse(harmony.joined(messages, harmony.CONTENT), calls)


def _call(message: harmony.HarmonyMessage, final: bool) -> ToolCallSoFar:
    """Whitespace around the body is not sent (a growing body's trailing whitespace waits, so
    the fragments add up to the stripped whole); an empty body is "{}"."""
    arguments = message.body.strip(WHITESPACE)
    if message.complete or final:
        return ToolCallSoFar(message.function_name, arguments or NO_ARGUMENTS, True)
    return ToolCallSoFar(message.function_name, arguments, False)


class HarmonyToolReader(ToolCallReader):
    """`parse(text, False)` a delta at a time: harmony.HarmonyReader's content and calls."""

    def __init__(self) -> None:
        super().__init__()
        self.harmony = harmony.HarmonyReader()
        self.calls = self.harmony.calls

    @property
    def steps(self) -> int:
        return self.harmony.steps

    def feed(self, delta: str) -> str:
        return self.harmony.feed(delta)[1]
