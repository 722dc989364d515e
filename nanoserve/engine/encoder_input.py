"""An encoder model's step input (models/bert.py): the step's whole prompts packed one after
another, positions from 0, with their token types, as an EncoderBatch. Built from the frozen
SeqInputs (engine/step_input.py) like every step, on the model runner's side."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.step_input import SeqInput
from nanoserve.models.bert import EncoderBatch


def encoder_model_input(
    inputs: list[SeqInput], to_device: Callable[[list, torch.dtype], torch.Tensor]
) -> ModelInput:
    """The step's prompts packed one after another, each whole, positions from 0."""
    input_ids: list[int] = []
    positions: list[int] = []
    token_types: list[int] = []
    cu_seqlens = [0]
    for item in inputs:
        assert item.start == 0, "an encoder prompt runs whole"
        count = item.num_new_tokens
        input_ids += item.token_ids
        positions += range(count)
        token_types += item.token_type_ids or [0] * count
        cu_seqlens.append(len(input_ids))
    batch = EncoderBatch(cu_seqlens, to_device(token_types, torch.long))
    return ModelInput(
        input_ids=to_device(input_ids, torch.long),
        positions=to_device(positions, torch.long),
        metadata=batch,
        logits_indices=to_device([], torch.long),
        sampling_inputs=[],
    )
