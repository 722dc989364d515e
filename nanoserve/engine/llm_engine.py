"""LLMEngine: add_request / abort_request / step. The offline LLM and the async server both
drive exactly this."""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import gc
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.distributed import set_parallel_state
from nanoserve.distributed.launcher import WorkerGroup
from nanoserve.distributed.rank import init_rank
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.pipeline_stage import LaunchedStep
from nanoserve.engine.request import Request, stop_string_holdback
from nanoserve.engine.sampling_batch import build_sampling_batch
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.spec_decode.draft import DraftProposer
from nanoserve.engine.spec_decode.metrics import SpecDecodingStats
from nanoserve.engine.spec_decode.ngram import NgramProposer
from nanoserve.engine.structured_output import SequenceGrammar, StructuredOutputManager
from nanoserve.engine.swap import HostBlockPool
from nanoserve.engine.worker import plan_topology, start_workers
from nanoserve.errors import InvalidRequestError
from nanoserve.inputs import PromptType, TextPrompt, parse_prompt
from nanoserve.layers.sampler import SamplerOutput, SamplingBatch
from nanoserve.lora.adapter import LoRAError
from nanoserve.lora.request import LoRARequest
from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.model import (
    check_gguf_file,
    check_quantization,
    find_gguf_file,
    gguf_tokenizer,
)
from nanoserve.models.registry import check_pipeline_support
from nanoserve.outputs import RequestMetrics, RequestOutput, RequestOutputKind
from nanoserve.pooling import PoolerConfig, PoolingState
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step failed because of what the requests in it asked for (not a dead device or rank).
    Those requests were aborted; the engine serves on. `request_ids`: the requests that failed."""

    def __init__(
        self,
        request_ids: list[str],
        cause: BaseException,
        outputs: list[RequestOutput] | None = None,
    ) -> None:
        super().__init__(f"the request failed during a model step: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause
        self.outputs = outputs or []  # the failed requests' last state (finish reason "abort")


def _is_device_fault(error: BaseException) -> bool:
    """A fault that leaves the device unusable for every request (a CUDA error poisons the
    context), as opposed to one request's bad input."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return "CUDA error" in str(error) or "device-side assert" in str(error)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prompt_tokens_cached_total: int = 0  # prompt tokens whose KV came from the prefix cache
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_swapped: int = 0  # requests with a sequence swapped out to the host pool
    num_swap_outs_total: int = 0  # sequences swapped out
    cpu_cache_usage: float = 0.0  # fraction of the host pool's blocks in use
    spec_decoding: SpecDecodingStats | None = None  # with --speculative-config
    # --enable-lora: (max_loras, the adapters of waiting requests, those of running ones), by name
    lora: tuple[int, list[str], list[str]] | None = None


@dataclass(slots=True)
class InFlightStep:
    """A pipelined step launched and not yet sampled (one per virtual engine at most)."""

    scheduler_output: SchedulerOutput
    model_input: ModelInput
    launched: LaunchedStep
    started: float
    sampling: SamplingBatch | None = None  # built at launch


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from nanoserve.models.gguf.importer import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return gguf_file
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a directory or a GGUF file; nanoserve loads Hugging "
            "Face-layout directories (config.json, *.safetensors, tokenizer.json) and GGUF files, "
            "and never downloads from a hub"
        )
    return path


def load_tokenizer(tokenizer: str | None, model_path: Path) -> Tokenizer:
    """`--tokenizer` when given; else the model's: a GGUF file's metadata or the directory's files."""
    if tokenizer is not None:
        return Tokenizer.from_pretrained(tokenizer)
    if find_gguf_file(model_path) is not None:
        return gguf_tokenizer(model_path)
    return Tokenizer.from_pretrained(model_path)


