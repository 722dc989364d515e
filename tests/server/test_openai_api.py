"""The OpenAI surface through the official `openai` client, against a real server (tiny Llama)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.server_helpers import http_request


def test_models_and_version(tiny_server):
    models = tiny_server.client().models.list()
    card = models.data[0]
    assert card.id == tiny_server.engine.served_model_name
    raw = json.loads(http_request(tiny_server.port, "GET", "/v1/models")[2])
    entry = raw["data"][0]
    assert raw["object"] == "list"
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(entry)
    assert entry["max_model_len"] == tiny_server.engine.max_model_len
    assert entry["root"] == tiny_server.engine.model_path
    status, _, body = http_request(tiny_server.port, "GET", "/version")
    assert status == 200 and "version" in json.loads(body)
    assert http_request(tiny_server.port, "GET", "/health")[0] == 200


def test_completion_usage_matches_tokens(tiny_server):
    client = tiny_server.client()
    result = client.completions.create(
        model=tiny_server.engine.served_model_name,
        prompt="The quick brown fox",
        max_tokens=7,
        temperature=0,
    )
    choice = result.choices[0]
    assert result.object == "text_completion" and choice.finish_reason == "length"
    prompt_ids = tiny_server.engine.tokenizer.encode("The quick brown fox")
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == len(prompt_ids) + 7
    # the same request streamed gives the same text, and include_usage counts the same tokens
    chunks = list(
        client.completions.create(
            model=None or tiny_server.engine.served_model_name,
            prompt="The quick brown fox",
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_n2_logprobs_and_prompt_forms(tiny_server):
    client = tiny_server.client()
    model = tiny_server.engine.served_model_name
    result = client.completions.create(
        model=model, prompt="Paris is", max_tokens=4, n=2, temperature=1.0, seed=1, logprobs=3
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 8
    for choice in result.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
        assert all(isinstance(t, str) for t in lp.tokens)
    # token ids and several prompts: choice index = prompt index * n + output index
    ids = tiny_server.engine.tokenizer.encode("Paris is")
    result = client.completions.create(
        model=model, prompt=[ids, "def add"], max_tokens=3, n=2, temperature=0
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in result.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy
    echoed = client.completions.create(
        model=model, prompt="Paris is", max_tokens=2, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith("Paris is")


def test_stop_strings(tiny_server):
    client = tiny_server.client()
    model = tiny_server.engine.served_model_name
    free = (
        client.completions.create(model=model, prompt="The quick", max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    stop = free[3:5]
    assert stop
    expected = free[: free.index(stop)]
    stopped = client.completions.create(
        model=model, prompt="The quick", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(
            model=model, prompt="The quick", max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_non_streamed_and_streamed(tiny_server):
    client = tiny_server.client()
    model = tiny_server.engine.served_model_name
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]
    result = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=6, temperature=0
    )
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.usage.completion_tokens == 6
    prompt = tiny_server.engine.tokenizer.apply_chat_template(messages)
    assert result.usage.prompt_tokens == len(
        tiny_server.engine.tokenizer.encode(prompt, add_special_tokens=False)
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == result.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_n2_logprobs_streamed(tiny_server):
    client = tiny_server.client()
    chunks = list(
        client.chat.completions.create(
            model=tiny_server.engine.served_model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            n=2,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            seed=3,
            stream_options={"include_usage": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    for index in (0, 1):
        entries = [
            e
            for c in chunks
            if c.choices and c.choices[0].index == index and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert len(entries) == 5
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert chunks[-1].usage.completion_tokens == 10
    result = client.chat.completions.create(
        model=tiny_server.engine.served_model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        temperature=0,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 3 and all(e.bytes == list(e.token.encode()) for e in content)


def test_unknown_fields_ignored_and_vllm_extras(tiny_server, caplog):
    body = {
        "prompt": "hello",
        "max_tokens": 3,
        "temperature": 0,
        "some_future_field": {"x": 1},
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [0],
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "priority": 0,
        "logit_bias": {"5": 1.0},
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "user": "u",
    }
    status, _, response = http_request(
        tiny_server.port, "POST", "/v1/completions", json.dumps(body)
    )
    assert status == 200, response
    assert json.loads(response)["usage"]["completion_tokens"] == 3
    assert "some_future_field" in caplog.text  # ignored, with a log line
    status, _, response = http_request(
        tiny_server.port,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "hello", "max_tokens": None, "ignore_eos": True}),
    )
    assert status == 200 and json.loads(response)["usage"]["completion_tokens"] == 16


def test_tokenize_detokenize(tiny_server):
    status, _, body = http_request(
        tiny_server.port,
        "POST",
        "/tokenize",
        json.dumps({"prompt": "hello world", "return_token_strs": True}),
    )
    data = json.loads(body)
    assert status == 200 and data["count"] == len(data["tokens"]) == len(data["token_strs"])
    assert data["max_model_len"] == tiny_server.engine.max_model_len
    status, _, body = http_request(
        tiny_server.port, "POST", "/detokenize", json.dumps({"tokens": data["tokens"]})
    )
    assert status == 200 and json.loads(body)["prompt"] == "hello world"
    status, _, body = http_request(
        tiny_server.port,
        "POST",
        "/tokenize",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    )
    assert status == 200 and json.loads(body)["count"] > 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ],
)
def test_invalid_fields_are_400(tiny_server, body, param):
    status, _, response = http_request(
        tiny_server.port, "POST", "/v1/completions", json.dumps(body)
    )
    error = json.loads(response)["error"]
    assert status == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["param"] == param and error["message"]


def test_error_statuses(tiny_server):
    port = tiny_server.port
    status, _, body = http_request(port, "POST", "/v1/completions", b'{"prompt": "x",')
    assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
    status, _, body = http_request(
        port, "POST", "/v1/completions", '{"prompt": "x"}', headers={"Content-Type": "text/plain"}
    )
    assert status == 400
    status, _, body = http_request(
        port, "POST", "/v1/completions", json.dumps({"prompt": "x", "model": "nope"})
    )
    error = json.loads(body)["error"]
    assert status == 404 and error["message"] == "The model `nope` does not exist."
    assert error["param"] == "model"
    assert http_request(port, "GET", "/v1/nothing")[0] == 404
    status, headers, _ = http_request(port, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    long_prompt = list(range(10, 10 + tiny_server.engine.max_model_len + 5))
    status, _, body = http_request(
        port, "POST", "/v1/completions", json.dumps({"prompt": [t % 300 for t in long_prompt]})
    )
    message = json.loads(body)["error"]["message"]
    assert status == 400 and message.startswith(
        f"This model's maximum context length is {tiny_server.engine.max_model_len} tokens."
    )
    with pytest.raises(openai.BadRequestError):
        tiny_server.client().chat.completions.create(
            model=tiny_server.engine.served_model_name, messages=[], max_tokens=2
        )
    assert http_request(port, "GET", "/health")[0] == 200  # nothing above disturbed the server
