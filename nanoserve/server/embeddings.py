"""POST /v1/embeddings (OpenAI's, as vLLM serves it for pooling models): `input` as a string, a
list of strings, a list of token ids or a list of token-id lists; `encoding_format` "float" or
"base64" (little-endian float32 bytes, what the `openai` client sends by default when numpy is
present and decodes itself); `dimensions` for Matryoshka models; `usage` counts the prompt
tokens. Each input is one engine request (a prompt pass, pooled; no KV kept after), batched with
everything else the scheduler runs."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

import msgspec

from nanoserve.inputs import TokensPrompt
from nanoserve.outputs import RequestOutputKind
from nanoserve.pooling_params import PoolingParams
from nanoserve.server.http.types import Response
from nanoserve.server.schemas import APIError
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


def _inputs(request: EmbeddingRequest) -> list[str | list[int]]:
    value = request.input
    if isinstance(value, str) or _is_ids(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v) for v in value):
        items = value
    else:
        raise bad_request(
            "input must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists (non-empty)",
            "input",
        )
    if len(items) > MAX_INPUTS:
        raise bad_request(
            f"input holds {len(items)} items; at most {MAX_INPUTS} per request", "input"
        )
    if any(isinstance(item, str) and not item for item in items):
        raise bad_request("input strings must not be empty", "input")
    return items


async def _prompts(
    ctx: ServingContext, request: EmbeddingRequest, items: list[str | list[int]]
) -> list[TokensPrompt]:
    ctx.check_truncation(request, reserve=0)  # a pooling prompt may fill the context
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(
        await ctx.encode_many(texts, request.add_special_tokens, ctx.truncation_side_of(request))
    )
    prompts = []
    for item in items:
        ids, _ = ctx.truncate(
            next(encoded) if isinstance(item, str) else list(item), request, reserve=0
        )
        prompts.append(TokensPrompt(ids, item if isinstance(item, str) else None))
    return prompts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embedding(
    ctx: ServingContext, request: EmbeddingRequest, is_pooling: bool
) -> Response:
    ctx.check_model(request.model)
    if not is_pooling:
        raise APIError(
            400,
            "The model does not support Embeddings API: it generates text (serve an "
            "embedding model with --runner pooling, or --task embed).",
            "model",
        )
    if request.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
    if request.dimensions is not None and request.dimensions < 1:
        raise bad_request("dimensions must be a positive integer", "dimensions")
    items = _inputs(request)
    prompts = await _prompts(ctx, request, items)
    params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
    base_id = response_id("embd", request.request_id)
    ctx.check_capacity()
    streams = []
    try:
        for index, prompt in enumerate(prompts):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
            streams.append(
                await ctx.engine.add_request(
                    request_id, prompt, params, request.priority, RequestOutputKind.FINAL_ONLY
                )
            )
    except BaseException:  # all or none
        ctx.abort_unfinished(streams)
        raise
    finals = await ctx.final_outputs(streams)
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": _encode(final.embedding, request.encoding_format),
        }
        for index, final in enumerate(finals)
    ]
    prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    body = {
        "id": base_id,
        "object": "list",
        "created": int(time.time()),
        "model": ctx.served_model_name,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return Response(200, encode_json(body))
