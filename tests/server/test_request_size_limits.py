"""One request's size must not slow everyone else (issue 33), on a real server over loopback.

Every list a request may carry is bounded: over its limit it is a 400 naming the field and the
limit, before any other work on the request (at its limit it is served). A request with a million
stop strings, or a prompt list past `n x prompts`, costs a normal request sent meanwhile no engine
step (counted with a one-sequence engine, where anything the engine took would hold the normal
request back a whole generation). A prompt list that must be tokenized is tokenized in slices, one
at a time: a small request waits for none of them, a large one for at most one (counted by
holding the first slice on the one preprocessing thread)."""

from __future__ import annotations

import json
import select
import threading

import pytest

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
)
from nanoserve.server.tools import MAX_TOOLS
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import connect, http_request, read_response

BOUND = 30.0  # seconds: only so that a broken test fails instead of hanging


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http_request(port, "POST", path, json.dumps(body), timeout=120)
    return status, json.loads(raw)


class StepCounter:
    """Counts the engine's steps (on its step thread)."""

    def __init__(self, engine) -> None:
        self.count = 0
        self.engine = engine
        self.real_step = engine.step

        def step():
            outputs = self.real_step()
            self.count += 1
            return outputs

        engine.step = step

    def during(self, work) -> tuple[object, int]:
        before = self.count
        result = work()
        return result, self.count - before


class WatchedTokenizer:
    """The server's tokenizer, recording each call with the prompt-list slices finished before
    it; with `hold_first_slice`, the first slice waits (on its pool thread) for `release`."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, int]] = []  # (kind, characters, slices done before)
        self.slices_done = 0
        self.hold_first_slice = False
        self.holding = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(("encode", len(text), self.slices_done))
        return self.inner.encode(text, add_special_tokens)

    def encode_each(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        self.calls.append(("slice", sum(map(len, texts)), self.slices_done))
        if self.hold_first_slice and self.slices_done == 0:
            self.holding.set()
            self.release.wait(BOUND)
        ids = self.inner.encode_each(texts, add_special_tokens)
        self.slices_done += 1
        return ids


@pytest.fixture(scope="module")
def one_seq_server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={"num_kv_blocks": 256, "max_num_seqs": 1},
        preprocess_threads=1,
    )
    handle.steps = StepCounter(handle.engine)
    yield handle
    handle.close()


@pytest.fixture
def watched(one_seq_server):
    ctx = one_seq_server.server.app.ctx
    tokenizer = ctx.tokenizer = WatchedTokenizer(ctx.tokenizer)
    yield tokenizer
    tokenizer.release.set()
    ctx.tokenizer = tokenizer.inner


def choices(count: int) -> list[str]:
    return [f"c{i}" for i in range(count)]


BIG_SCHEMA = {"type": "object", "description": "x" * MAX_GRAMMAR_CHARS}
OVER_LIMIT = [  # (fields, the field named, the limit in the message)
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop", MAX_STOP_STRINGS),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", MAX_STOP_STRING_CHARS),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", MAX_STOP_STRING_CHARS),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", MAX_STOP_TOKEN_IDS),
    (
        {"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}},
        "logit_bias",
        MAX_LOGIT_BIAS,
    ),
    ({"guided_choice": choices(MAX_CHOICES + 1)}, "guided_choice", MAX_CHOICES),
    (
        {"structured_outputs": {"choice": choices(MAX_CHOICES + 1)}},
        "structured_outputs",
        MAX_CHOICES,
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}},
        "response_format",
        MAX_GRAMMAR_CHARS,
    ),
    ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex", MAX_GRAMMAR_CHARS),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,param,limit", OVER_LIMIT)
def test_a_list_over_its_limit_is_a_400_naming_the_field_and_limit(
    tiny_server, watched_tiny, route, fields, param, limit
):
    prompt = (
        {"prompt": "hello"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hello"}]}
    )
    status, body = post(tiny_server.port, route, {**prompt, "max_tokens": 2, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and str(limit) in body["error"]["message"], body
    assert watched_tiny.calls == []  # refused before the prompt was tokenized


def test_too_many_tools_is_a_400_naming_the_limit(tiny_server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, body = post(
        tiny_server.port,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool] * (MAX_TOOLS + 1),
            "tool_choice": "required",
        },
    )
    assert status == 400 and body["error"]["param"] == "tools"
    assert str(MAX_TOOLS) in body["error"]["message"]
    # one tool whose schema, turned into the "required" grammar, is too large to compile
    big = {"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}
    status, body = post(
        tiny_server.port,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [big],
            "tool_choice": "required",
        },
    )
    assert status == 400 and body["error"]["param"] == "tools"
    assert str(MAX_GRAMMAR_CHARS) in body["error"]["message"], body


@pytest.mark.parametrize("field,value", [("allowed_token_ids", [1, 2]), ("bad_words", ["x"])])
def test_vllm_lists_nanoserve_does_not_apply_are_refused(tiny_server, field, value):
    status, body = post(
        tiny_server.port, "/v1/completions", {"prompt": "hello", "max_tokens": 2, field: value}
    )
    assert status == 400 and body["error"]["param"] == field
    assert "not supported" in body["error"]["message"]
    status, _ = post(
        tiny_server.port, "/v1/completions", {"prompt": "hello", "max_tokens": 2, field: []}
    )  # empty: nothing asked
    assert status == 200


def test_lists_at_their_limit_are_served(tiny_server):
    vocab = tiny_server.engine.model_config.vocab_size
    status, body = post(
        tiny_server.port,
        "/v1/completions",
        {
            "prompt": "hello",
            "max_tokens": 3,
            "ignore_eos": True,
            "stop": [f"never-{i}-" + "x" * 50 for i in range(MAX_STOP_STRINGS)],
            "stop_token_ids": [vocab - 1] * MAX_STOP_TOKEN_IDS,
            "logit_bias": {str(i): 0.0 for i in range(min(vocab, MAX_LOGIT_BIAS))},
        },
    )
    assert status == 200, body
    status, body = post(
        tiny_server.port,
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 8, "guided_choice": choices(MAX_CHOICES)},
    )
    assert status == 200 and body["choices"][0]["text"] in choices(MAX_CHOICES), body


def test_sampling_params_hold_the_same_bounds():
    """The offline LLM's requests too: at each limit accepted, one past it refused by name."""
    SamplingParams(
        stop=["s"] * MAX_STOP_STRINGS,
        stop_token_ids=[1] * MAX_STOP_TOKEN_IDS,
        logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)},
    )
    SamplingParams(stop="x" * MAX_STOP_STRING_CHARS)
    for fields, name in (
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**fields)
        assert caught.value.param == name
    StructuredOutputsParams(choice=choices(MAX_CHOICES))
    with pytest.raises(InvalidRequestError, match=str(MAX_CHOICES)):
        StructuredOutputsParams(choice=choices(MAX_CHOICES + 1))


