"""The tool fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`) checked as
vLLM checks them, and what they ask for: the tools the template sees, how the output is read
(none, auto with the server's parser, required, one named function) and, for "required" and a
named function, the JSON schema that constrains decoding (as vLLM builds it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.server.schemas import APIError
from nanoserve.server.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser

NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
MAX_TOOLS = 128  # as OpenAI: each tool goes into the prompt and into the "required" grammar


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param)


@dataclass(frozen=True, slots=True)
class ToolUse:
    tools: list[dict[str, Any]] | None  # as the chat template gets them
    mode: str  # "none", "auto", "required" or "named"
    function_name: str | None = None  # mode "named"
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes "required" and a named function hold; None for the others."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function_name)
            schema = tool["function"].get("parameters") or EMPTY_PARAMETERS
        elif self.mode == "required":
            schema = _required_schema(self.tools, self.parallel)
        else:
            return None
        # Compact JSON: the calls are read by a parser, and free whitespace only costs tokens.
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True, field="tools")

    def parser(self, auto_parser: type[ToolParser] | None) -> ToolParser | None:
        if self.mode == "named":
            return NamedToolParser(self.function_name)
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "auto" and auto_parser is not None:
            return auto_parser()
        return None


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """An array of {"name", "parameters"} objects, one shape per tool; the tools' `$defs` move to
    the root, where their `#/$defs/...` references point."""
    definitions: dict[str, Any] = {}
    shapes = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or EMPTY_PARAMETERS)
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if definitions.get(name, definition) != definition:
                raise _bad(
                    f"tools define `$defs/{name}` in two different ways; give the "
                    "definitions distinct names",
                    "tools",
                )
            definitions[name] = definition
        shapes.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _check_schema(schema: Any, where: str) -> None:
    """Enough of a JSON schema's shape to catch what is not one (a string, a list, a bad type)."""
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON schema object, got {type(schema).__name__}", "tools")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if any(item not in SCHEMA_TYPES for item in kinds):
        raise _bad(
            f"{where}.type must be one of {', '.join(SCHEMA_TYPES)} (or a list of them), "
            f"got {kind!r}",
            "tools",
        )
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise _bad(f"{where}.properties must be an object", "tools")
        for name, item in properties.items():
            if not isinstance(item, (dict, bool)):
                raise _bad(f"{where}.properties.{name} must be a JSON schema object", "tools")
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(item, str) for item in required)
    ):
        raise _bad(f"{where}.required must be a list of property names", "tools")


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("`tools` must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"`tools` may hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(
                f'{where} must be {{"type": "function", "function": {{...}}}}; only '
                "function tools are supported",
                "tools",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function must be an object with a `name`", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name must be a non-empty string", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.function.description must be a string", "tools")
        if function.get("parameters") is not None:
            _check_schema(function["parameters"], f"{where}.function.parameters")
    return tools


def check_tool_use(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, auto_tools_enabled: bool
) -> ToolUse:
    """vLLM's checks of the tool fields, in its order; raises a 400 naming the field."""
    if tools is not None:
        tools = _check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    parallel = parallel_tool_calls is not False
    if tool_choice == "none":
        return ToolUse(tools or None, "none", parallel=parallel)
    if tools is None:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise _bad(
                f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
                '"none", "auto" or "required" are supported.',
                "tool_choice",
            )
        if tool_choice == "required" and not tools:  # OpenAI: nothing to call, so none
            return ToolUse(None, "none", parallel=parallel)
        if tool_choice == "auto" and not auto_tools_enabled:
            raise _bad(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolUse(tools, tool_choice, parallel=parallel)
    if not isinstance(tool_choice, dict):
        raise _bad(
            f"Invalid value for `tool_choice`: {json.dumps(tool_choice)}! {NAMED_USAGE}",
            "tool_choice",
        )
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise _bad(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}",
            "tool_choice",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_USAGE}", "tool_choice"
        )
    if all(tool["function"]["name"] != name for tool in tools):
        raise _bad(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return ToolUse(tools, "named", name, parallel)


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Assistant `tool_calls` and `tool` messages, as the OpenAI API shapes them."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _bad(
                f"messages[{index}]: a message with role 'tool' needs a string `tool_call_id`",
                "messages",
            )
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(
                f"messages[{index}].tool_calls must be a list, on an assistant message", "messages"
            )
        for number, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _bad(
                    f"messages[{index}].tool_calls[{number}] needs a `function` with a `name`",
                    "messages",
                )
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    json.loads(arguments or "{}")
                except ValueError:
                    raise _bad(
                        f"messages[{index}].tool_calls[{number}].function.arguments is "
                        "not valid JSON",
                        "messages",
                    ) from None
            elif arguments is not None and not isinstance(arguments, dict):
                raise _bad(
                    f"messages[{index}].tool_calls[{number}].function.arguments must be "
                    "a JSON string",
                    "messages",
                )
