"""--response-cache-size on a real server: a repeat of a greedy or seeded request is answered from
the cache, identical (streamed or not, completions and chat), without the engine computing a
token (its counters stay put); sampled requests without a seed, other parameters, failures and
aborts never hit; LRU by bytes, TTL, POST /reset_prefix_cache, the /metrics counters."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy, connect, http_request, letter_bias, scrape_metrics

COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "nanoserve:response_cache_queries_total",
    "nanoserve:response_cache_hits_total",
)
ENGINE = COUNTERS[:3]


def counters(port: int) -> dict[str, float]:
    samples = scrape_metrics(port)
    return {name: samples[name] for name in COUNTERS}


def delta(before: dict, after: dict) -> dict:
    return {
        name.split(":")[1].removesuffix("_total"): after[name] - before[name] for name in COUNTERS
    }


def cache_moved(before: dict, after: dict) -> tuple[float, float]:
    d = delta(before, after)
    return d["response_cache_queries"], d["response_cache_hits"]


def engine_moved(before: dict, after: dict) -> bool:
    return any(after[name] != before[name] for name in ENGINE)


def post(port: int, path: str, payload: dict) -> bytes:
    status, _, body = http_request(port, "POST", path, json.dumps(payload))
    assert status == 200, body
    return body


def sse_events(body: bytes) -> list[dict]:
    events = [event for event in body.decode().split("\n\n") if event]
    assert events[-1] == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def merged_completion(events: list[dict]) -> dict:
    """Per choice index: the stream's text, token ids, logprobs and finish reason joined."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            merged = choices.setdefault(
                choice["index"],
                {
                    "text": "",
                    "token_ids": [],
                    "finish_reason": None,
                    "stop_reason": None,
                    "logprobs": {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                        "text_offset": [],
                    },
                },
            )
            merged["text"] += choice["text"]
            merged["token_ids"] += choice.get("token_ids") or []
            for field, values in (choice["logprobs"] or {}).items():
                merged["logprobs"][field] += values
            if choice["finish_reason"] is not None:
                merged["finish_reason"] = choice["finish_reason"]
                merged["stop_reason"] = choice["stop_reason"]
    return {"choices": choices, "usage": usage}


def merged_chat(events: list[dict]) -> dict:
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            merged = choices.setdefault(
                choice["index"],
                {"content": "", "token_ids": [], "logprobs": [], "finish_reason": None},
            )
            merged["content"] += choice["delta"].get("content") or ""
            merged["token_ids"] += choice.get("token_ids") or []
            merged["logprobs"] += (choice.get("logprobs") or {}).get("content") or []
            merged["finish_reason"] = choice["finish_reason"] or merged["finish_reason"]
    return {"choices": choices, "usage": usage}


def without_ids(response) -> dict:
    body = response.model_dump() if hasattr(response, "model_dump") else dict(response)
    body.pop("id"), body.pop("created")
    return body


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir, response_cache_size=1.0, server_dev_mode=True
    )  # POST /reset_prefix_cache
    yield handle
    handle.close()


