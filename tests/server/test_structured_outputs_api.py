"""Structured outputs through the HTTP API of a real server on SmolLM2: the official `openai`
client's response_format (and its pydantic `parse`) works unchanged, vLLM's structured_outputs
and guided_* fields work on both endpoints and stream the same text, and a bad schema, regex or
grammar is a 400 naming the field while the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import jsonschema
import pydantic
import pytest

from nanoserve import SamplingParams, StructuredOutputsParams
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["big", "old", "coastal"]},
            "maxItems": 2,
        },
    },
    "required": ["city", "population", "tags"],
}
MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=10**8)


@pytest.fixture(scope="module")
def server(smollm2_dir):
    handle = ServerHandle(
        smollm2_dir, engine_kwargs={"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 1024}
    )
    yield handle
    handle.close()


def test_openai_client_response_format(server):
    client = server.client()
    model = server.engine.served_model_name
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one batch for both
        plain = pool.submit(
            client.chat.completions.create,
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY, "strict": True},
            },
        )
        parsed = pool.submit(
            client.chat.completions.parse,
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=80,
            response_format=City,
        )
        result, parsed = plain.result(), parsed.result()
    assert result.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(result.choices[0].message.content), CITY)
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_guided_fields_stream_the_same_text(server):
    client = server.client()
    model = server.engine.served_model_name
    extra = {"guided_choice": ["Paris", "London", "Rome"]}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=16, extra_body=extra
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=16,
            extra_body=extra,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content in extra["guided_choice"]
    assert streamed == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    phone = r"\d{3}-\d{4}"
    completion = client.completions.create(
        model=model,
        prompt="My phone number is",
        max_tokens=16,
        n=2,
        temperature=0.9,
        seed=4,
        extra_body={"structured_outputs": {"regex": phone}},
    )
    for choice in completion.choices:
        assert re.fullmatch(phone, choice.text) and choice.finish_reason == "stop"


@pytest.mark.parametrize(
    "body,param,message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}},
                }
            },
            "response_format",
            "properties must be an object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"lark": "x"}}, "structured_outputs", "lark"),
        ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "nothing_here"),
        ({"guided_json": "{broken"}, "guided_json", "JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "Only one kind"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, body, param, message):
    for path, request in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        payload = {"model": server.engine.served_model_name, "max_tokens": 4, **request, **body}
        status, _, raw = http_request(server.port, "POST", path, json.dumps(payload))
        error = json.loads(raw)["error"]
        assert status == 400 and error["type"] == "BadRequestError" and error["code"] == 400, raw
        assert error["param"] == param and message in error["message"], error


def test_the_server_serves_on_after_bad_requests(server):
    status, _, raw = http_request(
        server.port,
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "model": server.engine.served_model_name,
                "prompt": "1, 2, 3,",
                "max_tokens": 2,
                "temperature": 0,
            }
        ),
    )
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"


def test_a_compiling_grammar_does_not_hold_up_other_requests(server):
    engine = server.engine
    engine.prepare_structured_output(
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="warm"))
    ).result()
    gate = threading.Event()
    engine.structured_output.executor.submit(gate.wait)  # the compile thread is busy
    client = server.client()
    model = engine.served_model_name
    numbers = r"[0-9]{1,3}( [0-9]{1,3}){2}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        constrained = pool.submit(
            client.completions.create,
            model=model,
            prompt="Three numbers:",
            max_tokens=16,
            temperature=0,
            extra_body={"guided_regex": numbers},
        )
        try:
            free = client.completions.create(
                model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0
            )
            assert free.choices[0].finish_reason == "length"
            assert not constrained.done()  # still waiting for its grammar
        finally:
            gate.set()
        assert re.fullmatch(numbers, constrained.result().choices[0].text)


def test_a_client_gone_while_its_grammar_compiles_cancels_nothing_shared(server):
    import asyncio

    engine = server.engine
    async_engine = server.server.engine
    params = SamplingParams(
        max_tokens=4,
        temperature=0,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{2} gone"),
    )
    gate = threading.Event()
    engine.prepare_structured_output(
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="warm"))
    ).result()
    engine.structured_output.executor.submit(gate.wait)
    shared = engine.prepare_structured_output(params)  # another request's, queued behind the gate

    async def add_then_give_up():
        task = asyncio.ensure_future(async_engine.add_request("gone-1", "Count:", params))
        for _ in range(3):  # loop turns, not time: in its first turn the task runs up to the
            await asyncio.sleep(0)  # wait for the gated compile, where it then stays
        assert not task.done()
        task.cancel()
        return await asyncio.gather(task, return_exceptions=True)

    try:
        (outcome,) = server.loop_thread.call(add_then_give_up)
        assert isinstance(outcome, asyncio.CancelledError)
    finally:
        gate.set()
    assert not shared.cancelled() and shared.result() is not None
