"""The pooling routes on encoder models through a real server: a BERT cross-encoder (one label,
as ms-marco MiniLM) for /v1/score and /v1/rerank against sentence-transformers' CrossEncoder on
the same checkpoint (and transformers' raw logits with use_activation false, its own truncation
for truncate_prompt_tokens), and an XLM-RoBERTa 3-label classifier for /classify and /pooling
against transformers' softmax and the checkpoint's id2label. Random checkpoints written by
transformers (tests/models/encoder_checkpoints.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.encoder_checkpoints import write_encoder_checkpoint
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.server.test_event_loop_budget import Spy

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital city of france", "a dog", "two slow green rivers", "paris"]
TEXTS = ["hello world", "the cat is blue, who knows why?", "paris"]
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross-encoder") / "bert-ce"
    return write_encoder_checkpoint(root, "bert", classifier=True, num_labels=1, seed=1)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    path = write_encoder_checkpoint(
        tmp_path_factory.mktemp("classifier") / "xlmr-cls",
        "xlm-roberta",
        classifier=True,
        num_labels=3,
        seed=2,
    )
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = LABELS  # labels of its own, to see that they are the checkpoint's
    config["label2id"] = {label: int(index) for index, label in LABELS.items()}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir):
    handle = ServerHandle(cross_encoder_dir, {"dtype": "float32", "runner": "pooling"})
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def classifier(classifier_dir):
    handle = ServerHandle(classifier_dir, {"dtype": "float32", "runner": "pooling"})
    yield handle
    handle.close()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, payload = http_request(server.port, "POST", path, json.dumps(body))
    return status, json.loads(payload)


def hf_logits(model_dir, first, second=None, **tokenize) -> torch.Tensor:
    """transformers' own logits, [batch, labels]."""
    import transformers as hf

    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    model = hf.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    inputs = tokenizer(first, second, padding=True, return_tensors="pt", **tokenize)
    with torch.no_grad():
        return model(**inputs).logits


def pair_lengths(model_dir, first: list[str], second: list[str], **tokenize) -> list[int]:
    import transformers as hf

    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    return [len(ids) for ids in tokenizer(first, second, **tokenize)["input_ids"]]


def test_score_equals_sentence_transformers_cross_encoder(cross_encoder, cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS]
    )
    status, body = post(cross_encoder, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(abs(d["score"] - float(e)) < 1e-4 for d, e in zip(body["data"], expected))
    tokens = sum(pair_lengths(cross_encoder_dir, [QUERY] * len(DOCUMENTS), DOCUMENTS))
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    status, pairwise = post(
        cross_encoder, "/score", {"text_1": [QUERY] * len(DOCUMENTS), "text_2": DOCUMENTS}
    )
    assert status == 200 and [round(d["score"], 6) for d in pairwise["data"]] == [
        round(d["score"], 6) for d in body["data"]
    ]


def test_score_without_activation_and_truncated(cross_encoder, cross_encoder_dir):
    logits = hf_logits(cross_encoder_dir, [QUERY] * 2, DOCUMENTS[:2])[:, 0]
    status, raw = post(
        cross_encoder,
        "/v1/score",
        {"text_1": QUERY, "text_2": DOCUMENTS[:2], "use_activation": False},
    )
    assert status == 200, raw
    assert all(abs(d["score"] - float(e)) < 1e-4 for d, e in zip(raw["data"], logits))
    keep = 9
    cut = hf_logits(
        cross_encoder_dir, [QUERY] * 2, DOCUMENTS[:2], truncation=True, max_length=keep
    )[:, 0]
    status, truncated = post(
        cross_encoder,
        "/v1/score",
        {"text_1": QUERY, "text_2": DOCUMENTS[:2], "truncate_prompt_tokens": keep},
    )
    assert status == 200, truncated
    assert all(
        abs(d["score"] - float(torch.sigmoid(e))) < 1e-4 for d, e in zip(truncated["data"], cut)
    )
    assert truncated["usage"]["prompt_tokens"] == sum(
        pair_lengths(
            cross_encoder_dir, [QUERY] * 2, DOCUMENTS[:2], truncation=True, max_length=keep
        )
    )


def test_rerank_orders_by_the_cross_encoder(cross_encoder, cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS]
    )
    order = sorted(range(len(DOCUMENTS)), key=lambda i: float(expected[i]), reverse=True)
    ranked = [float(expected[i]) for i in order]
    assert all(a - b > 1e-3 for a, b in zip(ranked, ranked[1:]))  # one order, not a near-tie
    status, body = post(
        cross_encoder, "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    )
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order[:3]
    assert all(
        abs(r["relevance_score"] - float(expected[r["index"]])) < 1e-4 for r in body["results"]
    )
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order[:3]]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncation_side": "left",
                       "truncate_prompt_tokens": 4}, "truncation_side"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
         "truncate_prompt_tokens"),
        ("/v1/score", {"text_1": "a", "text_2": "b " * 200}, "input_tokens"),
        ("/v1/embeddings", {"input": "a"}, "model"),
        ("/pooling", {"input": "a", "task": "embed"}, "task"),
    ],
)  # fmt: skip
def test_cross_encoder_refusals(cross_encoder, path, body, param):
    status, payload = post(cross_encoder, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload


def test_classify_equals_transformers(classifier, classifier_dir):
    probs = torch.softmax(hf_logits(classifier_dir, TEXTS), dim=-1)
    status, body = post(classifier, "/classify", {"input": TEXTS})
    assert status == 200, body
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for index, (item, want) in enumerate(zip(body["data"], probs)):
        assert item["index"] == index and item["num_classes"] == 3
        assert all(abs(p - float(w)) < 1e-4 for p, w in zip(item["probs"], want))
        assert item["label"] == LABELS[str(int(want.argmax()))]
    import transformers as hf

    tokenizer = hf.AutoTokenizer.from_pretrained(classifier_dir)
    tokens = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    status, raw = post(classifier, "/classify", {"input": TEXTS[0], "use_activation": False})
    assert status == 200, raw
    logits = hf_logits(classifier_dir, TEXTS[:1])[0]
    assert all(abs(p - float(w)) < 1e-4 for p, w in zip(raw["data"][0]["probs"], logits))


def test_pooling_on_a_classifier_gives_its_probabilities(classifier):
    status, classified = post(classifier, "/classify", {"input": TEXTS})
    assert status == 200, classified
    for task in (None, "classify"):
        body = {"input": TEXTS} if task is None else {"input": TEXTS, "task": task}
        status, pooled = post(classifier, "/pooling", body)
        assert status == 200, pooled
        assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in classified["data"]]
    status, payload = post(classifier, "/pooling", {"input": "a", "dimensions": 2})
    assert status == 400 and payload["error"]["param"] == "dimensions"