@pytest.fixture
def watched_tiny(tiny_server):
    ctx = tiny_server.server.app.ctx
    tokenizer = ctx.tokenizer = WatchedTokenizer(ctx.tokenizer)
    yield tokenizer
    ctx.tokenizer = tokenizer.inner


def completion_bytes(body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(payload)
    ) + payload


def send_then_wait_until_taken(handle, body: dict):
    """Send `body` on its own connection; return once the server answered it or the engine
    holds it (whichever this server does with it), with the socket to read the answer from."""
    sock = connect(handle.port, timeout=120)
    sock.sendall(completion_bytes(body))
    for _ in range(int(BOUND / 0.01)):
        readable, _, _ = select.select([sock], [], [], 0.01)
        if readable or handle.engine.has_unfinished_requests():
            return sock
    raise AssertionError("the server neither answered nor took the request")


NORMAL = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}


def test_a_million_stop_strings_cost_another_request_no_step(one_seq_server):
    port, steps = one_seq_server.port, one_seq_server.steps
    (status, _), alone = steps.during(lambda: post(port, "/v1/completions", NORMAL))
    assert status == 200 and alone > 0
    hostile = {
        "prompt": "hello",
        "max_tokens": 16,
        "ignore_eos": True,
        "stop": [f"s{i}" for i in range(1_000_000)],
    }  # a 13 MB body, as in the issue
    sock = send_then_wait_until_taken(one_seq_server, hostile)
    (status, _), waited = steps.during(lambda: post(port, "/v1/completions", NORMAL))
    assert status == 200 and waited == alone  # what the engine took would have held it back
    status, _, raw = read_response(sock, 60)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "stop"
    assert str(MAX_STOP_STRINGS) in error["message"]
    sock.close()


