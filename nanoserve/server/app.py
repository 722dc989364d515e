"""The route table: OpenAI endpoints, Anthropic's /v1/messages (server/anthropic.py), vLLM's
pooling routes (score, rerank, classify, pooling: server/scoring.py, classify.py), vLLM's
/health, /version, /tokenize, /detokenize, /metrics, /load, /tokenizer_info, /invocations and (in
development mode) /reset_prefix_cache, and the chat page (server/ui.py). With an API key every
route but OPEN_PATHS needs it, sent as `Authorization: Bearer <key>` or Anthropic's
`x-api-key: <key>`. Maps every error once, here: to vLLM's {"error": {...}} body, or on the
Anthropic paths to Anthropic's error body."""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import unquote

import msgspec

import nanoserve
from nanoserve.server import anthropic
from nanoserve.server import metrics as metrics_module
from nanoserve.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from nanoserve.server.chat import create_chat_completion, render_chat_prompt
from nanoserve.server.classify import (
    ClassifyRequest,
    PoolingRequest,
    create_classify,
    create_pooling,
)
from nanoserve.server.completions import create_completion
from nanoserve.server.embeddings import EmbeddingRequest, create_embedding
from nanoserve.server.http.types import HttpRequest, Response, StreamingResponse
from nanoserve.server.preprocess import SMALL_INPUT
from nanoserve.server.responses import create_response
from nanoserve.server.responses_input import (
    DEFAULT_STORE_MAX_BYTES,
    ResponsesRequest,
    ResponseStore,
)
from nanoserve.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from nanoserve.server.scoring import RerankRequest, ScoreRequest, create_rerank, create_score
from nanoserve.server.serving import (
    TOO_DEEP,
    ServingContext,
    bad_request,
    encode_json,
    error_body,
    to_api_error,
)
from nanoserve.server.tokenizer_info import tokenizer_info
from nanoserve.server.ui import CONFIG_PATH, PAGE_PATHS, ui_routes

logger = logging.getLogger("nanoserve.server")

Handler = Callable[[HttpRequest], Awaitable["Response | StreamingResponse"]]
_decoders: dict[type, msgspec.json.Decoder] = {}


def error_response(error: APIError) -> Response:
    return Response(error.status, error_body(error), headers=list(error.headers))


def http_error_response(status: int, message: str) -> Response:
    """For errors found by the HTTP layer (400 malformed, 408, 413, 431, 500)."""
    return error_response(APIError(status, message))


def check_content_type(request: HttpRequest) -> None:
    content_type = (request.header("content-type") or "application/json").split(";")[0].strip()
    if content_type.lower() != "application/json" and not content_type.lower().endswith("+json"):
        raise bad_request(f"Unsupported content type {content_type!r}: send application/json.")


def decode_body(request: HttpRequest, struct: type):
    check_content_type(request)
    decoder = _decoders.get(struct)
    if decoder is None:
        decoder = _decoders[struct] = msgspec.json.Decoder(struct)
    try:
        body = decoder.decode(request.body)
        _log_ignored_fields(request.body, struct)
        return body
    except RecursionError:
        raise bad_request(TOO_DEEP) from None
    except msgspec.ValidationError as error:
        # msgspec names the failing field only in its message ("... - at `$.n`").
        message = str(error)
        param = None
        if "at `$." in message:
            param = message.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
        raise bad_request(_worded_limit(message), param) from None
    except msgspec.DecodeError as error:
        raise bad_request(f"The request body is not valid JSON: {error}") from None


_TOO_LONG = re.compile(r"Expected `(array|object|str)` of length <= (\d+) - at `\$\.(.+)`")
_UNITS = {"array": "items", "object": "entries", "str": "characters"}


def _worded_limit(message: str) -> str:
    """msgspec's message for a bounded field that is too long, as a sentence naming the field
    and its limit (docs/robustness.md); any other message as it is."""
    match = _TOO_LONG.fullmatch(message)
    if match is None:
        return message
    kind, limit, path = match.groups()
    return f"`{path}` is too long: it may hold at most {limit} {_UNITS[kind]}."


