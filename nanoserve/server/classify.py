"""POST /classify (vLLM's classification API for sequence classifiers) and POST /pooling
(vLLM's raw pooling API: whatever the model pools, for each input).

Both take `input` as /v1/embeddings does (a string, strings, token ids or token-id lists). A
classify item is the class probabilities (`probs`, the raw logits with `use_activation` false),
their count and the most likely class's label from the checkpoint's `id2label` (transformers'
`LABEL_<i>` without one). A pooling item's `data` is what the model's task gives: the embedding
of an embedding model (with `dimensions`, `normalize` and `encoding_format` as /v1/embeddings),
the class probabilities of a classifier. `task` picks one the model serves; the per-token tasks
of vLLM (token_embed, token_classify) are not served here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from nanoserve.pooling_params import PoolingParams
from nanoserve.server.embeddings import (
    check_inputs,
    check_task,
    encode_vector,
    list_response,
    pool,
    pooled_data,
    pooling_tasks,
    tokenized_prompts,
)
from nanoserve.server.http.types import Response
from nanoserve.server.scoring import activation_of, check_unsupported
from nanoserve.server.serving import ServingContext, bad_request, response_id

SERVED_TASKS = ("embed", "classify")  # what /pooling's `task` may name


class ClassifyRequest(msgspec.Struct):
    """vLLM's ClassificationCompletionRequest."""

    input: Any = None
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    use_activation: bool | None = None
    softmax: bool | None = None  # vLLM's older names of use_activation
    activation: bool | None = None
    # vLLM's, not supported here: a 400 naming them when set
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None


class PoolingRequest(ClassifyRequest):
    """vLLM's PoolingCompletionRequest (its chat form, `messages`, is refused)."""

    task: str | None = None  # None: the model's own
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    messages: list[Any] | None = None


def label_of(ctx: ServingContext, probs: list[float]) -> str:
    """The most likely class's name: the checkpoint's id2label (ModelConfig reads it)."""
    best = max(range(len(probs)), key=probs.__getitem__)
    return ctx.engine.engine.model_config.id2label.get(best, f"LABEL_{best}")


def _check_common(ctx: ServingContext, request: ClassifyRequest) -> None:
    ctx.check_model(request.model)
    check_unsupported(request)


async def create_classify(ctx: ServingContext, request: ClassifyRequest) -> Response:
    _check_common(ctx, request)
    check_task(ctx, ("classify",), "Classification API")
    items = check_inputs(request.input, "input")
    prompts = await tokenized_prompts(ctx, request, items)
    base_id = response_id("classify", request.request_id)
    params = PoolingParams(task="classify", activation=activation_of(request))
    finals = await pool(ctx, base_id, prompts, params, request.priority)
    data = []
    for index, final in enumerate(finals):
        probs = pooled_data(final)
        data.append(
            {
                "index": index,
                "label": label_of(ctx, probs),
                "probs": probs,
                "num_classes": len(probs),
            }
        )
    return list_response(ctx, base_id, data, sum(len(p.prompt_token_ids) for p in prompts))


def _pooling_params(ctx: ServingContext, request: PoolingRequest) -> PoolingParams:
    """The task (the request's, else the model's default) and its options, checked."""
    served = pooling_tasks(ctx.engine.engine)
    task = request.task
    if task is None:  # the model's embed or classify (a cross-encoder's default may be score)
        task = check_task(ctx, SERVED_TASKS, "Pooling API")
    if task not in SERVED_TASKS:
        raise bad_request(
            f"task {task!r} is not supported by this server (one of {list(SERVED_TASKS)}, or "
            "none for the model's own)",
            "task",
        )
    if task not in served:
        raise bad_request(
            f"The model is not served for task {task!r} (it is for {', '.join(served)})", "task"
        )
    if request.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
    activation = activation_of(request)
    if task == "classify":
        for name in ("dimensions", "normalize"):
            if getattr(request, name) is not None:
                raise bad_request(f"`{name}` is for task embed, not classify", name)
        return PoolingParams(task=task, activation=activation)
    if request.dimensions is not None and request.dimensions < 1:
        raise bad_request("dimensions must be a positive integer", "dimensions")
    # vLLM's newer name of an embedding's normalization is use_activation
    normalize = request.normalize if request.normalize is not None else activation
    return PoolingParams(task=task, dimensions=request.dimensions, normalize=normalize)


async def create_pooling(ctx: ServingContext, request: PoolingRequest) -> Response:
    _check_common(ctx, request)
    if request.messages is not None:
        raise bad_request("`messages` is not supported by this server (send `input`)", "messages")
    params = _pooling_params(ctx, request)
    items = check_inputs(request.input, "input")
    prompts = await tokenized_prompts(ctx, request, items)
    base_id = response_id("pool", request.request_id)
    finals = await pool(ctx, base_id, prompts, params, request.priority)
    data = [
        {
            "index": index,
            "object": "pooling",
            "data": encode_vector(pooled_data(final), request.encoding_format),
        }
        for index, final in enumerate(finals)
    ]
    return list_response(ctx, base_id, data, sum(len(p.prompt_token_ids) for p in prompts))
