"""POST /v1/score, /score, /v1/rerank, /rerank and /v2/rerank through a real server on an
embedding model (the tiny Llama, --runner pooling): every score is the cosine of the two texts'
embeddings as the same server's /v1/embeddings gives them (computed here with torch), paired
1:1, 1:N and N:N as vLLM; rerank orders the documents by it, cuts to top_n and leaves the
documents out when asked; usage counts as vLLM; truncation; each bad request is a 400 naming its
field while the server keeps serving; a generating model refuses the routes; the engine requests
count in the metrics and a client that goes away aborts them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy, connect, http_request, scrape_metrics

DOCUMENTS = ["The capital of France is Paris.", "Brazil's capital is Brasilia.", "cats", "Paris"]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        # 64 tokens a step: a request of many documents takes several steps (the abort test)
        {
            "dtype": "float32",
            "runner": "pooling",
            "num_kv_blocks": 128,
            "max_num_batched_tokens": 64,
        },
    )
    yield handle
    handle.close()


def post(server, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    status, _, payload = http_request(server.port, "POST", path, json.dumps(body), headers)
    return status, json.loads(payload)


def embeddings(server, inputs: list) -> list[torch.Tensor]:
    """The oracle: the same server's /v1/embeddings, through the openai client."""
    result = server.client().embeddings.create(
        model=server.engine.served_model_name, input=inputs, encoding_format="float"
    )
    return [torch.tensor(d.embedding, dtype=torch.float64) for d in result.data]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def num_tokens(server, text: str) -> int:
    return len(server.engine.tokenizer.encode(text))


def pair_tokens(server, first: str, second: str) -> int:
    """vLLM's usage of an embedding model's score: both prompts and the pad token joining them."""
    pad = 0 if server.engine.tokenizer.pad_token_id is None else 1
    return num_tokens(server, first) + pad + num_tokens(server, second)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_one_to_many_is_the_cosine_of_the_embeddings(server, path):
    query, *documents = embeddings(server, [QUERY, *DOCUMENTS])
    status, body = post(server, path, {"text_1": QUERY, "text_2": DOCUMENTS, "model": None})
    assert status == 200, body
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert body["model"] == server.engine.served_model_name and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in body["data"])
    expected = [cosine(query, document) for document in documents]
    assert all(close(d["score"], e) for d, e in zip(body["data"], expected)), (body, expected)
    tokens = sum(pair_tokens(server, QUERY, document) for document in DOCUMENTS)
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }  # vLLM's UsageInfo


def test_score_one_to_one_and_pairwise(server):
    first = ["hello there", "good morning", "the cat sat"]
    second = ["hi", "good evening", "on the mat"]
    vectors = embeddings(server, [*first, *second])
    status, body = post(server, "/v1/score", {"text_1": first, "text_2": second})
    assert status == 200, body
    expected = [cosine(vectors[i], vectors[len(first) + i]) for i in range(len(first))]
    assert [round(d["score"], 5) for d in body["data"]] == [round(e, 5) for e in expected]
    status, single = post(server, "/v1/score", {"text_1": first[0], "text_2": second[0]})
    assert status == 200 and len(single["data"]) == 1
    assert close(single["data"][0]["score"], expected[0])
    status, listed = post(server, "/v1/score", {"text_1": [first[0]], "text_2": [second[0]]})
    assert status == 200 and close(listed["data"][0]["score"], expected[0])
    assert single["usage"]["prompt_tokens"] == pair_tokens(server, first[0], second[0])


