"""The scheduler's swapped queue, with a simulated KV pool whose slots hold token ids: after a
step's swap plan is applied, every scheduled sequence's blocks hold exactly its computed tokens
(through swaps, recompute fallbacks and prefix-cache hits), and nothing leaks on either pool."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.swap import HostBlockPool
from nanoserve.sampling_params import SamplingParams
from tests.engine.test_scheduler import fill_and_grow

requests = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 2), st.integers(0, 2)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=120, deadline=None)
@given(
    requests=requests,
    num_blocks=st.integers(8, 40),
    num_host_blocks=st.integers(0, 40),
    budget=st.integers(8, 128),
    max_seqs=st.integers(1, 8),
    block_size=st.sampled_from([4, 16]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_swapped_blocks_keep_their_tokens(
    requests, num_blocks, num_host_blocks, budget, max_seqs, block_size, policy
):
    capacity = num_blocks * block_size
    manager = BlockManager(num_blocks, block_size)
    host = HostBlockPool(num_host_blocks)
    scheduler = Scheduler(manager, max_seqs, budget, policy, host)
    device_slots = [[None] * block_size for _ in range(num_blocks)]
    host_slots = [[None] * block_size for _ in range(num_host_blocks)]
    pending = list(enumerate(requests))
    seqs = []
    steps = 0
    while pending or scheduler.has_work():
        steps += 1
        assert steps < 5000, "scheduler made no progress"
        if pending:
            i, (prompt_len, max_tokens, priority, token) = pending.pop(0)
            prompt_len = min(prompt_len, capacity - max_tokens)
            # Few distinct prompts: prefix-cache hits are common.
            seq = Sequence(
                i,
                str(i),
                0,
                [token] * prompt_len,
                prompt_len,
                SamplingParams(max_tokens=max_tokens),
                priority,
                i,
            )
            seqs.append(seq)
            scheduler.add(seq)
        waiting_before = set(scheduler.waiting)
        output = scheduler.schedule()
        scheduled, plan = output.scheduled_seqs, output.swap_plan
        assert not (plan.swap_out and plan.swap_in), "a step that preempted swapped something in"
        if any(item.seq in waiting_before for item in scheduled):
            assert not scheduler.swapped, "a waiting sequence was admitted before a swapped one"
        for source, destination in plan.swap_out:
            host_slots[destination] = list(device_slots[source])
        for source, destination in plan.swap_in:
            device_slots[destination] = list(host_slots[source])
        for item in scheduled:
            seq = item.seq
            table = seq.block_table
            for position in range(seq.num_computed_tokens):
                assert (
                    device_slots[table[position // block_size]][position % block_size]
                    == seq.token_ids[position]
                )
            for position in range(
                seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            ):
                device_slots[table[position // block_size]][position % block_size] = seq.token_ids[
                    position
                ]
            completes = item.completes_prompt
            seq.num_computed_tokens += item.num_new_tokens
            manager.register_full_blocks(seq)
            if completes:
                seq.token_ids.append(7 + seq.num_output_tokens % 2)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED
        used_host = sum(len(s.host_block_table) for s in scheduler.swapped)
        assert host.num_used_blocks == used_host
        assert all(s.status is SequenceStatus.SWAPPED for s in scheduler.swapped)
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert manager.num_used_blocks == 0 and host.num_used_blocks == 0


def _fill_and_grow(host_blocks: int):
    return fill_and_grow("fcfs", (0, 0), HostBlockPool(host_blocks))


def test_swaps_out_the_latest_arrival_and_back_in_before_new_work():
    scheduler, a, b = _fill_and_grow(host_blocks=4)
    b_blocks = list(b.block_table)
    output = scheduler.schedule()
    assert [s.seq for s in output.scheduled_seqs] == [a]
    assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 8 and not b.block_table
    assert output.swap_plan.swap_out == list(zip(b_blocks, [0, 1])) and not output.swap_plan.swap_in
    assert scheduler.num_preemptions == scheduler.num_swap_outs == 1
    c = Sequence(2, "c", 0, [5] * 3, 3, SamplingParams(), 0, 2)
    scheduler.add(c)
    a.num_computed_tokens = 9
    scheduler.remove(a)  # a finishes: room for b, which comes back before c is admitted
    output = scheduler.schedule()
    assert [(s.seq, s.num_new_tokens) for s in output.scheduled_seqs] == [(b, 1), (c, 3)]
    assert output.total_num_scheduled_tokens == 4
    plan = output.swap_plan
    assert not plan.swap_out
    assert [host for host, _ in plan.swap_in] == [0, 1] and [
        d for _, d in plan.swap_in
    ] == b.block_table[:2]
    assert len(b.block_table) == 3 and scheduler.host_pool.num_used_blocks == 0
    assert b.num_computed_tokens == 8 and c.num_computed_tokens == 0


def test_no_admission_while_a_sequence_is_swapped_out():
    scheduler, a, b = _fill_and_grow(host_blocks=4)
    assert scheduler.schedule().swap_plan.swap_out  # b swapped out
    c = Sequence(2, "c", 0, [5] * 3, 3, SamplingParams(), 0, 2)
    scheduler.add(c)
    a.num_computed_tokens = 9
    a.token_ids.append(3)
    # a (3 blocks) keeps running; b needs 3 blocks and only 1 is free: b stays out, so c
    # (1 block, which would fit) is not admitted either.
    assert [s.seq for s in scheduler.schedule().scheduled_seqs] == [a]
    assert b.status is SequenceStatus.SWAPPED and c.status is SequenceStatus.WAITING


def test_full_host_pool_recomputes():
    scheduler, a, b = _fill_and_grow(host_blocks=1)  # b holds 2 blocks: no room
    output = scheduler.schedule()
    assert [s.seq for s in output.scheduled_seqs] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert not output.swap_plan and scheduler.num_swap_outs == 0