def freeze_startup_heap() -> None:
    """Everything built by now (the model's modules, the tokenizer's tables, a GGUF file's
    metadata: ~185k objects) lives as long as the engine. gc.freeze moves it out of the cyclic
    collector's reach, as vLLM does after start-up; else each full collection walks it all again
    (40 ms on the default model, 85 ms on its GGUF file, whose vocabulary lists stay cached): an
    offline 64 x (128, 128) run went from ~1100 to ~1180 output tokens/s. What an earlier engine
    froze is unfrozen first, and shutting an engine down (LLMEngine.shutdown, AsyncLLMEngine.stop)
    unfreezes, so that an engine dropped, in reference cycles as it is, can still be collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Once a process: frozen objects are never collected, not even as the interpreter exits
    (nanobind, under Triton, then reports its functions leaked); unfreeze before that."""
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_path = str(config.model or self.model_dir)
        # vLLM names a model by its --model argument; the default model by its own name.
        self.served_model_name = config.served_model_name or config.model or self.model_dir.name
        check_quantization(config.quantization, self.model_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.pooler = self._pooler()  # None: the model generates
        self.tokenizer = load_tokenizer(config.tokenizer, self.model_dir)
        max_len = self._requested_max_model_len()
        torch.manual_seed(config.seed)
        check_pipeline_support(self.model_config, config.pipeline_parallel_size)
        self.topology = plan_topology(config, self.model_config)
        if find_gguf_file(self.model_dir) is not None:
            check_gguf_file(self.model_dir, config.tensor_parallel_size)
        self.workers: WorkerGroup | None = None
        self.dead_reason: str | None = None
        self._failure_callbacks: list = []
        device = None
        if self.topology.world_size > 1:
            self.workers = start_workers(config, self.topology, str(self.model_dir))
            self.topology = self.workers.topology  # with its rendezvous made concrete
            self.workers.on_failure(self._fail_during_startup)
            device = init_rank(self.topology, 0)
        self.runner = ModelRunner(config, self.model_config, self.model_dir, device=device)
        if self.workers is not None:
            self.workers.on_failure(self._on_worker_failure)
        self.max_model_len = self._make_virtual_engines(max_len)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        self.max_prompt_chars = self._max_prompt_chars()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.max_model_len
        )
        # Speculative decoding (--speculative-config): n-gram proposals verified each step.
        self.proposer = self._make_proposer(config.speculative)
        self.spec_stats = (
            SpecDecodingStats(config.speculative.num_speculative_tokens)
            if self.proposer is not None
            else None
        )
        # Structured outputs: made on the first constrained request.
        self.structured_output: StructuredOutputManager | None = None
        self._compiling: dict[str, concurrent.futures.Future] = {}  # request id → its grammar
        self._structured_output_lock = threading.Lock()
        # LoRA (--enable-lora): the adapters every rank holds, by lora_int_id, least recently
        # used first; at most --max-cpu-loras (default --max-loras) unless all are in use.
        self.loras: OrderedDict[int, LoRARequest] = OrderedDict()
        self._lora_removals: set[int] = set()  # removed while requests still ran with them
        freeze_startup_heap()

    def _pooler(self) -> PoolerConfig | None:
        """--runner pooling (or --task embed, or a headless checkpoint): how prompts become
        embeddings; None for a generating model."""
        config, model_config = self.config, self.model_config
        if config.resolve_runner(model_config.headless) == "generate":
            if model_config.headless:
                raise ValueError(
                    f"{model_config.architecture.removesuffix('ForCausalLM')}Model checkpoints have no "
                    "LM head: serve them with --runner pooling (or --task embed)"
                )
            return None
        if config.speculative is not None:
            raise ValueError("--speculative-config is for generating models, not --runner pooling")
        if config.pipeline_parallel_size > 1:
            raise ValueError("--runner pooling is not supported with pipeline parallelism")
        return PoolerConfig.for_model(self.model_dir, config.pooler_config)

    @property
    def is_pooling(self) -> bool:
        return self.pooler is not None

    def _make_proposer(self, spec) -> NgramProposer | DraftProposer | None:
        """--speculative-config's proposer: n-gram lookup, or a draft model on a KV pool of its
        own holding as many tokens as the target's."""
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        return DraftProposer(
            self.config,
            resolve_model_dir(spec.model),
            self.model_config,
            self.runner.num_kv_blocks,
            self.runner.device,
            spec.num_speculative_tokens,
        )

    def _requested_max_model_len(self) -> int:
        """--max-model-len, or the model's own limit; never past the model's positions."""
        max_len = self.model_config.max_position_embeddings
        requested = self.config.max_model_len
        if requested is not None:
            if requested > max_len:
                raise ValueError(
                    f"max_model_len {requested} exceeds the model's "
                    f"max_position_embeddings {max_len}"
                )
            max_len = requested
        return max_len

    def _make_virtual_engines(self, max_len: int) -> int:
        """Pipeline parallelism: one scheduler per "virtual engine" (vLLM V0), each with its own
        share of the pool, so that as many independent batches as stages can be in flight.
        Returns max_len, lowered to what one share holds."""
        config = self.config
        num_virtual_engines = config.pipeline_parallel_size
        blocks_each = self.runner.num_kv_blocks // num_virtual_engines
        if blocks_each < 1:
            raise ValueError(
                "the KV cache holds fewer blocks than pipeline stages; raise --kv-cache-memory"
            )
        capacity = blocks_each * config.block_size
        if capacity < max_len:
            logger.warning(
                "KV cache holds %d tokens; max_model_len lowered from %d", capacity, max_len
            )
            max_len = capacity
        self.host_pool = (
            HostBlockPool(self.runner.num_swap_blocks) if config.preemption_mode == "swap" else None
        )
        # Pooling reads every prompt row's hidden state: nothing may come from the prefix cache.
        prefix_caching = config.enable_prefix_caching and self.pooler is None
        self.block_managers = [
            BlockManager(blocks_each, config.block_size, prefix_caching)
            for _ in range(num_virtual_engines)
        ]
        self.schedulers = [
            Scheduler(
                manager,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.scheduling_policy,
                self.host_pool,
                virtual_engine,
                max_loras=config.max_loras if config.enable_lora else 0,
            )
            for virtual_engine, manager in enumerate(self.block_managers)
        ]
        self.in_flight: list[InFlightStep | None] = [None] * num_virtual_engines
        self._next_virtual_engine = 0
        return max_len

    # ---- life cycle -----------------------------------------------------------------------
    def _fail_during_startup(self, reason: str) -> None:
        if not hasattr(self, "schedulers"):
            # Rank 0 may be blocked in a rendezvous or collective that will never complete.
            logger.error("%s during startup; exiting", reason)
            self.workers.kill()
            os._exit(1)

    def _on_worker_failure(self, reason: str) -> None:
        self.dead_reason = reason
        for callback in list(self._failure_callbacks):
            callback(reason)

    def add_failure_callback(self, callback) -> None:
        """`callback(reason)` runs (on a watchdog thread) when a tensor-parallel rank dies."""
        self._failure_callbacks.append(callback)
        if self.dead_reason is not None:
            callback(self.dead_reason)

    def shutdown(self) -> None:
        """Stop the other ranks (tensor / pipeline parallelism) and leave the process group."""
        gc.unfreeze()  # this engine's objects back under the collector (freeze_startup_heap)
        if self.structured_output is not None:
            self.structured_output.shutdown()
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        if self.dead_reason is None:
            try:
                for in_flight in filter(None, self.in_flight):  # pipelined steps still in flight
                    self.runner.pipeline.wait(in_flight.launched)
                self.runner.shutdown()
            except Exception:  # a rank already gone: nothing to tell it
                pass
        workers.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        set_parallel_state(0, 1)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """A generating request (SamplingParams), or on a pooling model an embedding request
        (PoolingParams): its prompt is run once and pooled, and its one output is the embedding.
        `lora_request`: the LoRA adapter it runs with (--enable-lora)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduling_policy != "priority":  # vLLM's message
            raise InvalidRequestError(
                f"Got priority {priority} but Priority scheduling is not enabled."
            )
        if lora_request is not None and (
            isinstance(sampling_params, PoolingParams) or self.pooler is not None
        ):
            raise InvalidRequestError(
                "LoRA adapters are served for generating models only, not --runner pooling"
            )
        if isinstance(sampling_params, PoolingParams) or self.pooler is not None:
            self._add_pooling_request(request_id, prompt, sampling_params, priority, arrival_time)
            return
        prompt_text, token_ids = self._tokenize(prompt)
        self._check_prompt_tokens(token_ids)
        params = self._check_params(sampling_params, self.model_config.vocab_size)
        self._check_lengths(len(token_ids), params)
        grammar = self.prepare_structured_output(params)
        if grammar is not None and grammar.done() and grammar.exception() is not None:
            raise grammar.exception()
        if lora_request is not None:
            self.add_lora(lora_request)
        seqs = self._make_sequences(request_id, token_ids, params, priority, grammar)
        for seq in seqs:
            seq.lora_id = lora_request.lora_int_id if lora_request is not None else 0
        metrics = RequestMetrics(
            arrival_time=arrival_time if arrival_time is not None else time.time()
        )
        self.requests[request_id] = Request(
            request_id,
            prompt_text,
            list(token_ids),
            params,
            seqs,
            metrics,
            output_kind=output_kind,
            holdback=stop_string_holdback(params),
            lora_request=lora_request,
        )
        if grammar is not None and not grammar.done():
            self._compiling[request_id] = grammar
        virtual_engine = min(
            range(len(self.schedulers)), key=lambda v: self.schedulers[v].num_unfinished
        )
        for seq in seqs:
            seq.virtual_engine = virtual_engine
            self.schedulers[virtual_engine].add(seq)

    # ---- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> None:
        """Make every rank hold the adapter (read from lora.lora_path the first time its id is
        seen; a bad adapter is an InvalidRequestError naming what is wrong). vLLM's add_lora."""
        if not self.config.enable_lora:
            raise InvalidRequestError(
                "LoRA is not enabled: start the engine with --enable-lora "
                "(LLM(..., enable_lora=True))"
            )
        if self.runner.lora is None:
            raise InvalidRequestError(
                "LoRA adapters are served for generating models only, not --runner pooling"
            )
        known = self.loras.get(lora.lora_int_id)
        if known is not None:
            if (
                Path(known.lora_path).expanduser().resolve()
                != Path(lora.lora_path).expanduser().resolve()
            ):
                raise InvalidRequestError(
                    f"LoRA id {lora.lora_int_id} is already loaded from {known.lora_path!r}; "
                    f"another adapter ({lora.lora_path!r}) needs another lora_int_id"
                )
            self.loras.move_to_end(lora.lora_int_id)
            self._lora_removals.discard(lora.lora_int_id)
            self._trim_loras(lora.lora_int_id, 0)
            return
        self._trim_loras(lora.lora_int_id, 1)
        try:
            self.runner.add_lora(lora.lora_int_id, lora.lora_path)
        except LoRAError as error:
            raise InvalidRequestError(str(error)) from None
        self.loras[lora.lora_int_id] = lora

    def _trim_loras(self, keep: int, room: int) -> None:
        """Drop the least recently used adapters no request runs with (never `keep`) until
        `room` more fit in --max-cpu-loras."""
        capacity = self.config.max_cpu_loras or self.config.max_loras
        in_use = self._loras_in_use() | {keep}
        victims = [i for i in self.loras if i not in in_use]
        for victim in victims[: max(0, len(self.loras) + room - capacity)]:
            self._drop_lora(victim)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora); False when no rank holds it. Requests still
        running with it finish with it: the ranks drop it after the last one."""
        if lora_int_id not in self.loras or lora_int_id in self._lora_removals:
            return False
        if lora_int_id in self._loras_in_use():
            self._lora_removals.add(lora_int_id)
        else:
            self._drop_lora(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras) - self._lora_removals

    def _loras_in_use(self) -> set[int]:
        return {
            seq.lora_id for request in self.requests.values() for seq in request.seqs if seq.lora_id
        }

    def _drop_lora(self, lora_int_id: int) -> None:
        del self.loras[lora_int_id]
        self._lora_removals.discard(lora_int_id)
        self.runner.remove_lora(lora_int_id)

    def _finish_lora_removals(self) -> None:
        for lora_int_id in self._lora_removals - self._loras_in_use():
            self._drop_lora(lora_int_id)

    def _add_pooling_request(
        self, request_id: str, prompt: PromptType, params, priority: int, arrival_time: float | None
    ) -> None:
        if self.pooler is None:
            raise InvalidRequestError(
                "This model generates text; it does not embed (start a pooling model, "
                "--runner pooling, to embed)."
            )
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                "This model is served as a pooling model (--runner pooling): it embeds, "
                "it does not generate text."
            )
        try:
            self.pooler.check_dimensions(params.dimensions, self.model_config.hidden_size)
        except ValueError as error:
            raise InvalidRequestError(str(error), "dimensions") from None
        prompt_text, token_ids = self._tokenize(prompt)
        self._check_prompt_tokens(token_ids)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(token_ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input.",
                "input_tokens",
            )
        placeholder = SamplingParams(max_tokens=1)  # what the scheduler and outputs read
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            0,
            list(token_ids),
            len(token_ids),
            placeholder,
            priority,
            next(self._arrivals),
        )
        seq.pooling = PoolingState(self.pooler, params)
        metrics = RequestMetrics(
            arrival_time=arrival_time if arrival_time is not None else time.time()
        )
        self.requests[request_id] = Request(
            request_id, prompt_text, list(token_ids), placeholder, [seq], metrics
        )
        self.schedulers[0].add(seq)

    def _check_prompt_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        vocab = self.model_config.vocab_size
        for bad in (min(token_ids), max(token_ids)):  # vLLM's message
            if not 0 <= bad < vocab:
                raise InvalidRequestError(f"Token id {bad} is out of vocabulary", "prompt")

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> None:
        """The prompt and what it may generate fit in the context (vLLM's messages)."""
        max_len = self.max_model_len
        if num_prompt >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request "
                f"has {num_prompt} input tokens. Please reduce the length of the input messages.",
                "input_tokens",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > max_len:
            raise InvalidRequestError(  # vLLM blames the input too
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{max_len} tokens and your request has {num_prompt} input tokens "
                f"({params.max_tokens} > {max_len} - {num_prompt}).",
                "input_tokens",
            )
        if params.max_tokens is None and params.min_tokens > max_len - num_prompt:
            raise InvalidRequestError(
                f"min_tokens must be <= {max_len - num_prompt} (the context left after "
                f"{num_prompt} prompt tokens), got {params.min_tokens}"
            )

    def _make_sequences(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        grammar: concurrent.futures.Future | None,
    ) -> list[Sequence]:
        """The request's n sequences, each with its seeded generator and grammar matcher; the
        first scores the prompt when prompt logprobs are asked for."""
        arrival = next(self._arrivals)
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                next(self._seq_ids),
                request_id,
                index,
                list(token_ids),
                len(token_ids),
                params,
                priority,
                arrival,
            )
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(
                    params.seed + index
                )
            if grammar is not None:  # one matcher per sequence, one compiled grammar per request
                seq.grammar = SequenceGrammar(grammar)
            seqs.append(seq)
        if (
            params.prompt_logprobs is not None
        ):  # once per request: the first sequence scores the prompt
            seqs[0].prompt_logprobs = [None]
        return seqs

    def prepare_structured_output(self, params: SamplingParams) -> concurrent.futures.Future | None:
        """Start compiling a constrained request's grammar (or find it in the cache); None for
        a free request. The future raises InvalidRequestError for a bad schema, regex or
        grammar. Callable from any thread: the server awaits it before adding the request."""
        if params.structured_outputs is None:
            return None
        with self._structured_output_lock:
            if self.structured_output is None:
                self.structured_output = StructuredOutputManager(
                    self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
                )
        return self.structured_output.compile(params.structured_outputs)

    def release_structured_output(self, future: concurrent.futures.Future) -> None:
        """A caller of prepare_structured_output stopped waiting for `future` (a deadline, a
        client gone): with no one else waiting, a compile not started yet is dropped."""
        self.structured_output.release(future)

    def _fail_compiled_grammars(self) -> None:
        """Requests added before their grammar compiled: a failed compile fails the request
        (StepError, as a failed step would); the rest wait in the queue."""
        done = [rid for rid, future in self._compiling.items() if future.done()]
        failed = [rid for rid in done if self._compiling[rid].exception() is not None]
        errors = [self._compiling.pop(rid).exception() for rid in done]
        if failed:
            error = next(e for e in errors if e is not None)
            raise StepError(failed, error, self.abort_request(failed))

    def _check_params(self, params: SamplingParams, vocab: int) -> SamplingParams:
        """Bounds that depend on the engine (SamplingParams checked the rest when it was made),
        with vLLM's messages. Returns the params with -1 (all) logprobs resolved to the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        params._validate()  # fields may have been assigned after construction
        if params.n > self.config.max_n_sequences:
            raise InvalidRequestError(
                f"n must be <= {self.config.max_n_sequences} (max_n_sequences), got {params.n}", "n"
            )
        max_logprobs = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name, what in (("logprobs", "sample logprobs"), ("prompt_logprobs", "prompt logprobs")):
            value = getattr(params, name)
            if value is not None and (vocab if value == -1 else value) > max_logprobs:
                raise InvalidRequestError(
                    f"Requested {what} of {vocab if value == -1 else value}, which is greater than "
                    f"max allowed: {max_logprobs}",
                    name,
                )
        for name, token_ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
        ):
            invalid = [t for t in token_ids if not 0 <= t < vocab]
            if invalid:
                raise InvalidRequestError(
                    f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}",
                    name,
                )
        if params.logprobs == -1 or params.prompt_logprobs == -1:
            params = params.clone()
            params.logprobs = vocab if params.logprobs == -1 else params.logprobs
            params.prompt_logprobs = (
                vocab if params.prompt_logprobs == -1 else params.prompt_logprobs
            )
        return params

    def _max_prompt_chars(self) -> int:
        """No text longer than this fits in the context: each token covers at most as many
        characters as the longest vocabulary entry. Checked before tokenizing, which is slow."""
        backend = self.tokenizer.backend
        longest = max(
            (len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1
        )
        return self.max_model_len * max(longest, 1)

    def check_prompt_text(self, text: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {len(text)} characters of input, more than any {self.max_model_len} "
                f"tokens can hold. Please reduce the length of the input messages.",
                "input_tokens",
            )

    def _encode(self, text: str) -> list[int]:
        self.check_prompt_text(text)
        return self.tokenizer.encode(text)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        prompt = parse_prompt(prompt)
        if isinstance(prompt, TextPrompt):
            return prompt.prompt, self._encode(prompt.prompt)
        return prompt.prompt, prompt.prompt_token_ids

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Drop unfinished requests; returns their final outputs, cumulative whatever the
        request's output kind (for metrics)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        for rid in ids:
            request = self.requests.pop(rid, None)
            self._compiling.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if self.proposer is not None:
                    self.proposer.drop(seq)
                if not seq.is_finished:
                    self.schedulers[seq.virtual_engine].remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = seq.finish_reason or "abort"
            request.finished = True
            request.metrics.finished_time = time.time()
            aborted.append(self.output_processor.make_output(request, RequestOutputKind.CUMULATIVE))
        return aborted

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (call between steps). The cached KV lives on the device
        pool, its index here only: forgetting the index is enough, for every rank."""
        for manager in self.block_managers:
            manager.reset_prefix_cache()
        return True

    @property
    def device(self) -> torch.device:
        """Where the model runs (rank 0's device)."""
        return self.runner.device

    @property
    def generation_tokens_total(self) -> int:
        return self.output_processor.generation_tokens_total

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or any(self.in_flight)

    def stats(self) -> EngineStats:
        schedulers, managers = self.schedulers, self.block_managers  # one each unless pipelined
        num_blocks = sum(m.num_blocks for m in managers)
        return EngineStats(
            num_running=len({s.request_id for x in schedulers for s in x.running}),
            num_waiting=len({s.request_id for x in schedulers for s in x.waiting}),
            kv_cache_usage=sum(m.num_used_blocks for m in managers) / num_blocks,
            num_preemptions_total=sum(x.num_preemptions for x in schedulers),
            prefix_cache_queries_total=sum(m.prefix_cache_queries for m in managers),
            prefix_cache_hits_total=sum(m.prefix_cache_hits for m in managers),
            prompt_tokens_total=self.output_processor.prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            prompt_tokens_cached_total=self.output_processor.prompt_tokens_cached_total,
            block_size=self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            num_swapped=len({s.request_id for x in schedulers for s in x.swapped}),
            num_swap_outs_total=sum(x.num_swap_outs for x in schedulers),
            cpu_cache_usage=self.host_pool.usage if self.host_pool is not None else 0.0,
            spec_decoding=self.spec_stats.snapshot() if self.spec_stats is not None else None,
            lora=self._lora_stats() if self.config.enable_lora else None,
        )

    def _lora_stats(self) -> tuple[int, list[str], list[str]]:
        def names(queue: str) -> list[str]:
            ids = {s.lora_id for x in self.schedulers for s in getattr(x, queue) if s.lora_id}
            return sorted(self.loras[i].lora_name for i in ids if i in self.loras)

        return self.config.max_loras, names("waiting"), names("running")

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        if self._compiling:
            self._fail_compiled_grammars()
        if self._lora_removals:
            self._finish_lora_removals()
        if self.runner.pipeline is not None:
            return self._pipeline_step()
        (scheduler,) = self.schedulers  # without pipeline parallelism there is one virtual engine
        if self.proposer is not None:
            self._propose(scheduler.running)
        scheduler_output = scheduler.schedule()
        if (
            scheduler_output.swap_plan
        ):  # before the forward pass that may overwrite the freed blocks
            self.runner.swap(scheduler_output.swap_plan)
        if not scheduler_output.scheduled_seqs:
            if self._compiling:  # only grammars to wait for: not a busy loop
                concurrent.futures.wait(
                    list(self._compiling.values()),
                    timeout=0.1,
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
            return []
        try:
            return self._run_step(scheduler_output)
        except Exception as error:
            # With other ranks the step's collectives may be half done: only a restart recovers.
            if self.dead_reason is not None or self.workers is not None or _is_device_fault(error):
                raise
            request_ids = scheduler_output.request_ids
            logger.exception(
                "a step failed; failing its %d request(s), the engine goes on", len(request_ids)
            )
            outputs = self.abort_request(request_ids)
            raise StepError(request_ids, error, outputs) from error

    def _pipeline_step(self) -> list[RequestOutput]:
        """Pipeline parallelism: one virtual engine per call, in turn. Its batch in flight is
        finished first (the last stage's logits, sampled here, since its next batch depends on
        them), then its next batch is launched into stage 0 without waiting: the other virtual
        engines' batches are in the later stages meanwhile. A failure here is fatal, as with
        tensor parallelism (other ranks may be mid-step)."""
        virtual_engine = self._next_virtual_engine
        self._next_virtual_engine = (virtual_engine + 1) % len(self.schedulers)
        outputs: list[RequestOutput] = []
        in_flight, self.in_flight[virtual_engine] = self.in_flight[virtual_engine], None
        if in_flight is not None:
            received = self.runner.pipeline.wait(in_flight.launched)
            if in_flight.launched.tokens_only:
                result = SamplerOutput(received, None, None, None)
                outputs = self._finish_step(
                    in_flight.scheduler_output,
                    in_flight.model_input,
                    None,
                    in_flight.started,
                    result=result,
                )
            else:
                outputs = self._finish_step(
                    in_flight.scheduler_output,
                    in_flight.model_input,
                    received,
                    in_flight.started,
                    sampling=in_flight.sampling,
                )
        scheduler_output = self.schedulers[virtual_engine].schedule()
        if scheduler_output.scheduled_seqs:  # (no swap plan: swapping is off with pipelines)
            started = time.time()
            # The shares of the device pool lie one after another, in virtual engine order.
            offset = sum(manager.num_blocks for manager in self.block_managers[:virtual_engine])
            model_input = self.runner.prepare(scheduler_output.scheduled_seqs, block_offset=offset)
            # Built now (nothing it reads changes while in flight): a plain greedy step only
            # needs the last stage's argmax, not its logits (a constrained one needs them).
            sampling = self._sampling_batch(model_input)
            tokens_only = (
                sampling is not None
                and sampling.plain_greedy
                and not model_input.prompt_logprob_seqs
            )
            launched = self.runner.pipeline.launch(model_input, virtual_engine, tokens_only)
            self.in_flight[virtual_engine] = InFlightStep(
                scheduler_output, model_input, launched, started, sampling
            )
        return outputs

    def _run_step(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        now = time.time()
        model_input = self.runner.prepare(scheduler_output.scheduled_seqs)
        logits = self.runner.forward(model_input)  # a pooling model's: the hidden states
        if self.pooler is not None:
            return self._finish_pooling_step(scheduler_output, logits, now)
        return self._finish_step(scheduler_output, model_input, logits, now)

    def _finish_pooling_step(
        self, scheduler_output: SchedulerOutput, hidden: torch.Tensor, now: float
    ) -> list[RequestOutput]:
        """Each scheduled prompt chunk's rows (in schedule order: every row of a pooling step is
        a prompt row) into its sequence's pooling; a prompt done is an embedding, its request
        finished and its blocks freed."""
        outputs, row = [], 0
        for item in scheduler_output.scheduled_seqs:
            seq, count = item.seq, item.num_new_tokens
            request = self.requests[seq.request_id]
            request.record_scheduled(seq, now)
            seq.pooling.add(hidden[row : row + count])
            row += count
            seq.num_computed_tokens += count
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            self.output_processor.count_prompt(request, seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
            request.record_tokens(now)
            self.schedulers[seq.virtual_engine].remove(seq)
            del self.requests[seq.request_id]
            outputs.append(
                RequestOutput(
                    request.request_id,
                    request.prompt,
                    request.prompt_token_ids,
                    [],
                    True,
                    request.metrics,
                    embedding=seq.pooling.result().tolist(),
                )
            )
        return outputs

    def _after_verification(self, seqs: list[Sequence], result: SamplerOutput | None) -> None:
        """Verified sequences keep the KV of their kept proposals (every token but the one
        emitted last is computed now), give back the blocks of rejected ones, and register
        only blocks of kept tokens in the prefix cache."""
        for seq, emitted in zip(seqs, result.spec if result is not None and result.spec else ()):
            self.spec_stats.observe(len(seq.spec_token_ids), len(emitted) - 1)
        for seq in seqs:
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1
                manager = self.block_managers[seq.virtual_engine]
                manager.trim(seq)
                manager.register_full_blocks(seq)
            seq.clear_proposal()

    def _propose(self, running: list[Sequence]) -> None:
        """Speculative decoding: the tokens each running decode proposes for this step (the
        scheduler cuts them to its budget). None for a sequence whose next rows the sampler
        would process differently from one position to the next (penalties counting the
        proposals, min_tokens still masking EOS), or that still scores its prompt. A constrained
        sequence's proposal is cut where its grammar refuses it (engine/spec_decode/grammar.py)."""
        wanted = []
        for seq in running:
            params = seq.params
            seq.clear_proposal()
            # Room for the proposal and the token verification adds after it.
            limit = min(self.proposer.k, self.max_model_len - seq.num_tokens - 1)
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
            if (
                limit <= 0
                or seq.num_computed_tokens != seq.num_tokens - 1
                or seq.num_computed_tokens < seq.num_prompt_tokens
                or seq.needs_prompt_logprobs
                or seq.num_output_tokens < params.min_tokens
                or params.repetition_penalty != 1.0
                or params.frequency_penalty
                or params.presence_penalty
            ):
                continue
            wanted.append((seq, limit))
        self.proposer.propose_for(wanted, self._rows_batch, self.model_config.vocab_size)

    def _rows_batch(self, seqs: list[Sequence]) -> SamplingBatch | None:
        """The sampler's batch for these rows (one per sequence given)."""
        return build_sampling_batch(
            seqs,
            self.runner.device,
            self.model_config.vocab_size,
            self.eos_token_ids,
            self.generator,
        )

    def _sampling_batch(self, model_input: ModelInput) -> SamplingBatch | None:
        """The step's SamplingBatch, with the bitmask of its constrained rows. Their matchers
        only advance when this step's tokens are appended, so it may be built at launch."""
        sampling = self._rows_batch(model_input.sampling_seqs)
        if sampling is not None and self.structured_output is not None:
            self.structured_output.constrain(
                sampling, model_input.sampling_seqs, self.runner.device
            )
        return sampling

    def _finish_step(
        self,
        scheduler_output: SchedulerOutput,
        model_input: ModelInput,
        logits: torch.Tensor | None,
        now: float,
        sampling: SamplingBatch | None = None,
        result: SamplerOutput | None = None,
    ) -> list[RequestOutput]:
        """Sample (unless `result` holds the tokens already) and append the tokens. With pipeline
        parallelism a request may have been aborted while its step was in flight: its sequences
        are skipped."""
        if result is None:
            if sampling is None:
                # On CUDA the forward pass is only queued: the sampling tensors are built meanwhile.
                sampling = self._sampling_batch(model_input)
            # Verification rows: a sequence's k + 1 rows each processed as its plain decode row.
            spec_rows = [
                seq for seq in model_input.spec_seqs for _ in range(len(seq.spec_token_ids) + 1)
            ]
            result = self.runner.sample(logits, sampling, model_input, self._rows_batch(spec_rows))
        for item in scheduler_output.scheduled_seqs:
            seq = item.seq
            if seq.is_finished:  # aborted while in flight
                continue
            self.requests[seq.request_id].record_scheduled(seq, now)
            if seq.spec_token_ids:  # how many of its tokens count is known once verified (below)
                continue
            seq.num_computed_tokens += item.num_new_tokens
            # Its own virtual engine's table: block ids are only meaningful in their own share.
            self.block_managers[seq.virtual_engine].register_full_blocks(seq)
        processed = self.output_processor.process(
            self.requests,
            model_input.sampling_seqs,
            result,
            model_input.prompt_logprob_seqs,
            model_input.spec_seqs,
        )
        if model_input.spec_seqs:
            self._after_verification(model_input.spec_seqs, result)
        for seq in processed.finished_seqs:  # freed by the scheduler that holds them
            self.schedulers[seq.virtual_engine].remove(seq)
            if self.proposer is not None:
                self.proposer.drop(seq)
        for request in processed.finished_requests:
            del self.requests[request.request_id]
        return processed.outputs