def test_score_truncates_each_text(server):
    ids = server.engine.tokenizer.encode(QUERY)
    keep = 3
    query, document = embeddings(server, [ids[:keep], DOCUMENTS[0]])
    status, body = post(
        server,
        "/v1/score",
        {"text_1": QUERY, "text_2": DOCUMENTS[0], "truncate_prompt_tokens": keep},
    )
    assert status == 200, body
    # both texts are cut: the document too when it is longer than `keep`
    document_ids = server.engine.tokenizer.encode(DOCUMENTS[0])[:keep]
    (document,) = embeddings(server, [document_ids])
    assert close(body["data"][0]["score"], cosine(query, document))
    pad = 0 if server.engine.tokenizer.pad_token_id is None else 1
    assert body["usage"]["prompt_tokens"] == keep + pad + len(document_ids)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_cosine(server, path):
    query, *documents = embeddings(server, [QUERY, *DOCUMENTS])
    scores = [cosine(query, document) for document in documents]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: scores[i], reverse=True)
    status, body = post(
        server, path, {"query": QUERY, "documents": DOCUMENTS}, {"X-Request-Id": "r1"}
    )
    assert status == 200, body
    assert body["id"] == "rerank-r1" and body["model"] == server.engine.served_model_name
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    assert all(close(r["relevance_score"], scores[r["index"]]) for r in body["results"])
    tokens = sum(pair_tokens(server, QUERY, document) for document in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_and_return_documents(server):
    status, whole = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200, whole
    status, top = post(
        server,
        "/v1/rerank",
        {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
    )
    assert status == 200, top
    assert [r["index"] for r in top["results"]] == [r["index"] for r in whole["results"][:2]]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    assert top["usage"] == whole["usage"]  # every document was scored
    status, everything = post(
        server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 99}
    )
    assert status == 200 and len(everything["results"]) == len(DOCUMENTS)


TOO_MANY = ["x"] * 2049


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/score", {"text_2": "a"}, "text_1"),
        ("/v1/score", {"text_1": "a"}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
        ("/v1/score", {"text_1": [1, 2], "text_2": "a"}, "text_1"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": TOO_MANY}, "text_2"),
        (
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": -2},
            "truncate_prompt_tokens",
        ),
        (
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
        ),
        (
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncation_side": "middle"},
            "truncation_side",
        ),
        (
            "/v1/score",
            {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {}},
            "mm_processor_kwargs",
        ),
        ("/v1/score", {"text_1": "a", "text_2": "b", "priority": "high"}, "priority"),
        (
            "/v1/rerank",
            {"query": "q", "documents": ["a"], "max_tokens_per_doc": 9},
            "max_tokens_per_doc",
        ),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["t"]}, "rank_fields"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": ["a"], "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q"}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [{"text": "a"}]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": TOO_MANY}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "cache_salt": "s"}, "cache_salt"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, path, body, param):
    status, payload = post(server, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload
    assert payload["error"]["type"] == "BadRequestError"
    status, _ = post(server, "/v1/score", {"text_1": "still", "text_2": "serving"})
    assert status == 200


def test_a_longer_prompt_than_the_context_is_a_400(server):
    text = "word " * 600  # the tiny model's context is 512 tokens
    status, payload = post(server, "/v1/score", {"text_1": "a", "text_2": text})
    assert status == 400 and payload["error"]["param"] == "input_tokens", payload
    status, body = post(
        server, "/v1/score", {"text_1": "a", "text_2": text, "truncate_prompt_tokens": -1}
    )
    assert status == 200, body


def test_unknown_model_is_a_404(server):
    status, payload = post(
        server, "/v1/rerank", {"model": "nope", "query": "q", "documents": ["a"]}
    )
    assert status == 404 and payload["error"]["param"] == "model"


@pytest.mark.parametrize(
    "path, body, api",
    [
        ("/v1/score", {"text_1": "a", "text_2": "b"}, "Score API"),
        ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank API"),
        ("/classify", {"input": "a"}, "Classification API"),
        ("/pooling", {"input": "a"}, "Pooling API"),
    ],
)
def test_a_generating_model_refuses_the_pooling_routes(tiny_server, path, body, api):
    status, payload = post(tiny_server, path, body)
    assert status == 400, payload
    assert payload["error"]["message"].startswith(f"The model does not support {api}")
    assert payload["error"]["param"] == "model"


def test_engine_requests_are_counted(server):
    key = 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="%s"}' % (
        server.engine.served_model_name
    )
    prompt_key = "vllm:prompt_tokens_total"
    before = scrape_metrics(server.port)
    status, body = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    after = scrape_metrics(server.port)
    assert after[key] - before.get(key, 0) == 1 + len(DOCUMENTS)  # the query is embedded once
    embedded = num_tokens(server, QUERY) + sum(num_tokens(server, d) for d in DOCUMENTS)
    assert after[prompt_key] - before[prompt_key] == embedded


def test_a_client_that_goes_away_aborts_its_requests(server):
    """The first step is held while the client closes: all 41 engine requests are aborted by
    the handler, and those the held step did not finish (64 tokens a step) never run."""
    async_engine = server.server.app.ctx.engine
    asked: list[str] = []
    real_abort = async_engine.abort

    def abort(request_id: str) -> None:
        asked.append(request_id)
        real_abort(request_id)

    key = 'vllm:request_success_total{engine="0",finished_reason="%s",model_name="%s"}'
    stop, aborted = (
        key % (reason, server.engine.served_model_name) for reason in ("stop", "abort")
    )
    before = scrape_metrics(server.port)
    documents = [f"document number {i}" for i in range(40)]
    payload = json.dumps({"query": QUERY, "documents": documents}).encode()
    async_engine.abort = abort
    spy = StepSpy(server.engine)
    try:
        sock = connect(server.port)
        held = spy.hold_next_step()
        sock.sendall(
            b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: gone\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        step = spy.wait_for_next_step(seen=held)
        sock.close()
        try:
            wait_until(lambda: len(asked) == 1 + len(documents), "the handler's aborts")
        finally:
            spy.release(step)

        def ended() -> tuple[float, float] | None:  # every request finished or aborted
            after = scrape_metrics(server.port)
            counts = (after[stop] - before.get(stop, 0), after[aborted] - before.get(aborted, 0))
            return counts if sum(counts) == 1 + len(documents) else None

        finished, dropped = wait_until(ended, "the requests' ends")
    finally:
        spy.restore()
        del async_engine.abort
    assert set(asked) == {f"rerank-gone-{i}" for i in range(1 + len(documents))}
    assert dropped > 0, (finished, dropped)  # the held step could not finish them all
    assert len(spy.aborts) == dropped
    status, _ = post(server, "/v1/score", {"text_1": "still", "text_2": "serving"})
    assert status == 200
