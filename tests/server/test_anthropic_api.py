"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through a real server
on SmolLM2 with the official `anthropic` client. The oracle is the chat endpoint: the same
conversation, template and greedy tokens give the same text, tool calls and thinking, and the same
prompt tokens. A stream adds up to the non-streamed message; errors take Anthropic's shape and
statuses (400, 401 for a wrong x-api-key or bearer key, 404, 529 for a full queue, an `error`
event mid-stream); a client that goes away aborts its request; the metrics count these requests.
Greedy decoding (temperature 0) goes in extra_body: recent clients no longer have the argument."""

from __future__ import annotations

import json
import socket

import anthropic
import jsonschema
import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy, connect, http_request, scrape_metrics
from tests.server.tool_templates import QWEN_STYLE, WEATHER_PARAMETERS

GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_PARAMETERS,
}
NOW_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}
NOW = {"name": "now", "description": "The current time", "input_schema": NOW_SCHEMA}
TOOLS = [WEATHER, NOW]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "now": NOW_SCHEMA}
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
STEP_FAILED = "The request failed during a model step; the server log has the cause."
KEY = "sekret"


def _chat_tools(tools: list[dict]) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool["description"],
                "parameters": tool["input_schema"],
            },
        }
        for tool in tools
    ]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "qwen_style.jinja"
    path.write_text(QWEN_STYLE)
    return str(path)


SMOLLM2 = {"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 1024}


@pytest.fixture(scope="module")
def server(smollm2_dir, template):
    """SmolLM2 with a tool-calling template and the hermes parser: most tests use this one."""
    handle = ServerHandle(
        smollm2_dir,
        engine_kwargs=SMOLLM2,
        chat_template=template,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield handle
    handle.close()


def client(handle, **kwargs) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=handle.url, max_retries=0, timeout=120, **kwargs)


def create(handle, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("messages", ASK)
    return client(handle).messages.create(
        model=handle.engine.served_model_name, extra_body=GREEDY, **kwargs
    )


def streamed(handle, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("messages", ASK)
    with client(handle).messages.stream(
        model=handle.engine.served_model_name, extra_body=GREEDY, **kwargs
    ) as stream:
        return stream.get_final_message()


def chat(handle, messages, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    return handle.client().chat.completions.create(
        model=handle.engine.served_model_name, messages=messages, temperature=0, **kwargs
    )


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def post(handle, path: str, body: dict, headers: dict | None = None):
    status, _, raw = http_request(handle.port, "POST", path, json.dumps(body), headers)
    return status, json.loads(raw) if raw.startswith(b"{") else raw


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """A stream's (event name, data) pairs; each data's `type` is its event's name."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name, block
        events.append((name, data))
    return events


def assert_same_message(streamed_message, plain) -> None:
    def blocks(message):
        return [
            {key: value for key, value in block.to_dict().items() if key not in ("id", "signature")}
            for block in message.content
        ]

    assert blocks(streamed_message) == blocks(plain)
    assert streamed_message.stop_reason == plain.stop_reason
    assert streamed_message.stop_sequence == plain.stop_sequence
    assert streamed_message.usage.output_tokens == plain.usage.output_tokens
    assert prompt_tokens(streamed_message) == prompt_tokens(plain)


def test_plain_message_equals_the_chat_endpoints(server):
    message = create(server)
    oracle = chat(server, ASK)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == oracle.choices[0].message.content
    assert prompt_tokens(message) == oracle.usage.prompt_tokens
    assert message.usage.output_tokens == oracle.usage.completion_tokens
    reasons = {"length": "max_tokens", "stop": "end_turn"}
    assert message.stop_reason == reasons[oracle.choices[0].finish_reason]
    assert message.stop_sequence is None


