"""POST /v1/score and /score (vLLM's score API, after sentence-transformers' cross-encoder), and
/v1/rerank, /rerank and /v2/rerank (the Jina / Cohere rerank shape vLLM serves).

A score request pairs `text_1` with `text_2` as vLLM does: 1:1, 1:N (one text_1 against every
text_2) or N:N (pairwise); anything else is a 400. A rerank request scores its `query` against
each of its `documents` and answers them best first, the `top_n` best when it is positive.

A cross-encoder (a sequence classifier: bge-reranker, ms-marco MiniLM, a decoder reranker)
scores each pair as one prompt, the two texts tokenized together off the loop as transformers'
`tokenizer(text_1, text_2)` does, with token types, and cut to `truncate_prompt_tokens` as its
truncation cuts a pair (the special tokens stay); its score is the model's logit through a
sigmoid (`use_activation` false: the raw logit). Usage counts each pair prompt's tokens.

An embedding model scores a pair by the cosine of the two texts' embeddings (each text is one
engine request; a single text_1 is embedded once). Its usage counts, per pair, both texts'
tokens and, when the tokenizer has a pad token, one more: vLLM joins the two prompts with it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from nanoserve.inputs import TokensPrompt
from nanoserve.pooling_params import PoolingParams
from nanoserve.server.embeddings import (
    check_inputs,
    check_task,
    check_truncation,
    list_response,
    pool,
    pooled_data,
    pooling_tasks,
    tokenized_prompts,
    truncation_limit,
)
from nanoserve.server.http.types import Response
from nanoserve.server.serving import ServingContext, bad_request, encode_json, response_id


class ScoringFields(msgspec.Struct):
    """What vLLM's score and rerank requests share (its PoolingBasicRequestMixin and
    ClassifyRequestMixin)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # -1: max_model_len
    truncation_side: str | None = None
    priority: int = 0
    request_id: str | None = None
    # A cross-encoder's activation on its logit (sigmoid); vLLM's older names come after.
    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None
    # vLLM's, not supported here: a 400 naming them when set (not silently ignored)
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None


class ScoreRequest(ScoringFields):
    text_1: Any = None  # a string or a list of strings: checked by the handler
    text_2: Any = None


class RerankRequest(ScoringFields):
    query: Any = None  # a string
    documents: Any = None  # a string or a list of strings
    top_n: int = 0  # <= 0: all of them
    return_documents: bool = True  # Jina's: False leaves `document` out of each result
    # Cohere's, not supported here: a 400 naming them when set
    rank_fields: list[Any] | None = None
    max_chunks_per_doc: int | None = None
    max_tokens_per_doc: int | None = None


def activation_of(request: Any) -> bool | None:
    """vLLM's get_use_activation: use_activation, else the older softmax, else activation."""
    for name in ("use_activation", "softmax", "activation"):
        value = getattr(request, name)
        if value is not None:
            return value
    return None


# vLLM's and Cohere's fields that nanoserve does not apply: refused when set, not ignored
UNSUPPORTED = (
    "mm_processor_kwargs",
    "cache_salt",
    "rank_fields",
    "max_chunks_per_doc",
    "max_tokens_per_doc",
)


def check_unsupported(request: Any) -> None:
    for name in UNSUPPORTED:
        if getattr(request, name, None) is not None:
            raise bad_request(f"`{name}` is not supported by this server", name)


def check_request(ctx: ServingContext, request: ScoringFields, api: str) -> None:
    """The model, the task it is served for, and the fields we do not apply."""
    ctx.check_model(request.model)
    check_task(ctx, ("score",), api)
    check_unsupported(request)


def _texts(value: Any, field: str) -> list[str]:
    if value is None:
        raise bad_request(f"{field} is required", field)
    return check_inputs(value, field, allow_ids=False)  # type: ignore[return-value]


def _cosines(vectors_1: list[list[float]], vectors_2: list[list[float]]) -> list[float]:
    """Each pair's cosine in float32, as vLLM's (torch's CosineSimilarity, eps 1e-8)."""
    first = torch.tensor(vectors_1, dtype=torch.float32)
    second = torch.tensor(vectors_2, dtype=torch.float32)
    if first.shape[0] == 1:
        first = first.expand_as(second)
    return torch.nn.functional.cosine_similarity(first, second, dim=1).tolist()


