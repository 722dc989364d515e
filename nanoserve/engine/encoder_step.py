"""Encoder models' steps (BERT, XLM-RoBERTa: models/bert.py). Their attention is bidirectional,
so a prompt runs whole in one step (never chunked: every token sees every other), several
prompts packed up to the step's token budget; nothing is cached, so no KV block is held: the
scheduler runs over NoKVBlocks. The step's rows and token types become an EncoderBatch
(engine/encoder_input.py, on the model runner's side)."""

from __future__ import annotations

from collections import OrderedDict

from nanoserve.engine.block_counts import BlockCounts
from nanoserve.engine.sequence import Sequence


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