def test_stream_accumulates_to_the_plain_message(server):
    plain = create(server)
    assert_same_message(streamed(server), plain)
    # The events, in Anthropic's order (the client skips the ping).
    body = {"model": "x", "max_tokens": 16, "messages": ASK, "stream": True, **GREEDY}
    body["model"] = server.engine.served_model_name
    status, _, raw = http_request(server.port, "POST", "/v1/messages", json.dumps(body))
    assert status == 200
    events = sse_events(raw)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == prompt_tokens(plain)
    text = "".join(data["delta"]["text"] for name, data in events[3:-3])
    assert text == text_of(plain)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == plain.stop_reason
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens


def test_system_prompt_as_a_string_and_as_blocks(server):
    system = "You are a pirate. Always answer like a pirate."
    oracle = chat(server, [{"role": "system", "content": system}, *ASK])
    as_string = create(server, system=system)
    halves = [{"type": "text", "text": system[:17]}, {"type": "text", "text": system[17:]}]
    as_blocks = create(server, system=halves)
    for message in (as_string, as_blocks):
        assert text_of(message) == oracle.choices[0].message.content
        assert prompt_tokens(message) == oracle.usage.prompt_tokens
    assert prompt_tokens(as_string) > prompt_tokens(create(server))  # it reached the template


