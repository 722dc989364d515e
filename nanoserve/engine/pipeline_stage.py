"""One pipeline stage's part of a step (pipeline parallelism, --pipeline-parallel-size > 1).

The driver (rank 0, stage 0) broadcasts the step's inputs to every rank as with tensor
parallelism, but without waiting for the broadcast to finish: it runs stage 0's layers, starts
sending (hidden, residual) to stage 1, posts the receive of the step's logits from the last stage
and returns. The engine then launches another virtual engine's batch while the later stages work
on this one: stage k runs micro-batch i while stage k+1 runs i-1. Every rank runs the steps in
the order they were broadcast, so KV writes and reads keep the driver's order without any other
synchronisation; only the sampled tokens make the driver wait (`wait_logits`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.distributed import parallel_state
from nanoserve.distributed.pipeline import (
    irecv_from_last_stage,
    is_first_stage,
    is_last_stage,
    recv_intermediate,
    send_intermediate,
    send_to_driver,
)
from nanoserve.engine.model_input import (
    LoRAHeader,
    StopHeader,
    SwapHeader,
    empty_header,
    pack_step,
    read_header,
    unpack_step,
)
from nanoserve.kernels import greedy_argmax


@dataclass(slots=True)
class LaunchedStep:
    """A step in flight: where its logits, or its greedy token ids, will land (None: no row
    samples this step)."""

    virtual_engine: int
    tokens_only: bool = False
    result: torch.Tensor | None = None
    receive: dist.Work | None = None  # the posted irecv


class PipelineStage:
    def __init__(self, runner):
        self.runner = runner
        self.device = runner.device
        self.pp_size = parallel_state().pp_size
        # Sends and broadcasts started and not yet waited on, with the tensors they read (which
        # must outlive them). Bounded: the oldest are waited on first.
        self._pending: deque = deque()
        self._max_pending = 4 * self.pp_size
        self.steps_launched = 0
        # The driver's figures for benchmarks/pp: bytes it handed to stage 1, seconds it waited
        # for the last stage's results.
        self.handoff_bytes = 0
        self.wait_seconds = 0.0

    def _keep(self, tensor: torch.Tensor, work) -> None:
        self._pending.append((tensor, work))
        while len(self._pending) > self._max_pending:
            self._pending.popleft()[1].wait()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft()[1].wait()

    # ---- the driver ---------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, model_input, virtual_engine: int, tokens_only: bool = False) -> LaunchedStep:
        """`tokens_only`: every row samples plain greedy, so the last stage sends the argmax."""
        header, payload = pack_step(model_input, self.device, virtual_engine, tokens_only)
        self._keep(header, dist.broadcast(header, src=0, async_op=True))
        self._keep(payload, dist.broadcast(payload, src=0, async_op=True))
        self._run_stage(model_input, virtual_engine, None, tokens_only)
        launched = LaunchedStep(virtual_engine, tokens_only)
        num_rows = model_input.logits_indices.numel()
        if num_rows:
            # Posted after the send to stage 1: NCCL runs one pair's sends and receives in order
            # on one stream, and with 2 stages the last stage is that pair's other end.
            shape, dtype = (num_rows,), torch.long
            if not tokens_only:
                shape, dtype = (num_rows, self.runner.model_config.vocab_size), self.runner.dtype
            launched.result, launched.receive = irecv_from_last_stage(
                shape, dtype, self.device, virtual_engine
            )
        self.steps_launched += 1
        return launched

    def wait(self, launched: LaunchedStep) -> torch.Tensor | None:
        """The step's logits, or its token ids when launched `tokens_only`."""
        if launched.receive is not None:
            started = time.perf_counter()
            launched.receive.wait()
            self.wait_seconds += time.perf_counter() - started
        return launched.result

    # ---- every rank -----------------------------------------------------------------------------
    def _run_stage(self, model_input, virtual_engine: int, intermediate, tokens_only: bool) -> None:
        with self.runner.lora_context(model_input):
            out = self.runner.model(
                model_input.input_ids, model_input.positions, model_input.metadata, intermediate
            )
        if not is_last_stage():
            hidden, residual = out
            message, work = send_intermediate(hidden, residual, virtual_engine)
            self.handoff_bytes += message.numel() * message.element_size()
            self._keep(message, work)
            return
        if model_input.logits_indices.numel() == 0:
            return
        logits = self.runner.model.compute_logits(out[model_input.logits_indices])
        if logits is not None:  # this stage's tp rank 0
            self._keep(
                *send_to_driver(greedy_argmax(logits) if tokens_only else logits, virtual_engine)
            )

    @torch.inference_mode()
    def worker_loop(self) -> None:
        """Ranks other than the driver: each broadcast step, this stage's layers, until stop."""
        received = empty_header(self.device)
        hidden_size = self.runner.model_config.hidden_size
        while True:
            dist.broadcast(received, src=0)
            header = read_header(received)
            if isinstance(header, StopHeader):
                self.drain()
                dist.barrier()  # the other half of broadcast_stop's handshake
                return
            if isinstance(header, SwapHeader):
                raise RuntimeError("pipeline stage: unexpected swap command")
            payload = torch.empty(header.payload_size(), dtype=torch.long, device=self.device)
            dist.broadcast(payload, src=0)
            if isinstance(header, LoRAHeader):
                self.runner.lora_message(header, payload)
                continue
            model_input = unpack_step(header, payload)
            virtual_engine = header.virtual_engine
            intermediate = None
            if not is_first_stage():
                intermediate = recv_intermediate(
                    header.num_tokens, hidden_size, self.runner.dtype, self.device, virtual_engine
                )
            self._run_stage(model_input, virtual_engine, intermediate, header.tokens_only)
            self.steps_launched += 1