def test_prompts_past_n_x_prompts_are_refused_before_tokenizing(one_seq_server, watched):
    port, steps = one_seq_server.port, one_seq_server.steps
    limit = one_seq_server.engine.config.max_n_sequences
    (status, _), alone = steps.during(lambda: post(port, "/v1/completions", NORMAL))
    watched.calls.clear()
    hostile = {"prompt": ["word " * 800] * 2000, "max_tokens": 16}  # 2,000 x 4,000 characters
    sock = send_then_wait_until_taken(one_seq_server, hostile)
    (status, _), waited = steps.during(lambda: post(port, "/v1/completions", NORMAL))
    assert status == 200 and waited == alone
    status, _, raw = read_response(sock, 60)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "n" and str(limit) in error["message"]
    assert [call for call in watched.calls if call[1] >= 4000] == []  # none of it tokenized
    sock.close()


def test_a_prompt_list_is_tokenized_in_slices_others_wait_at_most_one(one_seq_server, watched):
    port = one_seq_server.port
    ctx = one_seq_server.server.app.ctx
    watched.hold_first_slice = True
    cut = {"truncate_prompt_tokens": 32}  # the prompts are longer than the tiny model's context
    hostile = {"prompt": ["word " * 800] * 100, "max_tokens": 1, **cut}  # 400,000 characters
    results: dict[str, tuple] = {}

    def send(name: str, body: dict) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.update({name: post(port, "/v1/completions", body)}), daemon=True
        )
        thread.start()
        return thread

    hostile_thread = send("hostile", hostile)
    assert watched.holding.wait(BOUND), "the prompt list was not tokenized in slices"
    # A small prompt is tokenized on the loop: served while the first slice is still held.
    status, body = post(port, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert status == 200 and watched.slices_done == 0, body
    # A large one queues on the (one) preprocessing thread behind the held slice, not behind
    # the whole list: the slices after the first are submitted only once it is done.
    large_thread = send("large", {"prompt": "word " * 1200, "max_tokens": 2, **cut})
    for _ in range(int(BOUND / 0.01)):
        if ctx.preprocessor.in_flight == 2:
            break
        threading.Event().wait(0.01)
    assert ctx.preprocessor.in_flight == 2, "the large request did not queue"
    watched.release.set()
    large_thread.join(BOUND)
    assert results["large"][0] == 200, results["large"]
    (large_call,) = [call for call in watched.calls if call[:2] == ("encode", 6000)]
    assert large_call[2] == 1  # it waited for exactly one slice of the list
    hostile_thread.join(BOUND)
    status, body = results["hostile"]
    assert status == 200 and len(body["choices"]) == 100, body
    slices = [call for call in watched.calls if call[0] == "slice"]
    assert len(slices) == 7 and all(size <= 64 * 1024 for _, size, _ in slices)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_more_messages_than_the_context_has_tokens_is_a_400(tiny_server, watched_tiny, route):
    limit = tiny_server.engine.max_model_len
    messages = [{"role": "user", "content": "hi"}] * (limit + 1)
    status, body = post(tiny_server.port, route, {"messages": messages, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert str(limit) in body["error"]["message"]
    assert watched_tiny.calls == []  # refused before rendering and tokenizing


def test_a_token_prompt_past_the_context_never_reaches_the_step_loop(one_seq_server):
    """Refused by its length before its ids are walked: the engine's add_request, which runs
    between two steps, never sees it."""
    engine, limit = one_seq_server.engine, one_seq_server.engine.max_model_len
    seen: list[str] = []
    real_add = engine.add_request

    def add_request(request_id, *args, **kwargs):
        seen.append(request_id)
        return real_add(request_id, *args, **kwargs)

    engine.add_request = add_request
    try:
        for prompt in ([7] * 1_000_000, [[7] * 3, [7] * (limit + 1)]):
            status, body = post(
                one_seq_server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 2}
            )
            assert status == 400 and body["error"]["param"] == "input_tokens", body
            assert f"maximum context length is {limit} tokens" in body["error"]["message"]
        assert seen == []
        status, _ = post(
            one_seq_server.port,
            "/v1/completions",  # truncation makes it fit
            {"prompt": [7] * 1000, "max_tokens": 2, "truncate_prompt_tokens": 10},
        )
        assert status == 200 and len(seen) == 1
    finally:
        engine.add_request = real_add
