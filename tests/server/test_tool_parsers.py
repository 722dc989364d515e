"""Tool-call and reasoning parsers on model-style outputs, whole and fed piece by piece: the
streamed content and argument fragments must add up to exactly the non-streamed result, and
malformed output must come back as plain content. Also the request checks of server/tools.py and
the schemas they build for tool_choice "required" and a named function. No model, no torch."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nanoserve.server.chat_output import ChatOutputReader, delta_messages
from nanoserve.server.reasoning_parsers import REASONING_PARSERS
from nanoserve.server.schemas import APIError
from nanoserve.server.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
)
from nanoserve.server.tools import AUTO_NEEDS_FLAGS, check_tool_messages, check_tool_use

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters

QWEN_TWO_CALLS = (
    'I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "now", "arguments": {}}\n</tool_call>'
)


def whole(parser, text):
    stream = ToolCallStream(parser)
    content, _ = stream.feed(text, True)
    return content, [(call.name, call.arguments) for call in stream.calls]


def streamed(parser, text, piece_size=1):
    """Feed the text `piece_size` characters at a time; the last feed is final."""
    stream = ToolCallStream(parser)
    content, calls, firsts = "", {}, []
    pieces = [text[i : i + piece_size] for i in range(0, len(text), piece_size)] or [""]
    for number, piece in enumerate(pieces):
        new_content, deltas = stream.feed(piece, number == len(pieces) - 1)
        content += new_content
        for delta in deltas:
            if delta.id is not None:  # a call's first delta: name, no argument text yet
                assert delta.index == len(calls) and delta.arguments == ""
                firsts.append(delta)
                calls[delta.index] = [delta.name, ""]
            else:
                assert delta.name is None and delta.arguments
                calls[delta.index][1] += delta.arguments
    return content, [tuple(call) for call in calls.values()], firsts


@pytest.mark.parametrize("piece_size", [1, 2, 3, 5, 8, 1000])
def test_hermes_two_calls_after_text(piece_size):
    parser = TOOL_PARSERS["hermes"]()
    content, calls = whole(parser, QWEN_TWO_CALLS)
    assert content == "I will look both up.\n"
    assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "{}")]
    assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "c"}
    stream_content, stream_calls, firsts = streamed(parser, QWEN_TWO_CALLS, piece_size)
    assert (stream_content, stream_calls) == (content, calls)
    assert len({first.id for first in firsts}) == 2
    assert all(first.id.startswith("chatcmpl-tool-") for first in firsts)


@pytest.mark.parametrize(
    "text",
    [
        'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # half a call
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # bad JSON
        '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        "a <tool_call> inside prose, then more prose",
    ],
)
def test_hermes_malformed_is_plain_content(text):
    parser = TOOL_PARSERS["hermes"]()
    assert whole(parser, text) == (text, [])
    assert streamed(parser, text)[0] == text  # held-back text comes out at the end


def test_hermes_holds_back_only_a_possible_marker():
    parser = TOOL_PARSERS["hermes"]()
    assert parser.parse("Hello <tool_", final=False).content == "Hello "
    assert parser.parse("Hello <tooth", final=False).content == "Hello <tooth"
    assert parser.parse("Hello <tool_", final=True).content == "Hello <tool_"


def test_hermes_last_call_without_closing_tag_and_text_after():
    parser = TOOL_PARSERS["hermes"]()
    text = '<tool_call>{"name": "now", "arguments": {}}'
    assert whole(parser, text) == ("", [("now", "{}")])
    after = '<tool_call>{"name": "now"}</tool_call>\nDone.'  # no arguments: "{}"
    assert whole(parser, after) == ("", [("now", "{}")])
    assert streamed(parser, after)[:2] == ("", [("now", "{}")])


def test_hermes_arguments_with_braces_and_escapes_in_strings():
    parser = TOOL_PARSERS["hermes"]()
    arguments = '{"code": "if (x) { return \\"}\\"; }", "n": [1, {"k": null}]}'
    text = f'<tool_call>\n{{"name": "run", "arguments": {arguments}}}\n</tool_call>'
    assert whole(parser, text) == ("", [("run", arguments)])
    assert streamed(parser, text)[:2] == ("", [("run", arguments)])


LLAMA_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'
)


@pytest.mark.parametrize(
    "text,expected",
    [
        (LLAMA_CALLS, [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
        ('<|python_tag|>{"name": "now", "parameters": {}}', [("now", "{}")]),
        (
            '  {"name": "get_weather", "arguments": {"city": "Oslo"}}',
            [("get_weather", '{"city": "Oslo"}')],
        ),
    ],
)
@pytest.mark.parametrize("piece_size", [1, 4])
def test_llama3_json(text, expected, piece_size):
    parser = TOOL_PARSERS["llama3_json"]()
    assert whole(parser, text) == ("", expected)
    assert streamed(parser, text, piece_size)[:2] == ("", expected)


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        '{"name": "get_weather", "parameters": {"city": ',
        '{"name": "now", "parameters": {}} and some words',
    ],
)
def test_llama3_json_plain_text(text):
    parser = TOOL_PARSERS["llama3_json"]()
    assert whole(parser, text) == (text, [])
    assert streamed(parser, text)[0] == text


@pytest.mark.parametrize(
    "text,content,expected",
    [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "now", "arguments": {}}]',
            "",
            [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
        ),
        ('Checking. [TOOL_CALLS][{"name": "now", "arguments": {}}]', "Checking. ", [("now", "{}")]),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now{}',
            "",
            [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
        ),
    ],
)
@pytest.mark.parametrize("piece_size", [1, 3])
def test_mistral(text, content, expected, piece_size):
    parser = TOOL_PARSERS["mistral"]()
    assert parser.keeps_special_tokens  # [TOOL_CALLS] is a special token
    assert whole(parser, text) == (content, expected)
    stream_content, calls, firsts = streamed(parser, text, piece_size)
    assert (stream_content, calls) == (content, expected)
    for first in firsts:  # Mistral's templates take 9-character alphanumeric ids only
        assert len(first.id) == 9 and first.id.isalnum()


@pytest.mark.parametrize(
    "text",
    ['[TOOL_CALLS][{"name": "now", "arguments": {', "[TOOL_CALLS] not json", "no calls at all"],
)
def test_mistral_malformed(text):
    assert whole(TOOL_PARSERS["mistral"](), text) == (text, [])


PYTHONIC = '[get_weather(city="Paris, FR", unit=\'c\'), now(), search(terms=["a", "b"], n=2)]'


@pytest.mark.parametrize("piece_size", [1, 6])
def test_pythonic(piece_size):
    parser = TOOL_PARSERS["pythonic"]()
    expected = [
        ("get_weather", '{"city": "Paris, FR", "unit": "c"}'),
        ("now", "{}"),
        ("search", '{"terms": ["a", "b"], "n": 2}'),
    ]
    assert whole(parser, PYTHONIC) == ("", expected)
    assert streamed(parser, PYTHONIC, piece_size)[:2] == ("", expected)
    wrapped = f"<|python_start|>{PYTHONIC}<|python_end|>"
    assert whole(parser, wrapped) == ("", expected)


@pytest.mark.parametrize(
    "text",
    ["[get_weather(city=", "[get_weather(city=x)]", "[1, 2]", "Paris is sunny.", "[f(*args)]"],
)
def test_pythonic_malformed(text):
    parser = TOOL_PARSERS["pythonic"]()
    assert whole(parser, text) == (text, [])
    assert streamed(parser, text)[0] == text


def test_required_and_named_outputs():
    required = (
        '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"now","parameters":{}}]'
    )
    expected = [("get_weather", '{"city":"Paris"}'), ("now", "{}")]
    assert whole(RequiredToolParser(), required) == ("", expected)
    assert streamed(RequiredToolParser(), required)[:2] == ("", expected)
    assert whole(NamedToolParser("now"), "") == ("", [("now", "{}")])
    named = '{"city":"Paris","unit":"c"}'
    assert whole(NamedToolParser("get_weather"), named) == ("", [("get_weather", named)])
    assert streamed(NamedToolParser("get_weather"), named)[:2] == ("", [("get_weather", named)])


def test_parallel_tool_calls_false_keeps_the_first_call():
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=1)
    stream.feed(QWEN_TWO_CALLS, True)
    assert [call.name for call in stream.calls] == ["get_weather"]


# ---- reasoning ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,text,reasoning,content",
    [
        (
            "qwen3",
            "<think>\nThe user wants 2+2.\n</think>\n\n4",
            "\nThe user wants 2+2.\n",
            "\n\n4",
        ),
        ("qwen3", "4", "", "4"),  # enable_thinking=false: no block in the output
        ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", ""),
        ("deepseek_r1", "Okay, 2+2.</think>4", "Okay, 2+2.", "4"),  # <think> was in the prompt
        ("deepseek_r1", "<think>Okay.</think>4", "Okay.", "4"),
        ("deepseek_r1", "still thinking", "still thinking", ""),
    ],
)
@pytest.mark.parametrize("piece_size", [1, 3, 1000])
def test_reasoning_parsers(name, text, reasoning, content, piece_size):
    parser = REASONING_PARSERS[name]()
    assert parser.split(text, True) == (reasoning, content)
    reader = ChatOutputReader(parser, None)
    output = reader.new_choice()
    got_reasoning = got_content = ""
    pieces = [text[i : i + piece_size] for i in range(0, len(text), piece_size)]
    for number, piece in enumerate(pieces):
        for message in delta_messages(output.feed(piece, number == len(pieces) - 1)):
            got_reasoning += message.reasoning_content or ""
            got_content += message.content or ""
    assert (got_reasoning, got_content) == (reasoning, content)


def test_reasoning_then_tool_call():
    reader = ChatOutputReader(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](), "auto")
    text = "<think>Need the weather.</think>\n\n" + QWEN_TWO_CALLS.split("\n", 1)[1]
    output = reader.new_choice()
    output.feed(text, True)
    content, reasoning = output.message_fields()
    assert reasoning == "Need the weather."
    assert content == "\n\n"
    assert [call.function.name for call in output.tool_calls] == ["get_weather", "now"]
    assert reader.finish_reason(True, "stop") == "tool_calls"


def test_finish_reasons():
    auto = ChatOutputReader(None, TOOL_PARSERS["hermes"](), "auto")
    assert auto.finish_reason(False, "stop") == "stop"
    assert auto.finish_reason(True, "length") == "tool_calls"
    required = ChatOutputReader(None, RequiredToolParser(), "required")
    assert required.finish_reason(True, "stop") == "tool_calls"
    assert required.finish_reason(True, "length") == "length"
    named = ChatOutputReader(None, NamedToolParser("now"), "named")
    assert named.finish_reason(True, "stop") == "stop"  # as OpenAI answers a forced function


# ---- request checks ----------------------------------------------------------------------
def refused(param, *args):
    with pytest.raises(APIError) as error:
        check_tool_use(*args)
    assert error.value.status == 400 and error.value.param == param
    return error.value.message


def test_tool_choice_checks():
    assert check_tool_use(None, None, True, False).mode == "none"
    assert check_tool_use([WEATHER], "none", True, False).tools == [WEATHER]  # still rendered
    assert refused("tool_choice", [WEATHER], None, True, False) == AUTO_NEEDS_FLAGS
    assert refused("tool_choice", [WEATHER], "auto", True, False) == AUTO_NEEDS_FLAGS
    assert check_tool_use([WEATHER], None, True, True).mode == "auto"
    assert "`tools` must be set" in refused("tool_choice", None, "required", True, False)
    assert "Invalid value" in refused("tool_choice", [WEATHER], "sometimes", True, False)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert "does not match" in refused("tool_choice", [WEATHER], named, True, False)
    assert "`function`" in refused("tool_choice", [WEATHER], {"type": "function"}, True, False)
    assert check_tool_use([], "required", True, False).mode == "none"


@pytest.mark.parametrize(
    "tools",
    [
        "get_weather",
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "an object please"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "dictionary"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}],
    ],
)
def test_bad_tools_name_the_field(tools):
    refused("tools", tools, "required", True, False)


def test_required_schema_accepts_calls_and_refuses_others():
    schema = check_tool_use([WEATHER, NOW], "required", True, False).constraint().json
    jsonschema.validate(
        [
            {"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "now", "parameters": {}},
        ],
        schema,
    )
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "other", "parameters": {}}],
        {"name": "now", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = check_tool_use([WEATHER, NOW], "required", False, False).constraint().json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, single)
    named = check_tool_use(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True, False
    ).constraint()
    assert named.json == WEATHER["function"]["parameters"] and named.field == "tools"


def test_required_schema_hoists_defs():
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "required": ["p"],
                "$defs": {
                    "P": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}},
                        "required": ["x"],
                    }
                },
            },
        },
    }
    schema = check_tool_use([tool], "required", True, False).constraint().json
    assert "P" in schema["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": {"x": "one"}}}], schema)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "content": "21 C"}],
        [{"role": "assistant", "tool_calls": [{"type": "function"}]}],
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": "{not json"}}
                ],
            }
        ],
        [{"role": "user", "content": "hi", "tool_calls": []}],
    ],
)
def test_bad_tool_messages_name_messages(messages):
    with pytest.raises(APIError) as error:
        check_tool_messages(messages)
    assert error.value.param == "messages"
