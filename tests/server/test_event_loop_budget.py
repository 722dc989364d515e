"""Work a request brings must not stall the event loop (issue 15, item 3): huge prompts are
refused before tokenizing, large ones tokenize on the preprocessing pool, request-supplied chat
templates are refused unless trusted, and trusted ones render sandboxed, bounded in output size
and time. No assertion is on time: the tests watch where the tokenizer's work runs (a spy
around the real method records its thread), whether it ran at all, and whether the loop answers
/health while a job is held on the pool; "bounded in time" is "the job ends" (the pool empties),
with a bound that only keeps a broken build from hanging the suite."""

from __future__ import annotations

import json
import threading

import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
HANG = 60.0  # seconds: only a hang takes this long


def post(port: int, path: str, body: dict, timeout: float = HANG):
    return http_request(port, "POST", path, json.dumps(body), timeout=timeout)


class Spy:
    """Wraps one method of the server's real tokenizer: each call does the real work and records
    its thread. With hold(), a call, once its work is done, waits for release() before it
    returns: its pool thread is certainly busy with it while the test probes the loop."""

    def __init__(self, monkeypatch, tokenizer, name: str) -> None:
        real = getattr(tokenizer, name)
        self.threads: list[threading.Thread] = []
        self.holding = False
        self.in_progress = threading.Event()
        self.released = threading.Event()

        def call(*args, **kwargs):
            self.threads.append(threading.current_thread())
            try:
                return real(*args, **kwargs)
            finally:
                if self.holding:
                    self.in_progress.set()
                    self.released.wait(HANG)

        monkeypatch.setattr(tokenizer, name, call)

    def hold(self) -> Spy:
        self.holding = True
        return self

    def off_the_loop(self) -> bool:
        """Every call ran on a preprocessing pool thread."""
        return all(thread.name.startswith("preprocess") for thread in self.threads)


def in_background(work) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    return thread, result


def pool_drains(handle: ServerHandle) -> None:
    """Wait until no job is queued or running on the preprocessing pool: a job that never
    stopped would keep its slot. (in_flight is read on the loop, where it changes.)"""
    preprocessor = handle.server.app.ctx.preprocessor

    async def in_flight() -> int:
        return preprocessor.in_flight

    wait_until(lambda: not handle.loop_thread.call(in_flight), "preprocessing to end", HANG)


@pytest.fixture(scope="module")
def trusting_server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64}, trust_request_chat_template=True
    )
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def impatient_server(tiny_llama_dir):
    """Trusts request templates and gives each 1 s to prepare: only for hostile templates, whose
    answer is a 400 however slow this machine is (a benign template here could miss 1 s on a
    loaded machine)."""
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={"num_kv_blocks": 64},
        trust_request_chat_template=True,
        preprocess_timeout=1.0,
    )
    yield handle
    handle.close()


def test_ten_megabyte_prompt_is_refused_before_tokenizing(tiny_server, monkeypatch):
    tokenizer = tiny_server.server.app.ctx.tokenizer
    encode = Spy(monkeypatch, tokenizer, "encode")
    render = Spy(monkeypatch, tokenizer, "apply_chat_template")
    prompt = "The quick brown fox jumps over the lazy dog. " * 230_000  # ~10 MB
    for path, body in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": prompt}]}),
        ("/tokenize", {"prompt": prompt}),
    ):
        status, _, raw = post(tiny_server.port, path, body)
        assert status == 400 and b"maximum context length" in raw, (path, raw[:200])
    assert encode.threads == []  # refused on its length alone: never tokenized
    assert len(render.threads) == 1 and render.off_the_loop()  # the chat messages rendered
    assert http_request(tiny_server.port, "GET", "/health")[0] == 200


def test_request_chat_template_needs_the_trust_flag(tiny_server):
    status, _, raw = post(
        tiny_server.port,
        CHAT,
        {"messages": MESSAGES, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"},
    )
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    status, _, raw = post(
        tiny_server.port, "/tokenize", {"messages": MESSAGES, "chat_template": "{{ 'x' }}"}
    )
    assert status == 400


def test_trusted_template_renders(trusting_server):
    status, _, raw = post(
        trusting_server.port,
        "/tokenize",
        {
            "messages": MESSAGES,
            "chat_template": "{% for m in messages %}<{{ m.content }}>{% endfor %}",
        },
    )
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
def test_hostile_trusted_template_is_bounded(impatient_server, name, monkeypatch):
    server = impatient_server
    render = Spy(monkeypatch, server.server.app.ctx.tokenizer, "apply_chat_template")
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": HOSTILE_TEMPLATES[name]}
    status, _, raw = post(server.port, CHAT, body)
    assert status == 400, raw[:300]
    assert json.loads(raw)["error"]["type"] == "BadRequestError"
    pool_drains(server)  # the render itself stopped (its deadline), not only the wait for it
    assert len(render.threads) == 1 and render.off_the_loop()
    assert http_request(server.port, "GET", "/health")[0] == 200


def test_large_prompt_tokenizes_off_the_loop(smollm2_dir, monkeypatch):
    handle = ServerHandle(
        smollm2_dir,
        engine_kwargs={"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 1024},
        preprocess_timeout=10 * HANG,
    )  # the hold below is never the timeout
    try:
        encode = Spy(monkeypatch, handle.server.app.ctx.tokenizer, "encode").hold()
        limit = handle.server.app.ctx.max_prompt_chars
        words = "Tokenizers split text into pieces; each piece becomes one id. "
        prompt = (words * (limit // len(words) + 1))[:limit]  # as long as can possibly fit
        thread, result = in_background(lambda: post(handle.port, "/tokenize", {"prompt": prompt}))
        try:
            assert encode.in_progress.wait(HANG), "the prompt was never tokenized"
            # Its pool thread is still inside the tokenizer call: the loop answers regardless.
            for path in ("/health", "/v1/models"):
                assert http_request(handle.port, "GET", path, timeout=HANG)[0] == 200
            assert thread.is_alive()  # (the request is still waiting for its tokens)
        finally:
            encode.released.set()
        thread.join(HANG)
        status, _, raw = result[0]
        assert status == 200 and json.loads(raw)["count"] > 1024
        assert len(encode.threads) == 1 and encode.off_the_loop()
    finally:
        handle.close()
