"""Server-only command-line flags (engine flags belong to nanoserve.cli) and ServerOptions.

Each default is written once, on `ServerOptions` or `HttpLimits`; the flags read it from there."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from nanoserve import envs
from nanoserve.server.http.types import HttpLimits
from nanoserve.server.reasoning_parsers import (
    DEFAULT_REASONING_PARSERS,
    REASONING_PARSERS,
    ReasoningParser,
)
from nanoserve.server.responses_input import DEFAULT_STORE_MAX_BYTES
from nanoserve.server.tool_parsers import TOOL_PARSERS, ToolParser

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int | None = None
    shutdown_grace_period: float = 30.0
    log_level: str = "info"
    trust_request_chat_template: bool = False
    enable_prompt_tokens_details: bool = False
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None  # prompt characters / token ids in the request log; None: all
    no_ui: bool = False  # serve the browser chat page at / unless set
    server_dev_mode: bool = False  # NANOSERVE_SERVER_DEV_MODE / VLLM_SERVER_DEV_MODE: dev routes
    preprocess_threads: int = 2  # tokenizing / template rendering of large inputs
    preprocess_timeout: float = 30.0
    max_preprocess_in_flight: int = 64
    structured_outputs_compile_timeout: float = 10.0  # seconds a request waits for its grammar
    response_cache_size: float = 0.0  # MiB of finished responses kept for repeats; 0: off
    response_cache_ttl: float = 3600.0  # seconds a cached response stays valid
    responses_store_max_bytes: int = DEFAULT_STORE_MAX_BYTES  # /v1/responses' store, JSON bytes
    chat_template: str | None = None  # a file, or the template itself; None: the model's
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (with tool_call_parser)
    tool_call_parser: str | None = None  # a name in tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in reasoning_parsers.REASONING_PARSERS
    # --lora-modules: (name, path, base model name or None) of each adapter served (--enable-lora)
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    limits: HttpLimits = field(default_factory=HttpLimits)


def _default(cls: type, name: str):
    for item in dataclasses.fields(cls):
        if item.name == name:
            return item.default
    raise KeyError(name)


# (flag, owner, field, type, help); positive numbers unless the type is bool or optional.
_OPTIONAL = ("max_waiting_requests", "max_log_len")  # None (the default) or >= 0
_NON_NEGATIVE = ("response_cache_size",)  # 0 turns the feature off
_TEXT = ("chat_template", "tool_call_parser", "reasoning_parser")  # None (the default) or text
_FLAGS: list[tuple[str, type, str, type, str]] = [
    (
        "--max-waiting-requests",
        ServerOptions,
        "max_waiting_requests",
        int,
        "answer 503 while this many requests wait for the engine",
    ),
    (
        "--shutdown-grace-period",
        ServerOptions,
        "shutdown_grace_period",
        float,
        "seconds in-flight requests may finish after SIGTERM/SIGINT; then each open stream gets an "
        "error event and [DONE]",
    ),
    (
        "--trust-request-chat-template",
        ServerOptions,
        "trust_request_chat_template",
        bool,
        "render a chat_template sent in a request (sandboxed); refused (400) without this flag",
    ),
    (
        "--enable-prompt-tokens-details",
        ServerOptions,
        "enable_prompt_tokens_details",
        bool,
        "report usage.prompt_tokens_details.cached_tokens (prompt tokens from the prefix cache)",
    ),
    (
        "--enable-server-load-tracking",
        ServerOptions,
        "enable_server_load_tracking",
        bool,
        "count in-flight completion and chat requests; GET /load reports them as server_load",
    ),
    (
        "--enable-tokenizer-info-endpoint",
        ServerOptions,
        "enable_tokenizer_info_endpoint",
        bool,
        "serve GET /tokenizer_info (the tokenizer's configuration and chat template)",
    ),
    (
        "--enable-log-requests",
        ServerOptions,
        "enable_log_requests",
        bool,
        "log each request: its id, prompt length and sampling params (the prompt itself only at "
        "--log-level debug)",
    ),
    (
        "--max-log-len",
        ServerOptions,
        "max_log_len",
        int,
        "prompt characters and token ids the debug request log shows; unset: all",
    ),
    (
        "--no-ui",
        ServerOptions,
        "no_ui",
        bool,
        "do not serve the browser chat page at / (GET /, /index.html and /ui/config answer 404)",
    ),
    (
        "--preprocess-threads",
        ServerOptions,
        "preprocess_threads",
        int,
        "threads that tokenize and render large inputs off the event loop",
    ),
    (
        "--preprocess-timeout",
        ServerOptions,
        "preprocess_timeout",
        float,
        "seconds one input may take to tokenize / render before a 400",
    ),
    (
        "--max-preprocess-in-flight",
        ServerOptions,
        "max_preprocess_in_flight",
        int,
        "large inputs queued or being prepared at once; 503 beyond",
    ),
    (
        "--structured-outputs-compile-timeout",
        ServerOptions,
        "structured_outputs_compile_timeout",
        float,
        "seconds a request may wait for its schema, regex or grammar to compile (queued "
        "compiles included) before a 400 naming its field; the compile finishes into the cache",
    ),
    (
        "--response-cache-size",
        ServerOptions,
        "response_cache_size",
        float,
        "MiB of finished responses kept to answer identical requests (greedy, or with a seed) "
        "without running the model; LRU by bytes; 0 turns the cache off",
    ),
    (
        "--response-cache-ttl",
        ServerOptions,
        "response_cache_ttl",
        float,
        "seconds a cached response may answer repeats",
    ),
    (
        "--responses-store-max-bytes",
        ServerOptions,
        "responses_store_max_bytes",
        int,
        "bytes of stored /v1/responses (their JSON and conversations) kept for previous_response_id "
        "and GET; the oldest go first; a larger response is not stored (store: false)",
    ),
    (
        "--chat-template",
        ServerOptions,
        "chat_template",
        str,
        "the chat template to render messages with, instead of the model's: a Jinja file, or the "
        "template itself",
    ),
    (
        "--enable-auto-tool-choice",
        ServerOptions,
        "enable_auto_tool_choice",
        bool,
        'let the model decide to call tools (tool_choice "auto", the default with tools); needs '
        "--tool-call-parser",
    ),
    (
        "--tool-call-parser",
        ServerOptions,
        "tool_call_parser",
        str,
        f"how the model writes tool calls: {', '.join(TOOL_PARSERS)}",
    ),
    (
        "--reasoning-parser",
        ServerOptions,
        "reasoning_parser",
        str,
        "return the model's thinking as reasoning_content: "
        f"{', '.join(REASONING_PARSERS)} (gpt-oss models: openai_gptoss unless given)",
    ),
    (
        "--timeout-keep-alive",
        HttpLimits,
        "keep_alive_timeout",
        float,
        "seconds an idle keep-alive connection stays open",
    ),
    (
        "--request-read-timeout",
        HttpLimits,
        "request_read_timeout",
        float,
        "seconds allowed to receive one request's headers and body",
    ),
    (
        "--write-timeout",
        HttpLimits,
        "write_timeout",
        float,
        "seconds a response may wait for a client that reads nothing before the connection closes",
    ),
    (
        "--max-request-header-bytes",
        HttpLimits,
        "max_header_bytes",
        int,
        "larger request headers get 431",
    ),
    (
        "--max-request-body-bytes",
        HttpLimits,
        "max_body_bytes",
        int,
        "larger request bodies get 413",
    ),
    (
        "--max-buffered-body-bytes",
        HttpLimits,
        "max_buffered_body_bytes",
        int,
        "request bodies held at once across all connections; a request over it gets 503",
    ),
]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server")
    group.add_argument(
        "--host", default=_default(ServerOptions, "host"), help="address to listen on"
    )
    group.add_argument(
        "--port",
        type=int,
        default=_default(ServerOptions, "port"),
        help="port to listen on; 0 picks a free one (the bound address is printed)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, "
        "/ping, /version and the chat page (default: $NANOSERVE_API_KEY or "
        "$VLLM_API_KEY)",
    )
    for flag, owner, name, kind, help_text in _FLAGS:
        default = _default(owner, name)
        if kind is bool:
            group.add_argument(
                flag, dest=name, action="store_true", default=default, help=help_text
            )
        else:
            group.add_argument(
                flag,
                dest=name,
                type=kind,
                default=default,
                help=f"{help_text} (default: {default})",
            )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve (with --enable-lora), each as name=path or as JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request names one as its model',
    )
    group.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        default=_default(ServerOptions, "log_level"),
        choices=LOG_LEVELS,
        help="server log level",
    )


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    def get(owner: type, name: str):
        value = getattr(args, name, None)
        return _default(owner, name) if value is None else value

    port = get(ServerOptions, "port")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    values: dict[type, dict] = {ServerOptions: {}, HttpLimits: {}}
    for flag, owner, name, kind, _ in _FLAGS:
        value = get(owner, name)
        if name in _TEXT:
            pass
        elif name in _OPTIONAL:
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        elif name in _NON_NEGATIVE:
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
        elif kind is not bool and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
        values[owner][name] = value
    api_key = getattr(args, "api_key", None) or envs.api_key()
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    if lora_modules and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    options = ServerOptions(
        host=get(ServerOptions, "host"),
        port=port,
        api_key=api_key,
        server_dev_mode=envs.server_dev_mode(),
        log_level=get(ServerOptions, "log_level"),
        lora_modules=lora_modules,
        limits=HttpLimits(**values[HttpLimits]),
        **values[ServerOptions],
    )
    ChatFeatures.from_options(options)  # a bad parser name or template file stops the start
    return options


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str, str | None], ...]:
    """vLLM's --lora-modules entries: name=path, or a JSON object with name, path and optionally
    base_model_name. Names must differ."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"--lora-modules: {value!r} is not JSON: {error}") from None
            unknown = (
                set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else set()
            )
            if (
                not isinstance(spec, dict)
                or not spec.get("name")
                or not spec.get("path")
                or unknown
            ):
                raise ValueError(
                    f'--lora-modules: {value!r} needs "name" and "path" (and at most '
                    '"base_model_name")'
                )
            modules.append((str(spec["name"]), str(spec["path"]), spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} is not name=path")
        modules.append((name, path, None))
    names = [name for name, _, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name appears twice in {', '.join(names)}")
    return tuple(modules)


@dataclass(frozen=True, slots=True)
class ChatFeatures:
    """What the chat flags turn into: the template text, the parser classes and objects."""

    chat_template: str | None
    auto_tool_parser: type[ToolParser] | None  # set only with --enable-auto-tool-choice
    reasoning_parser: ReasoningParser | None

    @classmethod
    def from_options(cls, options: ServerOptions, architecture: str | None = None) -> ChatFeatures:
        """Raises ValueError (the CLI's one-line error) for a flag that cannot work.
        `architecture`: the served model's, whose default reasoning parser applies when
        --reasoning-parser is not given (gpt-oss: openai_gptoss, as vLLM)."""
        tool_parser = _named(TOOL_PARSERS, options.tool_call_parser, "--tool-call-parser")
        if options.enable_auto_tool_choice and tool_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        name = options.reasoning_parser or DEFAULT_REASONING_PARSERS.get(architecture)
        reasoning = _named(REASONING_PARSERS, name, "--reasoning-parser")
        return cls(
            read_chat_template(options.chat_template),
            tool_parser if options.enable_auto_tool_choice else None,
            reasoning() if reasoning is not None else None,
        )


def _named(table: dict, name: str | None, flag: str):
    if name is None:
        return None
    if name not in table:
        raise ValueError(f"{flag} must be one of {', '.join(table)}, got {name!r}")
    return table[name]


def read_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a path to a file, else the template itself when it looks like
    Jinja; anything else is a missing file."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if any(marker in value for marker in ("{{", "{%", "\n")):
        return value
    raise ValueError(f"--chat-template: no such file: {value}")
