"""Decoder sequence classifiers (models/sequence_classification.py) through LLM.classify and
LLM.score, against transformers' *ForSequenceClassification on random checkpoints, and a causal
LM served as a yes/no reranker through --hf-overrides (vLLM's classifier_from_token /
is_original_qwen3_reranker), against the softmax of its LM head's two logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanoserve import LLM
from nanoserve.errors import InvalidRequestError
from tests.models.family_checkpoints import write_random_checkpoint, yes_no_reranker_overrides

QUERY = "<Query>: Paris is the capital of?\n"
DOCUMENTS = ["<Document>: France. Berlin is", "<Document>: def add(a, b):", "<Document>: 東京"]
TEXTS = ["The quick brown fox", "import torch", "Café, naïve"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder-classifiers")
    return {
        "score": write_random_checkpoint(root / "score", "qwen3", seed=3, num_labels=1),
        "classify": write_random_checkpoint(root / "classify", "qwen2", seed=4, num_labels=3),
        "causal": write_random_checkpoint(root / "causal", "qwen3", seed=5),
    }


def transformers_logits(path: Path, ids: list[int], causal: bool = False) -> torch.Tensor:
    import transformers

    auto = (
        transformers.AutoModelForCausalLM
        if causal
        else transformers.AutoModelForSequenceClassification
    )
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits[-1] if causal else logits


def test_one_label_classifier_scores_pairs_as_transformers(checkpoints):
    import transformers

    path = checkpoints["score"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    llm = LLM(str(path), runner="pooling", dtype="float32")
    try:
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="task 'embed' is not supported"):
            llm.embed("hello", use_tqdm=False)
    finally:
        llm.shutdown()
    for document, score in zip(DOCUMENTS, scores):
        ids = tokenizer(QUERY, document)["input_ids"]  # the pair: the two texts' tokens
        assert score.prompt_token_ids == ids
        expected = torch.sigmoid(transformers_logits(path, ids)).item()
        assert score.outputs.score == pytest.approx(expected, abs=1e-4)


def test_classifier_probabilities_as_transformers(checkpoints):
    import transformers

    path = checkpoints["classify"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    llm = LLM(str(path), dtype="float32")  # a classifier is a pooling model without the flag
    try:
        outputs = llm.classify(TEXTS, use_tqdm=False)
        alone = llm.classify(TEXTS[1], use_tqdm=False)[0]
        assert llm.llm_engine.model_config.id2label == {i: f"LABEL_{i}" for i in range(3)}
    finally:
        llm.shutdown()
    for text, output in zip(TEXTS, outputs):
        expected = transformers_logits(path, tokenizer(text)["input_ids"]).softmax(-1)
        assert output.outputs.probs == pytest.approx(expected.tolist(), abs=1e-4)
    assert alone.outputs.probs == pytest.approx(outputs[1].outputs.probs, abs=1e-6)
    with pytest.raises(ValueError, match="sequence classifiers do not generate"):
        LLM(str(path), runner="generate")


def test_causal_lm_as_yes_no_reranker(checkpoints):
    """Qwen3-Reranker as vLLM serves it: score = softmax over the LM head's logits of the two
    tokens (["no", "yes"]: here two tokens of the test vocabulary), at the pair's last token."""
    import transformers

    path = checkpoints["causal"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    overrides, (no_id, yes_id) = yes_no_reranker_overrides(path)
    llm = LLM(str(path), runner="pooling", dtype="float32", hf_overrides=json.dumps(overrides))
    try:
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for document, score in zip(DOCUMENTS, scores):
        ids = tokenizer(QUERY, document)["input_ids"]
        logits = transformers_logits(path, ids, causal=True)
        expected = logits[[no_id, yes_id]].softmax(-1)[1].item()
        assert score.outputs.score == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="--hf-overrides: unknown field"):
        LLM(str(path), runner="pooling", hf_overrides='{"vocab_size": 3}')


def test_truncation_keeps_the_limit(checkpoints):
    """truncate_prompt_tokens on a decoder classifier: at most that many tokens, for a text
    (the tokenizer's cut) and for token ids (the last ones, as vLLM's)."""
    from nanoserve import PoolingParams, TokensPrompt

    llm = LLM(str(checkpoints["classify"]), dtype="float32")
    try:
        params = PoolingParams(truncate_prompt_tokens=5)
        (text,) = llm.classify(TEXTS[0] * 8, params, use_tqdm=False)
        ids = llm.get_tokenizer().encode(TEXTS[0] * 8)
        (tokens,) = llm.classify(TokensPrompt(ids), params, use_tqdm=False)
        (tail,) = llm.classify(TokensPrompt(ids[-5:]), use_tqdm=False)
    finally:
        llm.shutdown()
    assert text.prompt_token_ids == ids[:5]
    assert tokens.prompt_token_ids == ids[-5:]
    assert tokens.outputs.probs == pytest.approx(tail.outputs.probs, abs=1e-6)
