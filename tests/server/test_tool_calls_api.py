"""Tool calling and reasoning output through a real server with the official `openai` client:
tool_choice "required" and a named function give calls whose arguments fit the tool's schema
(the tiny random model and SmolLM2), a stream assembles the same calls, `parse` fills
`parsed_arguments`, "auto" reads the calls the hermes parser finds, the qwen3 reasoning parser
splits the thinking out, multi-turn conversations with tool messages render through Qwen- and
Llama-style templates, and bad input is a 400 naming the field. Where the random model's text
must take a given shape, a regex constrains it, so no test depends on what it happens to say."""

from __future__ import annotations

import json
import shutil
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.server.tool_templates import LLAMA_STYLE, QWEN_STYLE, WEATHER_PARAMETERS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
NOW = {
    "type": "function",
    "function": {"name": "now", "strict": True, "description": "The current time"},
}
TOOLS = [WEATHER, NOW]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMAS = {
    "get_weather": WEATHER_PARAMETERS,
    "now": {"type": "object", "properties": {}, "additionalProperties": False},
}
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
]
HERMES_CALL = (
    '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Oslo)", '
    '"unit": "c"\\}\\}\n</tool_call>'
)


class GetWeather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def tool_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a longer context: its 400-token vocabulary spends ~1.2 characters a
    token, and a template with tools renders 600-1300 tokens (random weights and RoPE do not
    care how long the context is)."""
    path = tmp_path_factory.mktemp("tiny-llama-long") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tool_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "qwen_style.jinja"
    template.write_text(QWEN_STYLE)
    handle = ServerHandle(
        tool_model_dir,
        chat_template=str(template),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        trust_request_chat_template=True,
    )
    yield handle
    handle.close()


def check_calls(calls, names=("get_weather", "now")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_calls_that_fit_the_schemas(server, tiny_server):
    for handle in (server, tiny_server):  # the default server needs no flags for "required"
        result = handle.client().chat.completions.create(
            model=handle.engine.served_model_name,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=200,
        )
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=false
        check_calls(choice.message.tool_calls)


def test_named_function_is_the_one_called(server):
    result = server.client().chat.completions.create(
        model=server.engine.served_model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=0,
        max_tokens=100,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM answer a forced function
    check_calls(choice.message.tool_calls, names=("get_weather",))
    now = server.client().chat.completions.create(
        model=server.engine.served_model_name,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "now"}},
        max_tokens=100,
    )
    assert now.choices[0].message.tool_calls[0].function.arguments == "{}"


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_stream_assembles_the_same_calls(server, tool_choice):
    client = server.client()
    # One call at most: the grammar then ends the array, so the answer is whole (a random model
    # allowed several calls writes them until max_tokens cuts the last one).
    kwargs = dict(
        model=server.engine.served_model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason in ("tool_calls", "stop") and whole.message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    pieces: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.id is not None:  # a call's first delta: id, type, name, empty arguments
                assert call.type == "function" and call.function.name
                assert call.function.arguments == "" and call.index not in pieces
                pieces[call.index] = [call.function.name, ""]
            else:
                assert call.function.name is None and call.function.arguments
                pieces[call.index][1] += call.function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    expected = [[call.function.name, call.function.arguments] for call in whole.message.tool_calls]
    assert [pieces[index] for index in sorted(pieces)] == expected
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert [
        [call.function.name, call.function.arguments]
        for call in final.choices[0].message.tool_calls
    ] == expected
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == json.loads(
        expected[0][1]
    )


def test_parse_with_a_pydantic_function_tool(server):
    result = server.client().chat.completions.parse(
        model=server.engine.served_model_name,
        messages=ASK,
        temperature=0,
        max_tokens=100,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
    )
    call = result.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_auto_reads_hermes_calls_and_plain_text(server):
    """The regex makes the model write a Qwen-style call; "auto" must find it, streamed too."""
    client = server.client()
    kwargs = dict(
        model=server.engine.served_model_name,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": "Let me check\\.\n" + HERMES_CALL}},
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    check_calls(choice.message.tool_calls)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me check.\n"
    arguments = "".join(
        call.function.arguments or ""
        for c in chunks
        if c.choices
        for call in c.choices[0].delta.tool_calls or []
    )
    assert arguments == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(
        **{**kwargs, "extra_body": {"structured_outputs": {"regex": "It is (sunny|raining)\\."}}}
    )
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].message.content in ("It is sunny.", "It is raining.")
    none = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert not none.message.tool_calls and none.message.content.startswith("Let me check.\n<tool")


def reasoning_of(message) -> str | None:
    """vLLM's field, whether or not this openai version declares it."""
    return getattr(message, "reasoning_content", None) or (message.model_extra or {}).get(
        "reasoning_content"
    )


