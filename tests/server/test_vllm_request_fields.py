"""vLLM request fields and validation that clients written against vLLM rely on (issue 18):
out-of-vocabulary ids, logit_bias keys, seed bounds, truncate_prompt_tokens / truncation_side,
return_token_ids, chat echo with continue_final_message, per-chunk usage."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.server_helpers import http_request, sse_events

INT64_MAX = 2**63 - 1
PROMPT_IDS = list(range(20, 32))  # 12 tokens


def post(port: int, path: str, body: dict):
    status, _, raw = http_request(port, "POST", path, json.dumps(body), timeout=60)
    if status == 200 and body.get("stream"):
        return status, [e for e in sse_events(raw) if isinstance(e, dict)]
    return status, json.loads(raw)


def error_of(status: int, body: dict) -> dict:
    assert status == 400, body
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    return body["error"]


# ---- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,base",
    [
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ],
)
def test_out_of_vocabulary_logit_bias_and_stop_token_ids(tiny_server, path, base):
    vocab = tiny_server.engine.model_config.vocab_size
    for field, value, bad in (
        ("logit_bias", {str(vocab + 1): 1.0}, vocab + 1),
        ("stop_token_ids", [vocab + 1], vocab + 1),
        ("stop_token_ids", [-1], -1),
    ):
        error = error_of(*post(tiny_server.port, path, {**base, "max_tokens": 2, field: value}))
        assert error["message"] == (
            f"token_id(s) [{bad}] in {field} contain out-of-vocab token "
            f"ids. Vocabulary size: {vocab}"
        )
        assert error["param"] == field
    for field, value in (("logit_bias", {str(vocab - 1): 1.0}), ("stop_token_ids", [vocab - 1])):
        assert post(tiny_server.port, path, {**base, "max_tokens": 2, field: value})[0] == 200


def test_non_integer_logit_bias_keys_are_named(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=tiny_server.engine.served_model_name,
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            logit_bias={"bad1": 50.0, "bad2": 20},
        )
    error = caught.value.body
    assert error["message"] == (
        "logit_bias contains key(s) that cannot be converted to integer token IDs: ['bad1', 'bad2']"
    )
    assert error["param"] == "logit_bias"


def test_out_of_vocabulary_prompt_ids_get_vllms_message(tiny_server):
    vocab = tiny_server.engine.model_config.vocab_size
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError, match=f"Token id {vocab + 5} is out of vocabulary"):
        client.completions.create(
            model=tiny_server.engine.served_model_name, prompt=[5, vocab + 5], max_tokens=2
        )
    error = error_of(*post(tiny_server.port, "/v1/completions", {"prompt": [3, -4]}))
    assert error["message"] == "Token id -4 is out of vocabulary" and error["param"] == "prompt"


def test_seed_outside_signed_64_bit_names_the_bound(tiny_server):
    for seed, bound in ((INT64_MAX + 1, str(INT64_MAX)), (-(2**63) - 1, str(-(2**63)))):
        error = error_of(*post(tiny_server.port, "/v1/completions", {"prompt": "hi", "seed": seed}))
        assert bound in error["message"] and error["param"] == "seed"


def test_long_seed_as_vllm_tests_it(tiny_server):
    """vLLM's test_long_seed: a chat request with a seed just past int64 is a 400 whose message
    names the broken bound the way pydantic does."""
    client = tiny_server.client()
    for seed, word in ((-(2**63) - 1, "greater_than_equal"), (INT64_MAX + 1, "less_than_equal")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=tiny_server.engine.served_model_name,
                temperature=0,
                seed=seed,
                messages=[{"role": "system", "content": "You are a helpful assistant."}],
            )
        assert word in caught.value.message


# ---- truncation -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "side,expected", [("right", PROMPT_IDS[:4]), ("left", PROMPT_IDS[-4:]), (None, PROMPT_IDS[:4])]
)  # the tokenizer's side: right
def test_truncate_prompt_tokens_keeps_the_asked_side(tiny_server, side, expected):
    client = tiny_server.client()
    extra = {"return_token_ids": True, "truncate_prompt_tokens": 4}
    if side is not None:
        extra["truncation_side"] = side
    result = client.completions.create(
        model=tiny_server.engine.served_model_name,
        prompt=PROMPT_IDS,
        max_tokens=1,
        temperature=0,
        extra_body=extra,
    )
    assert result.choices[0].prompt_token_ids == expected
    assert result.usage.prompt_tokens == 4


def test_truncation_of_text_and_chat_prompts(tiny_server):
    engine = tiny_server.engine
    text = "The quick brown fox jumps over the lazy dog. " * 3
    ids = engine.tokenizer.encode(text)
    request = {
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0,
        "truncate_prompt_tokens": 5,
        "truncation_side": "left",
        "return_token_ids": True,
    }
    status, body = post(tiny_server.port, "/v1/completions", {**request, "echo": True})
    assert status == 200, body
    assert body["choices"][0]["prompt_token_ids"] == ids[-5:]
    # echo with return_token_ids echoes no prompt text (the ids say it), as vLLM
    plain = post(tiny_server.port, "/v1/completions", request)[1]
    assert body["choices"][0]["text"] == plain["choices"][0]["text"]
    status, body = post(
        tiny_server.port,
        "/v1/completions",
        {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 5, "echo": True},
    )
    assert body["choices"][0]["text"].startswith(engine.tokenizer.decode(ids[:5]))
    messages = [{"role": "user", "content": text}]
    status, body = post(
        tiny_server.port,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 1,
            "truncate_prompt_tokens": 6,
            "return_token_ids": True,
        },
    )
    assert (
        status == 200 and len(body["prompt_token_ids"]) == 6 and body["usage"]["prompt_tokens"] == 6
    )
    # -1: max_model_len - 1, which this prompt is under: nothing cut
    status, body = post(
        tiny_server.port,
        "/v1/completions",
        {
            "prompt": PROMPT_IDS,
            "max_tokens": 1,
            "truncate_prompt_tokens": -1,
            "return_token_ids": True,
        },
    )
    assert body["choices"][0]["prompt_token_ids"] == PROMPT_IDS


@pytest.mark.parametrize(
    "fields,param,message",
    [
        (
            {"truncate_prompt_tokens": 10**6},
            "truncate_prompt_tokens",
            "truncate_prompt_tokens=1000000 cannot be greater than max_model_len = {L}. Please request "
            "a smaller truncation size.",
        ),
        (
            {"truncate_prompt_tokens": -2},
            "truncate_prompt_tokens",
            "truncate_prompt_tokens must be",
        ),
        (
            {"truncate_prompt_tokens": 3, "truncation_side": "middle"},
            "truncation_side",
            "`truncation_side` must be either 'left' or 'right'.",
        ),
    ],
)
def test_bad_truncation_is_400(tiny_server, fields, param, message):
    error = error_of(*post(tiny_server.port, "/v1/completions", {"prompt": "hi", **fields}))
    assert message.format(L=tiny_server.engine.max_model_len) in error["message"]
    assert error["param"] == param


# ---- return_token_ids -------------------------------------------------------------------
def test_completion_return_token_ids(tiny_server):
    model = tiny_server.engine.served_model_name
    client = tiny_server.client()
    result = client.completions.create(
        model=model,
        prompt="Paris is",
        max_tokens=5,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = result.choices[0]
    assert choice.prompt_token_ids == tiny_server.engine.tokenizer.encode("Paris is")
    assert len(choice.token_ids) == 5
    assert tiny_server.engine.tokenizer.decode(choice.token_ids) == choice.text
    without = client.completions.create(model=model, prompt="Paris is", max_tokens=5)
    assert without.choices[0].token_ids is None and without.choices[0].prompt_token_ids is None
    # streamed: the prompt ids in the first chunk, each token once, aligned with the logprobs
    status, events = post(
        tiny_server.port,
        "/v1/completions",
        {
            "prompt": "Paris is",
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert choices[0]["prompt_token_ids"] == choice.prompt_token_ids
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    streamed = [t for c in choices for t in c["token_ids"]]
    assert streamed == choice.token_ids
    assert [f"token_id:{t}" for t in streamed] == [
        t for c in choices for t in c["logprobs"]["tokens"]
    ]


def test_chat_return_token_ids(tiny_server):
    messages = [{"role": "user", "content": "Paris is"}]
    expected_prompt = tiny_server.engine.tokenizer.encode(
        tiny_server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    status, body = post(
        tiny_server.port,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
    )
    assert body["prompt_token_ids"] == expected_prompt and len(body["choices"][0]["token_ids"]) == 4
    status, events = post(
        tiny_server.port,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        },
    )
    assert events[0]["prompt_token_ids"] == expected_prompt
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert streamed == body["choices"][0]["token_ids"]


# ---- chat echo --------------------------------------------------------------------------
SAYING = "Here is a common saying about apple. An apple a day, keeps"


@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_with_continue_final_message(tiny_server, echo):
    client = tiny_server.client()
    messages = [
        {"role": "user", "content": "tell me a common saying"},
        {"role": "assistant", "content": SAYING},
    ]
    result = client.chat.completions.create(
        model=tiny_server.engine.served_model_name,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False},
    )
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content.startswith(SAYING) == echo
    generated = client.chat.completions.create(
        model=tiny_server.engine.served_model_name,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert message.content == (SAYING if echo else "") + generated.choices[0].message.content
    if echo:  # echo also scores the prompt (prompt_logprobs = top_logprobs = 0), as vLLM
        assert len(result.prompt_logprobs) == result.usage.prompt_tokens
    # streamed: the role chunk, then the echoed message, then the generated text
    stream = client.chat.completions.create(
        model=tiny_server.engine.served_model_name,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False},
    )
    deltas = [chunk.choices[0].delta for chunk in stream]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    assert "".join(d.content or "" for d in deltas) == message.content


def test_chat_echo_without_a_final_assistant_message_adds_nothing(tiny_server):
    status, body = post(
        tiny_server.port,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hello there"}],
            "echo": True,
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    plain = post(
        tiny_server.port,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 3,
            "temperature": 0,
        },
    )[1]
    assert body["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


# ---- usage on every chunk ---------------------------------------------------------------
OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def test_completion_continuous_usage_counts_each_choice(tiny_server):
    status, events = post(
        tiny_server.port,
        "/v1/completions",
        {
            "prompt": [PROMPT_IDS, PROMPT_IDS[:5]],
            "n": 2,
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": OPTIONS,
        },
    )
    assert status == 200
    *chunks, final = events
    seen: dict[int, int] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        index = choice["index"]
        prompt_len = len(PROMPT_IDS) if index < 2 else 5
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_len
        assert usage["completion_tokens"] > seen.get(index, 0)
        assert usage["total_tokens"] == prompt_len + usage["completion_tokens"]
        seen[index] = usage["completion_tokens"]
    assert seen == {0: 4, 1: 4, 2: 4, 3: 4}
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 16
    assert final["usage"]["prompt_tokens"] == len(PROMPT_IDS) + 5


def test_chat_continuous_usage_grows_every_chunk(tiny_server):
    client = tiny_server.client()
    stream = client.chat.completions.create(
        model=tiny_server.engine.served_model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options=OPTIONS,
        extra_body={"min_tokens": 6},
    )
    last = 0
    for chunk in stream:
        usage = chunk.usage
        assert usage is not None
        assert (
            last == 0
            or usage.completion_tokens > last
            or (not chunk.choices and usage.completion_tokens == last)
        )
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        last = usage.completion_tokens
    assert last == 6


# ---- request_id ---------------------------------------------------------------------------
def test_client_request_id_names_the_response(tiny_server):
    """As vLLM: the X-Request-Id header, else the body's request_id, after the response's prefix
    (it is the engine request's id too: the request log shows it)."""
    port = tiny_server.port
    status, body = post(
        port, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "request_id": "body-id-1"}
    )
    assert status == 200 and body["id"] == "cmpl-body-id-1"
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "request_id": "body-id-2",
        "stream": True,
    }
    status, _, raw = http_request(
        port,
        "POST",
        "/v1/chat/completions",
        json.dumps(chat),
        headers={"X-Request-Id": "header-id"},
        timeout=60,
    )
    events = [e for e in sse_events(raw) if isinstance(e, dict)]
    assert status == 200 and events and {e["id"] for e in events} == {"chatcmpl-header-id"}
    status, body = post(port, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1})
    assert status == 200 and body["id"].startswith("cmpl-") and len(body["id"]) > 20  # random
