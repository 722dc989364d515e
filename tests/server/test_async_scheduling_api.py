"""A server with --async-scheduling (engine/async_scheduling.py) streams what a server without it
streams: the official `openai` client, real sockets, concurrent streams ending at different
steps (max_tokens, stop strings), a chat stream and a client that goes away mid-stream."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle

PROMPTS = ["The quick brown fox", "Paris is", "Once upon a time", "1, 2, 3,", "Hello"]


@pytest.fixture(scope="module")
def async_server(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"async_scheduling": True})
    yield handle
    handle.close()


def stream_completion(server: ServerHandle, prompt: str, **kwargs) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of one streamed completion."""
    chunks = list(
        server.client().completions.create(
            model=server.engine.served_model_name,
            prompt=prompt,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish, chunks[-1].usage.completion_tokens


def test_concurrent_streams_equal_the_server_without_it(async_server, tiny_server):
    free = tiny_server.client().completions.create(
        model=tiny_server.engine.served_model_name, prompt=PROMPTS[0], max_tokens=16, temperature=0
    )
    stop = free.choices[0].text[5:8]
    assert stop.strip()
    requests = [
        (prompt, {"max_tokens": 4 + 3 * i} if i % 2 else {"max_tokens": 16, "stop": [stop]})
        for i, prompt in enumerate(PROMPTS)
    ]
    log = async_server.engine.async_scheduling.log
    overlapped = log.num_overlapped
    results = {}
    for server in (tiny_server, async_server):
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(stream_completion, server, p, **kw) for p, kw in requests]
            results[server] = [future.result() for future in futures]
    assert results[async_server] == results[tiny_server]
    assert results[async_server][0][1] == "stop"  # the stop string came
    assert {finish for _, finish, _ in results[async_server]} == {"stop", "length"}
    assert log.num_overlapped - overlapped >= 15  # every stream's steps overlapped


def test_chat_stream(async_server, tiny_server):
    messages = [{"role": "user", "content": "Say hi"}]
    texts = []
    for server in (tiny_server, async_server):
        chunks = server.client().chat.completions.create(
            model=server.engine.served_model_name,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert texts[0] == texts[1] and texts[0]


def test_client_gone_mid_stream_frees_its_blocks(async_server):
    """A stream closed by its client is aborted, its step in flight or not; the engine frees
    its blocks and serves the next request."""
    engine = async_server.engine
    stream = async_server.client().completions.create(
        model=engine.served_model_name,
        prompt=PROMPTS[2],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_until(lambda: engine.block_managers[0].num_used_blocks == 0, "the blocks freed")
    text, finish, tokens = stream_completion(async_server, PROMPTS[1], max_tokens=5)
    assert finish == "length" and tokens == 5
