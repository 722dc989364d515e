"""The async engine and the server around it, on a fake engine: the loop stays responsive while
steps run, aborts land within one step, overload gives 503, and a failed step kills the engine
visibly (error chunk, /health 503) without hanging anyone."""
from __future__ import annotations

import json
import threading
import time

import pytest

from nanoserve.server.api_server import start_server
from nanoserve.server.args import ServerOptions
from tests.server.fake_engine import FakeEngine
from tests.server.server_helpers import LoopThread, connect, http_request, read_response


@pytest.fixture
def fake_server():
    started = []

    def start(engine: FakeEngine, **options):
        loop_thread = LoopThread()
        server = loop_thread.call(lambda: start_server(engine, ServerOptions(port=0, **options)))
        started.append((loop_thread, server))
        return server
    yield start
    for loop_thread, server in started:
        loop_thread.call(lambda: server.shutdown(0.5))
        loop_thread.close()


def post(port, path, body, timeout=30.0):
    return http_request(port, "POST", path, json.dumps(body), timeout=timeout)


def sse_events(body: bytes) -> list:
    events = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_loop_answers_while_steps_run(fake_server):
    engine = FakeEngine(step_seconds=0.25)
    server = fake_server(engine)
    results = []
    clients = [threading.Thread(target=lambda: results.append(post(
        server.port, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "stream": True})))
        for _ in range(4)]
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 10
    while engine.num_steps < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for path in ("/health", "/metrics", "/v1/models"):
        start = time.monotonic()
        assert http_request(server.port, "GET", path, timeout=5)[0] == 200
        assert time.monotonic() - start < 0.15, path  # well under one 0.25 s step
    for thread in clients:
        thread.join(30)
    assert len(results) == 4 and all(status == 200 for status, _, _ in results)
    assert threading.main_thread().ident not in engine.thread_ids
    steps = engine.num_steps
    time.sleep(0.3)
    assert engine.num_steps == steps  # idle: no stepping without work


def test_disconnect_aborts_within_one_step(fake_server):
    engine = FakeEngine(step_seconds=0.05)
    server = fake_server(engine)
    sock = connect(server.port)
    payload = json.dumps({"prompt": "x", "max_tokens": 200, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload))
    data = b""
    while data.count(b"data: ") < 2:
        data += sock.recv(4096)
    steps_at_close = engine.num_steps
    sock.close()
    deadline = time.monotonic() + 5
    while not engine.aborted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.aborted[0][1] <= steps_at_close + 2  # the running step, then the abort
    assert not engine.requests


def test_waiting_limit_gives_503(fake_server):
    engine = FakeEngine(step_seconds=0.05, max_running=1)
    server = fake_server(engine, max_waiting_requests=2)
    results = {}

    def run(name):
        results[name] = post(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 12})
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while server.engine.num_waiting < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, headers, body = post(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and json.loads(body)["error"]["code"] == 503
    assert headers.get("retry-after") == "1"
    for thread in threads:
        thread.join(30)
    assert all(results[i][0] == 200 for i in range(3))  # the others were not disturbed


def test_prompt_too_long_is_400_with_vllm_wording(fake_server):
    server = fake_server(FakeEngine(max_model_len=16))
    status, _, body = post(server.port, "/v1/completions", {"prompt": "y" * 40})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "input_tokens"
    assert error["message"].startswith("This model's maximum context length is 16 tokens. "
                                       "However, your request has 40 input tokens.")


def test_dead_engine(fake_server):
    engine = FakeEngine(step_seconds=0.02, fail_on_step=4)
    server = fake_server(engine)
    status, _, body = post(server.port, "/v1/completions",
                           {"prompt": "x", "max_tokens": 50, "stream": True})
    events = sse_events(body)
    assert status == 200 and events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["code"] == 503
    assert http_request(server.port, "GET", "/health")[0] == 503
    status, _, body = post(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 5})
    assert status == 503
    status, _, body = post(server.port, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 503


def test_pipelined_api_requests_and_keep_alive(fake_server):
    server = fake_server(FakeEngine())
    sock = connect(server.port)
    body = json.dumps({"prompt": "x", "max_tokens": 3}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    sock.sendall(request + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n" + request)
    first, second, third = (read_response(sock) for _ in range(3))
    assert first[0] == 200 and json.loads(first[2])["choices"][0]["text"] == "aaa"
    assert second[0] == 200 and second[2] == b""
    assert third[0] == 200 and json.loads(third[2])["usage"]["completion_tokens"] == 3