def test_a_last_assistant_message_is_continued(server):
    """Anthropic's prefill: the answer goes on from the assistant's text, as the chat endpoint's
    continue_final_message."""
    prefill = [*ASK, {"role": "assistant", "content": "The capital city is"}]
    message = create(server, messages=prefill)
    oracle = chat(
        server,
        prefill,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert text_of(message) == oracle.choices[0].message.content
    counted = client(server).messages.count_tokens(
        model=server.engine.served_model_name, messages=prefill
    )
    assert counted.input_tokens == prompt_tokens(message) == oracle.usage.prompt_tokens


def test_stop_sequences_stop_and_are_named(server):
    whole = text_of(create(server, max_tokens=16))
    words = whole.split()
    assert len(words) >= 4, whole
    stop = words[2]  # a word from the answer itself: the greedy answer reaches it
    message = create(server, max_tokens=16, stop_sequences=["@@never@@", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == whole[: whole.index(stop)]
    assert_same_message(streamed(server, stop_sequences=["@@never@@", stop]), message)


def test_max_tokens_is_the_stop_reason_when_reached(server):
    message = create(server, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert message.stop_sequence is None


def check_tool_uses(message, names=("get_weather", "now")) -> list:
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses, message
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in names
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


@pytest.mark.parametrize(
    "tool_choice, names",
    [({"type": "any"}, ("get_weather", "now")), ({"type": "tool", "name": "now"}, ("now",))],
)
def test_any_and_a_named_tool_give_tool_uses_that_fit_the_schemas(server, tool_choice, names):
    message = create(
        server, messages=WEATHER_ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80
    )
    assert message.stop_reason == "tool_use"
    uses = check_tool_uses(message, names)
    if tool_choice["type"] == "tool":
        assert len(uses) == 1
    assert_same_message(
        streamed(server, messages=WEATHER_ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80),
        message,
    )
    # the chat endpoint's forced calls, as the oracle
    chat_choice = (
        "required"
        if tool_choice["type"] == "any"
        else {"type": "function", "function": {"name": "now"}}
    )
    oracle = chat(
        server, WEATHER_ASK, tools=_chat_tools(TOOLS), tool_choice=chat_choice, max_tokens=80
    )
    calls = oracle.choices[0].message.tool_calls
    assert [(use.name, use.input) for use in uses] == [
        (call.function.name, json.loads(call.function.arguments)) for call in calls
    ]


def test_disable_parallel_tool_use_gives_one_call(server):
    message = create(
        server,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=80,
    )
    assert len(check_tool_uses(message)) == 1


def test_auto_reads_the_parsers_calls_as_the_chat_endpoint(server):
    message = create(server, messages=WEATHER_ASK, tools=TOOLS, max_tokens=40)
    oracle = chat(server, WEATHER_ASK, tools=_chat_tools(TOOLS), tool_choice="auto", max_tokens=40)
    choice = oracle.choices[0]
    assert text_of(message) == (choice.message.content or "")
    uses = [block for block in message.content if block.type == "tool_use"]
    calls = choice.message.tool_calls or []
    assert [(use.name, use.input) for use in uses] == [
        (call.function.name, json.loads(call.function.arguments)) for call in calls
    ]
    assert message.stop_reason == (
        "tool_use" if calls else "max_tokens" if choice.finish_reason == "length" else "end_turn"
    )
    assert_same_message(streamed(server, messages=WEATHER_ASK, tools=TOOLS, max_tokens=40), message)
    none = create(server, messages=WEATHER_ASK, tools=TOOLS, tool_choice={"type": "none"})
    assert [block.type for block in none.content] == ["text"]


TOOL_TURN = [
    *WEATHER_ASK,
    {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": "toolu_01",
                "name": "get_weather",
                "input": {"city": "Paris", "unit": "c"},
            }
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C and sunny"}
        ],
    },
]
CHAT_TOOL_TURN = [
    *WEATHER_ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "toolu_01",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_01", "content": "21 C and sunny"},
]


def test_a_tool_result_turn_answers_as_the_chat_endpoint(server):
    message = create(server, messages=TOOL_TURN, tools=TOOLS, tool_choice={"type": "none"})
    oracle = chat(server, CHAT_TOOL_TURN, tools=_chat_tools(TOOLS), tool_choice="none")
    assert text_of(message) == oracle.choices[0].message.content
    assert prompt_tokens(message) == oracle.usage.prompt_tokens
    # a tool result given as text blocks is the same turn
    blocks = json.loads(json.dumps(TOOL_TURN))
    blocks[-1]["content"][0]["content"] = [{"type": "text", "text": "21 C and sunny"}]
    again = create(server, messages=blocks, tools=TOOLS, tool_choice={"type": "none"})
    assert text_of(again) == text_of(message)


def test_count_tokens_equals_the_chat_endpoints_prompt_tokens(server):
    cases = [
        ({"messages": ASK}, {"messages": ASK}),
        (
            {"messages": ASK, "system": "Be brief."},
            {"messages": [{"role": "system", "content": "Be brief."}, *ASK]},
        ),
        (
            {"messages": TOOL_TURN, "tools": TOOLS},
            {"messages": CHAT_TOOL_TURN, "tools": _chat_tools(TOOLS)},
        ),
    ]
    for body, chat_body in cases:
        counted = client(server).messages.count_tokens(
            model=server.engine.served_model_name, **body
        )
        oracle = chat(server, max_tokens=1, **chat_body)
        assert counted.input_tokens == oracle.usage.prompt_tokens, body


def error_of(handle, body: dict, path: str = "/v1/messages", headers: dict | None = None):
    body = {"model": handle.engine.served_model_name, **body}
    if path == "/v1/messages":
        body.setdefault("max_tokens", 8)
    status, error = post(handle, path, body, headers)
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    return status, error["error"]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": "What is this?"}, IMAGE],
        [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [IMAGE]}],
    ],
)
def test_image_blocks_are_refused_naming_them(server, content):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, error = error_of(server, {"messages": [{"role": "user", "content": content}]}, path)
        assert status == 400 and error["type"] == "invalid_request_error"
        assert "image" in error["message"], error
    with pytest.raises(anthropic.BadRequestError):
        create(server, messages=[{"role": "user", "content": content}])


