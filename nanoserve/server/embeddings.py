"""POST /v1/embeddings (OpenAI's, as vLLM serves it for pooling models): `input` as a string, a
list of strings, a list of token ids or a list of token-id lists; `encoding_format` "float" or
"base64" (little-endian float32 bytes, what the `openai` client sends by default when numpy is
present and decodes itself); `dimensions` for Matryoshka models; `usage` counts the prompt
tokens. Each input is one engine request (a prompt pass, pooled; no KV kept after), batched with
everything else the scheduler runs.

Also the part every pooling route shares (scoring.py, classify.py): the checks of an input list,
its tokenizing and truncation, the task a served model answers, and the submission of one
engine request per prompt, all or none, aborted if the client goes."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any

import msgspec

from nanoserve.inputs import TokensPrompt
from nanoserve.outputs import PoolingRequestOutput, RequestOutputKind
from nanoserve.pooling_params import PoolingParams
from nanoserve.server.http.types import Response
from nanoserve.server.schemas import APIError, Usage
from nanoserve.server.serving import ServingContext, bad_request, encode_json, response_id

MAX_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request


class EmbeddingRequest(msgspec.Struct):
    input: Any = None
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def pooling_tasks(engine: Any) -> tuple[str, ...]:
    """The pooling tasks (PoolingParams.task) the served model answers, its default first: none
    for a generating model; embed and score (by cosine) for an embedding model; classify and
    score for a sequence classifier (a cross-encoder)."""
    return tuple(engine.pooling_tasks) if engine.is_pooling else ()


def check_task(ctx: ServingContext, tasks: tuple[str, ...], api: str) -> str:
    """The first of `tasks` the model answers; a 400 naming the API otherwise (vLLM's message),
    with the flag that serves such a model."""
    served = pooling_tasks(ctx.engine.engine)
    for task in tasks:
        if task in served:
            return task
    if not served:
        how = "it generates text (serve a pooling model with --runner pooling)"
    else:
        how = f"it is served for {', '.join(served)}"
    raise APIError(400, f"The model does not support {api}: {how}.", "model")


def check_inputs(value: Any, field: str, allow_ids: bool = True) -> list[str | list[int]]:
    """A pooling route's list of inputs: one string (or token-id list) or a non-empty list of
    them, at most MAX_INPUTS, no empty string; a 400 naming `field` otherwise."""
    if isinstance(value, str) or (allow_ids and _is_ids(value)):
        items = [value]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, str) or (allow_ids and _is_ids(v)) for v in value)
    ):
        items = value
    elif allow_ids:
        raise bad_request(
            f"{field} must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists (non-empty)",
            field,
        )
    else:
        raise bad_request(f"{field} must be a string or a non-empty list of strings", field)
    if len(items) > MAX_INPUTS:
        raise bad_request(
            f"{field} holds {len(items)} items; at most {MAX_INPUTS} per request", field
        )
    if any(isinstance(item, str) and not item for item in items):
        raise bad_request(f"{field} strings must not be empty", field)
    return items


def is_encoder(ctx: ServingContext) -> bool:
    """An encoder-only model (BERT, XLM-RoBERTa): its tokenizer's truncation keeps the special
    tokens."""
    return ctx.engine.engine.model_config.encoder is not None


def check_truncation(ctx: ServingContext, request: Any) -> None:
    """vLLM's checks of truncate_prompt_tokens and truncation_side, for a pooling prompt (which
    may fill the context); 0 would leave no prompt."""
    ctx.check_truncation(request, reserve=0)
    if request.truncate_prompt_tokens == 0:
        raise bad_request(
            "truncate_prompt_tokens 0 would leave no prompt: -1 (max_model_len) or >= 1",
            "truncate_prompt_tokens",
        )


def truncation_limit(ctx: ServingContext, request: Any) -> int | None:
    """The tokens truncate_prompt_tokens keeps (-1: the model's context), or None."""
    limit = request.truncate_prompt_tokens
    return ctx.max_model_len if limit == -1 else limit


async def tokenized_prompts(
    ctx: ServingContext, request: Any, items: list[str | list[int]]
) -> list[TokensPrompt]:
    """Each input as a prompt: strings tokenized off the loop, then cut per the request's
    `truncate_prompt_tokens` / `truncation_side` (a pooling prompt may fill the context). An
    encoder's texts cut from the right are cut as its tokenizer cuts them ([CLS] and [SEP]
    stay, as vLLM and sentence-transformers do); token ids are cut as they are."""
    check_truncation(ctx, request)
    side = ctx.truncation_side_of(request)
    add_special_tokens = getattr(request, "add_special_tokens", True)
    texts = [ctx.fit(item, side) for item in items if isinstance(item, str)]
    keep = truncation_limit(ctx, request)
    if keep is not None and side == "right" and add_special_tokens and is_encoder(ctx):
        tokenizer = ctx.tokenizer
        encoded = await ctx.map_sliced(
            texts,
            [len(text) for text in texts],
            lambda some: [tokenizer.encode_with_types(text, None, keep)[0] for text in some],
        )
    else:
        encoded = await ctx.encode_many(texts, add_special_tokens, side)
    tokens = iter(encoded)
    prompts = []
    for item in items:
        ids, _ = ctx.truncate(
            next(tokens) if isinstance(item, str) else list(item), request, reserve=0
        )
        prompts.append(TokensPrompt(ids, item if isinstance(item, str) else None))
    return prompts


async def pool(
    ctx: ServingContext,
    base_id: str,
    prompts: list[TokensPrompt],
    params: PoolingParams,
    priority: int,
) -> list[PoolingRequestOutput]:
    """One engine request per prompt (`base_id`, or `base_id-i` for several), all or none;
    their final outputs in order. The requests are queued together, so the engine takes them
    all between two steps (added one at a time, each would wait for a step of its own). A
    client that goes away aborts the unfinished ones."""
    ctx.check_capacity()

    def add(index: int, prompt: TokensPrompt):
        request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
        if ctx.request_logger is not None:  # --enable-log-requests, as the other routes
            ctx.request_logger.log_inputs(
                request_id, prompt.prompt, prompt.prompt_token_ids, params, priority
            )
        return ctx.engine.add_request(
            request_id, prompt, params, priority, RequestOutputKind.FINAL_ONLY
        )

    adds = [asyncio.ensure_future(add(index, prompt)) for index, prompt in enumerate(prompts)]
    try:
        await asyncio.gather(*adds, return_exceptions=True)
    except BaseException:  # cancelled (the client left): withdraw every request
        _withdraw(ctx, adds)
        raise
    refused = [add.exception() for add in adds if add.exception() is not None]
    if refused:  # all or none
        _withdraw(ctx, adds)
        raise refused[0]
    return await ctx.final_outputs([add.result() for add in adds])


def _withdraw(ctx: ServingContext, adds: list[asyncio.Future]) -> None:
    """An add still waiting withdraws its own request when cancelled (add_request); one that
    was accepted is aborted here, even if the caller was cancelled before it could see it."""
    for add in adds:
        if not add.done():
            add.cancel()
        elif not add.cancelled() and add.exception() is None:
            ctx.engine.abort(add.result().request_id)


def pooled_data(final: PoolingRequestOutput) -> list[float]:
    """A pooling request's result: the embedding, class probabilities or [score]."""
    return final.outputs.data


def usage(prompt_tokens: int) -> Usage:
    """vLLM's UsageInfo of a pooling response: prompt tokens only (completion_tokens 0)."""
    return Usage(prompt_tokens, prompt_tokens)


def list_response(
    ctx: ServingContext, base_id: str, data: list[dict[str, Any]], prompt_tokens: int
) -> Response:
    """A pooling route's 200 body (embeddings, score, classify, pooling): vLLM's list shape."""
    body = {
        "id": base_id,
        "object": "list",
        "created": int(time.time()),
        "model": ctx.served_model_name,
        "data": data,
        "usage": usage(prompt_tokens),
    }
    return Response(200, encode_json(body))


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embedding(ctx: ServingContext, request: EmbeddingRequest) -> Response:
    ctx.check_model(request.model)
    check_task(ctx, ("embed",), "Embeddings API")
    if request.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
    if request.dimensions is not None and request.dimensions < 1:
        raise bad_request("dimensions must be a positive integer", "dimensions")
    items = check_inputs(request.input, "input")
    prompts = await tokenized_prompts(ctx, request, items)
    params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize, task="embed")
    base_id = response_id("embd", request.request_id)
    finals = await pool(ctx, base_id, prompts, params, request.priority)
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encode_vector(pooled_data(final), request.encoding_format),
        }
        for index, final in enumerate(finals)
    ]
    return list_response(ctx, base_id, data, sum(len(p.prompt_token_ids) for p in prompts))
