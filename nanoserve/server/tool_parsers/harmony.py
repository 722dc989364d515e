"""gpt-oss's "harmony" output, read as it grows. The chat template ends the prompt with
`<|start|>assistant`, so the output is a header, then `<|message|>`, the body and `<|end|>`
(`<|return|>` after the last answer, `<|call|>` after a tool call); each later message opens with
`<|start|>assistant`. A header names the channel (`<|channel|>analysis`, `final`, `commentary`),
maybe a recipient (`to=functions.NAME`, before or after the channel) and a content type
(`<|constrain|>json`, or a bare `json`; not read). The markers are special tokens, so the decoded
text must keep them (both parsers set `keeps_special_tokens`). `<|return|>` and `<|call|>` are
eos tokens: the text may end with or without them.

Two parsers read it, each through `read_messages`:
- the `openai_gptoss` reasoning parser (reasoning_parsers.py): reasoning is the analysis bodies,
  content the final and preamble (commentary without recipient) bodies, as clean text;
- the `openai` tool parser (gpt_oss.py) reads the whole output itself (`reads_whole_output`), not
  the reasoning parser's rest: calls are the messages to `functions.NAME`, content the same clean
  text. So the content is right with or without the tool parser, and neither parser hands the
  other harmony markup. (This module sits in tool_parsers/, as json_scan.py does, so that
  reasoning_parsers.py imports it without an import circle.)

Several messages of a kind join with a newline (as vLLM's non-streamed answer; a stream sends it
once the next message's header is whole). A header not whole yet is held back, and so is the end
of a body that may be the start of a marker. Output that does not start with a header is not
harmony: all of it is content."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nanoserve.server.tool_parsers.json_scan import held_back

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# What ends a body: the three end markers, or a next message opened without one.
BODY_ENDS = (END, RETURN, CALL, START)
HEADER_STARTS = (CHANNEL, START, CONSTRAIN, MESSAGE, " to=", "to=")
FUNCTIONS = "functions."
_HEADER_WORDS = re.compile(r"<\|\w+\|>|[^\s<]+")

REASONING, CONTENT, CALL_KIND, OTHER = "reasoning", "content", "call", "other"


@dataclass(slots=True)
class HarmonyMessage:
    channel: str  # "" when the header names none
    recipient: str | None
    body: str  # as far as it can be shown
    complete: bool  # its end marker came

    @property
    def kind(self) -> str:
        """A call to one of the request's functions; else the analysis channel is reasoning and a
        message without recipient (final, a commentary preamble) is content. A message to a
        built-in tool (browser, python) is neither, as in vLLM's chat completions."""
        if (
            self.recipient is not None
            and self.recipient.startswith(FUNCTIONS)
            and len(self.recipient) > len(FUNCTIONS)
        ):
            return CALL_KIND
        if self.channel == "analysis":
            return REASONING
        return CONTENT if self.recipient is None else OTHER

    @property
    def function_name(self) -> str:
        return self.recipient[len(FUNCTIONS) :] if self.recipient else ""


def read_messages(text: str, final: bool) -> list[HarmonyMessage] | None:
    """The messages of the output so far; None when it is not harmony."""
    if not text.startswith(HEADER_STARTS):
        if not final and any(start.startswith(text) for start in HEADER_STARTS):
            return []  # empty, or a header's first characters
        return None
    messages: list[HarmonyMessage] = []
    position = 0
    while position < len(text):
        header_end = text.find(MESSAGE, position)
        if header_end < 0:
            break  # a header still being written (or cut off): held back
        channel, recipient = _header(text[position:header_end])
        body_start = header_end + len(MESSAGE)
        end, marker = _body_end(text, body_start)
        if end < 0:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - max(held_back(body, ending) for ending in BODY_ENDS)]
            messages.append(HarmonyMessage(channel, recipient, body, False))
            break
        messages.append(HarmonyMessage(channel, recipient, text[body_start:end], True))
        position = end if marker == START else end + len(marker)
    return messages


def joined(messages: list[HarmonyMessage], kind: str) -> str:
    return "\n".join(message.body for message in messages if message.kind == kind)


