"""A pooling model's step (--runner pooling): no sampling; each prompt's hidden states are
pooled into its embedding, which is the request's one output."""

from __future__ import annotations

import torch

from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import SequenceStatus
from nanoserve.outputs import RequestOutput


def finish_pooling_step(
    scheduler_output: SchedulerOutput,
    hidden: torch.Tensor,
    now: float,
    requests: dict[str, Request],
    schedulers: list[Scheduler],
    output_processor: OutputProcessor,
) -> list[RequestOutput]:
    """Each scheduled prompt chunk's rows (in schedule order: every row of a pooling step is
    a prompt row) into its sequence's pooling; a prompt done is an embedding, its request
    finished and its blocks freed."""
    outputs, row = [], 0
    for item in scheduler_output.scheduled_seqs:
        seq, count = item.seq, item.num_new_tokens
        request = requests[seq.request_id]
        request.record_scheduled(seq, now)
        seq.pooling.add(hidden[row : row + count])
        row += count
        seq.num_computed_tokens += count
        if seq.num_computed_tokens < seq.num_tokens:
            continue
        output_processor.count_prompt(request, seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
        request.record_tokens(now)
        schedulers[seq.virtual_engine].remove(seq)
        del requests[seq.request_id]
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
