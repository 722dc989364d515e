"""The scheduler's side of a step's input: a frozen SeqInput (engine/step_input.py) built from
each scheduled Sequence before the model runner sees the step, a SamplingInput from any sequence
(the draft proposer's batches), and a step's inputs mapped back to their live sequences by seq_id
when the engine core collects what the step produced."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.step_input import PLACEHOLDER_TOKEN, ImageSlice, SamplingInput, SeqInput
from nanoserve.multimodal.mrope import mrope_positions, overlaps_image, rope_shift, uses_mrope


def sampling_input(seq: Sequence) -> SamplingInput:
    """What the sampler reads of the sequence (its tokens only when its penalties count them)."""
    params = seq.params
    repetition = params.repetition_penalty != 1.0
    penalized = repetition or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    return SamplingInput(
        seq_id=seq.seq_id,
        params=params,
        generator=seq.generator,
        # (a token still on the device counts: min_tokens holds EOS back until it is out)
        num_output_tokens=seq.num_output_tokens + seq.num_output_placeholders,
        output_token_ids=tuple(seq.output_token_ids) if penalized else (),
        prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt_tokens]) if repetition else (),
        grammar=seq.grammar,
    )


def seq_input(item: ScheduledSequence) -> SeqInput:
    """One scheduled sequence's part of the step: its tokens from num_computed_tokens on,
    num_new_tokens of them (a verification: its last token and its proposal)."""
    seq, proposal = item.seq, item.seq.proposal
    start = seq.num_computed_tokens
    end = start + item.num_new_tokens
    offset, targets = 0, ()
    shift, mrope = 0, None  # M-RoPE (multimodal/mrope.py): a sequence with Qwen2.5-VL's images
    if seq.images and uses_mrope(seq.images):
        if overlaps_image(seq.images, start, end):
            mrope = mrope_positions(seq.images, start, end)
        else:
            shift = rope_shift(seq.images, start)
    if proposal.token_ids:
        token_ids = (seq.token_ids[start], *proposal.token_ids)
        assert start == seq.num_tokens - 1 and len(token_ids) == item.num_new_tokens
    else:
        token_ids = tuple(seq.token_ids[start:end])
        if len(token_ids) < end - start:  # --async-scheduling: its last token is on the device
            assert end - start == 1 and seq.num_output_placeholders, "a placeholder in a prompt"
            token_ids = (PLACEHOLDER_TOKEN,)
        if seq.needs_prompt_logprobs:
            offset, targets = _prompt_logprob_targets(seq, start, end)
    return SeqInput(
        seq_id=seq.seq_id,
        token_ids=token_ids,
        start=start,
        block_table=tuple(seq.block_table),
        lora_id=seq.lora_id,
        is_decode=item.num_new_tokens == 1 and start >= seq.num_prompt_tokens,
        completes_prompt=item.completes_prompt,
        sampling=sampling_input(seq),
        proposal=tuple(proposal.token_ids),
        draft_probs=proposal.draft_probs,
        bitmask=proposal.bitmask,
        prompt_logprob_offset=offset,
        prompt_logprob_targets=targets,
        token_type_ids=tuple(seq.token_type_ids[start:end]) if seq.token_type_ids else (),
        images=image_slices(seq, start, start + len(token_ids)) if seq.images else (),
        position_shift=shift,
        mrope_positions=mrope,
    )


def image_slices(seq: Sequence, start: int, end: int) -> tuple[ImageSlice, ...]:
    """The parts of its images whose tokens are rows [start, end) of the sequence."""
    slices = []
    for image in seq.images:
        first, last = max(image.position, start), min(image.end, end)
        if first < last:
            slices.append(
                ImageSlice(
                    image.image_hash,
                    image.pixel_values,
                    row=first - start,
                    offset=first - image.position,
                    count=last - first,
                    grid_thw=image.grid_thw,
                )
            )
    return tuple(slices)


def step_inputs(scheduled: list[ScheduledSequence]) -> list[SeqInput]:
    return [seq_input(item) for item in scheduled]


def _prompt_logprob_targets(seq: Sequence, start: int, end: int) -> tuple[int, tuple[int, ...]]:
    """The step's rows whose next token is a prompt token not yet scored: the first one's offset
    among the sequence's rows, and their next tokens."""
    assert start < len(seq.prompt_logprobs), "prompt rows skipped without logits"
    first = max(start, len(seq.prompt_logprobs) - 1)
    last = min(end, seq.num_prompt_tokens - 1)
    if last <= first:
        return 0, ()
    return first - start, tuple(seq.token_ids[first + 1 : last + 1])


@dataclass(slots=True)
class StepSeqs:
    """A step's results' sequences, in the order of the runner's output: those that sampled a
    token, those that scored prompt rows (with their number of rows), those that verified."""

    sampled: list[Sequence]
    prompt_logprobs: list[tuple[Sequence, int]]
    verified: list[Sequence]


def step_seqs(scheduler_output: SchedulerOutput, model_input: ModelInput) -> StepSeqs:
    """The live sequences behind the step's inputs (the engine core writes the results to them)."""
    by_id = {item.seq.seq_id: item.seq for item in scheduler_output.scheduled_seqs}
    return StepSeqs(
        [by_id[i.seq_id] for i in model_input.sampling_inputs],
        [
            (by_id[i.seq_id], len(i.prompt_logprob_targets))
            for i in model_input.prompt_logprob_inputs
        ],
        [by_id[i.seq_id] for i in model_input.spec_inputs],
    )
