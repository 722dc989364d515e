"""--async-scheduling (vLLM's flag; SGLang's overlap scheduler): the host's work for one step runs
while the device computes the next.

Without it a step is: schedule, prepare, run, sample, then collect (the tokens to the host, stop
checks, detokenizing, outputs) while the device waits. With it, `step()` schedules and launches
step N+1 first, while step N may still run on the device, and only then collects step N: on CUDA
the forward pass and the sampler are only queued, so collecting N runs under N+1's kernels, and
N's tokens reach the host by their own copy (an event, not a sync of the stream).

Step N+1 is planned before the host has seen N's tokens. A sequence that samples in N holds a
placeholder for the token (`Sequence.num_output_placeholders`, vLLM's name) that the scheduler
counts as one of its tokens; its decode row in N+1 is PLACEHOLDER_TOKEN (engine/step_input.py),
which the model runner takes from N's sampled tokens on the device (SGLang's future token ids).
A step's tokens count as computed once it is launched; its blocks are registered in the prefix
cache when it is collected, as far as the token ids are known. Each `step()` returns the outputs
of the step it collected.

What it costs: a sequence that N finishes (EOS, a stop token or string, an abort) has one more
token computed in N+1, which is dropped; its blocks are freed when N is collected, and the
device writes them in stream order, before any later step's. A sequence whose tokens (those on
the device included) reach max_tokens or the model's length finishes whatever they are, so it is
not scheduled again (Scheduler._reaches_its_length). Some steps cannot be planned before the step
before is collected: when that step sampled for a constrained sequence (its grammar advances on
the host) or one with penalties (their token counts), or scored prompt rows (the next chunk's
targets follow them), it is collected first (*drained*) and the next step is planned as without
the flag. Speculative decoding and pipeline parallelism are refused (config.py), pooling models
too (nothing is sampled).

On a CPU the device is the same cores and a forward pass runs when it is called: the same code
path runs and is tested, without the gain. `StepLog` records in which order steps were scheduled
and collected (counted, never timed)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from nanoserve.config import ASYNC_POOLING_REFUSAL
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.request import Request
from nanoserve.engine.sampling_batch import SamplingBatches
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.seq_inputs import step_inputs, step_seqs
from nanoserve.engine.sequence import SequenceStatus
from nanoserve.engine.step_input import PreviousTokens
from nanoserve.engine.structured_output import GrammarCompiles
from nanoserve.layers.sampler import LogprobsTensors, SamplerOutput
from nanoserve.outputs import StepOutput
from nanoserve.sampling_params import SamplingParams

# The engine's handler of a failed step: the requests it held are failed (StepError), or the
# error is fatal; it raises either way.
FailStep = Callable[[Exception, list[str]], NoReturn]


@dataclass(slots=True)
class StepLog:
    """What async scheduling did, in order: ("schedule", n) when step n was planned, ("collect",
    n) when its tokens were applied (the latest events only), and counts."""

    events: deque[tuple[str, int]] = field(default_factory=lambda: deque(maxlen=4096))
    num_launched: int = 0
    num_collected: int = 0
    num_overlapped: int = 0  # steps planned while the step before was not collected yet
    num_drained: int = 0  # steps planned after collecting the step before first (see above)


@dataclass(slots=True)
class StepInFlight:
    """A step launched and not yet collected: its sampled tokens on the device, and their copy
    on the host (complete once `copied` has happened; None on a CPU, where it already is)."""

    number: int
    scheduler_output: SchedulerOutput
    model_input: ModelInput
    result: SamplerOutput | None
    host_result: SamplerOutput | None
    copied: torch.cuda.Event | None

    def previous_tokens(self) -> PreviousTokens | None:
        """What the next step's placeholders are taken from."""
        if self.result is None or not self.model_input.sampling_inputs:
            return None
        rows = {item.seq_id: row for row, item in enumerate(self.model_input.sampling_inputs)}
        return PreviousTokens(self.result.token_ids, rows)

    def wait(self) -> SamplerOutput | None:
        if self.copied is not None:
            self.copied.synchronize()  # this step's copy only, not the step launched after it
        return self.host_result


