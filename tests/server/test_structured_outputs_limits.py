"""Structured-output compiles under load, on a real server (issue 52 row 10): a request waiting
for its grammar counts toward --max-waiting-requests, and one whose grammar is not compiled by
--structured-outputs-compile-timeout gets a 400 naming its field, its queued compile dropped.

The compile thread is held busy by a job the test submits to it (a threading.Event it sets), so
"still compiling" is a state the test makes, not a race it hopes to win."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import pytest

from nanoserve import SamplingParams, StructuredOutputsParams
from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

ENGINE = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64}
WARM = "warm"


def _post(server, body: dict) -> tuple[int, dict]:
    payload = {
        "model": server.engine.served_model_name,
        "prompt": "Say:",
        "max_tokens": 16,
        "temperature": 0,
        **body,
    }
    status, _, raw = http_request(
        server.port, "POST", "/v1/completions", json.dumps(payload), timeout=120
    )
    return status, json.loads(raw)


def _hold_compile_thread(server) -> threading.Event:
    """The grammar compiler built (one compile done) and its thread then busy until the
    returned event is set."""
    engine = server.engine
    engine.prepare_structured_output(
        SamplingParams(structured_outputs=StructuredOutputsParams(regex=WARM))
    ).result()
    gate = threading.Event()
    engine.structured_output.executor.submit(gate.wait)
    return gate


@pytest.fixture(scope="module")
def limited(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs=ENGINE,
        max_waiting_requests=2,
        structured_outputs_compile_timeout=600.0,
    )
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def deadline(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir, engine_kwargs=ENGINE, structured_outputs_compile_timeout=0.05
    )
    yield handle
    handle.close()


def test_requests_waiting_for_their_grammar_count_as_waiting(limited):
    gate = _hold_compile_thread(limited)
    manager = limited.engine.structured_output
    compiles = manager.num_compiles
    regexes = [r"[0-9]{2} one", r"[0-9]{2} two"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            waiting = [pool.submit(_post, limited, {"guided_regex": regex}) for regex in regexes]
            wait_until(lambda: manager.num_compiles == compiles + 2)  # both queued for compiling
            assert limited.server.engine.num_waiting == 2
            status, body = _post(limited, {})  # a free request is refused like any other
            assert status == 503, body
            assert "overloaded" in body["error"]["message"]
            status, body = _post(limited, {"guided_regex": r"[0-9]{2} three"})
            assert status == 503, body
        finally:
            gate.set()
        for future, regex in zip(waiting, regexes):
            status, body = future.result(timeout=120)
            assert status == 200 and re.fullmatch(regex, body["choices"][0]["text"]), body
    assert limited.server.engine.num_waiting == 0
    assert _post(limited, {})[0] == 200


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
FIELDS = [
    (
        "response_format",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA},
            }
        },
    ),
    ("guided_json", {"guided_json": {**SCHEMA, "title": "guided"}}),
    ("structured_outputs", {"structured_outputs": {"regex": r"[a-z]{2} late"}}),
    ("guided_regex", {"guided_regex": r"[a-z]{3} late"}),
]


def test_a_grammar_not_compiled_by_the_deadline_is_a_400_naming_its_field(deadline):
    gate = _hold_compile_thread(deadline)
    manager = deadline.engine.structured_output
    cancelled = manager.num_cancelled
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            for field, body in FIELDS:
                status, answer = pool.submit(_post, deadline, body).result(timeout=120)
                assert status == 400, answer
                error = answer["error"]
                assert error["param"] == field and error["type"] == "BadRequestError", error
                assert "was not compiled within 0.05 s" in error["message"], error
            # None of them started (the thread is held) and no one waits: all dropped.
            assert manager.num_cancelled == cancelled + len(FIELDS)
            assert deadline.server.engine.num_waiting == 0
        finally:
            gate.set()
    status, body = _post(deadline, {"guided_regex": WARM})  # compiled: no wait, served
    assert status == 200 and body["choices"][0]["text"] == WARM, body