def test_completion_hit_is_identical_and_never_reaches_the_engine(server):
    client = server.client()
    model = server.engine.served_model_name
    request = dict(
        model=model,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    first_counts = counters(server.port)
    first = client.completions.create(**request)
    before = counters(server.port)
    assert cache_moved(first_counts, before) == (1, 0) and engine_moved(first_counts, before)
    second = client.completions.create(**request)
    after = counters(server.port)
    assert cache_moved(before, after) == (1, 1)
    assert not engine_moved(before, after)  # no prompt, no token, not even a scheduler lookup
    assert without_ids(second) == without_ids(first)
    choice = second.choices[0]
    assert (
        choice.model_extra["token_ids"]
        and len(choice.logprobs.tokens) == 12
        or choice.finish_reason == "stop"
    )
    assert second.usage.completion_tokens == len(choice.model_extra["token_ids"])
    assert second.id != first.id


def test_streamed_hits_match_the_original_either_way(server):
    port = server.port
    payload = {
        "prompt": "def add(a, b):",
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = counters(port)
    streamed_miss = merged_completion(sse_events(post(port, "/v1/completions", payload)))
    middle = counters(port)
    assert cache_moved(before, middle) == (1, 0) and engine_moved(before, middle)
    streamed_hit = merged_completion(sse_events(post(port, "/v1/completions", payload)))
    after = counters(port)
    assert cache_moved(middle, after) == (1, 1) and not engine_moved(middle, after)
    # A live stream's text_offset depends on where its chunks fell (text held back while a
    # character is incomplete); the replay is one chunk, whose offsets are the unstreamed ones.
    hit_offsets = streamed_hit["choices"][0]["logprobs"].pop("text_offset")
    streamed_miss["choices"][0]["logprobs"].pop("text_offset")
    assert streamed_hit == streamed_miss
    hit_choice = streamed_hit["choices"][0]
    assert streamed_hit["usage"]["completion_tokens"] == len(hit_choice["token_ids"])
    # the entry a stream stored answers the same request unstreamed, and the other way round
    plain = dict(payload, stream=False)
    plain.pop("stream_options")
    body = json.loads(post(port, "/v1/completions", plain))
    assert cache_moved(after, counters(port)) == (1, 1)
    choice = body["choices"][0]
    stream_choice = streamed_miss["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (
        stream_choice["text"],
        stream_choice["token_ids"],
        stream_choice["finish_reason"],
    )
    assert choice["logprobs"] == dict(stream_choice["logprobs"], text_offset=hit_offsets)


def test_echo_with_prompt_logprobs_and_n_seeded(server):
    port, model = server.port, server.engine.served_model_name
    client = server.client()
    for request in (
        dict(prompt="hello world", max_tokens=5, temperature=0, echo=True, logprobs=1),
        dict(prompt="hello world", max_tokens=6, temperature=0.9, seed=11, n=3),
        dict(prompt=["one", "two"], max_tokens=4, temperature=0, n=1),
    ):
        before = counters(port)
        first = client.completions.create(model=model, **request)
        middle = counters(port)
        second = client.completions.create(model=model, **request)
        after = counters(port)
        assert cache_moved(before, middle) == (1, 0) and cache_moved(middle, after) == (1, 1)
        assert not engine_moved(middle, after)
        assert without_ids(second) == without_ids(first)
        num_prompts = 2 if isinstance(request["prompt"], list) else 1
        assert len(second.choices) == request.get("n", 1) * num_prompts


def test_chat_hit_streamed_and_not(server):
    port, client = server.port, server.client()
    model = server.engine.served_model_name
    messages = [{"role": "user", "content": "Tell me a story"}]
    request = dict(
        model=model,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    before = counters(port)
    first = client.chat.completions.create(**request)
    middle = counters(port)
    second = client.chat.completions.create(**request)
    after = counters(port)
    assert cache_moved(before, middle) == (1, 0) and cache_moved(middle, after) == (1, 1)
    assert not engine_moved(middle, after)
    assert without_ids(second) == without_ids(first)
    payload = {
        "messages": messages,
        "max_completion_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streamed = merged_chat(sse_events(post(port, "/v1/chat/completions", payload)))
    assert cache_moved(after, counters(port)) == (1, 1)
    choice = first.choices[0]
    assert streamed["choices"][0] == {
        "content": choice.message.content,
        "token_ids": choice.model_extra["token_ids"],
        "logprobs": [entry.model_dump() for entry in choice.logprobs.content],
        "finish_reason": choice.finish_reason,
    }
    usage = first.usage
    assert {
        key: streamed["usage"][key]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    } == {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    # a streamed miss stores too
    other = dict(payload, max_completion_tokens=7)
    before = counters(port)
    miss = merged_chat(sse_events(post(port, "/v1/chat/completions", other)))
    hit = merged_chat(sse_events(post(port, "/v1/chat/completions", other)))
    after = counters(port)
    assert cache_moved(before, after) == (2, 1) and hit == miss


def test_sampled_requests_without_a_seed_are_never_cached(server):
    port, client = server.port, server.client()
    model = server.engine.served_model_name
    for _ in range(2):
        before = counters(port)
        client.completions.create(model=model, prompt="random walk", max_tokens=4, temperature=0.8)
        after = counters(port)
        assert cache_moved(before, after) == (0, 0)  # not even looked up
        assert after["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]


def test_different_parameters_miss(server):
    port, client = server.port, server.client()
    model = server.engine.served_model_name
    base = dict(prompt="Parameters matter", max_tokens=6, temperature=0)
    client.completions.create(model=model, **base)
    variants = [
        dict(max_tokens=7),
        dict(stop=["zz"]),
        dict(logprobs=1),
        dict(seed=5),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.25),
        dict(extra_body={"min_tokens": 2}),
        dict(logit_bias={"50": 5}),
        dict(extra_body={"stop_token_ids": [3]}),
        dict(extra_body={"include_stop_str_in_output": True}),
        dict(extra_body={"skip_special_tokens": False}),
        dict(extra_body={"repetition_penalty": 1.3}),
        dict(top_p=0.5),
        dict(prompt="Parameters matter!"),
        dict(echo=True, logprobs=0),
    ]
    for variant in variants:
        before = counters(port)
        client.completions.create(model=model, **{**base, **variant})
        after = counters(port)
        assert cache_moved(before, after) == (1, 0), variant
        assert engine_moved(before, after), variant
    before = counters(port)
    client.completions.create(model=model, **base)
    assert cache_moved(before, counters(port)) == (1, 1)


def test_reset_prefix_cache_clears_both_caches(server):
    port = server.port
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks can be cached
    request = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = json.loads(post(port, "/v1/completions", request))
    before = counters(port)
    post(port, "/v1/completions", dict(request, max_tokens=5))  # new response, cached prefix
    d = delta(before, counters(port))
    assert (d["response_cache_queries"], d["response_cache_hits"]) == (1, 0)
    assert d["prefix_cache_hits"] == 32
    before = counters(port)
    post(port, "/v1/completions", request)
    assert cache_moved(before, counters(port)) == (1, 1)

    status, headers, body = http_request(port, "POST", "/reset_prefix_cache")
    assert (status, body) == (200, b"")
    assert len(server.server.app.ctx.response_cache) == 0

    before = counters(port)
    again = json.loads(post(port, "/v1/completions", request))
    d = delta(before, counters(port))
    assert (d["response_cache_queries"], d["response_cache_hits"]) == (1, 0)
    assert d["prompt_tokens"] == 40 and d["prefix_cache_queries"] == 40
    assert d["prefix_cache_hits"] == 0
    assert again["choices"] == first["choices"]
    status, _, _ = http_request(port, "GET", "/reset_prefix_cache")
    assert status == 405


def test_aborted_request_is_not_stored(server):
    port = server.port
    payload = json.dumps(
        {
            "prompt": "abort me",
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "logit_bias": letter_bias(server.server.app.ctx.tokenizer),
        }
    ).encode()
    aborts = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="%s"}' % (
        server.engine.served_model_name
    )

    def stream_then_disconnect() -> None:
        # The second step stays running until the client has read the first event and closed:
        # the request is certainly unfinished when the server learns of the close, however fast
        # its 480 tokens would otherwise go.
        spy = StepSpy(server.engine)
        try:
            sock = connect(port)
            second = spy.hold_second_step(
                lambda: sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                    b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
                )
            )
            try:
                received = b""
                while b"data: " not in received:
                    chunk = sock.recv(65536)
                    assert chunk, (
                        f"the server closed the stream before its first event: {received!r}"
                    )
                    received += chunk
                sock.close()
            finally:
                spy.release(second)
        finally:
            spy.restore()

    for expected_queries in (1, 1):
        before = scrape_metrics(port)
        stream_then_disconnect()
        wait_until(
            lambda: scrape_metrics(port)[aborts] != before[aborts], "the disconnect to abort"
        )
        after = scrape_metrics(port)
        assert (
            after["nanoserve:response_cache_queries_total"]
            - before["nanoserve:response_cache_queries_total"]
            == expected_queries
        )
        assert (
            after["nanoserve:response_cache_hits_total"]
            == before["nanoserve:response_cache_hits_total"]
        )


def test_eviction_keeps_the_size_bound(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, response_cache_size=0.005)  # 5242 bytes
    try:
        cache = handle.server.app.ctx.response_cache
        assert cache.max_bytes == 5242
        prompts = [[200 + i, 201 + i, 202 + i] for i in range(30)]
        for prompt in prompts:
            post(
                handle.port,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": 3, "temperature": 0},
            )
            assert 0 < cache.size_bytes <= cache.max_bytes
        assert 3 <= len(cache) < 30
        assert cache.size_bytes == sum(
            cache.entry_size(key, blob) for key, (blob, _) in cache.entries.items()
        )
        before = counters(handle.port)
        post(
            handle.port,
            "/v1/completions",
            {"prompt": prompts[-1], "max_tokens": 3, "temperature": 0},
        )
        middle = counters(handle.port)
        assert cache_moved(before, middle) == (1, 1)  # the newest stayed
        post(
            handle.port,
            "/v1/completions",
            {"prompt": prompts[0], "max_tokens": 3, "temperature": 0},
        )
        after = counters(handle.port)
        assert cache_moved(middle, after) == (1, 0) and engine_moved(middle, after)
        assert cache.size_bytes <= cache.max_bytes
    finally:
        handle.close()


def test_entries_expire_after_the_ttl(tiny_llama_dir):
    ttl = 1.0
    handle = ServerHandle(tiny_llama_dir, response_cache_size=1.0, response_cache_ttl=ttl)
    try:
        request = {"prompt": "short lived", "max_tokens": 3, "temperature": 0}
        sent = time.monotonic()
        post(handle.port, "/v1/completions", request)  # stored before this returns
        deadline = sent + 60
        while True:  # hits until the entry expires; the first miss stores it again
            before = counters(handle.port)
            post(handle.port, "/v1/completions", request)
            received = time.monotonic()
            queries, hits = cache_moved(before, counters(handle.port))
            assert queries == 1
            if hits == 0:
                break
            assert received < deadline, "the entry never expired"
            time.sleep(0.05)
        assert received - sent >= ttl  # never expired early
        before = counters(handle.port)
        post(handle.port, "/v1/completions", request)
        assert cache_moved(before, counters(handle.port)) == (1, 1)  # stored again
    finally:
        handle.close()


def test_off_by_default(tiny_server):
    assert tiny_server.server.app.ctx.response_cache is None
    request = {"prompt": "no cache here", "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        before = counters(tiny_server.port)
        post(tiny_server.port, "/v1/completions", request)
        after = counters(tiny_server.port)
        assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] >= 1
        assert cache_moved(before, after) == (0, 0)
        assert after["nanoserve:response_cache_queries_total"] == 0
    # not in development mode: the route that changes server state does not exist
    status, _, body = http_request(tiny_server.port, "POST", "/reset_prefix_cache")
    assert status == 404


def test_reset_while_a_request_runs(server):
    """The reset waits for the step in flight (the step loop runs it between steps): the running
    request goes on to the same tokens, and its stored answer is not touched by the reset."""
    client, model = server.client(), server.engine.served_model_name
    request = dict(
        model=model,
        prompt="keep going",
        max_tokens=400,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    reference = client.completions.create(**request)
    assert http_request(server.port, "POST", "/reset_prefix_cache")[0] == 200
    before = counters(server.port)
    text, finish_reason, resets = "", None, 0
    for chunk in client.completions.create(stream=True, **request):
        text += chunk.choices[0].text
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        if resets < 3:
            assert http_request(server.port, "POST", "/reset_prefix_cache")[0] == 200
            resets += 1
    assert (text, finish_reason) == (reference.choices[0].text, "length")
    after = counters(server.port)
    assert cache_moved(before, after) == (1, 0)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 400
    repeat = client.completions.create(**request)  # stored after the resets
    assert cache_moved(after, counters(server.port)) == (1, 1)
    assert repeat.choices[0].text == reference.choices[0].text
