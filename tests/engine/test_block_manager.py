"""Block manager invariants under random workloads (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams

PARAMS = SamplingParams()


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), len(tokens), PARAMS, 0, seq_id)


def check_invariants(manager: BlockManager, live: list[Sequence]) -> None:
    counts = [0] * manager.num_blocks
    for seq in live:
        for block in seq.block_table:
            counts[block] += 1
    assert counts == manager.ref_counts, (
        "ref counts must equal the number of tables holding a block"
    )
    assert set(manager.free_blocks) == {b for b in range(manager.num_blocks) if counts[b] == 0}
    for key, block in manager.hash_to_block.items():
        assert manager.block_hash[block] == key


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "free"]),
        st.integers(0, 1000),
        st.lists(st.integers(0, 3), min_size=1, max_size=70),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(4, 40))
def test_no_block_leaked_or_shared_without_ref_count(ops, block_size, num_blocks):
    manager = BlockManager(num_blocks, block_size)
    live: list[Sequence] = []
    next_id = 0
    for op, pick, tokens in ops:
        if op == "add":
            seq = make_seq(next_id, tokens)
            next_id += 1
            manager.match_prefix(seq)
            assert seq.num_computed_tokens < seq.num_tokens
            remaining = seq.num_tokens - seq.num_computed_tokens
            if manager.can_allocate(seq, remaining):
                manager.allocate(seq, remaining)
                seq.num_computed_tokens = seq.num_tokens
                manager.register_full_blocks(seq)
                live.append(seq)
            else:
                manager.free(seq)
        elif op == "grow" and live:
            seq = live[pick % len(live)]
            seq.token_ids.extend(tokens[:5])
            new = seq.num_tokens - seq.num_computed_tokens
            if manager.can_allocate(seq, new):
                manager.allocate(seq, new)
                seq.num_computed_tokens = seq.num_tokens
                manager.register_full_blocks(seq)
        elif op == "free" and live:
            manager.free(live.pop(pick % len(live)))
        check_invariants(manager, live)
    for seq in live:
        manager.free(seq)
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == num_blocks


def test_prefix_hit_shares_blocks_and_lru_evicts_oldest():
    manager = BlockManager(8, 4)
    first = make_seq(0, list(range(13)))
    manager.match_prefix(first)
    manager.allocate(first, 13)
    first.num_computed_tokens = 13
    manager.register_full_blocks(first)
    second = make_seq(1, list(range(12)) + [99, 98])
    manager.match_prefix(second)
    assert second.num_cached_tokens == 12 and second.block_table == first.block_table[:3]
    assert [manager.ref_counts[b] for b in second.block_table] == [2, 2, 2]
    manager.free(second)
    manager.free(first)
    # All 8 blocks free; the 3 cached ones stay findable until the space is needed.
    assert manager.num_free_blocks == 8 and len(manager.hash_to_block) == 3
    third = make_seq(2, [50] * 17)
    manager.match_prefix(third)
    manager.allocate(third, 17)  # 5 blocks: the 5 never-cached/least-recent blocks first
    assert len(manager.hash_to_block) == 3
    fourth = make_seq(3, list(range(12)) + [7])
    manager.match_prefix(fourth)
    assert fourth.num_cached_tokens == 12
