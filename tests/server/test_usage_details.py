"""Usage reporting defaults (issue 19): `stream_options: {}` does not turn the usage chunk on, and
with --enable-prompt-tokens-details usage carries prompt_tokens_details.cached_tokens, the prompt
tokens served from the prefix cache."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request, sse_events

PROMPT = list(range(10, 50))  # 40 tokens: two full 16-token blocks can come from the cache


def post(port: int, path: str, body: dict):
    status, _, raw = http_request(port, "POST", path, json.dumps(body), timeout=60)
    assert status == 200, raw[:300]
    return raw


def usage_chunks(raw: bytes) -> list[dict]:
    return [e for e in sse_events(raw) if isinstance(e, dict) and e.get("usage")]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ],
)
def test_empty_stream_options_means_no_usage_chunk(tiny_server, path, body):
    body = {**body, "max_tokens": 3, "stream": True}
    assert usage_chunks(post(tiny_server.port, path, {**body, "stream_options": {}})) == []
    assert usage_chunks(post(tiny_server.port, path, body)) == []
    raw = post(tiny_server.port, path, {**body, "stream_options": {"include_usage": True}})
    [chunk] = usage_chunks(raw)
    assert chunk["usage"]["completion_tokens"] == 3
    assert chunk["usage"]["prompt_tokens_details"] is None  # the flag is off on this server


@pytest.fixture(scope="module")
def details_server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={"num_kv_blocks": 128, "block_size": 16},
        enable_prompt_tokens_details=True,
    )
    yield handle
    handle.close()


def test_cached_tokens_reported(details_server):
    port = details_server.port
    first = json.loads(post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = json.loads(post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}))
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    # Streamed, and with several prompts: one of them cached, one new.
    raw = post(
        port,
        "/v1/completions",
        {
            "prompt": [PROMPT, list(range(60, 100))],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    [chunk] = usage_chunks(raw)
    assert chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert chunk["usage"]["prompt_tokens"] == 80


def test_cached_tokens_in_chat_with_the_openai_client(details_server):
    client = details_server.client()
    model = details_server.engine.served_model_name
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 4}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    result = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    prompt_tokens = result.usage.prompt_tokens
    assert prompt_tokens >= 16 and result.usage.prompt_tokens_details.cached_tokens >= 16
    assert (
        result.usage.prompt_tokens_details.cached_tokens == prompt_tokens // 16 * 16
        or result.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    )
