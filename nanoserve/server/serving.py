"""The OpenAI serving layer's shared part (vLLM's serving_engine.py), used by the serving
modules chat.py and completions.py: the serving context, request → SamplingParams, prompt
tokenization off the event loop, submission to the async engine (or a replay from the response
cache), what a streamed choice has sent, SSE, and the one map from errors to HTTP statuses."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from nanoserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from nanoserve.engine.llm_engine import StepError
from nanoserve.errors import InvalidRequestError
from nanoserve.inputs import TokensPrompt
from nanoserve.lora.request import LoRARequest
from nanoserve.multimodal.fetch import FetchPolicy
from nanoserve.multimodal.image import ImageLimits
from nanoserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.preprocess import Preprocessor
from nanoserve.server.reasoning_parsers import ReasoningParser
from nanoserve.server.request_logger import RequestLogger
from nanoserve.server.response_cache import ResponseCache, cache_key, is_cacheable
from nanoserve.server.schemas import (
    APIError,
    ErrorInfo,
    ErrorResponse,
    OverloadedError,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from nanoserve.server.structured_outputs import structured_outputs_params
from nanoserve.server.tool_parsers import ToolParser

logger = logging.getLogger("nanoserve.server")

DONE = b"data: [DONE]\n\n"
encode_json = msgspec.json.encode

# Sampling defaults a model's generation_config.json may override (as vLLM does).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_dir: str | Path | None) -> dict[str, float]:
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {
        key: raw[key] for key in GENERATION_DEFAULT_KEYS if isinstance(raw.get(key), (int, float))
    }


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(prefix: str, client_id: str | None) -> str:
    """The response's id, which is also the engine request's: vLLM's form, the client's id
    (X-Request-Id or the body's request_id) after the prefix; random without one."""
    return f"{prefix}-{client_id}" if client_id else random_id(prefix)


def sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


def error_body(error: APIError) -> bytes:
    return encode_json(
        ErrorResponse(ErrorInfo(error.message, error.error_type, error.param, error.status))
    )


TOO_DEEP = "The request body is nested too deeply."
# What a client is told of a failure inside the server: the cause (its repr may show paths,
# tensors, addresses) goes to the log only.
STEP_FAILED = "The request failed during a model step; the server log has the cause."
INTERNAL_ERROR = "Internal server error."
# Characters of a prompt list tokenized in one job: another request's large input waits behind at
# most one such slice on the preprocessing pool (a single longer prompt is a slice of its own).
PROMPT_SLICE_CHARS = 64 * 1024


def to_api_error(error: BaseException) -> APIError | None:
    """The one map from an exception to its HTTP status and `param`: a request the engine or
    SamplingParams refused (InvalidRequestError, its `param` set where it was raised) is a 400,
    a dead engine 503, a failed step 500. None: not a user-facing error (a bug: 500)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), error.param)
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error))
    if isinstance(error, StepError):  # this request's step failed; the engine serves on
        logger.error(
            "request(s) %s failed during a model step: %r",
            ", ".join(error.request_ids),
            error.cause,
        )
        return APIError(500, STEP_FAILED)
    if isinstance(error, RecursionError):  # nested input that decoded, then was too deep
        return APIError(400, TOO_DEEP)
    return None


def sse_error(error: BaseException) -> bytes:
    """A mid-stream error: the 200 went out, so the error is an event."""
    api_error = to_api_error(error)
    if api_error is None:  # a bug: the client gets no detail of it
        logger.error("a stream failed", exc_info=error)
        api_error = APIError(500, INTERNAL_ERROR)
    return b"data: " + error_body(api_error) + b"\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    tokenizer: Any
    served_model_name: str
    model_path: str
    max_model_len: int
    generation_defaults: dict[str, float]
    preprocessor: Preprocessor
    max_prompt_chars: int
    max_n_sequences: int
    max_waiting_requests: int | None = None
    trust_request_chat_template: bool = False
    enable_prompt_tokens_details: bool = False
    truncation_side: str = "right"  # the tokenizer's default, when a request names none
    on_admission_rejected: Callable[[str], None] | None = None  # metrics: a 503 for a full queue
    request_logger: RequestLogger | None = None  # --enable-log-requests
    response_cache: ResponseCache | None = None  # --response-cache-size
    chat_template: str | None = None  # --chat-template: instead of the model's
    auto_tool_parser: type[ToolParser] | None = None  # --enable-auto-tool-choice's parser
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    # --allowed-media-domains and the fetch timeout: what an http(s) image URL may reach
    media_fetch: FetchPolicy = field(default_factory=FetchPolicy)
    # --max-image-bytes and --max-image-pixels (and --limit-mm-per-prompt): one image's limits
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    # --lora-modules (and adapters loaded at run time): a request whose model names one runs with it.
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    next_lora_id: int = 1
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model; 404 for
        anything else."""
        if name is None or name in (self.served_model_name, self.model_path):
            return None
        lora = self.lora_modules.get(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return lora

    def response_model(self, name: str | None) -> str:
        """model_name of the adapter a request's `model` named (the base model's otherwise)."""
        lora = self.lora_modules.get(name) if name is not None else None
        return self.model_name(lora)

    def new_lora(self, name: str, path: str) -> LoRARequest:
        """An adapter under a fresh id (never reused: the prefix cache keys blocks by it)."""
        self.next_lora_id = max(
            [self.next_lora_id, *(lora.lora_int_id + 1 for lora in self.lora_modules.values())]
        )
        lora = LoRARequest(name, self.next_lora_id, path, self.served_model_name)
        self.next_lora_id += 1
        return lora

    def model_name(self, lora: LoRARequest | None) -> str:
        """What a response's `model` says: the adapter's name, as vLLM, or the served model's."""
        return lora.lora_name if lora is not None else self.served_model_name

    def check_capacity(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, "The engine is dead; this server can no longer serve requests.")
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting >= limit:
            if self.on_admission_rejected is not None:
                self.on_admission_rejected("max_num_queued_reqs")
            raise OverloadedError(
                f"The server is overloaded: {self.engine.num_waiting} requests are "
                f"waiting (limit {limit}). Retry later."
            )

    async def off_loop(self, size: int, fn, *args, **kwargs):
        """Run fn on the preprocessing pool when the input is large, so the loop stays free."""
        return await self.preprocessor.run(size, fn, *args, **kwargs)

    def fit(self, text: str, truncation_side: str | None) -> str:
        """With a truncation side, text longer than any context is first cut (by characters,
        from that side); the tokens are truncated later. Without one it is a 400."""
        if len(text) > self.max_prompt_chars and truncation_side is not None:
            cut = self.max_prompt_chars
            text = text[-cut:] if truncation_side == "left" else text[:cut]
        if len(text) > self.max_prompt_chars:  # cannot fit, whatever it tokenizes to
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(text)} characters of input, more than any "
                f"{self.max_model_len} tokens can hold. Please reduce the length of the input "
                "messages.",
                "input_tokens",
            )
        return text

    async def encode(
        self, text: str, add_special_tokens: bool, truncation_side: str | None = None
    ) -> list[int]:
        text = self.fit(text, truncation_side)
        return await self.off_loop(
            len(text), self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )

    async def encode_many(
        self, texts: list[str], add_special_tokens: bool, truncation_side: str | None = None
    ) -> list[list[int]]:
        """The prompts of one request, each checked for length before any is tokenized, then
        tokenized in slices (map_sliced)."""
        texts = [self.fit(text, truncation_side) for text in texts]
        return await self.map_sliced(
            texts,
            [len(text) for text in texts],
            lambda some: self.tokenizer.encode_each(some, add_special_tokens),
        )

    async def map_sliced(self, items: list, sizes: list[int], fn: Callable[[list], list]) -> list:
        """fn over `items` (their sizes in characters) in slices of about PROMPT_SLICE_CHARS
        characters, one slice at a time, the results joined: the pool serves other requests'
        inputs between two slices, and the loop is never held for more than a slice below
        SMALL_INPUT characters."""
        prepare_by = self.preprocessor.deadline()
        result: list = []
        start = 0
        while start < len(items):
            end, size = start + 1, sizes[start]
            while end < len(items) and size + sizes[end] <= PROMPT_SLICE_CHARS:
                size += sizes[end]
                end += 1
            result += await self.preprocessor.run(size, fn, items[start:end], prepare_by=prepare_by)
            start = end
        return result

    def check_prompt_tokens(self, num_tokens: int) -> None:
        """The engine's (and vLLM's) refusal of a prompt that fills the context, found here
        before the prompt is walked, hashed for the response cache or queued for the engine."""
        if num_tokens >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {num_tokens} input tokens. Please reduce the length of the "
                "input messages.",
                "input_tokens",
            )

    def check_num_sequences(self, n: int, num_prompts: int) -> None:
        """n x prompts, the outputs one request asks for: checked before any prompt is
        tokenized, and again when the request is submitted."""
        if n * num_prompts > self.max_n_sequences:
            raise bad_request(
                f"n x prompts must be <= {self.max_n_sequences} per request, got "
                f"{n} x {num_prompts}",
                "n",
            )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        details = PromptTokensDetails(cached_tokens) if self.enable_prompt_tokens_details else None
        return Usage(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens, details)

    def check_fields(
        self, request: SamplingFields, logprobs_name: str, logprobs: int | None
    ) -> None:
        """vLLM's request-level checks of logprobs, prompt_logprobs and truncation; vLLM's
        fields that nanoserve does not apply are refused, not ignored."""
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(request, name):
                raise bad_request(f"`{name}` is not supported by this server", name)
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is not None:
            if request.stream and (prompt_logprobs > 0 or prompt_logprobs == -1):
                raise bad_request(
                    "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
                )
            if prompt_logprobs < -1:
                raise bad_request(
                    "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs"
                )
        if logprobs is not None and logprobs < -1:
            raise bad_request(f"`{logprobs_name}` must be a positive value or -1.", logprobs_name)
        self.check_truncation(request)

    def check_truncation(self, request, reserve: int = 1) -> None:
        """vLLM's checks of truncate_prompt_tokens and truncation_side (any request carrying
        them). `reserve`: the positions -1 leaves free (1 for the token to generate; 0 for a
        pooling request)."""
        if request.truncation_side not in (None, "left", "right"):
            raise bad_request(
                "`truncation_side` must be either 'left' or 'right'.", "truncation_side"
            )
        limit = request.truncate_prompt_tokens
        if limit is not None and limit < -1:
            whole = "max_model_len - 1" if reserve else "max_model_len"
            raise bad_request(
                f"truncate_prompt_tokens must be -1 ({whole}) or >= 0, got {limit}",
                "truncate_prompt_tokens",
            )
        if limit is not None and limit > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens={limit} cannot be greater than "
                f"max_model_len = {self.max_model_len}. Please request a smaller "
                "truncation size.",
                "truncate_prompt_tokens",
            )

    def truncation_side_of(self, request: SamplingFields) -> str | None:
        """The side to cut from, or None when the request does not truncate."""
        if request.truncate_prompt_tokens is None:
            return None
        return request.truncation_side or self.truncation_side

    def truncate(
        self, token_ids: list[int], request: SamplingFields, reserve: int = 1
    ) -> tuple[list[int], bool]:
        """truncate_prompt_tokens as vLLM: keep that many tokens (-1: max_model_len - reserve),
        the last ones with truncation_side "left". Returns the tokens and whether any were cut."""
        limit = request.truncate_prompt_tokens
        if limit is None:
            return token_ids, False
        keep = self.max_model_len - reserve if limit == -1 else limit
        if keep >= len(token_ids):
            return token_ids, False
        if self.truncation_side_of(request) == "left":
            return token_ids[len(token_ids) - keep :], True
        return token_ids[:keep], True

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises APIError, or InvalidRequestError (SamplingParams' checks) naming the field."""
        if request.stream_options is not None and not request.stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        defaults = self.generation_defaults

        def pick(name: str, fallback: float) -> Any:
            value = getattr(request, name)
            return value if value is not None else defaults.get(name, fallback)

        logit_bias = None
        if request.logit_bias:
            logit_bias, invalid = {}, []
            for token, bias in request.logit_bias.items():
                try:
                    logit_bias[int(token)] = float(bias)
                except (ValueError, TypeError):
                    invalid.append(token)
            if invalid:
                raise bad_request(
                    "logit_bias contains key(s) that cannot be converted to integer "
                    f"token IDs: {invalid!r}",
                    "logit_bias",
                )
        return SamplingParams(
            n=request.n,
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=int(pick("top_k", 0)),
            min_p=float(pick("min_p", 0.0)),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            seed=request.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            logit_bias=logit_bias,
            structured_outputs=structured_outputs_params(request),
        )

    async def submit(
        self,
        base_id: str,
        prompts: list[TokensPrompt],
        params: SamplingParams,
        priority: int,
        lora: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Add one engine request per prompt; all or none (a rejected one aborts the rest)."""
        self.check_num_sequences(params.n, len(prompts))
        self.check_capacity()
        streams: list[RequestStream] = []
        try:
            for index, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
                if self.request_logger is not None:
                    self.request_logger.log_inputs(
                        request_id, prompt.prompt, prompt.prompt_token_ids, params, priority
                    )
                streams.append(
                    await self.engine.add_request(
                        request_id,
                        prompt,
                        params,
                        priority,
                        RequestOutputKind.DELTA,
                        lora_request=lora,
                    )
                )
        except BaseException:  # the routes map it to its status (to_api_error)
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams

    def cached_streams(
        self,
        base_id: str,
        prompts: list[TokensPrompt],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> tuple[bytes | None, list[RequestStream] | None]:
        """Look the request up in the response cache. Returns the key to store its outputs under
        (None: not cacheable, or a hit) and, on a hit, finished streams that replay the stored
        outputs: the engine never sees the request."""
        cache = self.response_cache
        if cache is None or not cache.enabled or not is_cacheable(params):
            return None, None
        if any(prompt.multi_modal_data for prompt in prompts):  # its ids don't say which image
            return None, None
        model = f"{self.served_model_name}\0{self.model_path}"
        if lora is not None:  # an adapter's answers are its own (by id: one id, one adapter)
            model += f"\0lora\0{lora.lora_int_id}\0{lora.lora_path}"
        key = cache_key(model, [prompt.prompt_token_ids for prompt in prompts], params)
        outputs = cache.get(key)
        if outputs is None:
            return key, None
        streams = []
        for index, (prompt, output) in enumerate(zip(prompts, outputs)):
            output.request_id = base_id if len(outputs) == 1 else f"{base_id}-{index}"
            output.prompt = prompt.prompt
            output.prompt_token_ids = prompt.prompt_token_ids
            stream = RequestStream(output.request_id, time.time(), params)
            stream.put(output)
            streams.append(stream)
        return None, streams

    def store_response(self, key: bytes | None, finals: list) -> None:
        """Keep a finished request's final outputs (one per prompt) for its repeats; failed or
        aborted ones are refused by the cache."""
        if key is not None and self.response_cache is not None:
            self.response_cache.put(key, finals)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Each stream's outputs folded into its whole answer, in order; on any error (the
        client gone, the engine dead) the unfinished ones are aborted first."""
        finals = []
        try:
            for stream in streams:
                final = None
                async for output in stream:
                    final = fold(final, output)
                finals.append(final)
        except BaseException:
            self.abort_unfinished(streams)
            raise
        return finals

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)


def fold(whole: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """A request's deltas so far as one output (for the response, or the response cache)."""
    if whole is None:
        return delta
    whole.add(delta)
    return whole


@dataclass(slots=True)
class ChoiceProgress:
    """One streamed choice: what of it came from the engine and what went out. The engine's
    deltas already hold back text that a stop string may still take."""

    num_tokens: int = 0  # generated tokens received: the usage so far
    chars_sent: int = 0  # characters sent, an echoed prompt included (completions' text_offset)
    started: bool = False  # its first chunk went out
    finished: bool = False

    def take(self, choice: CompletionOutput, shows_tokens: bool) -> bool:
        """Count a delta in; True when it makes a chunk: new text, the finish, or new tokens
        that the client sees (`shows_tokens`: logprobs or token ids asked for). Empty deltas
        are not sent."""
        if self.finished:
            return False
        self.num_tokens += len(choice.token_ids)
        self.finished = choice.finish_reason is not None
        return bool(choice.text) or self.finished or (shows_tokens and bool(choice.token_ids))

    def usage(self, prompt_tokens: int) -> Usage:
        """continuous_usage_stats: per choice, as vLLM: its prompt and its tokens so far."""
        return Usage(prompt_tokens, prompt_tokens + self.num_tokens, self.num_tokens)