async def _embedding_scores(
    ctx: ServingContext,
    request: ScoringFields,
    base_id: str,
    texts_1: list[str],
    texts_2: list[str],
) -> tuple[list[float], int]:
    """Each pair's cosine and the usage's prompt tokens (see the module's docstring)."""
    prompts = await tokenized_prompts(ctx, request, [*texts_1, *texts_2])
    params = PoolingParams(task="embed")
    finals = await pool(ctx, base_id, prompts, params, request.priority)
    vectors = [pooled_data(final) for final in finals]
    size = len(vectors) * len(vectors[0])
    scores = await ctx.off_loop(size, _cosines, vectors[: len(texts_1)], vectors[len(texts_1) :])
    lengths = [len(prompt.prompt_token_ids) for prompt in prompts]
    lengths_1, lengths_2 = lengths[: len(texts_1)], lengths[len(texts_1) :]
    if len(lengths_1) == 1:
        lengths_1 = lengths_1 * len(lengths_2)
    pad = 0 if ctx.tokenizer.pad_token_id is None else 1
    return scores, sum(a + pad + b for a, b in zip(lengths_1, lengths_2))


async def _scores(
    ctx: ServingContext,
    request: ScoringFields,
    base_id: str,
    texts_1: list[str],
    texts_2: list[str],
) -> tuple[list[float], int]:
    """The scores of texts_1 against texts_2 (1:1, 1:N or N:N) and the prompt tokens used."""
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise bad_request(
            f"Input lengths must be either 1:1, 1:N or N:N, got {len(texts_1)}:{len(texts_2)}",
            "text_2",
        )
    if "embed" in pooling_tasks(ctx.engine.engine):
        return await _embedding_scores(ctx, request, base_id, texts_1, texts_2)
    return await _cross_encoder_scores(ctx, request, base_id, texts_1, texts_2)


async def _cross_encoder_scores(
    ctx: ServingContext,
    request: ScoringFields,
    base_id: str,
    texts_1: list[str],
    texts_2: list[str],
) -> tuple[list[float], int]:
    """Each pair's score as one prompt, and the prompts' tokens."""
    check_truncation(ctx, request)
    if request.truncation_side == "left":
        raise bad_request(
            "truncation_side 'left' is not supported for a cross-encoder's pairs (they are "
            "cut as the tokenizer cuts them, from the right)",
            "truncation_side",
        )
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    prompts = await _pair_prompts(ctx, request, list(zip(texts_1, texts_2)))
    params = PoolingParams(task="score", activation=activation_of(request))
    finals = await pool(ctx, base_id, prompts, params, request.priority)
    scores = [pooled_data(final)[0] for final in finals]
    return scores, sum(len(prompt.prompt_token_ids) for prompt in prompts)


async def _pair_prompts(
    ctx: ServingContext, request: ScoringFields, pairs: list[tuple[str, str]]
) -> list[TokensPrompt]:
    """Each pair tokenized as one prompt off the loop (the tokenizer's pair encoding, with
    its token types), cut to truncate_prompt_tokens as the tokenizer cuts a pair."""
    keep = truncation_limit(ctx, request)
    if keep is None:  # a pair longer than any context is refused before it is tokenized
        for first, second in pairs:
            ctx.fit(first + second, None)
    tokenizer = ctx.tokenizer

    def encode(some: list[tuple[str, str]]) -> list[TokensPrompt]:
        prompts = []
        for first, second in some:
            ids, types = tokenizer.encode_with_types(first, second, keep)
            prompts.append(TokensPrompt(ids, None, types))
        return prompts

    return await ctx.map_sliced(pairs, [len(a) + len(b) for a, b in pairs], encode)


async def create_score(ctx: ServingContext, request: ScoreRequest) -> Response:
    check_request(ctx, request, "Score API")
    texts_1 = _texts(request.text_1, "text_1")
    texts_2 = _texts(request.text_2, "text_2")
    base_id = response_id("score", request.request_id)
    scores, prompt_tokens = await _scores(ctx, request, base_id, texts_1, texts_2)
    data = [
        {"index": index, "object": "score", "score": score} for index, score in enumerate(scores)
    ]
    return list_response(ctx, base_id, data, prompt_tokens)


async def create_rerank(ctx: ServingContext, request: RerankRequest) -> Response:
    check_request(ctx, request, "Rerank API")
    if not isinstance(request.query, str) or not request.query:
        raise bad_request("query must be a non-empty string", "query")
    documents = _texts(request.documents, "documents")
    base_id = response_id("rerank", request.request_id)
    scores, prompt_tokens = await _scores(ctx, request, base_id, [request.query], documents)
    ranked = sorted(range(len(scores)), key=lambda index: scores[index], reverse=True)
    if request.top_n > 0:
        ranked = ranked[: request.top_n]
    results = []
    for index in ranked:
        result: dict[str, Any] = {"index": index}
        if request.return_documents:
            result["document"] = {"text": documents[index]}
        result["relevance_score"] = scores[index]
        results.append(result)
    body = {
        "id": base_id,
        "model": ctx.served_model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }
    return Response(200, encode_json(body))