def _header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a header such as `<|start|>assistant to=functions.f<|channel|>
    commentary json` or `<|channel|>commentary to=functions.f <|constrain|>json`."""
    words = _HEADER_WORDS.findall(header)
    channel, recipient = "", None
    for index, word in enumerate(words):
        if word.startswith("to="):
            recipient = word[len("to=") :]
        elif word == CHANNEL and index + 1 < len(words) and not words[index + 1].startswith("<|"):
            channel = words[index + 1]
    return channel, recipient


def _body_end(text: str, start: int) -> tuple[int, str]:
    """Where the body starting at `start` ends and the marker there; (-1, "") while it goes on."""
    best, marker = -1, ""
    for ending in BODY_ENDS:
        found = text.find(ending, start)
        if found >= 0 and (best < 0 or found < best):
            best, marker = found, ending
    return best, marker


class _EndSearch:
    """The first of several markers in text that arrives in pieces (MarkerSearch for many)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.tail = ""
        self.steps = 0

    def feed(self, delta: str) -> tuple[str, str | None, str]:
        """(the text before the first marker that can be shown now, the marker found or None,
        the text after it)."""
        text = self.tail + delta
        self.steps += len(text)
        best, marker = -1, ""
        for ending in self.markers:
            found = text.find(ending)
            if found >= 0 and (best < 0 or found < best):
                best, marker = found, ending
        if best >= 0:
            self.tail = ""
            return text[:best], marker, text[best + len(marker) :]
        held = max(held_back(text, ending) for ending in self.markers)
        self.tail = text[len(text) - held :]
        return text[: len(text) - held], None, ""


class HarmonyCall:
    """A message to `functions.NAME` as the `openai` tool parser streams it: its body with the
    whitespace around it left out (trailing whitespace waits), "{}" when it ends empty."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.arguments: list[str] = []
        self.arguments_length = 0
        self.generation = 0
        self.status = "open"
        self.started = False
        self.trailing = ""

    def add(self, piece: str) -> None:
        if not self.started:
            piece = piece.lstrip(WHITESPACE_CHARS)
            self.started = bool(piece)
        shown = piece.rstrip(WHITESPACE_CHARS)
        if shown:
            self.arguments.append(self.trailing + shown)
            self.arguments_length += len(self.trailing) + len(shown)
            self.trailing = ""
        self.trailing += piece[len(shown) :]

    def end(self) -> None:
        self.status = "closed"
        if not self.arguments:
            self.arguments, self.arguments_length = ["{}"], 2


WHITESPACE_CHARS = " \t\n\r"


class HarmonyReader:
    """`read_messages(text, False)` a delta at a time, as the parts the parsers show: `feed`
    returns the (reasoning, content) it adds; the calls to functions go to `calls`."""

    def __init__(self) -> None:
        self.state = "start"
        self.start: str = ""  # the output while it may be a header's first characters
        self.header: list[str] = []
        self.search = _EndSearch((MESSAGE,))
        self._done_steps = 0
        self.kind = OTHER
        self.counts = {REASONING: 0, CONTENT: 0}  # messages of each kind so far
        self.calls: list[HarmonyCall] = []

    @property
    def steps(self) -> int:
        """Characters looked at for markers."""
        return self.search.steps + self._done_steps

    def feed(self, delta: str) -> tuple[str, str]:
        if self.state == "plain":
            return "", delta
        parts = {REASONING: [], CONTENT: []}
        if self.state == "start":
            text = self.start + delta
            if not text.startswith(HEADER_STARTS):
                if any(start.startswith(text) for start in HEADER_STARTS):
                    self.start = text
                    return "", ""
                self.state = "plain"
                return "", text
            self.state, self.start, delta = "header", "", text
        while delta:
            before, marker, after = self.search.feed(delta)
            if self.state == "header":
                self.header.append(before)
                if marker is None:
                    break
                self._open_message(parts)
            else:
                self._add_body(before, parts)
                if marker is None:
                    break
                self._end_message()
                if marker == START:
                    after = START + after
            delta = after
        return "".join(parts[REASONING]), "".join(parts[CONTENT])

    def _open_message(self, parts: dict[str, list[str]]) -> None:
        channel, recipient = _header("".join(self.header))
        self.header = []
        message = HarmonyMessage(channel, recipient, "", False)
        self.kind = message.kind
        if self.kind in self.counts:
            if self.counts[self.kind]:
                parts[self.kind].append("\n")
            self.counts[self.kind] += 1
        elif self.kind == CALL_KIND:
            self.calls.append(HarmonyCall(message.function_name))
        self._switch("body", BODY_ENDS)

    def _add_body(self, piece: str, parts: dict[str, list[str]]) -> None:
        if self.kind in parts:
            parts[self.kind].append(piece)
        elif self.kind == CALL_KIND:
            self.calls[-1].add(piece)

    def _end_message(self) -> None:
        if self.kind == CALL_KIND:
            self.calls[-1].end()
        self._switch("header", (MESSAGE,))

    def _switch(self, state: str, markers: tuple[str, ...]) -> None:
        self._done_steps += self.search.steps
        self.state, self.search = state, _EndSearch(markers)
