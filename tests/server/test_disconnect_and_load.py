"""Client disconnects abort their requests; many concurrent streams all complete correctly."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy, connect, http_request, letter_bias, scrape_metrics


@pytest.fixture(scope="module")
def small_kv_server(tiny_llama_dir):
    # A small KV pool so one request's blocks show in kv_cache_usage_perc.
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64})
    yield handle
    handle.close()


def _wait_idle(port: int, idle_usage: float, timeout: float = 60.0) -> dict[str, float]:
    """Poll the metrics until the server is idle (the timeout is only a hang bound)."""

    def idle_metrics() -> dict[str, float] | None:
        metrics = scrape_metrics(port)
        idle = (
            metrics["vllm:num_requests_running"] == 0
            and metrics["vllm:num_requests_waiting"] == 0
            and metrics["vllm:kv_cache_usage_perc"] == idle_usage
        )
        return metrics if idle else None

    return wait_until(idle_metrics, "an idle server", timeout)


def _send(sock, body: dict, extra_headers: bytes = b"") -> None:
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%b\r\n%b" % (len(payload), extra_headers, payload)
    )


def test_stream_disconnect_aborts_and_frees_kv(small_kv_server):
    port, engine = small_kv_server.port, small_kv_server.engine
    idle = scrape_metrics(port)
    idle_usage = idle["vllm:kv_cache_usage_perc"]
    key = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="%s"}' % (
        engine.served_model_name
    )
    spy = StepSpy(engine)
    try:
        sock = connect(port)
        # The second step stays running while the test reads, looks and closes: the request is
        # certainly mid-stream, however fast its 480 tokens would otherwise come.
        step = spy.hold_second_step(
            lambda: _send(
                sock,
                {
                    "prompt": "The quick brown fox",
                    "max_tokens": 480,
                    "ignore_eos": True,
                    "stream": True,
                    "logit_bias": letter_bias(small_kv_server.server.app.ctx.tokenizer),
                },
            )
        )
        try:
            received = b""
            while b"data: " not in received:  # the first step's event
                received += sock.recv(4096)
            busy = scrape_metrics(port)
            tokens_at_close = engine.generation_tokens_total
            sock.close()
        finally:
            spy.release(step)
        assert busy["vllm:num_requests_running"] == 1
        assert busy["vllm:kv_cache_usage_perc"] > idle_usage
        metrics = _wait_idle(port, idle_usage)
    finally:
        spy.restore()
    assert metrics[key] == idle[key] + 1 and len(spy.aborts) == 1
    # The engine really dropped it, within a few steps of the close (the server learns of a
    # close from its writes: the held step, two more whose chunks are those writes, the abort).
    assert spy.aborts[0][1] <= step + 4, (spy.aborts, step)
    assert engine.generation_tokens_total - tokens_at_close <= 4


def test_non_streamed_disconnect_aborts(small_kv_server):
    """The client asked for `100 Continue`, so the server may probe it with more of them after
    its EOF, and tell that it is gone (without the header nothing may be written before the
    answer: test_connection_robustness.py)."""
    port = small_kv_server.port
    idle_usage = scrape_metrics(port)["vllm:kv_cache_usage_perc"]
    sock = connect(port)
    _send(
        sock,
        {"prompt": "hello", "max_tokens": 480, "ignore_eos": True},
        b"Expect: 100-continue\r\n",
    )
    wait_until(lambda: scrape_metrics(port)["vllm:num_requests_running"], "the request to run")
    sock.close()
    _wait_idle(port, idle_usage)  # that it was aborted, not finished: test_connection_robustness


def test_64_concurrent_streams(tiny_server):
    max_tokens = 24

    async def one(client, index: int):
        stream = await client.completions.create(
            model=tiny_server.engine.served_model_name,
            prompt=f"request number {index}: ",
            max_tokens=max_tokens,
            stream=True,
            logprobs=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        usage = finish = None
        async for chunk in stream:
            if chunk.choices:
                tokens += len(chunk.choices[0].logprobs.tokens)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return tokens, usage.completion_tokens, finish

    async def main():
        client = openai.AsyncOpenAI(
            base_url=tiny_server.url + "/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results == [(max_tokens, max_tokens, "length")] * 64
    metrics = scrape_metrics(tiny_server.port)
    assert metrics["vllm:num_requests_running"] == 0


def test_api_key(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            handle.client(api_key="wrong").models.list()
        status, _, body = http_request(handle.port, "GET", "/v1/models")
        assert status == 401 and json.loads(body)["error"]["code"] == 401
        assert handle.client(api_key="sekret").models.list().data
        assert http_request(handle.port, "GET", "/health")[0] == 200
    finally:
        handle.close()
