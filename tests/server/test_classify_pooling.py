"""POST /pooling and /classify through a real server on an embedding model (the tiny Llama,
--runner pooling): /pooling gives, for each input, what /v1/embeddings gives (the oracle, through
the `openai` client), as floats or base64, with `normalize` and `truncate_prompt_tokens`; `task`
and every bad field are 400s naming the field; /classify refuses a model that does not classify.
"""

from __future__ import annotations

import base64
import json
import logging
import struct

import pytest

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

TEXTS = ["The quick brown fox", "jumps over the lazy dog", "hello"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        {"dtype": "float32", "runner": "pooling", "num_kv_blocks": 128},
        enable_log_requests=True,
    )
    yield handle
    handle.close()


def post(server, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    status, _, payload = http_request(server.port, "POST", path, json.dumps(body), headers)
    return status, json.loads(payload)


def embeddings(server, inputs, **extra) -> list[list[float]]:
    result = server.client().embeddings.create(
        model=server.engine.served_model_name,
        input=inputs,
        encoding_format="float",
        extra_body=extra or None,
    )
    return [d.embedding for d in result.data]


def close(a, b) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 + 1e-4 * abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("task", [None, "embed"])
def test_pooling_gives_the_embeddings(server, task):
    expected = embeddings(server, TEXTS)
    body = {"input": TEXTS, "model": server.engine.served_model_name}
    if task is not None:
        body["task"] = task
    status, result = post(server, "/pooling", body, {"X-Request-Id": "p1"})
    assert status == 200, result
    assert result["id"] == "pool-p1" and result["object"] == "list"
    assert result["model"] == server.engine.served_model_name
    assert [d["index"] for d in result["data"]] == [0, 1, 2]
    assert all(d["object"] == "pooling" for d in result["data"])
    assert all(close(d["data"], e) for d, e in zip(result["data"], expected))
    tokens = sum(len(server.engine.tokenizer.encode(t)) for t in TEXTS)
    assert result["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def test_pooling_base64_normalize_token_ids_and_truncation(server):
    status, result = post(server, "/pooling", {"input": "hello", "encoding_format": "base64"})
    assert status == 200, result
    raw = base64.b64decode(result["data"][0]["data"])
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), embeddings(server, "hello")[0])
    status, raw_vector = post(server, "/pooling", {"input": "hello", "normalize": False})
    assert status == 200
    assert close(raw_vector["data"][0]["data"], embeddings(server, "hello", normalize=False)[0])
    ids = [5, 17, 42, 99, 7, 8]
    status, cut = post(
        server,
        "/pooling",
        {"input": [ids], "truncate_prompt_tokens": 3, "truncation_side": "left"},
    )
    assert status == 200 and cut["usage"]["prompt_tokens"] == 3
    assert close(cut["data"][0]["data"], embeddings(server, [ids[3:]])[0])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x", "task": "classify"}, "task"),
        ({"input": "x", "task": "token_embed"}, "task"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ({"input": "x", "truncate_prompt_tokens": -3}, "truncate_prompt_tokens"),
        ({"input": "x", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"input": "x", "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
        ({"input": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"input": [[1, 2], [999999]]}, "prompt"),
    ],
)
def test_bad_pooling_requests_are_400s_naming_the_field(server, body, param):
    status, payload = post(server, "/pooling", body)
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload
    status, _ = post(server, "/pooling", {"input": "still serving"})
    assert status == 200


def test_classify_refuses_an_embedding_model(server):
    status, payload = post(server, "/classify", {"input": "hello"})
    assert status == 400, payload
    assert payload["error"]["message"].startswith("The model does not support Classification API")
    assert "embed" in payload["error"]["message"] and payload["error"]["param"] == "model"


def test_each_engine_request_is_logged(server, caplog):
    """--enable-log-requests: one line per engine request, as the generating routes."""
    caplog.set_level(logging.INFO, logger="nanoserve.requests")
    status, _ = post(server, "/pooling", {"input": TEXTS[:2]}, {"X-Request-Id": "logged"})
    assert status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoserve.requests"]
    for index, text in enumerate(TEXTS[:2]):
        tokens = len(server.engine.tokenizer.encode(text))
        assert any(
            line.startswith(
                f"Received request pool-logged-{index}: prompt_token_ids_len: {tokens}, "
                "priority: 0, params: PoolingParams("
            )
            for line in lines
        ), lines
