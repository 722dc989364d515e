"""OpenAI / vLLM request and response shapes as msgspec Structs.

Unknown request fields are ignored (msgspec's default), as vLLM accepts them. Field names and
defaults follow vLLM's OpenAI server.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from nanoserve.sampling_params import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)


class APIError(Exception):
    """A user-facing error, rendered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or ERROR_TYPES.get(status, "InternalServerError")
        self.headers = headers or []


class OverloadedError(APIError):
    """The 503 for a full waiting queue (--max-waiting-requests), apart from other 503s: the
    Anthropic routes answer it as their 529 overloaded_error."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, headers=[("retry-after", "1")])


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


# ---- requests ------------------------------------------------------------------------------
# Bounded lists (sampling_params.py says why): the decoder refuses a longer one, before any other
# work on the request; app.py words its message.
StopString = Annotated[str, msgspec.Meta(max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
Choices = Annotated[list[str], msgspec.Meta(max_length=MAX_CHOICES)]
# OpenAI's limits on `metadata` (the Responses API stores it with the response): 16 pairs,
# keys of at most 64 characters (checked by responses_input.py: msgspec's message for a key does
# not name the field), string values of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
Metadata = Annotated[
    dict[str, Annotated[str, msgspec.Meta(max_length=MAX_METADATA_VALUE_CHARS)]],
    msgspec.Meta(max_length=MAX_METADATA_PAIRS),
]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(msgspec.Struct):
    """Sampling fields shared by completions and chat (None: the model's default)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: LogitBias | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # -1: max_model_len - 1
    truncation_side: str | None = None  # "left" keeps the last tokens, "right" the first
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs (server/structured_outputs.py turns them into StructuredOutputsParams):
    # OpenAI's response_format, vLLM's structured_outputs object and its older guided_* names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None  # a schema object or its JSON text
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; xgrammar is the one backend
    guided_whitespace_pattern: str | None = None  # accepted and ignored
    # vLLM's, not supported here: a 400 naming them when not empty (not silently ignored)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


class CompletionRequest(SamplingFields):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]: checked by the handler
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    use_beam_search: bool = False  # vLLM's: n beams, the n best sequences as the choices
    length_penalty: float = 1.0  # with use_beam_search: score = logprob sum / length ** this


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = []
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    # Tool calling (server/tools.py checks them): a list of {"type": "function", "function":
    # {...}}; "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    tools: Any = None
    tool_choice: Any = None  # None: "auto" with tools, else "none" (as vLLM)
    parallel_tool_calls: bool | None = True
    # OpenAI's: handed to the chat template as `reasoning_effort` (gpt-oss's reads it) unless
    # chat_template_kwargs sets it; server/chat.py checks the value.
    reasoning_effort: str | None = None


class LoadLoRAAdapterRequest(msgspec.Struct):
    """POST /v1/load_lora_adapter (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter already served under the name


class UnloadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str = ""
    lora_int_id: int | None = None


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


# ---- responses -----------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One per prompt token: None for the first, else {token id: its logprob} (ids as JSON keys).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None = None


class CompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A call's first delta has id, type, name and arguments ""; later ones argument text."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk only, with return_token_ids


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None
    permission: list[dict[str, Any]] = []


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
