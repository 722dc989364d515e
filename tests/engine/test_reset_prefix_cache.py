"""BlockManager.reset_prefix_cache: nothing cached is found afterwards, blocks in use stay with
their sequences, and prefixes computed later are cached again."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_manager import BlockManager
from tests.engine.test_block_manager import check_invariants, make_seq


def run(manager: BlockManager, seq) -> None:
    manager.match_prefix(seq)
    manager.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_full_blocks(seq)


def test_reset_forgets_free_and_in_use_blocks():
    manager = BlockManager(16, 4)
    running = make_seq(0, list(range(13)))
    run(manager, running)
    done = make_seq(1, [7] * 9)
    run(manager, done)
    manager.free(done)
    assert len(manager.hash_to_block) == 5
    assert manager.reset_prefix_cache() == 5
    assert manager.hash_to_block == {} and set(manager.block_hash) == {None}
    repeat = make_seq(2, list(range(13)))
    manager.match_prefix(repeat)
    assert repeat.num_cached_tokens == 0 and repeat.block_table == []
    assert manager.ref_counts[running.block_table[0]] == 1  # still the running sequence's
    check_invariants(manager, [running])
    # the running sequence's next full block, and new prefixes, are cached again
    running.token_ids.extend([20, 21, 22])
    manager.allocate(running, 3)
    running.num_computed_tokens = 16
    manager.register_full_blocks(running)
    assert len(manager.hash_to_block) == 1
    run(manager, repeat)
    again = make_seq(3, list(range(13)))
    manager.match_prefix(again)
    assert again.num_cached_tokens == 12
    for seq in (running, repeat, again):
        manager.free(seq)
    assert manager.num_free_blocks == 16


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "free", "reset"]),
        st.integers(0, 1000),
        st.lists(st.integers(0, 2), min_size=1, max_size=30),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(ops=ops)
def test_resets_among_other_work_leak_nothing(ops):
    manager = BlockManager(24, 4)
    live = []
    for number, (op, pick, tokens) in enumerate(ops):
        if op == "add":
            seq = make_seq(number, tokens)
            manager.match_prefix(seq)
            if not manager.can_allocate(seq, seq.num_tokens - seq.num_computed_tokens):
                manager.free(seq)
                continue
            manager.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens = seq.num_tokens
            manager.register_full_blocks(seq)
            live.append(seq)
        elif op == "free" and live:
            manager.free(live.pop(pick % len(live)))
        elif op == "reset":
            manager.reset_prefix_cache()
            assert not manager.hash_to_block
        check_invariants(manager, live)
    for seq in live:
        manager.free(seq)
    assert manager.num_free_blocks == 24