@pytest.mark.parametrize(
    "body, name",
    [
        ({"messages": ASK, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
            "`x`",
        ),
        ({"messages": ASK, "tools": [{"name": "t", "input_schema": {}, "strict": True}]}, "strict"),
    ],
)
def test_unknown_fields_are_refused_naming_them(server, body, name):
    status, error = error_of(server, body)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert name in error["message"], error


@pytest.mark.parametrize(
    "body, name",
    [
        ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": []}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "type"),
        ({"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 4}}, "thinking"),
        (
            {"messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
            "tool_choice",
        ),
    ],
)
def test_bad_requests_are_anthropic_400s_naming_the_field(server, body, name):
    status, error = error_of(server, body)
    assert status == 400 and error["type"] == "invalid_request_error", error
    assert name in error["message"], error


def test_unknown_model_and_route_are_404s(server):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client(server).messages.create(model="nope", max_tokens=4, messages=ASK)
    assert raised.value.body["error"]["type"] == "not_found_error"
    status, error = error_of(server, {"messages": ASK}, "/v1/messages/nope")
    assert status == 404 and error["type"] == "not_found_error"


@pytest.fixture(scope="module")
def gate_server(tiny_llama_dir):
    """A server with an API key and a waiting queue that holds nothing: every request that
    passes the key is refused as overloaded."""
    handle = ServerHandle(
        tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64}, api_key=KEY, max_waiting_requests=0
    )
    yield handle
    handle.close()


def test_a_wrong_key_is_401_by_x_api_key_and_by_bearer(gate_server):
    for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}):
        status, error = error_of(gate_server, {"messages": ASK}, headers=headers)
        assert status == 401 and error["type"] == "authentication_error", headers
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        status, error = error_of(gate_server, {"messages": ASK}, headers=headers)
        assert status == 529, headers  # past the key: the full queue answers
    # the key in x-api-key opens the OpenAI routes too
    status, _, _ = http_request(gate_server.port, "GET", "/v1/models", headers={"x-api-key": KEY})
    assert status == 200
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(gate_server, api_key="wrong").messages.create(
            model=gate_server.engine.served_model_name, max_tokens=4, messages=ASK
        )
    assert raised.value.body["error"]["type"] == "authentication_error"


def test_a_full_queue_is_529_overloaded(gate_server):
    keyed = client(gate_server, api_key=None, default_headers={"x-api-key": KEY})
    for stream in (False, True):
        with pytest.raises(anthropic.APIStatusError) as raised:
            keyed.messages.create(
                model=gate_server.engine.served_model_name,
                max_tokens=4,
                messages=ASK,
                stream=stream,
            )
        assert raised.value.status_code == 529
        assert raised.value.body["error"]["type"] == "overloaded_error"
        assert raised.value.response.headers["retry-after"] == "1"
    # the OpenAI routes keep vLLM's 503
    status, _, _ = http_request(
        gate_server.port,
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": ASK}),
        {"x-api-key": KEY},
    )
    assert status == 503


@pytest.fixture(scope="module")
def story(server):
    """A greedy answer that runs to max_tokens: a request for more runs at least this long."""
    plain = create(server, max_tokens=12, messages=STORY)
    assert plain.stop_reason == "max_tokens" and plain.usage.output_tokens == 12
    return plain


def test_a_step_failing_mid_stream_is_an_error_event(server, story):
    """The engine's forward fails from its third call on: the stream has begun (its first
    tokens went out), then gets Anthropic's `error` event; the server serves on."""
    plain = story
    engine = server.engine
    real_forward = engine.runner.forward
    calls = 0

    def forward(model_input):
        nonlocal calls
        calls += 1
        if calls >= 3:
            raise RuntimeError("injected fault")
        return real_forward(model_input)

    engine.runner.forward = forward
    try:
        body = {
            "model": server.engine.served_model_name,
            "max_tokens": 12,
            "messages": STORY,
            "stream": True,
            **GREEDY,
        }
        status, _, raw = http_request(server.port, "POST", "/v1/messages", json.dumps(body))
        with pytest.raises(anthropic.APIStatusError) as raised:
            streamed(server, max_tokens=12, messages=STORY)
    finally:
        del engine.runner.forward
    assert engine.runner.forward == real_forward
    assert status == 200
    events = sse_events(raw)
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["error"] == {"type": "api_error", "message": STEP_FAILED}
    sent = "".join(
        data["delta"].get("text", "") for name, data in events if name == "content_block_delta"
    )
    assert sent and text_of(plain).startswith(sent)  # the tokens before the failure
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": STEP_FAILED},
    }
    assert_same_message(streamed(server, max_tokens=12, messages=STORY), plain)  # serving on


