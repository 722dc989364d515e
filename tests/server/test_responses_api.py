"""POST /v1/responses through a real server with the official `openai` client: the answer equals
the chat endpoint's for the same conversation (the oracle: same template, same greedy tokens),
streams send the Responses event types in order and add up to the same text, a JSON schema in
`text.format` holds, function tools give function_call items whose arguments fit their schema,
stored responses continue with previous_response_id and are read back and deleted, and fields
nanoserve does not serve are refused with a 400 naming them."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from nanoserve.server.responses_input import ResponseStore
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.server.tool_templates import QWEN_STYLE, WEATHER_PARAMETERS

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-responses") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # a template with tools renders ~1k tokens
    (path / "config.json").write_text(json.dumps(config))
    template = tmp_path_factory.mktemp("templates") / "qwen_style.jinja"
    template.write_text(QWEN_STYLE)
    handle = ServerHandle(
        path, chat_template=str(template), enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    yield handle
    handle.close()


def chat(server, messages, **kwargs):
    return server.client().chat.completions.create(
        model=server.engine.served_model_name, messages=messages, temperature=0, **kwargs
    )


def respond(server, **kwargs):
    return server.client().responses.create(
        model=server.engine.served_model_name, temperature=0, **kwargs
    )


def test_plain_answer_equals_the_chat_endpoints(server):
    result = respond(server, input="Hello there", max_output_tokens=12)
    oracle = chat(server, [{"role": "user", "content": "Hello there"}], max_tokens=12)
    assert result.object == "response" and result.id.startswith("resp-")
    assert result.output_text == oracle.choices[0].message.content
    message = result.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert result.usage.input_tokens == oracle.usage.prompt_tokens
    assert result.usage.output_tokens == oracle.usage.completion_tokens
    assert result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens
    if oracle.choices[0].finish_reason == "length":
        assert result.status == "incomplete"
        assert result.incomplete_details.reason == "max_output_tokens"
    else:
        assert result.status == "completed"


def test_instructions_and_message_items_are_the_conversation(server):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!"}],
        },
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
    ]
    result = respond(server, input=items, instructions="You are terse.", max_output_tokens=10)
    oracle = chat(
        server,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
        ],
        max_tokens=10,
    )
    assert result.output_text == oracle.choices[0].message.content
    assert result.usage.input_tokens == oracle.usage.prompt_tokens
    assert result.instructions == "You are terse."


def test_stream_sends_the_event_types_in_order(server):
    whole = respond(server, input="Tell me a story", max_output_tokens=16)
    events = list(respond(server, input="Tell me a story", max_output_tokens=16, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert (
        final.output_text == whole.output_text
        and final.usage.output_tokens == whole.usage.output_tokens
    )
    with server.client().responses.stream(
        model=server.engine.served_model_name,
        temperature=0,
        input="Tell me a story",
        max_output_tokens=16,
    ) as stream:
        assert stream.get_final_response().output_text == whole.output_text
    item_id = events[2].item.id
    assert all(
        event.item_id == item_id for event in events if event.type == "response.output_text.delta"
    )


def test_json_schema_format_constrains_as_the_chat_endpoints(server):
    """The random model pads JSON with whitespace until max tokens, so the oracle is the chat
    endpoint with the same schema as response_format: the same constrained greedy tokens. With
    nothing but whitespace allowed after the value, the text is a JSON prefix of the schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    result = respond(
        server,
        input="Pick a city",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    oracle = chat(
        server,
        [{"role": "user", "content": "Pick a city"}],
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    assert result.output_text == oracle.choices[0].message.content
    unconstrained = respond(server, input="Pick a city", max_output_tokens=40)
    assert result.output_text != unconstrained.output_text
    assert result.output_text.lstrip().startswith("{")
    assert result.text.format.type == "json_schema"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools_give_function_call_items(server, tool_choice):
    kwargs = dict(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    result = respond(server, **kwargs)
    calls = [item for item in result.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)
    events = list(respond(server, stream=True, **kwargs))
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done[0].arguments == calls[0].arguments
    added = [
        e.item
        for e in events
        if e.type == "response.output_item.added" and e.item.type == "function_call"
    ]
    assert added[0].name == "get_weather"


def test_function_call_output_continues_the_conversation(server):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "c"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    ]
    result = respond(server, input=items, tools=[WEATHER], max_output_tokens=10)
    oracle = chat(
        server,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Paris", "unit": "c"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_tokens=10,
    )
    assert result.usage.input_tokens == oracle.usage.prompt_tokens


def test_previous_response_id_continues_and_stored_responses_are_read_and_deleted(server):
    first = respond(server, input="Hello", max_output_tokens=6)
    second = respond(server, input="And then?", previous_response_id=first.id, max_output_tokens=6)
    oracle = chat(
        server,
        [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=6,
    )
    assert second.output_text == oracle.choices[0].message.content
    assert second.usage.input_tokens == oracle.usage.prompt_tokens
    assert second.previous_response_id == first.id
    client = server.client()
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as error:
        respond(server, input="x", previous_response_id=first.id)
    assert error.value.body["param"] == "previous_response_id"
    unstored = respond(server, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_reasoning_effort_is_accepted(server):
    """reasoning.effort goes to the chat template as reasoning_effort (SmolLM2's ignores it)."""
    assert (
        respond(server, input="Hello", max_output_tokens=2, reasoning={"effort": "low"}).output_text
        is not None
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": []}, "input"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_unsupported_fields_are_refused_naming_them(server, body, param):
    status, _, payload = http_request(server.port, "POST", "/v1/responses", json.dumps(body))
    assert status == 400, payload
    assert json.loads(payload)["error"]["param"] == param
    assert respond(server, input="still serving", max_output_tokens=2).output_text is not None


def test_store_is_bounded_and_expires():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(name, b"{}", [])
    assert store.get("a") is None and store.get("b") is not None  # the oldest went first
    now[0] = 10.5
    assert store.get("b") is None and store.get("c") is None  # expired


def test_continuations_leave_the_stored_conversation_unchanged(server):
    """Issue 52 row 5: a continuation's input items once merged into the stored conversation's
    last tool-call turn (shared dicts), so every later request on X, failed or not, changed X.
    The oracle: the chat endpoint's prompt for X's conversation plus a tool output."""
    first = respond(
        server,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    assert [item.type for item in first.output] == ["function_call"]  # X ends in a tool-call turn
    call = first.output[0]
    tool_output = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    oracle = chat(
        server,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_tokens=1,
    ).usage.prompt_tokens
    extra_call = {
        "type": "function_call",
        "call_id": "call_other",
        "name": "get_weather",
        "arguments": '{"city": "Oslo", "unit": "f"}',
    }
    for _ in range(3):
        respond(
            server,
            previous_response_id=first.id,
            input=[extra_call],
            tools=[WEATHER],
            max_output_tokens=1,
        )
        with pytest.raises(openai.BadRequestError):  # refused after its input was read
            respond(
                server,
                previous_response_id=first.id,
                input=[extra_call],
                tool_choice="required",
                max_output_tokens=1,
            )
    follow_up = respond(
        server,
        previous_response_id=first.id,
        input=[tool_output],
        tools=[WEATHER],
        max_output_tokens=1,
    )
    assert follow_up.usage.input_tokens == oracle
    stored = server.server.app.response_store.get(first.id).conversation()
    assert stored[-1]["tool_calls"] == [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    ]


def test_metadata_within_openais_limits_is_stored_and_returned(server):
    metadata = {f"{index:02d}".ljust(64, "k"): "v" * 512 for index in range(16)}
    result = respond(server, input="Hello", max_output_tokens=1, metadata=metadata)
    assert result.metadata == metadata
    assert server.client().responses.retrieve(result.id).metadata == metadata


@pytest.mark.parametrize(
    "metadata",
    [
        {f"key{index}": "v" for index in range(17)},  # 17 pairs
        {"k" * 65: "v"},  # a 65-character key
        {"key": "v" * 513},  # a 513-character value
        {"key": 1},  # a value that is not a string
    ],
    ids=["pairs", "key", "value", "type"],
)
def test_metadata_over_openais_limits_is_refused_naming_it(server, metadata):
    """Issue 52 row 4: metadata is stored with the response; unbounded, 16 MiB went into
    every entry."""
    status, _, payload = http_request(
        server.port,
        "POST",
        "/v1/responses",
        json.dumps(
            {
                "model": server.engine.served_model_name,
                "input": "x",
                "max_output_tokens": 1,
                "metadata": metadata,
            }
        ),
    )
    assert status == 400, payload
    assert json.loads(payload)["error"]["param"] == "metadata"


def test_store_is_bounded_in_bytes_oldest_first():
    store = ResponseStore(max_entries=100, max_bytes=100)
    for name in ("a", "b", "c", "d"):
        assert store.put(name, b"x" * 30, [])  # 30 bytes and b"[]": 32 each
        assert store.total_bytes <= 100
    assert store.get("a") is None and [store.get(name).size for name in "bcd"] == [32, 32, 32]
    assert store.total_bytes == 96
    assert not store.put("e", b"x" * 99, [])  # larger than the whole budget: not kept
    assert store.get("e") is None and store.total_bytes == 96 and len(store) == 3
    assert store.delete("b") and store.total_bytes == 64


@pytest.fixture(scope="module")
def capped_server(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, responses_store_max_bytes=CAPPED_STORE_BYTES)
    yield handle
    handle.close()


CAPPED_STORE_BYTES = 4096


def test_a_byte_capped_store_evicts_oldest_first_and_never_exceeds_its_cap(capped_server):
    """--responses-store-max-bytes: the store's bytes (each response's JSON as returned plus its
    conversation's JSON) never pass the cap; the oldest go first; a response larger than the
    whole cap is not stored, says `store: false`, and cannot be continued."""
    client, store = capped_server.client(), capped_server.server.app.response_store
    model = capped_server.engine.served_model_name
    ids = []
    for index in range(12):
        result = client.responses.create(
            model=model, input=f"Hello {index}", max_output_tokens=1, temperature=0
        )
        ids.append(result.id)
        sizes = [store.get(response_id).size for response_id in ids if store.get(response_id)]
        assert store.total_bytes == sum(sizes) <= CAPPED_STORE_BYTES
    kept = [response_id for response_id in ids if store.get(response_id) is not None]
    assert 1 < len(kept) < len(ids) and kept == ids[-len(kept) :]  # the newest, in order
    for response_id in kept:  # counted: the bytes GET returns, and the conversation's JSON
        entry = store.get(response_id)
        status, _, body = http_request(capped_server.port, "GET", f"/v1/responses/{response_id}")
        assert status == 200 and body == entry.body
        conversation = json.dumps(entry.conversation(), separators=(",", ":"), ensure_ascii=False)
        assert entry.size == len(body) + len(conversation.encode())
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=ids[0])
    metadata = {f"{index:02d}".ljust(64, "k"): "v" * 512 for index in range(16)}  # ~9 KiB
    for stream in (False, True):
        if stream:
            events = list(
                client.responses.create(
                    model=model, input="Hi", max_output_tokens=1, metadata=metadata, stream=True
                )
            )
            result = events[-1].response
        else:
            result = client.responses.create(
                model=model, input="Hi", max_output_tokens=1, metadata=metadata
            )
        assert result.store is False and result.metadata == metadata
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(result.id)
        assert store.total_bytes <= CAPPED_STORE_BYTES and store.get(kept[-1]) is not None
