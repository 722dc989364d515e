"""Wire engine, async engine, OpenAI app and HTTP server together; run until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nanoserve import envs
from nanoserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, new_step_executor
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.lora.request import LoRARequest
from nanoserve.multimodal.fetch import FetchPolicy
from nanoserve.server.app import OpenAIApp, http_error_response
from nanoserve.server.args import ChatFeatures, ServerOptions
from nanoserve.server.http.server import HttpServer
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.preprocess import Preprocessor
from nanoserve.server.request_logger import RequestLogger
from nanoserve.server.response_cache import ResponseCache
from nanoserve.server.serving import ServingContext, load_generation_defaults
from nanoserve.server.shutdown_signals import ShutdownSignals

logger = logging.getLogger("nanoserve.server")


@dataclass
class RunningServer:
    host: str
    port: int
    http: HttpServer
    engine: AsyncLLMEngine
    app: OpenAIApp
    options: ServerOptions
    preprocessor: Preprocessor

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def shutdown(self, grace_period: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, abort the rest
        (their handlers abort the engine requests), then stop the engine."""
        grace = self.options.shutdown_grace_period if grace_period is None else grace_period
        error = EngineDeadError("The server is shutting down and its grace period ran out.")
        await self.http.shutdown(grace, on_grace_expired=lambda: self.engine.fail_all(error))
        await self.engine.stop()
        self.preprocessor.shutdown()


async def start_server(
    engine: LLMEngine, options: ServerOptions, step_executor: ThreadPoolExecutor | None = None
) -> RunningServer:
    """Serve an already built LLMEngine on the running loop; returns once listening.
    `step_executor`: the thread the engine was built on (see `new_step_executor`). The engine
    stays the caller's: after the server's shutdown, `engine.shutdown()` stops its worker ranks
    (as `serve` does, which owns the signals that may have to kill them meanwhile)."""
    config = engine.config
    chat = ChatFeatures.from_options(options, engine.model_config.architecture)
    lora_modules = _load_lora_modules(engine, options)
    response_cache = None
    if options.response_cache_size > 0:
        response_cache = ResponseCache(
            int(options.response_cache_size * 2**20), options.response_cache_ttl
        )
    num_blocks = sum(m.num_blocks for m in engine.block_managers)
    kv_cache_size_tokens = num_blocks * config.block_size
    metrics = ServerMetrics(
        engine.served_model_name,
        engine.max_model_len,
        {
            "block_size": config.block_size,
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "num_gpu_blocks": num_blocks,
            "num_cpu_blocks": None,
            # vLLM 0.32's labels: the KV pool in tokens, and how many max_model_len requests fit it
            "kv_cache_size_tokens": kv_cache_size_tokens,
            "kv_cache_max_concurrency": kv_cache_size_tokens / engine.max_model_len,
        },
        response_cache,
    )
    async_engine = AsyncLLMEngine(
        engine,
        observer=metrics,
        step_executor=step_executor,
        log_stats=not config.disable_log_stats,
        compile_timeout=options.structured_outputs_compile_timeout,
    )
    async_engine.start()
    preprocessor = Preprocessor(
        options.preprocess_threads, options.preprocess_timeout, options.max_preprocess_in_flight
    )
    ctx = ServingContext(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        served_model_name=engine.served_model_name,
        model_path=engine.model_path,
        max_model_len=engine.max_model_len,
        generation_defaults=load_generation_defaults(engine.model_dir),
        preprocessor=preprocessor,
        max_prompt_chars=engine.max_prompt_chars,
        max_n_sequences=engine.config.max_n_sequences,
        max_waiting_requests=options.max_waiting_requests,
        trust_request_chat_template=options.trust_request_chat_template,
        enable_prompt_tokens_details=options.enable_prompt_tokens_details,
        truncation_side=engine.tokenizer.truncation_side,
        on_admission_rejected=metrics.on_admission_rejected,
        request_logger=RequestLogger(options.max_log_len) if options.enable_log_requests else None,
        response_cache=response_cache,
        chat_template=chat.chat_template,
        auto_tool_parser=chat.auto_tool_parser,
        reasoning_parser=chat.reasoning_parser,
        media_fetch=FetchPolicy.create(engine.config.allowed_media_domains),
        image_limits=engine.config.image_limits,
        lora_modules={lora.lora_name: lora for lora in lora_modules},
        next_lora_id=len(lora_modules) + 1,
    )
    app = OpenAIApp(
        ctx,
        metrics,
        api_key=options.api_key,
        runtime_lora=config.enable_lora and envs.allow_runtime_lora_updating(),
        server_load_tracking=options.enable_server_load_tracking,
        tokenizer_info=options.enable_tokenizer_info_endpoint,
        ui=not options.no_ui,
        dev_routes=options.server_dev_mode,
        responses_store_max_bytes=options.responses_store_max_bytes,
    )
    http = HttpServer(
        app, options.limits, error_response=http_error_response, check_headers=app.refuse_headers
    )
    host, port = await http.start(options.host, options.port)
    return RunningServer(host, port, http, async_engine, app, options, preprocessor)


