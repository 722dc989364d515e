"""Reasoning parsers (vLLM's --reasoning-parser): the thinking part of a model's output goes to
`reasoning_content`, the rest to `content`. `split(text, final)` reads a whole output (the
non-streamed answer, a stream's last delta); both parts only grow as the text grows, so a stream
sends their differences. A stream reads its other deltas with the parser's `reader()`, which keeps
its place between deltas (a delta costs work in proportion to its length, not the text so far)."""

from __future__ import annotations

from typing import ClassVar

from nanoserve.server.tool_parsers import harmony
from nanoserve.server.tool_parsers.incremental import MarkerSearch
from nanoserve.server.tool_parsers.json_scan import held_back

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    name: ClassVar[str]
    # Formats whose markers are special tokens need them kept in the decoded text.
    keeps_special_tokens: ClassVar[bool] = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far."""
        raise NotImplementedError

    def reader(self) -> ThinkReader | harmony.HarmonyReader | None:
        """What reads a stream's deltas as they come (the same parts as `split(text so far,
        False)`); None: the stream splits the whole text after each delta."""
        return None


class ThinkReader:
    """`split(text, False)` of the think-tag parsers a delta at a time: the first characters
    decide whether the output opens with `<think>`, then reasoning up to `</think>` (what may be
    its start held back), then content. `content_unless_opened`: Qwen3's output without `<think>`
    is all content; DeepSeek-R1's is all reasoning."""

    def __init__(self, content_unless_opened: bool) -> None:
        self.content_unless_opened = content_unless_opened
        self.start = ""  # the output while it may still be the start of `<think>`
        self.state = "start"
        self.search = MarkerSearch(THINK_END)

    @property
    def steps(self) -> int:
        """Characters looked at for `</think>`."""
        return self.search.steps

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) the delta adds."""
        if self.state == "content":
            return "", delta
        if self.state == "start":
            text = self.start + delta
            if text.startswith(THINK_START):
                delta = text[len(THINK_START) :]
            elif THINK_START.startswith(text):
                self.start = text
                return "", ""
            elif self.content_unless_opened:
                self.state = "content"
                return "", text
            else:
                delta = text
            self.state, self.start = "reasoning", ""
        reasoning, after = self.search.feed(delta)
        if after is None:
            return reasoning, ""
        self.state = "content"
        return reasoning, after


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens `<think>` in the prompt, so the output is reasoning until
    `</think>` (an output without it is all reasoning); a `<think>` the model writes itself is
    dropped."""

    name = "deepseek_r1"

    def reader(self) -> ThinkReader:
        return ThinkReader(content_unless_opened=False)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        start = 0
        if text.startswith(THINK_START):
            start = len(THINK_START)
        elif not final and THINK_START.startswith(text):
            return "", ""
        end = text.find(THINK_END, start)
        if end >= 0:
            return text[start:end], text[end + len(THINK_END) :]
        if final:
            return text[start:], ""
        return text[start : len(text) - held_back(text[start:], THINK_END)], ""


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """Qwen3 writes `<think>...</think>` itself; with enable_thinking=false its template closes
    an empty block in the prompt and the output, starting without `<think>`, is all content."""

    name = "qwen3"

    def reader(self) -> ThinkReader:
        return ThinkReader(content_unless_opened=True)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if text.startswith(THINK_START) or (not final and THINK_START.startswith(text)):
            return super().split(text, final)
        return "", text


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (tool_parsers/harmony.py): the analysis bodies are the
    reasoning, the final and preamble bodies the content; calls are left to the `openai` tool
    parser, which reads the whole output."""

    name = "openai_gptoss"
    keeps_special_tokens = True

    def reader(self) -> harmony.HarmonyReader:
        return harmony.HarmonyReader()

    def split(self, text: str, final: bool) -> tuple[str, str]:
        messages = harmony.read_messages(text, final)
        if messages is None:
            return "", text
        return (
            harmony.joined(messages, harmony.REASONING),
            harmony.joined(messages, harmony.CONTENT),
        )


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)
}
# The parser a model's architecture gets without --reasoning-parser: vLLM always separates
# gpt-oss's reasoning.
DEFAULT_REASONING_PARSERS: dict[str, str] = {"GptOssForCausalLM": GptOssReasoningParser.name}
