"""vLLM's extra routes (issue 18): /load with --enable-server-load-tracking, /tokenizer_info with
--enable-tokenizer-info-endpoint, SageMaker's /invocations, and GET /v1/models/{id}."""

from __future__ import annotations

import json
from urllib.parse import quote

import openai
import pytest

from nanoserve.server.http.types import HttpRequest, StreamingResponse
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request, sse_events


@pytest.fixture(scope="module")
def flagged_server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={"num_kv_blocks": 256},
        enable_server_load_tracking=True,
        enable_tokenizer_info_endpoint=True,
        api_key="secret",
    )
    yield handle
    handle.close()


AUTH = {"Authorization": "Bearer secret"}


def get_json(port: int, path: str, headers: dict | None = None) -> tuple[int, dict]:
    status, _, body = http_request(port, "GET", path, headers=headers)
    return status, json.loads(body)


def load(port: int) -> int:
    status, body = get_json(port, "/load", AUTH)
    assert status == 200
    return body["server_load"]


def test_server_load_counts_requests_until_their_response_is_done(flagged_server):
    port = flagged_server.port
    assert load(port) == 0
    app = flagged_server.server.app
    body = json.dumps({"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True})
    request = HttpRequest(
        "POST",
        "/v1/completions",
        "",
        "1.1",
        [("content-type", "application/json"), ("authorization", "Bearer secret")],
        body.encode(),
    )
    # Two streams accepted and not yet sent: both count until their bodies end.
    first = flagged_server.loop_thread.call(lambda: app(request))
    second = flagged_server.loop_thread.call(lambda: app(request))
    assert isinstance(first, StreamingResponse) and load(port) == 2

    async def drain(response):
        return [piece async for piece in response.body]

    pieces = flagged_server.loop_thread.call(lambda: drain(first))
    assert pieces[-1] == b"data: [DONE]\n\n" and load(port) == 1
    flagged_server.loop_thread.call(second.body.aclose)  # a client that went away
    assert load(port) == 0
    # Over HTTP: streamed, not streamed, and refused requests all leave it at 0.
    for extra in ({"stream": True}, {}, {"max_tokens": -1}):
        http_request(
            port,
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "hi", "max_tokens": 3, **extra}),
            headers=AUTH,
        )
        assert load(port) == 0


def test_server_load_is_zero_without_the_flag(tiny_server):
    app = tiny_server.server.app
    request = HttpRequest(
        "POST",
        "/v1/completions",
        "",
        "1.1",
        [("content-type", "application/json")],
        json.dumps({"prompt": "hello", "max_tokens": 5, "stream": True}).encode(),
    )
    response = tiny_server.loop_thread.call(lambda: app(request))
    assert load(tiny_server.port) == 0
    tiny_server.loop_thread.call(response.body.aclose)


def test_tokenizer_info(flagged_server):
    status, info = get_json(flagged_server.port, "/tokenizer_info", AUTH)
    assert status == 200
    tokenizer = flagged_server.engine.tokenizer
    assert info["tokenizer_class"] == "GPT2Tokenizer"  # from tokenizer_config.json
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert info["chat_template"] == tokenizer.chat_template
    added = info["added_tokens_decoder"]
    assert added["2"] == {
        "content": "<|im_end|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    assert {"vocab_file", "merges_file"}.isdisjoint(info)


def test_tokenizer_info_needs_its_flag(tiny_server):
    status, body = get_json(tiny_server.port, "/tokenizer_info")
    assert status == 404 and body["error"]["type"] == "NotFoundError"


def test_invocations_dispatch_on_the_body(flagged_server):
    port = flagged_server.port
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    status, _, raw = http_request(port, "POST", "/invocations", json.dumps(chat), headers=AUTH)
    direct = http_request(port, "POST", "/v1/chat/completions", json.dumps(chat), headers=AUTH)[2]
    assert status == 200 and json.loads(raw)["object"] == "chat.completion"
    assert json.loads(raw)["choices"] == json.loads(direct)["choices"]
    completion = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    status, _, raw = http_request(
        port, "POST", "/invocations", json.dumps(completion), headers=AUTH
    )
    assert status == 200 and json.loads(raw)["object"] == "text_completion"
    status, _, raw = http_request(
        port, "POST", "/invocations", json.dumps({**completion, "stream": True}), headers=AUTH
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    for body in ({"model": "x"}, {"prompt": ""}, {"messages": "not a list"}):
        status, _, raw = http_request(port, "POST", "/invocations", json.dumps(body), headers=AUTH)
        error = json.loads(raw)["error"]
        assert status == 400 and error["message"] == (
            "Cannot find suitable handler for request. Expected one of: "
            "['ChatCompletionRequest', 'CompletionRequest']"
        )
    status, _, raw = http_request(
        port, "POST", "/invocations", "{}", headers={"Content-Type": "text/plain", **AUTH}
    )
    assert status == 400


def test_retrieve_model(flagged_server):
    client = flagged_server.client(api_key="secret")
    name = flagged_server.engine.served_model_name
    model = client.models.retrieve(name)  # the client escapes the "/" in a path-like name
    assert model.id == name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    status, body = get_json(flagged_server.port, "/v1/models/" + quote(name, safe=""))
    assert status == 401  # under /v1: the API key is needed
    status, body = get_json(flagged_server.port, "/v1/models/" + quote(name, safe=""), AUTH)
    assert status == 200 and body["root"] == flagged_server.engine.model_path
