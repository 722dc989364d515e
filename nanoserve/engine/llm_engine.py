"""LLMEngine: add_request / abort_request / step. The offline LLM and the async server both
drive exactly this. The core schedules, runs and collects; beside it sit the input processor
(checks, tokenizing, a request's sequences), the LoRA registry (lora/registry.py), the other
ranks (ranks.py), pipeline stepping (pipeline_driver.py), speculation, pooling and stats."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import NoReturn

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.async_scheduling import AsyncScheduling
from nanoserve.engine.input_processor import InputProcessor
from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.pipeline_driver import InFlightStep, PipelineDriver, make_virtual_engines
from nanoserve.engine.pooling_step import finish_pooling_step
from nanoserve.engine.ranks import OtherRanks
from nanoserve.engine.request import Request
from nanoserve.engine.sampling_batch import SamplingBatches
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.seq_inputs import step_inputs, step_seqs
from nanoserve.engine.sequence import SequenceStatus
from nanoserve.engine.speculation import Speculation
from nanoserve.engine.startup import freeze_startup_heap, open_model
from nanoserve.engine.stats import EngineStats, collect_stats
from nanoserve.engine.structured_output import GrammarCompiles, StructuredOutputManager
from nanoserve.engine.worker import plan_topology
from nanoserve.errors import InvalidRequestError, StepError, is_device_fault
from nanoserve.inputs import PromptType
from nanoserve.layers.sampler import SamplerOutput, SamplingBatch
from nanoserve.lora.registry import LoRARegistry
from nanoserve.lora.request import LoRARequest
from nanoserve.models.gguf.model import check_gguf_file, find_gguf_file
from nanoserve.outputs import RequestOutput, RequestOutputKind, StepOutput
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model = open_model(config)
        self.model_dir, self.model_config = model.model_dir, model.model_config
        self.tokenizer, self.pooler = model.tokenizer, model.pooler  # pooler None: generates
        self.pooling_tasks, self.default_task = model.pooling_tasks, model.default_task
        self.model_path = str(config.model or self.model_dir)
        # vLLM names a model by its --model argument; the default model by its own name.
        self.served_model_name = config.served_model_name or config.model or self.model_dir.name
        torch.manual_seed(config.seed)
        self.topology = plan_topology(config, self.model_config)
        if find_gguf_file(self.model_dir) is not None:
            check_gguf_file(self.model_dir, config.tensor_parallel_size)
        self.ranks = OtherRanks()  # tensor / pipeline parallelism's other ranks
        device = None
        if self.topology.world_size > 1:
            device = self.ranks.start(config, self.topology, str(self.model_dir))
            self.topology = self.ranks.workers.topology  # with its rendezvous made concrete
        self.runner = ModelRunner(config, self.model_config, self.model_dir, device=device)
        engines = make_virtual_engines(
            config, self.runner, self.pooler is None, model.max_model_len
        )
        self.block_managers, self.schedulers = engines.block_managers, engines.schedulers
        self.host_pool, self.max_model_len = engines.host_pool, engines.max_model_len
        self.ranks.now_serving()
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        self.inputs = InputProcessor(config, model, self.max_model_len, self.runner.device)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.max_model_len
        )
        # Structured outputs: the manager is made on the first constrained request.
        self.grammars = GrammarCompiles(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        self.sampling = SamplingBatches(
            self.runner.device,
            self.model_config.vocab_size,
            self.eos_token_ids,
            self.generator,
            self.grammars,
        )
        self.speculation = None  # --speculative-config: proposals verified each step
        if config.speculative is not None:
            self.speculation = Speculation(
                config,
                self.model_config,
                self.runner,
                self.max_model_len,
                self.sampling.rows,
                self.block_managers,
            )
        self.pipeline: PipelineDriver | None = None
        if self.runner.pipeline is not None:
            self.pipeline = PipelineDriver(
                self.runner,
                self.schedulers,
                self.block_managers,
                self.sampling.step,
                self._finish_step,
            )
        # LoRA (--enable-lora): the adapters every rank holds (lora/registry.py).
        self.lora_registry = LoRARegistry(
            self.runner,
            config.enable_lora,
            config.max_cpu_loras or config.max_loras,
            self._loras_in_use,
        )
        self.async_scheduling = AsyncScheduling.of(self) if config.async_scheduling else None
        freeze_startup_heap()

    @property
    def is_pooling(self) -> bool:
        return self.pooler is not None

    # ---- life cycle -----------------------------------------------------------------------
    def add_failure_callback(self, callback) -> None:
        """`callback(reason)` runs (on a watchdog thread) when a tensor-parallel rank dies."""
        self.ranks.add_failure_callback(callback)

    def shutdown(self) -> None:
        """Stop the other ranks (tensor / pipeline parallelism) and leave the process group."""
        gc.unfreeze()  # this engine's objects back under the collector (freeze_startup_heap)
        self.grammars.shutdown()
        self.ranks.stop(self._stop_ranks)

    def _stop_ranks(self) -> None:
        if self.pipeline is not None:  # pipelined steps still in flight
            self.pipeline.wait_all()
        self.runner.shutdown()

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
        self.inputs.check_request(sampling_params, priority, lora_request)
        if isinstance(sampling_params, PoolingParams) or self.pooler is not None:
            request = self.inputs.pooling_request(
                request_id, prompt, sampling_params, priority, arrival_time
            )
        else:
            text, token_ids, params, images = self.inputs.generation_inputs(prompt, sampling_params)
            grammar = self.prepare_structured_output(params)
            if grammar is not None and grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
            if lora_request is not None:
                self.lora_registry.add(lora_request)
            request = self.inputs.make_request(
                request_id,
                text,
                token_ids,
                params,
                priority,
                arrival_time,
                output_kind,
                lora_request,
                grammar,
                images,
            )
            if grammar is not None and not grammar.done():
                self.grammars.pending[request_id] = grammar
        self.requests[request_id] = request
        # The virtual engine with the fewest requests (there is one unless pipelined).
        virtual_engine = min(
            range(len(self.schedulers)), key=lambda v: self.schedulers[v].num_unfinished
        )
        for seq in request.seqs:
            seq.virtual_engine = virtual_engine
            self.schedulers[virtual_engine].add(seq)

    # ---- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> None:
        """vLLM's add_lora: every rank holds the adapter (lora/registry.py)."""
        self.lora_registry.add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's remove_lora; False when no rank holds it."""
        return self.lora_registry.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.lora_registry.ids()

    @property
    def loras(self) -> OrderedDict[int, LoRARequest]:
        """The adapters every rank holds, by lora_int_id, least recently used first."""
        return self.lora_registry.adapters

    def _loras_in_use(self) -> set[int]:
        return {
            seq.lora_id for request in self.requests.values() for seq in request.seqs if seq.lora_id
        }

    def prepare_structured_output(self, params: SamplingParams) -> concurrent.futures.Future | None:
        """Start compiling a constrained request's grammar (or find it in the cache); None for
        a free request. The future raises InvalidRequestError for a bad schema, regex or
        grammar. Callable from any thread: the server awaits it before adding the request."""
        return self.grammars.prepare(params)

    def release_structured_output(self, future: concurrent.futures.Future) -> None:
        """A caller of prepare_structured_output stopped waiting for `future` (a deadline, a
        client gone): with no one else waiting, a compile not started yet is dropped."""
        self.grammars.manager.release(future)

    @property
    def structured_output(self) -> StructuredOutputManager | None:
        return self.grammars.manager

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Drop unfinished requests; returns their final outputs, cumulative whatever the
        request's output kind (for metrics)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        for rid in ids:
            request = self.requests.pop(rid, None)
            self.grammars.pending.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if self.speculation is not None:
                    self.speculation.drop(seq)
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
    def max_prompt_chars(self) -> int:
        """No longer text fits in the context (checked before tokenizing, which is slow)."""
        return self.inputs.max_prompt_chars

    @property
    def device(self) -> torch.device:
        """Where the model runs (rank 0's device)."""
        return self.runner.device

    @property
    def generation_tokens_total(self) -> int:
        return self.output_processor.generation_tokens_total

    @property
    def in_flight(self) -> list[InFlightStep | None]:
        """Pipelined steps launched and not yet sampled, by virtual engine."""
        return self.pipeline.in_flight if self.pipeline is not None else []

    def has_unfinished_requests(self) -> bool:
        overlapped = self.async_scheduling is not None and self.async_scheduling.in_flight
        return bool(self.requests) or any(self.in_flight) or bool(overlapped)

    def stats(self) -> EngineStats:
        lora_registry = self.lora_registry if self.config.enable_lora else None
        return collect_stats(
            self.schedulers,
            self.block_managers,
            self.output_processor,
            self.config,
            self.host_pool,
            self.speculation.stats if self.speculation is not None else None,
            lora_registry,
        )

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self.ranks.dead_reason is not None:
            raise RuntimeError(self.ranks.dead_reason)
        if self.grammars.pending:
            # Requests added before their grammar compiled: a failed compile fails the request
            # (StepError, as a failed step would); the rest wait in the queue.
            failed, error = self.grammars.take_failed()
            if failed:
                raise StepError(failed, error, self.abort_request(failed))
        self.lora_registry.finish_removals()
        if self.pipeline is not None:
            return self.pipeline.step()
        if self.async_scheduling is not None:
            return self.async_scheduling.step(self._fail_step)
        (scheduler,) = self.schedulers  # without pipeline parallelism there is one virtual engine
        if self.speculation is not None:
            self.speculation.propose(scheduler.running)
        scheduler_output = scheduler.schedule()
        if scheduler_output.swap_plan:  # before the forward pass that may overwrite the blocks
            self.runner.swap(scheduler_output.swap_plan)
        if not scheduler_output.scheduled_seqs:
            if self.grammars.pending:
                self.grammars.wait_for_one(timeout=0.1)
            return []
        try:
            return self._run_step(scheduler_output)
        except Exception as error:
            self._fail_step(error, scheduler_output.request_ids)

    def _fail_step(self, error: Exception, request_ids: list[str]) -> NoReturn:
        """A failed step fails its requests (StepError) and the engine goes on. With other ranks
        the step's collectives may be half done, as after a device fault: only a restart helps."""
        if self.ranks.dead_reason or self.ranks.workers is not None or is_device_fault(error):
            raise error
        logger.exception("a step failed; failing its %d request(s); going on", len(request_ids))
        raise StepError(request_ids, error, self.abort_request(request_ids)) from error

    def _run_step(self, scheduler_output: SchedulerOutput) -> list[StepOutput]:
        now = time.time()
        model_input = self.runner.prepare(step_inputs(scheduler_output.scheduled_seqs))
        logits = self.runner.forward(model_input)  # a pooling model's: the hidden states
        if self.pooler is not None:
            return finish_pooling_step(
                scheduler_output,
                logits,
                now,
                self.requests,
                self.schedulers,
                self.output_processor,
                self.runner.classifier_head,
            )
        return self._finish_step(scheduler_output, model_input, logits, now)

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
                sampling = self.sampling.step(model_input)
            # Verification rows: a sequence's k + 1 rows each processed as its plain decode row.
            spec_rows = [
                item.sampling
                for item in model_input.spec_inputs
                for _ in range(len(item.proposal) + 1)
            ]
            result = self.runner.sample(
                logits, sampling, model_input, self.sampling.rows(spec_rows)
            )
        for item in scheduler_output.scheduled_seqs:
            seq = item.seq
            if seq.is_finished:  # aborted while in flight
                continue
            self.requests[seq.request_id].record_scheduled(seq, now)
            # how many of its tokens count is known once verified (below)
            if seq.proposal.token_ids:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            # Its own virtual engine's table: block ids are only meaningful in their own share.
            self.block_managers[seq.virtual_engine].register_full_blocks(seq)
        # The runner saw frozen inputs: its results go to the live sequences they were made from.
        seqs = step_seqs(scheduler_output, model_input)
        processed = self.output_processor.process(
            self.requests, seqs.sampled, result, seqs.prompt_logprobs, seqs.verified
        )
        if seqs.verified:
            self.speculation.after_verification(seqs.verified, result)
        for seq in processed.finished_seqs:  # freed by the scheduler that holds them
            self.schedulers[seq.virtual_engine].remove(seq)
            if self.speculation is not None:
                self.speculation.drop(seq)
        for request in processed.finished_requests:
            del self.requests[request.request_id]
        return processed.outputs
