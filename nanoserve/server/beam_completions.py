"""`use_beam_search` on POST /v1/completions (vLLM's extension): `n` beams per prompt through
nanoserve/beam_search.py, each step's beams sent to the engine as one-token requests (the prefix
cache shares their blocks), the `n` best sequences returned as the choices, best first. Not
streamed; sample logprobs, echo and a structured output are refused with a 400 naming the field,
as the search picks tokens by its own scores."""

from __future__ import annotations

import time

from nanoserve.beam_search import BeamSearch, BeamSearchParams
from nanoserve.errors import InvalidRequestError
from nanoserve.inputs import TokensPrompt
from nanoserve.lora.request import LoRARequest
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.http.types import Response
from nanoserve.server.schemas import CompletionChoice, CompletionRequest, CompletionResponse
from nanoserve.server.serving import ServingContext, bad_request, encode_json, response_id

REFUSED = (
    ("stream", "streaming"),
    ("logprobs", "logprobs"),
    ("echo", "echo"),
    ("response_format", "structured outputs"),
    ("structured_outputs", "structured outputs"),
    ("guided_json", "structured outputs"),
    ("guided_regex", "structured outputs"),
    ("guided_choice", "structured outputs"),
    ("guided_grammar", "structured outputs"),
    ("prompt_logprobs", "prompt logprobs"),
)


def beam_params(ctx: ServingContext, request: CompletionRequest) -> BeamSearchParams:
    for name, what in REFUSED:
        if getattr(request, name) not in (None, False):
            raise bad_request(f"{what} cannot be combined with use_beam_search", name)
    if request.temperature not in (None, 0, 0.0):
        raise bad_request(
            "beam search is deterministic: temperature must be 0 (or unset)", "temperature"
        )
    if request.n < 1:
        raise bad_request("use_beam_search takes n (the beam width) of at least 1", "n")
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    if max_tokens < 1:
        raise bad_request("max_tokens must be at least 1 with use_beam_search", "max_tokens")
    return BeamSearchParams(
        request.n,
        max_tokens,
        ignore_eos=request.ignore_eos,
        length_penalty=float(request.length_penalty),
    )


async def _search(
    ctx: ServingContext,
    base_id: str,
    prompt: TokensPrompt,
    params: BeamSearchParams,
    priority: int,
    lora: LoRARequest | None,
) -> BeamSearch:
    search = BeamSearch(prompt.prompt_token_ids, params, set(ctx.tokenizer.eos_token_ids))
    step_params = SamplingParams(
        max_tokens=1, temperature=0, logprobs=search.num_logprobs, ignore_eos=True
    )
    step = 0
    while pending := search.pending():
        try:
            streams = await ctx.submit(
                f"{base_id}-beam{step}",
                [TokensPrompt(t) for t in pending],
                step_params,
                priority,
                lora,
            )
        except InvalidRequestError as error:  # the server's --max-logprobs bounds the width
            raise bad_request(
                f"beam width {params.beam_width} needs {search.num_logprobs} "
                f"logprobs a step: {error}",
                "n",
            ) from None
        finals = await ctx.final_outputs(streams)
        search.advance(
            [
                {token: lp.logprob for token, lp in final.outputs[0].logprobs[0].items()}
                for final in finals
            ]
        )
        step += 1
    return search


async def create_beam_completion(
    ctx: ServingContext,
    request: CompletionRequest,
    prompts: list[TokensPrompt],
    params: BeamSearchParams,
    lora: LoRARequest | None = None,
) -> Response:
    base_id = response_id("cmpl", request.request_id)
    created = int(time.time())
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, prompt in enumerate(prompts):
        search = await _search(ctx, f"{base_id}-{index}", prompt, params, request.priority, lora)
        prompt_tokens += len(prompt.prompt_token_ids)
        for rank, beam in enumerate(search.output().sequences):
            generated = beam.tokens[len(prompt.prompt_token_ids) :]
            completion_tokens += len(generated)
            text = ctx.tokenizer.decode(generated, skip_special_tokens=request.skip_special_tokens)
            choices.append(
                CompletionChoice(
                    index * params.beam_width + rank,
                    text,
                    None,
                    beam.finish_reason,
                    beam.stop_reason,
                    generated if request.return_token_ids else None,
                )
            )
    usage = ctx.usage(prompt_tokens, completion_tokens, 0)
    return Response(
        200,
        encode_json(
            CompletionResponse(
                base_id, "text_completion", created, ctx.model_name(lora), choices, usage
            )
        ),
    )