_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _log_ignored_fields(raw: bytes, struct: type) -> None:
    unknown = _top_level.decode(raw).keys() - set(struct.__struct_fields__)
    if unknown:
        logger.warning(
            "The following fields were present in the request but ignored: %s", sorted(unknown)
        )


def with_request_id(request: HttpRequest, body):
    """vLLM: the X-Request-Id header, else the body's `request_id`, names the request (its
    response id and the engine request's id)."""
    body.request_id = request.header("x-request-id") or body.request_id
    return body


class _ReleaseWhenDone:
    """A streamed body that calls `release` once, when it ends or is closed (even unstarted)."""

    def __init__(self, body, release: Callable[[], None]) -> None:
        self.body = body
        self.release: Callable[[], None] | None = release

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.body.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self.body.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


INVOCATION_TYPES = ("ChatCompletionRequest", "CompletionRequest")
MODELS_PREFIX = "/v1/models/"
RESPONSES_PREFIX = "/v1/responses/"
# An allowlist: with --api-key, only these answer without the key (probes, the version, and the
# chat page, which asks for the key and sends it with its API calls). Every other path, a route
# added later or none at all, needs the key.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", *PAGE_PATHS, CONFIG_PATH})


class OpenAIApp:
    def __init__(
        self,
        ctx: ServingContext,
        metrics: metrics_module.ServerMetrics,
        api_key: str | None = None,
        server_load_tracking: bool = False,
        tokenizer_info: bool = False,
        ui: bool = True,
        runtime_lora: bool = False,
        dev_routes: bool = False,
        responses_store_max_bytes: int = DEFAULT_STORE_MAX_BYTES,
    ) -> None:
        """`runtime_lora`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-lora
        with NANOSERVE_ALLOW_RUNTIME_LORA_UPDATING or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
        `dev_routes`: serve the routes that change server state for development
        (NANOSERVE_SERVER_DEV_MODE or vLLM's VLLM_SERVER_DEV_MODE): POST /reset_prefix_cache."""
        self.ctx = ctx
        self.metrics = metrics
        self.api_key = api_key
        self.server_load_tracking = server_load_tracking
        self.server_load = 0  # completion and chat requests in flight (with the tracking flag)
        # /v1/responses' store and previous_response_id
        self.response_store = ResponseStore(max_bytes=responses_store_max_bytes)
        self.routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self.health},
            "/ping": {"GET": self.health, "POST": self.health},
            "/version": {"GET": self.version},
            "/metrics": {"GET": self.prometheus},
            "/load": {"GET": self.load},
            "/v1/models": {"GET": self.models},
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat},
            "/v1/responses": {"POST": self.responses},
            anthropic.PATH: {"POST": self.messages},
            anthropic.COUNT_TOKENS_PATH: {"POST": self.count_message_tokens},
            "/v1/embeddings": {"POST": self.embeddings},
            # vLLM's pooling routes beside embeddings (server/scoring.py, classify.py)
            "/v1/score": {"POST": self.score},
            "/score": {"POST": self.score},
            "/v1/rerank": {"POST": self.rerank},
            "/rerank": {"POST": self.rerank},
            "/v2/rerank": {"POST": self.rerank},
            "/classify": {"POST": self.classify},
            "/pooling": {"POST": self.pooling},
            "/invocations": {"POST": self.invocations},
            "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
        }
        # Paths under a prefix: the rest of the path is an id.
        self.prefix_routes: dict[str, dict[str, Handler]] = {
            MODELS_PREFIX: {"GET": self.model},
            RESPONSES_PREFIX: {"GET": self.stored_response, "DELETE": self.delete_response},
        }
        if dev_routes:
            self.routes["/reset_prefix_cache"] = {"POST": self.reset_prefix_cache}
        if tokenizer_info:
            self.routes["/tokenizer_info"] = {"GET": self.tokenizer_info}
        if runtime_lora:
            self.routes["/v1/load_lora_adapter"] = {"POST": self.load_lora_adapter}
            self.routes["/v1/unload_lora_adapter"] = {"POST": self.unload_lora_adapter}
        if ui:  # the browser chat page at /
            self.routes.update(ui_routes(api_key_required=api_key is not None))

    def _methods(self, path: str) -> dict[str, Handler] | None:
        methods = self.routes.get(path)
        if methods is not None:
            return methods
        for prefix, methods in self.prefix_routes.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                return methods
        return None

    async def __call__(self, request: HttpRequest) -> Response | StreamingResponse:
        try:
            # Before the route is looked up: without the key, no route's existence shows.
            self.authenticate(request)
            methods = self._methods(request.path)
            if methods is None:
                raise APIError(404, f"Route {request.path} not found.")
            method = "GET" if request.method == "HEAD" else request.method
            handler = methods.get(method)
            if handler is None:
                allow = ", ".join(sorted(methods))
                raise APIError(
                    405,
                    f"Method {request.method} not allowed for {request.path}.",
                    headers=[("allow", allow)],
                )
            return await handler(request)
        except Exception as error:
            api_error = to_api_error(error)
            if api_error is None:
                raise  # the connection answers 500 and logs it
            if anthropic.is_anthropic_path(request.path):
                return anthropic.error_response(api_error)
            return error_response(api_error)

    def needs_key(self, path: str) -> bool:
        return self.api_key is not None and path not in OPEN_PATHS

    def authenticate(self, request: HttpRequest) -> None:
        """Raises the 401 unless the path is open or the request carries the key, in its
        `Authorization: Bearer` header or (Anthropic's clients) its `x-api-key` header; the HTTP
        layer may call it as soon as the headers are in."""
        if not self.needs_key(request.path):
            return
        expected = self.api_key.encode()
        scheme, _, token = (request.header("authorization") or "").partition(" ")
        bearer = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), expected
        )
        api_key = request.header("x-api-key")
        keyed = api_key is not None and hmac.compare_digest(api_key.strip().encode(), expected)
        if not (bearer or keyed):
            raise APIError(
                401,
                "Unauthorized: a valid API key is required (Authorization: Bearer <key>, or "
                "x-api-key: <key>).",
                headers=[("www-authenticate", "Bearer")],
            )

    def refuse_headers(self, request: HttpRequest) -> Response | None:
        """The HTTP layer's check once a request's headers are in (`HttpServer`'s
        `check_headers`): the 401 to send instead of reading its body, or None."""
        try:
            self.authenticate(request)
        except APIError as error:
            if anthropic.is_anthropic_path(request.path):
                return anthropic.error_response(error)
            return error_response(error)
        return None

    # ---- plain endpoints ----
    async def health(self, request: HttpRequest) -> Response:
        if self.ctx.engine.is_dead:
            return error_response(APIError(503, "The engine is dead."))
        return Response(200, b"", content_type=None)

    async def version(self, request: HttpRequest) -> Response:
        return Response(200, encode_json({"version": nanoserve.__version__}))

    async def prometheus(self, request: HttpRequest) -> Response:
        body = self.metrics.render(self.ctx.engine.stats)
        return Response(200, body, content_type=metrics_module.CONTENT_TYPE)

    async def reset_prefix_cache(self, request: HttpRequest) -> Response:
        """vLLM's route: an empty 200 once the engine's prefix cache (cleared between two steps)
        and the response cache are empty. vLLM's query flags (reset_running_requests,
        reset_external) are accepted and need nothing: the prefix cache of running requests'
        blocks is dropped too, and there is no external cache."""
        logger.info("Resetting prefix cache...")
        await self.ctx.engine.reset_prefix_cache()
        if self.ctx.response_cache is not None:
            self.ctx.response_cache.clear()
        return Response(200, b"", content_type=None)

    async def load(self, request: HttpRequest) -> Response:
        return Response(200, encode_json({"server_load": self.server_load}))

    async def tokenizer_info(self, request: HttpRequest) -> Response:
        return Response(200, encode_json(tokenizer_info(self.ctx.tokenizer)))

    def _model_card(self, lora=None) -> ModelCard:
        """The served model's card, or a LoRA adapter's (vLLM's: its path as root, the base
        model as parent)."""
        ctx = self.ctx
        if lora is not None:
            return ModelCard(
                lora.lora_name,
                "model",
                ctx.created,
                "nanoserve",
                lora.lora_path,
                ctx.max_model_len,
                lora.base_model_name or ctx.served_model_name,
                [],
            )
        return ModelCard(
            ctx.served_model_name,
            "model",
            ctx.created,
            "nanoserve",
            ctx.model_path,
            ctx.max_model_len,
            None,
            [],
        )

    async def models(self, request: HttpRequest) -> Response:
        cards = [self._model_card()] + [
            self._model_card(lora) for lora in self.ctx.lora_modules.values()
        ]
        return Response(200, encode_json(ModelList("list", cards)))

    async def model(self, request: HttpRequest) -> Response:
        """GET /v1/models/{id} (OpenAI's retrieve-model): the served model or an adapter, else 404."""
        name = unquote(request.path[len(MODELS_PREFIX) :])
        if name == self.ctx.served_model_name:
            return Response(200, encode_json(self._model_card()))
        if name in self.ctx.lora_modules:
            return Response(200, encode_json(self._model_card(self.ctx.lora_modules[name])))
        raise APIError(404, f"The model `{name}` does not exist.", "model")

    async def load_lora_adapter(self, request: HttpRequest) -> Response:
        """vLLM's runtime adapter loading: read on every rank between two steps; a bad
        adapter is a 400 naming what is wrong, and nothing changes."""
        body = decode_body(request, LoadLoRAAdapterRequest)
        ctx = self.ctx
        if not body.lora_name or not body.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if body.lora_name in (ctx.served_model_name, ctx.model_path):
            raise bad_request(f"'{body.lora_name}' is the base model's name", "lora_name")
        old = ctx.lora_modules.get(body.lora_name)
        if old is not None and not body.load_inplace:  # vLLM's message
            raise bad_request(
                f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name"
            )
        lora = ctx.new_lora(body.lora_name, body.lora_path)
        await ctx.engine.call_between_steps(lambda engine: engine.add_lora(lora))
        ctx.lora_modules[body.lora_name] = lora
        if old is not None:
            await ctx.engine.call_between_steps(lambda engine: engine.remove_lora(old.lora_int_id))
        logger.info("loaded LoRA adapter %r from %s", lora.lora_name, lora.lora_path)
        return Response(
            200,
            f"Success: LoRA adapter '{body.lora_name}' added successfully.".encode(),
            content_type="text/plain; charset=utf-8",
        )

    async def unload_lora_adapter(self, request: HttpRequest) -> Response:
        """New requests can no longer name it; those running finish with it."""
        body = decode_body(request, UnloadLoRAAdapterRequest)
        ctx = self.ctx
        lora = ctx.lora_modules.pop(body.lora_name, None)
        if lora is None:
            raise APIError(
                404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name"
            )
        await ctx.engine.call_between_steps(lambda engine: engine.remove_lora(lora.lora_int_id))
        logger.info("unloaded LoRA adapter %r", lora.lora_name)
        return Response(
            200,
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.".encode(),
            content_type="text/plain; charset=utf-8",
        )

    # ---- OpenAI endpoints ----
    async def _tracked(self, serve: Callable[[], Awaitable[Response | StreamingResponse]]):
        """With --enable-server-load-tracking, count the request until its response is done."""
        if not self.server_load_tracking:
            return await serve()
        self.server_load += 1
        try:
            response = await serve()
        except BaseException:
            self.server_load -= 1
            raise
        if isinstance(response, StreamingResponse):
            response.body = _ReleaseWhenDone(response.body, self._release_load)
        else:
            self.server_load -= 1
        return response

    def _release_load(self) -> None:
        self.server_load -= 1

    async def completions(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, CompletionRequest))
        return await self._tracked(lambda: create_completion(self.ctx, body))

    async def chat(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, ChatCompletionRequest))
        return await self._tracked(lambda: create_chat_completion(self.ctx, body))

    async def embeddings(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, EmbeddingRequest))
        return await self._tracked(lambda: create_embedding(self.ctx, body))

    async def score(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, ScoreRequest))
        return await self._tracked(lambda: create_score(self.ctx, body))

    async def rerank(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, RerankRequest))
        return await self._tracked(lambda: create_rerank(self.ctx, body))

    async def classify(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, ClassifyRequest))
        return await self._tracked(lambda: create_classify(self.ctx, body))

    async def pooling(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, PoolingRequest))
        return await self._tracked(lambda: create_pooling(self.ctx, body))

    async def responses(self, request: HttpRequest):
        body = with_request_id(request, decode_body(request, ResponsesRequest))
        return await self._tracked(lambda: create_response(self.ctx, self.response_store, body))

    async def messages(self, request: HttpRequest):
        """Anthropic's POST /v1/messages."""
        body = with_request_id(request, decode_body(request, MessagesRequest))
        return await self._tracked(lambda: anthropic.create_message(self.ctx, body))

    async def count_message_tokens(self, request: HttpRequest) -> Response:
        """Anthropic's POST /v1/messages/count_tokens."""
        body = decode_body(request, CountTokensRequest)
        return await anthropic.count_tokens(self.ctx, body)

    def _stored_id(self, request: HttpRequest) -> str:
        return unquote(request.path[len(RESPONSES_PREFIX) :])

    async def stored_response(self, request: HttpRequest) -> Response:
        """GET /v1/responses/{id}: a stored response as it was returned, else 404."""
        stored = self.response_store.get(self._stored_id(request))
        if stored is None:
            raise APIError(404, f"Response with id '{self._stored_id(request)}' not found.")
        return Response(200, stored.body)

    async def delete_response(self, request: HttpRequest) -> Response:
        response_id = self._stored_id(request)
        if not self.response_store.delete(response_id):
            raise APIError(404, f"Response with id '{response_id}' not found.")
        return Response(
            200, encode_json({"id": response_id, "object": "response", "deleted": True})
        )

    async def invocations(self, request: HttpRequest):
        """SageMaker's POST /invocations, as vLLM: a chat request when the body has `messages`,
        a completion request when it has a non-empty `prompt`."""
        check_content_type(request)
        try:
            fields = _top_level.decode(request.body)
        except (msgspec.DecodeError, RecursionError):
            raise bad_request("The request body is not a JSON object.") from None

        def decoded(struct: type):
            try:
                return with_request_id(request, decode_body(request, struct))
            except APIError:  # not this kind of request: try the next
                return None

        if "messages" in fields and (chat := decoded(ChatCompletionRequest)) is not None:
            return await self._tracked(lambda: create_chat_completion(self.ctx, chat))
        prompt = fields.get("prompt")
        if (
            prompt is not None
            and bytes(prompt) not in (b"null", b'""')
            and (completion := decoded(CompletionRequest)) is not None
        ):
            return await self._tracked(lambda: create_completion(self.ctx, completion))
        raise bad_request(
            f"Cannot find suitable handler for request. Expected one of: {list(INVOCATION_TYPES)}"
        )

    async def tokenize(self, request: HttpRequest) -> Response:
        body = decode_body(request, TokenizeRequest)
        ctx = self.ctx
        ctx.check_model(body.model)
        if body.messages is not None:
            prompt = await render_chat_prompt(
                ctx,
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template,
                body.chat_template_kwargs,
                bool(body.add_special_tokens),
            )
            tokens = prompt.prompt_token_ids
            if prompt.multi_modal_data:  # counted as the model reads them: the images' tokens
                expand = ctx.engine.engine.inputs.model_token_ids
                tokens = await ctx.off_loop(SMALL_INPUT, expand, prompt)
        elif body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await ctx.encode(body.prompt, add_special)
        else:
            raise bad_request("either 'prompt' or 'messages' is required", "prompt")
        token_strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return Response(
            200, encode_json(TokenizeResponse(len(tokens), ctx.max_model_len, tokens, token_strs))
        )

    async def detokenize(self, request: HttpRequest) -> Response:
        body = decode_body(request, DetokenizeRequest)
        ctx = self.ctx
        ctx.check_model(body.model)
        vocab_size = getattr(ctx.tokenizer, "vocab_size", None)
        if body.tokens and (
            min(body.tokens) < 0  # min / max: no Python loop on the event loop
            or (vocab_size is not None and max(body.tokens) >= vocab_size)
        ):
            raise bad_request("token ids must be in the vocabulary", "tokens")
        text = await ctx.off_loop(len(body.tokens), ctx.tokenizer.decode, body.tokens)
        return Response(200, encode_json(DetokenizeResponse(text)))
