"""The driver's side of pipeline parallelism (--pipeline-parallel-size > 1): one virtual
engine (a scheduler with its share of the KV pool) per step, in turn, each with at most one
batch in flight while the others' batches are in the later stages. Each stage's part of a step
is engine/pipeline_stage.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.encoder_step import NoKVBlocks
from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.pipeline_stage import LaunchedStep
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.seq_inputs import step_inputs
from nanoserve.engine.swap import HostBlockPool
from nanoserve.layers.sampler import SamplerOutput, SamplingBatch
from nanoserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightStep:
    """A pipelined step launched and not yet sampled (one per virtual engine at most)."""

    scheduler_output: SchedulerOutput
    model_input: ModelInput
    launched: LaunchedStep
    started: float
    sampling: SamplingBatch | None = None  # built at launch


class FinishStep(Protocol):
    """The engine's end of a step: sample (unless `result` holds the tokens) and collect."""

    def __call__(
        self,
        scheduler_output: SchedulerOutput,
        model_input: ModelInput,
        logits: torch.Tensor | None,
        now: float,
        sampling: SamplingBatch | None = None,
        result: SamplerOutput | None = None,
    ) -> list[RequestOutput]: ...


class PipelineDriver:
    def __init__(
        self,
        runner: ModelRunner,
        schedulers: list[Scheduler],
        block_managers: list[BlockManager],
        sampling_batch: Callable[[ModelInput], SamplingBatch | None],
        finish_step: FinishStep,
    ) -> None:
        assert runner.pipeline is not None
        self.runner, self.stage = runner, runner.pipeline
        self.schedulers, self.block_managers = schedulers, block_managers
        self.sampling_batch, self.finish_step = sampling_batch, finish_step
        self.in_flight: list[InFlightStep | None] = [None] * len(schedulers)
        self.next_virtual_engine = 0

    def step(self) -> list[RequestOutput]:
        """Pipeline parallelism: one virtual engine per call, in turn. Its batch in flight is
        finished first (the last stage's logits, sampled here, since its next batch depends on
        them), then its next batch is launched into stage 0 without waiting: the other virtual
        engines' batches are in the later stages meanwhile. A failure here is fatal, as with
        tensor parallelism (other ranks may be mid-step)."""
        virtual_engine = self.next_virtual_engine
        self.next_virtual_engine = (virtual_engine + 1) % len(self.schedulers)
        outputs: list[RequestOutput] = []
        in_flight, self.in_flight[virtual_engine] = self.in_flight[virtual_engine], None
        if in_flight is not None:
            received = self.stage.wait(in_flight.launched)
            if in_flight.launched.tokens_only:
                result = SamplerOutput(received, None, None, None)
                outputs = self.finish_step(
                    in_flight.scheduler_output,
                    in_flight.model_input,
                    None,
                    in_flight.started,
                    result=result,
                )
            else:
                outputs = self.finish_step(
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
            inputs = step_inputs(scheduler_output.scheduled_seqs)
            model_input = self.runner.prepare(inputs, block_offset=offset)
            # Built now (nothing it reads changes while in flight): a plain greedy step only
            # needs the last stage's argmax, not its logits (a constrained one needs them).
            sampling = self.sampling_batch(model_input)
            tokens_only = (
                sampling is not None
                and sampling.plain_greedy
                and not model_input.prompt_logprob_inputs
            )
            launched = self.stage.launch(model_input, virtual_engine, tokens_only)
            self.in_flight[virtual_engine] = InFlightStep(
                scheduler_output, model_input, launched, started, sampling
            )
        return outputs

    def wait_all(self) -> None:
        """Wait for the steps still in flight (at shutdown)."""
        for in_flight in filter(None, self.in_flight):
            self.stage.wait(in_flight.launched)


@dataclass(slots=True)
class VirtualEngines:
    """One scheduler per virtual engine (vLLM V0; one unless pipelined), each over its own
    share of the KV pool, so that as many independent batches as stages can be in flight."""

    block_managers: list[BlockManager]
    schedulers: list[Scheduler]
    host_pool: HostBlockPool | None  # --preemption-mode swap
    max_model_len: int  # lowered to what one share holds


def make_virtual_engines(
    config: EngineConfig, runner: ModelRunner, generating: bool, max_len: int
) -> VirtualEngines:
    if runner.encoder:  # whole prompts, no KV blocks (engine/encoder_step.py)
        scheduler = Scheduler(
            NoKVBlocks(config.block_size),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            whole_prompts=True,
        )
        return VirtualEngines([scheduler.block_manager], [scheduler], None, max_len)
    num_virtual_engines = config.pipeline_parallel_size
    blocks_each = runner.num_kv_blocks // num_virtual_engines
    if blocks_each < 1:
        raise ValueError(
            "the KV cache holds fewer blocks than pipeline stages; raise --kv-cache-memory"
        )
    capacity = blocks_each * config.block_size
    if capacity < max_len:
        logger.warning("KV cache holds %d tokens; max_model_len lowered from %d", capacity, max_len)
        max_len = capacity
    host_pool = HostBlockPool(runner.num_swap_blocks) if config.preemption_mode == "swap" else None
    # Pooling reads every prompt row's hidden state: nothing may come from the prefix cache.
    prefix_caching = config.enable_prefix_caching and generating
    block_managers = [
        BlockManager(blocks_each, config.block_size, prefix_caching)
        for _ in range(num_virtual_engines)
    ]
    schedulers = [
        Scheduler(
            manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            host_pool,
            virtual_engine,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_model_len=max_len,
        )
        for virtual_engine, manager in enumerate(block_managers)
    ]
    return VirtualEngines(block_managers, schedulers, host_pool, max_len)
