"""Work a request brings must not stall the event loop (issue 15, item 3): huge prompts are
refused before tokenizing, large ones tokenize on the preprocessing pool with the GIL released,
request-supplied chat templates are refused unless trusted, and trusted ones render sandboxed,
bounded in output size and time. Each test measures /health latency while the work runs."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def post(port: int, path: str, body: dict, timeout: float = 60.0):
    return http_request(port, "POST", path, json.dumps(body), timeout=timeout)


def while_health_polled(port: int, work) -> tuple[object, float]:
    """Run `work()` on a thread; poll /health until it returns. (its result, worst latency)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    worst = 0.0
    thread.start()
    deadline = time.monotonic() + 60
    while thread.is_alive():
        assert time.monotonic() < deadline, "the request never finished"
        started = time.monotonic()
        assert http_request(port, "GET", "/health", timeout=30)[0] == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.01)
    thread.join()
    return result[0], worst


@pytest.fixture(scope="module")
def trusting_server(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64},
                          trust_request_chat_template=True, preprocess_timeout=1.0)
    yield handle
    handle.close()


def test_ten_megabyte_prompt_is_refused_without_stalling(tiny_server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 230_000  # ~10 MB
    for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 1}),
                       (CHAT, {"messages": [{"role": "user", "content": prompt}]}),
                       ("/tokenize", {"prompt": prompt})):
        (status, _, raw), worst = while_health_polled(
            tiny_server.port, lambda: post(tiny_server.port, path, body))
        assert status == 400 and b"maximum context length" in raw, (path, raw[:200])
        assert worst < 0.5, (path, worst)


def test_request_chat_template_needs_the_trust_flag(tiny_server):
    status, _, raw = post(tiny_server.port, CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                                    "chat_template": "{{ messages[0].content }}"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    status, _, raw = post(tiny_server.port, "/tokenize",
                          {"messages": MESSAGES, "chat_template": "{{ 'x' }}"})
    assert status == 400


def test_trusted_template_renders(trusting_server):
    status, _, raw = post(trusting_server.port, "/tokenize", {
        "messages": MESSAGES, "chat_template": "{% for m in messages %}<{{ m.content }}>{% endfor %}"})
    assert status == 200, raw[:200]
    assert json.loads(raw)["count"] > 0


HOSTILE_TEMPLATES = {
    "a 200 MB string": "{{ 'x' * 200000000 }}",
    "a string doubled in a loop": "{% set s = namespace(v='x') %}{% for i in range(100) %}"
                                  "{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}",
    "nested loops without output": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                   "{% endfor %}{% endfor %}",
    "nested loops with output": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                "{{ i }}{% endfor %}{% endfor %}",
    "a huge power": "{{ 7 ** 100000000 }}",
    "python internals": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_trusted_template_is_bounded(trusting_server, name):
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": HOSTILE_TEMPLATES[name]}
    started = time.monotonic()
    (status, _, raw), worst = while_health_polled(
        trusting_server.port, lambda: post(trusting_server.port, CHAT, body))
    assert status == 400, raw[:300]
    assert json.loads(raw)["error"]["type"] == "BadRequestError"
    assert time.monotonic() - started < 1.0 + 3.0  # the 1 s preprocessing timeout, plus slack
    assert worst < 0.5, worst


def test_large_prompt_tokenizes_off_the_loop(smollm2_dir):
    handle = ServerHandle(smollm2_dir, engine_kwargs={"dtype": "float32", "num_kv_blocks": 64,
                                                      "max_model_len": 1024})
    try:
        limit = handle.server.app.ctx.max_prompt_chars
        words = "Tokenizers split text into pieces; each piece becomes one id. "
        prompt = (words * (limit // len(words) + 1))[:limit]  # as long as can possibly fit
        (status, _, raw), worst = while_health_polled(
            handle.port, lambda: post(handle.port, "/tokenize", {"prompt": prompt}))
        assert status == 200 and json.loads(raw)["count"] > 1024
        assert worst < 0.3, worst
    finally:
        handle.close()
