"""Tool-call parsers by their `--tool-call-parser` names (vLLM's), and the stream that turns a
parser's view of the growing output into OpenAI's tool-call deltas."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import ToolCallParse, ToolCallSoFar, ToolParser
from nanoserve.server.tool_parsers.gpt_oss import OpenAIToolParser
from nanoserve.server.tool_parsers.hermes import HermesToolParser
from nanoserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from nanoserve.server.tool_parsers.mistral import MistralToolParser
from nanoserve.server.tool_parsers.pythonic import PythonicToolParser
from nanoserve.server.tool_parsers.required import NamedToolParser, RequiredToolParser
from nanoserve.server.tool_parsers.stream import ToolCall, ToolCallDelta, ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        OpenAIToolParser,
        PythonicToolParser,
    )
}

__all__ = [
    "TOOL_PARSERS",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParse",
    "ToolCallSoFar",
    "ToolCallStream",
    "ToolParser",
]
