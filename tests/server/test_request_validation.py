"""No single request may kill the engine (issue 15, items 1, 2, 4): every numeric parameter is
bounds-checked at the door (400 with the OpenAI error body), JSON nested to any depth is a 400 on
every route, `n` is capped, and a step that fails because of its requests fails only those."""

from __future__ import annotations

import json
import logging

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from tests.server.server_helpers import http_request, sse_events
from tests.server.test_async_engine import serve  # noqa: F401 (serve: fixture)

INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1


def post(port: int, path: str, body, timeout: float = 60.0):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return http_request(port, "POST", path, raw, timeout=timeout)


def assert_bad_request(status: int, body: bytes, *names: str) -> dict:
    assert status == 400, (status, body[:300])
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    for name in names:
        assert name in error["message"] or error["param"] == name, error
    return error


def assert_healthy(port: int) -> None:
    assert http_request(port, "GET", "/health")[0] == 200
    status, _, body = post(port, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert status == 200, body[:300]
    assert json.loads(body)["usage"]["completion_tokens"] == 3


BAD_FIELDS = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": UINT64_MAX}, "top_k"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 10_000}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": 2**63}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": UINT64_MAX}, "max_tokens"),
    ({"min_tokens": 2**63}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": {str(UINT64_MAX): 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1e300}}, "logit_bias"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),  # past the vocabulary
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [UINT64_MAX]}, "stop_token_ids"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"prompt": [2**63]}, "prompt"),
    ({"prompt": [UINT64_MAX, 5]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[5, 6], [2**63]]}, "prompt"),
    ({"n": 64, "prompt": ["a", "b", "c"]}, "n"),  # n x prompts over the cap
    ('{"temperature": 1e999}', "temperature"),  # JSON's way to say infinity
    ({"repetition_penalty": -1e308}, "repetition_penalty"),
]


@pytest.mark.parametrize("fields,name", BAD_FIELDS, ids=[str(f)[:40] for f, _ in BAD_FIELDS])
def test_out_of_range_parameter_is_400_and_engine_lives(tiny_server, fields, name):
    if isinstance(fields, str):  # raw JSON that Python's json would not write
        body = '{"prompt": "hello", "max_tokens": 4, ' + fields[1:]
    else:
        body = {"prompt": "hello", "max_tokens": 4, **fields}
    status, _, raw = post(tiny_server.port, "/v1/completions", body)
    assert_bad_request(status, raw, name)
    assert not tiny_server.server.engine.is_dead
    assert http_request(tiny_server.port, "GET", "/health")[0] == 200


def test_seed_bounds_are_signed_64_bit(tiny_server):
    client = tiny_server.client()
    for seed in (INT64_MAX, -(2**63), 0, -1):
        result = client.completions.create(
            model=tiny_server.engine.served_model_name, prompt="hello", max_tokens=3, seed=seed, n=2
        )
        assert len(result.choices) == 2
    status, _, raw = post(
        tiny_server.port, "/v1/completions", {"prompt": "hello", "seed": INT64_MAX + 1}
    )
    error = assert_bad_request(status, raw, "seed")
    assert str(INT64_MAX) in error["message"] and str(-(2**63)) in error["message"]


def test_chat_route_checks_the_same_bounds(tiny_server):
    messages = [{"role": "user", "content": "hi"}]
    for fields, name in (
        ({"top_k": 2**63}, "top_k"),
        ({"n": 10_000}, "n"),
        ({"top_logprobs": 2**63, "logprobs": True}, "logprobs"),
        ({"max_completion_tokens": UINT64_MAX}, "max_tokens"),
    ):
        status, _, raw = post(
            tiny_server.port, "/v1/chat/completions", {"messages": messages, **fields}
        )
        assert_bad_request(status, raw, name)
    assert_healthy(tiny_server.port)


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


NESTED_BODIES = {
    "known field": lambda depth: b'{"prompt": ' + _nested(depth) + b"}",
    "unknown field": lambda depth: b'{"prompt": "x", "extra": ' + _nested(depth) + b"}",
    "message content": lambda depth: (
        b'{"messages": [{"role": "user", "content": '
        + b'{"a": ' * depth
        + b"1"
        + b"}" * depth
        + b"}]}"
    ),
    "top level": _nested,
}
JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@pytest.mark.parametrize("depth", [2_000, 100_000, 1_000_000])
def test_deeply_nested_json_is_400_on_every_route(tiny_server, depth):
    for route in JSON_ROUTES:
        for shape, make in NESTED_BODIES.items():
            status, _, raw = post(tiny_server.port, route, make(depth))
            assert status == 400, (route, shape, status, raw[:200])
            assert json.loads(raw)["error"]["type"] == "BadRequestError", (route, shape)
    assert_healthy(tiny_server.port)


@pytest.fixture(scope="module")
def faulty_engine(tiny_llama_dir):
    """The real engine; its forward pass fails for batches holding a marked prompt, as a request
    whose input breaks the step would (the door now stops every such input we know of)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=128))
    real_forward = engine.runner.forward

    def forward(model_input):
        if any(item.token_ids[:4] == tuple(POISON) for item in model_input.sampling_inputs):
            raise RuntimeError("Overflow when unpacking long long")
        return real_forward(model_input)

    engine.runner.forward = forward
    return engine


POISON = [7, 7, 7, 7]
STEP_FAILED = "The request failed during a model step; the server log has the cause."


def test_step_failure_fails_only_its_requests(serve, faulty_engine, caplog):
    """The client gets a generic message; the cause (its repr may show internals) is logged."""
    served = serve(faulty_engine)
    port = served.port
    caplog.set_level(logging.ERROR, logger="nanoserve.server")
    status, _, raw = post(port, "/v1/completions", {"prompt": POISON, "max_tokens": 5})
    assert status == 500, raw[:300]
    assert json.loads(raw)["error"] == {
        "message": STEP_FAILED,
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    status, _, raw = post(
        port, "/v1/completions", {"prompt": POISON + [8], "max_tokens": 5, "stream": True}
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]", events
    assert events[-2]["error"]["message"] == STEP_FAILED
    assert "Overflow when unpacking long long" in caplog.text  # the cause, in the log only
    assert not served.server.engine.is_dead
    assert_healthy(port)
    assert not faulty_engine.requests and not faulty_engine.schedulers[0].running
    # The fault freed the failed requests' blocks: the pool is whole again.
    assert faulty_engine.block_managers[0].num_used_blocks == 0


def test_offline_llm_gets_the_same_validation(tiny_llama_dir):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 1)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_n_sequences=8)
    params = SamplingParams(max_tokens=3)
    params.top_k = 2**63  # assigned after construction: the engine checks again at the door
    with pytest.raises(ValueError, match="top_k"):
        llm.generate("hello", params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_n_sequences"):
        llm.generate("hello", SamplingParams(n=9), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hello", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    [output] = llm.generate(
        "hello", SamplingParams(max_tokens=3, seed=INT64_MAX, n=2), use_tqdm=False
    )
    assert [len(c.token_ids) for c in output.outputs] == [3, 3]
    assert not llm.llm_engine.requests