def test_long_pairs_are_tokenized_off_the_event_loop(cross_encoder, monkeypatch):
    """Pairs of more than SMALL_INPUT characters are tokenized on the preprocessing pool, and
    the engine is handed their tokens (it tokenizes nothing on the loop)."""
    tokenizer = cross_encoder.server.app.ctx.tokenizer
    spy = Spy(monkeypatch, tokenizer, "encode_with_types")
    documents = ["paris is the capital city of france " * 150, "a dog " * 900]
    status, body = post(
        cross_encoder,
        "/v1/rerank",
        {"query": QUERY, "documents": documents, "truncate_prompt_tokens": -1},
    )
    assert status == 200, body
    assert len(spy.threads) == len(documents) and spy.off_the_loop()
    max_len = cross_encoder.engine.max_model_len
    assert body["usage"]["prompt_tokens"] == max_len * len(documents)


def test_an_encoders_truncation_keeps_its_special_tokens(classifier, classifier_dir):
    """truncate_prompt_tokens cuts an encoder's text as its tokenizer does ([CLS] / </s> stay):
    the same answer as the token ids transformers' truncation gives."""
    import transformers as hf

    keep = 5
    tokenizer = hf.AutoTokenizer.from_pretrained(classifier_dir)
    ids = tokenizer(TEXTS[1], truncation=True, max_length=keep)["input_ids"]
    assert len(ids) == keep and ids[-1] == tokenizer.sep_token_id
    status, cut = post(classifier, "/classify", {"input": TEXTS[1], "truncate_prompt_tokens": keep})
    assert status == 200, cut
    status, given = post(classifier, "/classify", {"input": [ids]})
    assert status == 200, given
    assert cut["data"][0]["probs"] == given["data"][0]["probs"]
    assert cut["usage"]["prompt_tokens"] == keep


@pytest.fixture(scope="module")
def yes_no_reranker(tmp_path_factory):
    """A random Qwen3 causal LM served as Qwen3-Reranker is, by vLLM's --hf-overrides: the
    score is the softmax of the LM head's logits of two tokens ("no", "yes")."""
    from tests.models.family_checkpoints import write_random_checkpoint, yes_no_reranker_overrides

    path = write_random_checkpoint(tmp_path_factory.mktemp("reranker") / "qwen3", "qwen3", seed=5)
    overrides, ids = yes_no_reranker_overrides(path)
    handle = ServerHandle(
        path, {"dtype": "float32", "runner": "pooling", "hf_overrides": json.dumps(overrides)}
    )
    yield handle, path, ids
    handle.close()


def test_rerank_on_a_yes_no_decoder_reranker(yes_no_reranker):
    import transformers as hf

    server, path, (no, yes) = yes_no_reranker
    query = "<Query>: Paris is the capital of?\n"
    documents = ["<Document>: France. Berlin is", "<Document>: def add(a, b):", "<Document>: 東京"]
    tokenizer = hf.AutoTokenizer.from_pretrained(path)
    model = hf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected, lengths = [], []
    for document in documents:
        ids = tokenizer(query, document)["input_ids"]  # the two texts' tokens, one prompt
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        expected.append(float(logits[[no, yes]].softmax(-1)[1]))
        lengths.append(len(ids))
    status, body = post(server, "/rerank", {"query": query, "documents": documents})
    assert status == 200, body
    order = sorted(range(len(documents)), key=lambda i: expected[i], reverse=True)
    ranked = [expected[i] for i in order]
    assert all(a - b > 1e-3 for a, b in zip(ranked, ranked[1:]))  # one order, not a near-tie
    assert [r["index"] for r in body["results"]] == order
    assert all(abs(r["relevance_score"] - expected[r["index"]]) < 1e-4 for r in body["results"])
    assert body["usage"]["prompt_tokens"] == sum(lengths)
    status, payload = post(server, "/v1/embeddings", {"input": "a"})
    assert status == 400 and payload["error"]["param"] == "model"