def _load_lora_modules(engine: LLMEngine, options: ServerOptions) -> list[LoRARequest]:
    """--lora-modules read on every rank before the server listens (a bad adapter stops the
    start with one line naming it)."""
    loras = []
    for lora_id, (name, path, base_model_name) in enumerate(options.lora_modules, 1):
        if name in (engine.served_model_name, engine.model_path):
            raise ValueError(f"--lora-modules: {name!r} is the base model's name")
        lora = LoRARequest(name, lora_id, path, base_model_name or engine.served_model_name)
        engine.add_lora(lora)
        logger.info("serving LoRA adapter %r from %s", name, path)
        loras.append(lora)
    return loras


def configure_logging(level: str) -> None:
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(
        level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("nanoserve").setLevel(numeric)


async def serve(engine_config, options: ServerOptions, signals: ShutdownSignals) -> int:
    """Build the engine, serve until a signal (or a dead rank), shut down. `signals` owns SIGINT
    and SIGTERM from before the engine (and its worker ranks) exists: a signal at any moment ends
    in the same graceful path, the ranks stopped and joined by `engine.shutdown()`."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server: RunningServer | None = None

    def on_signal(signum: int, count: int) -> None:
        name = signal.Signals(signum).name
        if count == 1:
            if server is None:
                logger.info(
                    "%s during start-up: stopping without serving (again to stop at once)", name
                )
            else:
                logger.info(
                    "%s: shutting down (grace period %.0f s)", name, options.shutdown_grace_period
                )
            stop.set()
        elif server is not None:  # do not wait for in-flight requests
            logger.info("second signal: aborting in-flight requests")
            for connection in list(server.http.connections):
                connection.abort()

    exit_code = 0

    def on_engine_failure(reason: str) -> None:  # called on the tensor-parallel watchdog thread
        def fail() -> None:
            nonlocal exit_code
            exit_code = 1
            logger.error("%s: failing in-flight requests and exiting", reason)
            server.engine._die(RuntimeError(reason))  # streams get the error, /health turns 503
            stop.set()

        loop.call_soon_threadsafe(fail)

    signals.listen(loop, on_signal)
    try:
        if stop.is_set():  # a signal while the server's modules were imported: no rank exists yet
            return 0
        step_executor = new_step_executor()
        engine = await loop.run_in_executor(step_executor, LLMEngine, engine_config)
        try:
            if stop.is_set():  # a signal during start-up: stop the ranks without serving
                step_executor.shutdown(wait=True)
            else:
                server = await start_server(engine, options, step_executor)
                signals.serving = True
                print(f"listening on {server.url}", flush=True)
                logger.info("serving %s on %s", engine.served_model_name, server.url)
                engine.add_failure_callback(on_engine_failure)
                await stop.wait()
                grace = (
                    options.shutdown_grace_period
                    if exit_code == 0
                    else min(options.shutdown_grace_period, 5.0)
                )
                await server.shutdown(grace)
                signals.serving = False  # a signal now: the ranks may be stuck, kill them
        finally:
            engine.shutdown()  # stops and joins the tensor- / pipeline-parallel worker ranks
    finally:
        signals.stop_listening()
    logger.info("shutdown complete")
    return exit_code


def run(engine_config, options: ServerOptions, signals: ShutdownSignals | None = None) -> int:
    """Serve until a signal. `signals`: installed by the caller as early as it can (`cmd_serve`
    does so before importing this module); made here otherwise."""
    configure_logging(options.log_level)
    own_signals = signals is None
    signals = ShutdownSignals() if own_signals else signals
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            return asyncio.run(serve(engine_config, options, signals))
        return uvloop.run(serve(engine_config, options, signals))
    finally:
        if own_signals:
            signals.restore()