def needs_host_tokens(params: SamplingParams) -> bool:
    """A sequence whose next sampling reads its last token on the host: a grammar's state or
    the penalties' counts."""
    return (
        params.structured_outputs is not None
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def copy_to_host(
    result: SamplerOutput | None, device: torch.device
) -> tuple[SamplerOutput | None, torch.cuda.Event | None]:
    """The sampler's tensors copied to the host without waiting for them (pinned memory; an
    event says when they are there). On a CPU they are there already."""
    if result is None or device.type != "cuda":
        return result, None

    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to("cpu", non_blocking=True)

    prompt = result.prompt_logprobs
    copied = SamplerOutput(
        host(result.token_ids),
        host(result.logprobs),
        host(result.logprob_token_ids),
        host(result.ranks),
        None
        if prompt is None
        else LogprobsTensors(host(prompt.logprobs), host(prompt.token_ids), host(prompt.ranks)),
    )
    event = torch.cuda.Event()
    event.record()
    return copied, event


class AsyncScheduling:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        block_manager: BlockManager,
        sampling: SamplingBatches,
        output_processor: OutputProcessor,
        grammars: GrammarCompiles,
        requests: dict[str, Request],
    ) -> None:
        """`requests`: the engine's table of unfinished requests (the same dict)."""
        self.runner, self.scheduler, self.block_manager = runner, scheduler, block_manager
        self.sampling, self.output_processor, self.grammars = sampling, output_processor, grammars
        self.requests = requests
        self.in_flight: StepInFlight | None = None
        self.log = StepLog()

    @classmethod
    def of(cls, engine) -> AsyncScheduling:
        """For an LLMEngine (engine/llm_engine.py, which imports this module), from its parts."""
        if engine.pooler is not None:  # (a headless checkpoint; config.py refuses the flags)
            raise ValueError(ASYNC_POOLING_REFUSAL)
        (scheduler,), (block_manager,) = engine.schedulers, engine.block_managers
        return cls(
            engine.runner,
            scheduler,
            block_manager,
            engine.sampling,
            engine.output_processor,
            engine.grammars,
            engine.requests,
        )

    def step(self, fail: FailStep) -> list[StepOutput]:
        """Plan and launch the next step, then collect the one in flight: its outputs."""
        in_flight, outputs = self.in_flight, []
        failed = in_flight.scheduler_output.request_ids if in_flight is not None else []
        if in_flight is not None and self._must_drain(in_flight):
            self.log.num_drained += 1
            outputs = self._collect_or_fail(in_flight, fail, failed)
            in_flight = None
        scheduler_output = self.scheduler.schedule()
        launched = None
        try:
            if scheduler_output.swap_plan:  # before the forward pass that may overwrite them
                self.runner.swap(scheduler_output.swap_plan)
            if scheduler_output.scheduled_seqs:
                launched = self._launch(scheduler_output, in_flight)
        except Exception as error:
            self.in_flight = None
            fail(error, list(dict.fromkeys(failed + scheduler_output.request_ids)))
        self.in_flight = launched
        if in_flight is not None:
            if launched is not None:
                failed += launched.scheduler_output.request_ids
            outputs = self._collect_or_fail(in_flight, fail, failed)
        elif launched is None and not outputs and self.grammars.pending:
            self.grammars.wait_for_one(timeout=0.1)  # nothing to run until a grammar compiles
        return outputs

    def _must_drain(self, in_flight: StepInFlight) -> bool:
        """The next step's plan needs what `in_flight` produced on the host (see above)."""
        model_input = in_flight.model_input
        return bool(model_input.prompt_logprob_inputs) or any(
            needs_host_tokens(item.sampling.params) for item in model_input.sampling_inputs
        )

    def _launch(
        self, scheduler_output: SchedulerOutput, previous: StepInFlight | None
    ) -> StepInFlight:
        """Prepare, run and sample the step (queued, on CUDA); its tokens count as computed and
        the sequences that sample hold a placeholder for their new token."""
        log = self.log
        log.num_launched += 1
        number = log.num_launched
        log.events.append(("schedule", number))
        if previous is not None:
            log.num_overlapped += 1
        now = time.time()
        runner = self.runner
        model_input = runner.prepare(
            step_inputs(scheduler_output.scheduled_seqs),
            previous=previous.previous_tokens() if previous is not None else None,
        )
        logits = runner.forward(model_input)
        result = runner.sample(logits, self.sampling.step(model_input), model_input)
        host_result, copied = copy_to_host(result, runner.device)
        for item in scheduler_output.scheduled_seqs:
            seq = item.seq
            self.requests[seq.request_id].record_scheduled(seq, now)
            if item.completes_prompt:  # (read before its tokens count as computed)
                seq.num_output_placeholders += 1
            seq.num_computed_tokens += item.num_new_tokens
        return StepInFlight(number, scheduler_output, model_input, result, host_result, copied)

    def _collect_or_fail(
        self, step: StepInFlight, fail: FailStep, request_ids: list[str]
    ) -> list[StepOutput]:
        """`step` collected; should that fail, so do `request_ids` (those of every step that
        was in flight: none is left)."""
        self.in_flight = None if self.in_flight is step else self.in_flight
        try:
            return self._collect(step)
        except Exception as error:
            self.in_flight = None
            fail(error, list(dict.fromkeys(request_ids)))

    def _collect(self, step: StepInFlight) -> list[StepOutput]:
        """Apply a step's tokens to its sequences (those finished meanwhile skipped): stop
        checks, detokenizing, outputs; the finished ones are freed."""
        self.log.num_collected += 1
        self.log.events.append(("collect", step.number))
        result = step.wait()
        seqs = step_seqs(step.scheduler_output, step.model_input)
        for seq in seqs.sampled:
            seq.num_output_placeholders -= 1
        for item in step.scheduler_output.scheduled_seqs:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING:  # not finished, nor preempted since
                # Computed (or queued before any step that could read them) and known blocks.
                known = min(seq.num_computed_tokens, seq.num_tokens)
                self.block_manager.register_full_blocks(seq, known)
        processed = self.output_processor.process(
            self.requests, seqs.sampled, result, seqs.prompt_logprobs
        )
        for seq in processed.finished_seqs:
            self.scheduler.remove(seq)
        for request in processed.finished_requests:
            del self.requests[request.request_id]
        return processed.outputs
