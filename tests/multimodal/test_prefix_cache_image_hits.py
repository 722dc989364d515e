"""The prefix cache with images, block by block (hypothesis): prompts drawn from two text tokens
and three images whose tokens are all the same id, so the same text with different images is
common. Each prompt's cache hits are counted against an oracle that keys every full block by its
tokens and by which image sits where in it, chained from the first block: a prompt hits exactly
the longest such chain an earlier prompt computed, never a block of another image; ref counts
come back to zero."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence
from nanoserve.multimodal.inputs import PromptImage
from nanoserve.sampling_params import SamplingParams

BLOCK = 4
IMAGE_TOKEN = 9
IMAGE_LENGTH = 5  # tokens per image: images straddle blocks, some share one
HASHES = ("image-a", "image-b", "image-c")
PARAMS = SamplingParams(max_tokens=1)

segment = st.one_of(
    st.lists(st.integers(1, 2), min_size=1, max_size=5),  # text
    st.sampled_from(HASHES),  # an image
)
prompts = st.lists(st.lists(segment, min_size=1, max_size=5), min_size=1, max_size=8)


def build(segments: list, seq_id: int) -> Sequence:
    tokens, images = [], []
    for part in segments:
        if isinstance(part, str):
            images.append(PromptImage(None, part, len(tokens), IMAGE_LENGTH))
            tokens += [IMAGE_TOKEN] * IMAGE_LENGTH
        else:
            tokens += part
    seq = Sequence(seq_id, str(seq_id), 0, tokens, len(tokens), PARAMS, 0, seq_id)
    seq.images = tuple(images)
    return seq


def block_keys(seq: Sequence) -> list[tuple]:
    """The oracle: each full block's key, its content and every block's before it."""
    image_at = {}  # token position -> (image hash, its first token's position)
    for image in seq.images:
        for position in range(image.position, image.end):
            image_at[position] = (image.image_hash, image.position)
    keys, chain = [], ()
    for start in range(0, seq.num_tokens - BLOCK + 1, BLOCK):
        chain += (tuple((seq.token_ids[p], image_at.get(p)) for p in range(start, start + BLOCK)),)
        keys.append(chain)
    return keys


@settings(max_examples=200, deadline=None)
@given(prompts)
def test_hits_are_the_longest_chain_of_equal_blocks(batch):
    manager = BlockManager(num_blocks=512, block_size=BLOCK)
    computed: set[tuple] = set()
    held = []
    for seq_id, segments in enumerate(batch):
        seq = build(segments, seq_id)
        keys = block_keys(seq)
        usable = (seq.num_tokens - 1) // BLOCK  # one token is always left to compute
        expected = 0
        while expected < usable and keys[expected] in computed:
            expected += 1
        manager.match_prefix(seq)
        assert seq.num_cached_tokens == expected * BLOCK
        manager.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        manager.register_full_blocks(seq)
        computed.update(keys)
        held.append(seq)
    # a block is shared only by prompts whose keys agree up to it
    for i, first in enumerate(held):
        for second in held[i + 1 :]:
            for index, (a, b) in enumerate(zip(first.block_table, second.block_table)):
                if a == b:
                    assert block_keys(first)[index] == block_keys(second)[index]
    hits = sum(seq.num_cached_tokens for seq in held)
    assert manager.prefix_cache_hits == hits
    for seq in held:
        manager.free(seq)
    assert manager.num_used_blocks == 0 and not any(manager.ref_counts)
