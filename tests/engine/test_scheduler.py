"""Scheduler invariants with a simulated model (hypothesis): budgets hold, every request ends,
no block leaks, preemption recovers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams

requests = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 2), st.integers(0, 5)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=120, deadline=None)
@given(
    requests=requests,
    num_blocks=st.integers(8, 40),
    budget=st.integers(8, 128),
    max_seqs=st.integers(1, 8),
    block_size=st.sampled_from([4, 16]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_every_request_finishes_within_budgets(
    requests, num_blocks, budget, max_seqs, block_size, policy
):
    # Each sequence must fit in the pool on its own (the engine caps max_model_len likewise).
    capacity = num_blocks * block_size
    manager = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(manager, max_seqs, budget, policy)
    pending = list(enumerate(requests))
    seqs = []
    steps = 0
    while pending or scheduler.has_work():
        steps += 1
        assert steps < 5000, "scheduler made no progress"
        if pending:  # a request joins at any step
            i, (prompt_len, max_tokens, priority, token) = pending.pop(0)
            prompt_len = min(prompt_len, capacity - max_tokens)
            seq = Sequence(
                i,
                str(i),
                0,
                [token + i % 3] * prompt_len,
                prompt_len,
                SamplingParams(max_tokens=max_tokens),
                priority,
                i,
            )
            seqs.append(seq)
            scheduler.add(seq)
        scheduled = scheduler.schedule().scheduled_seqs
        assert sum(s.num_new_tokens for s in scheduled) <= budget
        assert len(scheduler.running) <= max_seqs
        assert len({id(s.seq) for s in scheduled}) == len(scheduled)
        for item in scheduled:
            seq = item.seq
            assert item.num_new_tokens >= 1
            assert (
                len(seq.block_table) * block_size >= seq.num_computed_tokens + item.num_new_tokens
            )
            completes = item.completes_prompt
            seq.num_computed_tokens += item.num_new_tokens
            manager.register_full_blocks(seq)
            if completes:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert manager.num_used_blocks == 0


def test_preempts_latest_arrival_first():
    manager = BlockManager(4, 4)
    scheduler = Scheduler(manager, 8, 64)
    a = Sequence(0, "a", 0, [1] * 7, 7, SamplingParams(), 0, 0)
    b = Sequence(1, "b", 0, [2] * 7, 7, SamplingParams(), 0, 1)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()  # both prefill: 2 blocks each, pool full
    for seq in (a, b):
        seq.num_computed_tokens = 7
        seq.token_ids.append(3)
    scheduler.schedule()  # 8 tokens each fit in 2 blocks
    for seq in (a, b):
        seq.num_computed_tokens = 8
        seq.token_ids.append(3)
    scheduled = (
        scheduler.schedule().scheduled_seqs
    )  # both need a third block: b (later arrival) is preempted
    assert [s.seq for s in scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1


def fill_and_grow(policy: str, priorities: tuple[int, int], host=None):
    """Two 7-token prompts fill a 4-block pool; two decode steps later both need a third block
    (the next schedule() must preempt one). host: a HostBlockPool for swap mode."""
    manager = BlockManager(4, 4)
    scheduler = Scheduler(manager, 8, 64, policy, host)
    a = Sequence(0, "a", 0, [1] * 7, 7, SamplingParams(), priorities[0], 0)
    b = Sequence(1, "b", 0, [2] * 7, 7, SamplingParams(), priorities[1], 1)
    scheduler.add(a)
    scheduler.add(b)
    for computed in (7, 8):
        scheduler.schedule()
        for seq in (a, b):
            seq.num_computed_tokens = computed
            seq.token_ids.append(3)
    return scheduler, a, b


def test_priority_policy_preempts_the_least_urgent():
    """vLLM's priority scheduler: the victim is the running request with the largest
    (priority, arrival), here the earlier arrival because its priority value is higher."""
    scheduler, a, b = fill_and_grow("priority", (2, 0))
    scheduled = scheduler.schedule().scheduled_seqs
    assert [s.seq for s in scheduled] == [b]
    assert a.status is SequenceStatus.WAITING and a.num_computed_tokens == 0
    # With fcfs the same requests are ordered by arrival alone: the later one (b) gives way.
    scheduler, a, b = fill_and_grow("fcfs", (0, 0))
    scheduled = scheduler.schedule().scheduled_seqs
    assert [s.seq for s in scheduled] == [a] and b.status is SequenceStatus.WAITING


def test_waiting_order_follows_the_policy():
    for policy, expected in (("fcfs", ["x", "y", "z"]), ("priority", ["z", "x", "y"])):
        scheduler = Scheduler(BlockManager(64, 4), 1, 64, policy)
        for order, (name, priority) in enumerate((("x", 1), ("y", 1), ("z", -1))):
            scheduler.add(Sequence(order, name, 0, [1] * 3, 3, SamplingParams(), priority, order))
        assert [seq.request_id for seq in scheduler.waiting] == expected


def test_scheduler_output_names_its_virtual_engine_and_requests():
    """One typed hand-off: the scheduled sequences with their token counts, the swap plan (empty
    without swapping) and the virtual engine whose share of the pool the block ids index."""
    scheduler = Scheduler(BlockManager(8, 4), 8, 64, virtual_engine=1)
    a = Sequence(0, "a", 0, [1] * 5, 5, SamplingParams(), 0, 0)
    b = Sequence(1, "b", 0, [2] * 3, 3, SamplingParams(), 0, 1)
    a2 = Sequence(2, "a", 1, [1] * 5, 5, SamplingParams(), 0, 0)
    for seq in (a, b, a2):
        scheduler.add(seq)
    output = scheduler.schedule()
    assert output.virtual_engine == 1 and not output.swap_plan
    assert [(s.seq, s.num_new_tokens) for s in output.scheduled_seqs] == [(a, 5), (a2, 5), (b, 3)]
    assert output.total_num_scheduled_tokens == 13 and output.request_ids == ["a", "b"]
