"""Paged KV blocks: allocation with ref counts, and prefix caching.

A full block is keyed by a hash chained over every token before it (and the hashes of the
images whose tokens it holds, with where they sit), so equal keys mean equal prefixes. Freed
cached blocks stay findable until a new allocation needs the space; the least recently freed go
first.
"""

from __future__ import annotations

from collections import OrderedDict

from nanoserve.engine.block_counts import BlockCounts
from nanoserve.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager(BlockCounts):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # What each cached block's key was made of (its tokens, its images): checked on a hit.
        self.block_tokens: list[tuple | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Blocks with ref count 0, oldest-freed first; cached ones among them can still be hit.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    # ---- prefix cache -------------------------------------------------------------------
    def _hash(self, parent: int | None, tokens: tuple) -> int:
        return hash((parent, tokens))

    def _block_content(self, seq: Sequence, index: int) -> tuple:
        """Block `index`'s tokens, and for each image with tokens in it its hash and its first
        token's place relative to the block: an image token id alone does not say which image."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        tokens = tuple(seq.token_ids[start:end])
        images = tuple(
            (image.image_hash, image.position - start)
            for image in seq.images
            if image.position < end and image.end > start
        )
        return (tokens, images) if images else tokens

    @staticmethod
    def _root(seq: Sequence):
        """The parent of a sequence's first block: its LoRA adapter's K/V differ from the base
        model's (and another adapter's) for the same tokens, so each adapter has its own chains."""
        return ("lora", seq.lora_id) if seq.lora_id else None

    def match_prefix(self, seq: Sequence) -> None:
        """On a sequence's first schedule, take the cached blocks of its longest cached prefix.
        At least one token is always left to compute, to produce the next token's logits."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.block_hashes = []
        # A cached prefix has no logits: a sequence that needs its prompt logprobs computes every
        # prompt row (vLLM V1 likewise skips prefix-cache reads for such requests).
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_cache_queries += seq.num_tokens
        parent = self._root(seq)
        for i in range(max_blocks):
            tokens = self._block_content(seq, i)
            key = self._hash(parent, tokens)
            block = self.hash_to_block.get(key)
            if block is None or self.block_tokens[block] != tokens:
                break
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(key)
            parent = key
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        self.prefix_cache_hits += seq.num_cached_tokens

    def register_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Make the sequence's newly completed blocks findable by later requests: those within
        its first `num_tokens` tokens (default: its computed ones; with --async-scheduling the
        computed ones whose ids are known)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = num_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            parent = seq.block_hashes[i - 1] if i else self._root(seq)
            tokens = self._block_content(seq, i)
            key = self._hash(parent, tokens)
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            if key not in self.hash_to_block:
                self.hash_to_block[key] = block
                self.block_hash[block] = key
                self.block_tokens[block] = tokens
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_blocks):
            raise NoFreeBlocksError(f"need {needed} blocks, {len(self.free_blocks)} free")
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (speculative decoding: those allocated
        for proposed tokens that were rejected). They were never registered: only blocks of
        computed tokens are."""
        keep = -(-seq.num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def _evict(self, block: int) -> None:
        key = self.block_hash[block]
        if key is not None:
            if self.hash_to_block.get(key) == block:
                del self.hash_to_block[key]
            self.block_hash[block] = None
            self.block_tokens[block] = None

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix's deepest blocks are evicted before its root.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, "block freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, of free and in-use blocks alike: no later request finds
        one. Running sequences keep their blocks; their next full blocks are hashed again and
        become findable, as any new block. Returns how many blocks were findable."""
        count = len(self.hash_to_block)
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        return count
