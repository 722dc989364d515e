"""POST /v1/embeddings through a real server with the official `openai` client: float and
base64 (the client's default with numpy, which it decodes itself) give LLM.embed's vectors for
strings, lists of strings and token ids; usage counts the prompt tokens; Matryoshka dimensions;
and bad input is a 400 naming the field while the server keeps serving."""

from __future__ import annotations

import base64
import json
import shutil
import struct

import pytest

from nanoserve import LLM, PoolingParams
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["is_matryoshka"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    handle = ServerHandle(
        model_dir, {"dtype": "float32", "runner": "pooling", "num_kv_blocks": 128}
    )
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=str(model_dir), dtype="float32", runner="pooling", num_kv_blocks=128)


def close(a, b) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 + 1e-4 * abs(y) for x, y in zip(a, b))


def test_float_and_base64_equal_the_offline_vectors(server, offline):
    texts = ["The quick brown fox", "jumps over the lazy dog", "hello"]
    expected = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    client = server.client()
    floats = client.embeddings.create(
        model=server.engine.served_model_name, input=texts, encoding_format="float"
    )
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert all(close(d.embedding, e) for d, e in zip(floats.data, expected))
    default = client.embeddings.create(
        model=server.engine.served_model_name, input=texts
    )  # base64 on the wire
    assert all(close(d.embedding, e) for d, e in zip(default.data, expected))
    tokens = offline.get_tokenizer()
    assert (
        floats.usage.prompt_tokens
        == floats.usage.total_tokens
        == sum(len(tokens.encode(t)) for t in texts)
    )
    status, _, body = http_request(
        server.port,
        "POST",
        "/v1/embeddings",
        json.dumps({"input": "hello", "encoding_format": "base64"}),
    )
    raw = base64.b64decode(json.loads(body)["data"][0]["embedding"])
    assert status == 200 and close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), expected[2])


def test_token_ids_and_dimensions(server, offline):
    ids = [[5, 17, 42, 99], [7, 8, 9]]
    result = server.client().embeddings.create(
        model=server.engine.served_model_name, input=ids, dimensions=16
    )
    expected = [
        o.outputs.embedding
        for o in offline.embed(
            [{"prompt_token_ids": i} for i in ids], PoolingParams(dimensions=16), use_tqdm=False
        )
    ]
    assert all(
        len(d.embedding) == 16 and close(d.embedding, e) for d, e in zip(result.data, expected)
    )
    single = server.client().embeddings.create(model=server.engine.served_model_name, input=ids[0])
    assert len(single.data) == 1 and single.usage.prompt_tokens == 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 1000}, "dimensions"),
        ({"input": [[1, 2], [999999]]}, "prompt"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    status, _, payload = http_request(server.port, "POST", "/v1/embeddings", json.dumps(body))
    assert status == 400, payload
    assert json.loads(payload)["error"]["param"] == param
    assert server.client().embeddings.create(model=server.engine.served_model_name, input="ok").data


def test_generating_model_and_pooling_model_refuse_each_others_routes(server, tiny_server):
    status, _, payload = http_request(
        tiny_server.port, "POST", "/v1/embeddings", json.dumps({"input": "hi"})
    )
    assert (
        status == 400
        and "does not support Embeddings API" in json.loads(payload)["error"]["message"]
    )
    status, _, payload = http_request(
        server.port, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2})
    )
    assert status == 400 and "does not generate" in json.loads(payload)["error"]["message"]


def test_truncate_prompt_tokens(server, offline):
    ids = [5, 17, 42, 99, 7, 8]

    def embed(**fields):
        status, _, body = http_request(
            server.port, "POST", "/v1/embeddings", json.dumps({"input": ids, **fields})
        )
        assert status == 200, body
        return json.loads(body)

    def expected(tokens):
        return offline.embed([{"prompt_token_ids": tokens}], use_tqdm=False)[0].outputs.embedding

    for side in ("right", "left"):  # more than the prompt: all of it
        whole = embed(truncate_prompt_tokens=8, truncation_side=side)
        assert whole["usage"]["prompt_tokens"] == 6 and close(
            whole["data"][0]["embedding"], expected(ids)
        )
    assert close(embed(truncate_prompt_tokens=-1)["data"][0]["embedding"], expected(ids))
    assert close(embed(truncate_prompt_tokens=3)["data"][0]["embedding"], expected(ids[:3]))
    left = embed(truncate_prompt_tokens=3, truncation_side="left")
    assert left["usage"]["prompt_tokens"] == 3 and close(
        left["data"][0]["embedding"], expected(ids[3:])
    )
    status, _, body = http_request(
        server.port,
        "POST",
        "/v1/embeddings",
        json.dumps({"input": ids, "truncate_prompt_tokens": -2}),
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "truncate_prompt_tokens"