def abort_key(handle) -> str:
    return 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="%s"}' % (
        handle.engine.served_model_name
    )


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_its_request(server, story, stream):
    """Held at its second step while the client goes: the request (which would run 12 tokens
    or more, `story`) is aborted within a few steps."""
    before = scrape_metrics(server.port)[abort_key(server)]
    body = json.dumps(
        {
            "model": server.engine.served_model_name,
            "max_tokens": 400,
            "messages": STORY,
            "stream": stream,
            **GREEDY,
        }
    ).encode()
    head = (
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%b\r\n"
        % (len(body), b"" if stream else b"Expect: 100-continue\r\n")
    )
    async_engine = server.server.app.ctx.engine
    spy = StepSpy(server.engine)
    try:
        sock = connect(server.port)
        step = spy.hold_second_step(lambda: sock.sendall(head + body))
        try:
            if stream:  # its first events are out
                received = b""
                while b"content_block_delta" not in received:
                    received += sock.recv(4096)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            if not stream:  # the EOF and the probes that follow it find the client gone
                wait_until(lambda: async_engine.intake.qsize(), "the abort to be queued")
        finally:
            spy.release(step)  # a stream finds the client gone by the writes that follow
        wait_until(lambda: spy.aborts, "the abort")
        wait_until(
            lambda: scrape_metrics(server.port)["vllm:num_requests_running"] == 0, "an idle engine"
        )
    finally:
        spy.restore()
    assert len(spy.aborts) == 1 and spy.aborts[0][0].startswith("msg_")
    assert spy.aborts[0][1] <= step + 4, (spy.aborts, step)
    assert scrape_metrics(server.port)[abort_key(server)] == before + 1


def test_metrics_count_messages_requests(server):
    before = scrape_metrics(server.port)
    message = create(server, max_tokens=5)
    streamed_message = streamed(server, max_tokens=5)
    after = scrape_metrics(server.port)

    def delta(name: str) -> float:
        return after[name] - before[name]

    def finished(reason: str) -> str:
        return 'vllm:request_success_total{engine="0",finished_reason="%s",model_name="%s"}' % (
            reason,
            server.engine.served_model_name,
        )

    messages = (message, streamed_message)
    for reason, stop_reason in (("length", "max_tokens"), ("stop", "end_turn")):
        expected = sum(m.stop_reason == stop_reason for m in messages)
        assert delta(finished(reason)) == expected
    assert delta("vllm:prompt_tokens_total") == sum(map(prompt_tokens, messages))
    assert delta("vllm:generation_tokens_total") == sum(m.usage.output_tokens for m in messages)


@pytest.fixture(scope="module")
def thinking_server(smollm2_dir, template):
    """SmolLM2 under DeepSeek-R1's reasoning parser: its output is thinking until `</think>`."""
    handle = ServerHandle(
        smollm2_dir, engine_kwargs=SMOLLM2, chat_template=template, reasoning_parser="deepseek_r1"
    )
    yield handle
    handle.close()


def test_thinking_is_read_by_the_reasoning_parser(thinking_server):
    thinking = {"type": "enabled", "budget_tokens": 8}
    message = create(thinking_server, thinking=thinking, max_tokens=12)
    oracle = chat(
        thinking_server,
        ASK,
        max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    reasoning = oracle.choices[0].message.model_extra["reasoning_content"]
    assert reasoning  # the parser found thinking, which the answer carries as a block
    blocks = message.content
    assert blocks[0].type == "thinking" and blocks[0].thinking == reasoning
    assert blocks[0].signature
    assert text_of(message) == (oracle.choices[0].message.content or "")
    assert_same_message(streamed(thinking_server, thinking=thinking, max_tokens=12), message)
    # thinking disabled reaches the template (Qwen3's switch), which closes the thinking block
    disabled = create(thinking_server, thinking={"type": "disabled"}, max_tokens=12)
    disabled_oracle = chat(
        thinking_server,
        ASK,
        max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert prompt_tokens(disabled) == disabled_oracle.usage.prompt_tokens
    assert prompt_tokens(disabled) > prompt_tokens(message)
