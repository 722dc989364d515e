"""A pooling model's step (--runner pooling): no sampling; each prompt's hidden states are
pooled, and the pooled vector is the request's one output: the embedding (task embed), or,
through a sequence classifier's head, class probabilities (classify) or a pair's score."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.outputs import PoolingOutput, PoolingRequestOutput
from nanoserve.pooling_params import PoolingParams

# A classifier's head: [n, hidden] pooled rows -> [n, num_labels] logits.
ClassifierHead = Callable[[torch.Tensor], torch.Tensor]


def finish_pooling_step(
    scheduler_output: SchedulerOutput,
    hidden: torch.Tensor,
    now: float,
    requests: dict[str, Request],
    schedulers: list[Scheduler],
    output_processor: OutputProcessor,
    head: ClassifierHead | None = None,
) -> list[PoolingRequestOutput]:
    """Each scheduled prompt chunk's rows (in schedule order: every row of a pooling step is
    a prompt row) into its sequence's pooling; a prompt done is pooled (and, for classify and
    score, run through `head` with the others of the step), its request finished and its
    blocks freed."""
    done: list[Sequence] = []
    row = 0
    for item in scheduler_output.scheduled_seqs:
        seq, count = item.seq, item.num_new_tokens
        request = requests[seq.request_id]
        request.record_scheduled(seq, now)
        seq.pooling.add(hidden[row : row + count])
        row += count
        seq.num_computed_tokens += count
        if seq.num_computed_tokens == seq.num_tokens:
            done.append(seq)
    results = _results(done, head)
    outputs = []
    for seq, data in zip(done, results):
        request = requests[seq.request_id]
        output_processor.count_prompt(request, seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
        request.record_tokens(now)
        schedulers[seq.virtual_engine].remove(seq)
        del requests[seq.request_id]
        outputs.append(
            PoolingRequestOutput(
                request.request_id,
                PoolingOutput(data),
                request.prompt_token_ids,
                True,
                request.prompt,
                request.metrics,
            )
        )
    return outputs


def _results(done: list[Sequence], head: ClassifierHead | None) -> list[list[float]]:
    """Each finished sequence's output values: its pooled vector, or its head's activated
    logits (the classify and score rows of the step go through the head together)."""
    pooled = [seq.pooling.result() for seq in done]
    results: list[list[float] | None] = [None] * len(done)
    heads = [i for i, seq in enumerate(done) if seq.pooling.params.task != "embed"]
    if heads:
        if head is None:
            raise RuntimeError("a classify or score request on a model without a head")
        with torch.inference_mode():
            logits = head(torch.stack([pooled[i] for i in heads])).float()
        for row, i in enumerate(heads):
            results[i] = activate(logits[row], done[i].pooling.params).tolist()
    for i, vector in enumerate(pooled):
        if results[i] is None:
            results[i] = vector.tolist()
    return results


def activate(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """vLLM's default activation for classify and score: softmax over the labels when there
    are several, sigmoid for one; none with activation=False."""
    if params.activation is False:
        return logits
    if logits.numel() == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
