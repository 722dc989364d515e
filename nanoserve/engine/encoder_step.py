"""Encoder models' steps (BERT, XLM-RoBERTa: models/bert.py). Their attention is bidirectional,
so a prompt runs whole in one step (never chunked: every token sees every other), several
prompts packed up to the step's token budget; nothing is cached, so no KV block is held: the
scheduler runs over NoKVBlocks. The step's rows and token types become an EncoderBatch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from nanoserve.engine.block_manager import BlockCounts
from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.scheduler import ScheduledSequence
from nanoserve.engine.sequence import Sequence
from nanoserve.models.bert import EncoderBatch


class NoKVBlocks(BlockCounts):
    """The scheduler's block manager for a model with no KV cache: every prompt fits, nothing
    is held, nothing is cached."""

    def __init__(self, block_size: int) -> None:
        self.num_blocks = 0
        self.block_size = block_size
        self.enable_prefix_caching = False
        self.free_blocks: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        pass

    def match_prefix(self, seq: Sequence) -> None:
        pass

    def register_full_blocks(self, seq: Sequence) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass

    def reset_prefix_cache(self) -> int:
        return 0


def encoder_model_input(
    scheduled: list[ScheduledSequence], to_device: Callable[[list, torch.dtype], torch.Tensor]
) -> ModelInput:
    """The step's prompts packed one after another, each whole, positions from 0."""
    input_ids: list[int] = []
    positions: list[int] = []
    token_types: list[int] = []
    cu_seqlens = [0]
    for item in scheduled:
        seq = item.seq
        assert item.num_new_tokens == seq.num_tokens and seq.num_computed_tokens == 0, (
            "an encoder prompt runs whole"
        )
        input_ids += seq.token_ids
        positions += range(seq.num_tokens)
        token_types += seq.token_type_ids or [0] * seq.num_tokens
        cu_seqlens.append(len(input_ids))
    batch = EncoderBatch(cu_seqlens, to_device(token_types, torch.long))
    return ModelInput(
        input_ids=to_device(input_ids, torch.long),
        positions=to_device(positions, torch.long),
        metadata=batch,
        logits_indices=to_device([], torch.long),
        sampling_seqs=[],
    )