def test_qwen3_reasoning_is_split_out(server):
    client = server.client()
    kwargs = dict(
        model=server.engine.served_model_name,
        messages=ASK,
        temperature=0,
        max_tokens=60,
        extra_body={
            "structured_outputs": {"regex": "<think>[a-z]{1,12}</think>\n\n(Sunny|Rainy)\\."}
        },
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = reasoning_of(message)
    assert reasoning.isalpha() and message.content in ("\n\nSunny.", "\n\nRainy.")
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(reasoning_of(delta) or "" for delta in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def rendered_prompt(handle, **kwargs) -> str:
    result = handle.client().chat.completions.create(
        model=handle.engine.served_model_name,
        max_tokens=1,
        temperature=0,
        extra_body={"return_token_ids": True, **kwargs.pop("extra_body", {})},
        **kwargs,
    )
    ids = result.model_extra["prompt_token_ids"]
    return handle.engine.tokenizer.decode(ids, skip_special_tokens=False)


def test_reasoning_effort_reaches_the_template(server):
    """OpenAI's reasoning_effort (the official client's parameter) is the template's
    `reasoning_effort` (gpt-oss's template reads it), unless chat_template_kwargs sets one."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}|effort={{ reasoning_effort }}|"

    def prompt(**kwargs) -> str:
        body = {"chat_template": template, **kwargs.pop("extra_body", {})}
        return rendered_prompt(server, messages=ASK, extra_body=body, **kwargs)

    assert prompt(reasoning_effort="high").endswith("|effort=high|")
    assert prompt().endswith("|effort=|")
    assert prompt(
        reasoning_effort="high", extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}}
    ).endswith("|effort=low|")
    with pytest.raises(openai.BadRequestError) as error:
        prompt(reasoning_effort="extreme")
    assert error.value.body["param"] == "reasoning_effort"


def test_multi_turn_with_a_tool_message_renders_qwen_style(server):
    prompt = rendered_prompt(
        server,
        messages=CONVERSATION,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(NOW) + "\n</tools>" in prompt
    assert prompt.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
        "<tool_response>\n21 C and sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_multi_turn_with_a_tool_message_renders_llama_style(server):
    prompt = rendered_prompt(
        server,
        messages=CONVERSATION,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"chat_template": LLAMA_STYLE},
    )
    assert "Environment: ipython\n" in prompt
    assert json.dumps(WEATHER, indent=4) + "\n\n" in prompt
    assert prompt.endswith(
        "What is the weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n21 C and sunny<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def error_of(handle, body: dict) -> dict:
    status, _, raw = http_request(
        handle.port,
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": handle.engine.served_model_name, "max_tokens": 4, **body}),
    )
    assert status == 400, raw
    return json.loads(raw)["error"]


def test_auto_without_the_flags_is_vllms_400(tiny_server):
    for body in (
        {"messages": ASK, "tools": TOOLS},
        {"messages": ASK, "tools": TOOLS, "tool_choice": "auto"},
    ):
        error = error_of(tiny_server, body)
        assert error["message"] == (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
        assert error["param"] == "tool_choice" and error["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):  # the client sees it as one
        tiny_server.client().chat.completions.create(
            model=tiny_server.engine.served_model_name, messages=ASK, tools=TOOLS
        )


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": CONVERSATION[:2] + [{"role": "tool", "content": "21 C"}]}, "messages"),
    ],
)
def test_bad_tool_input_names_the_field(server, body, param):
    error = error_of(server, {"messages": ASK, **body})
    assert error["param"] == param, error
    assert server.client().models.list().data  # still serving


def test_smollm2_required_and_named(smollm2_dir, tmp_path):
    template = tmp_path / "qwen_style.jinja"
    template.write_text(QWEN_STYLE)
    handle = ServerHandle(
        smollm2_dir,
        engine_kwargs={"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 1024},
        chat_template=str(template),
    )
    try:
        client = handle.client()
        for tool_choice in ("required", NAMED):
            result = client.chat.completions.create(
                model=handle.engine.served_model_name,
                messages=ASK,
                tools=TOOLS,
                tool_choice=tool_choice,
                temperature=0,
                max_tokens=120,
            )
            check_calls(result.choices[0].message.tool_calls)
    finally:
        handle.close()


def test_offline_chat_renders_tools_as_the_server(server, tool_model_dir):
    from nanoserve import LLM, SamplingParams

    llm = LLM(model=str(tool_model_dir), num_kv_blocks=128)
    try:
        output = llm.chat(
            CONVERSATION,
            SamplingParams(max_tokens=1, temperature=0),
            chat_template=QWEN_STYLE,
            tools=TOOLS,
            chat_template_kwargs={"enable_thinking": False},
        )[0]
    finally:
        llm.shutdown()
    assert output.prompt == rendered_prompt(
        server,
        messages=CONVERSATION,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
