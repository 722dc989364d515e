"""Continuous batching: which sequences run this step and how many tokens each computes.

Three queues, each in the policy's order (vLLM's --scheduling-policy): "fcfs" by arrival,
"priority" by (priority, arrival). Running sequences go first (decodes and unfinished prefill
chunks), then swapped ones come back, then waiting ones are admitted, within a token budget and a
sequence cap. A long prompt is split into chunks so it never stalls running decodes. When blocks
run out, the last running sequence in that order (the latest arrival; with "priority", the least
urgent, as vLLM's priority scheduler) is preempted: recomputed later, or with preemption mode
"swap" its blocks are copied to the host pool (recompute when that is full). As in vLLM V0, a
step that preempted swaps nothing in and admits nothing, and no waiting sequence is admitted
while any is swapped out. A waiting sequence whose grammar is still compiling (structured
outputs) is passed over until it is ready.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.swap import HostBlockPool, SwapPlan


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the sequence has computed every token it holds, so it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


def _arrival_key(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival_order, seq.index)


def _priority_key(seq: Sequence) -> tuple[int, int, int]:
    return (seq.priority, seq.arrival_order, seq.index)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", host_pool: HostBlockPool | None = None):
        """`host_pool`: preempt by swapping into it (None: by recompute)."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.sort_key = _priority_key if policy == "priority" else _arrival_key
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []  # kept sorted by sort_key
        self.swapped: list[Sequence] = []  # kept sorted by sort_key
        self.host_pool = host_pool
        self.swap_plan = SwapPlan()  # copies owed before the next forward pass
        self.num_preemptions = 0
        self.num_swap_outs = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.host_pool.free(seq.host_block_table)
            seq.host_block_table = []
        self.block_manager.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def take_swap_plan(self) -> SwapPlan:
        """The block copies the scheduled step needs first (the model runner makes them)."""
        plan, self.swap_plan = self.swap_plan, SwapPlan()
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        num_blocks = len(seq.block_table)
        if self.host_pool is not None and num_blocks and self.host_pool.can_allocate(num_blocks):
            self._swap_out(seq)
            return
        self.block_manager.free(seq)
        self.add(seq)

    def _swap_out(self, seq: Sequence) -> None:
        seq.host_block_table = self.host_pool.allocate(len(seq.block_table))
        self.swap_plan.swap_out.extend(zip(seq.block_table, seq.host_block_table))
        num_computed = seq.num_computed_tokens
        self.block_manager.free(seq)  # cached blocks stay findable; the copy is made first
        seq.num_computed_tokens = num_computed
        seq.status = SequenceStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=self.sort_key)
        self.num_swap_outs += 1

    def _swap_in(self, seq: Sequence, num_new: int) -> None:
        """Fresh device blocks for everything the sequence held and its next chunk; its full
        blocks are hashed and registered again after the step, as newly computed ones."""
        self.block_manager.allocate(seq, num_new)
        self.swap_plan.swap_in.extend(zip(seq.host_block_table, seq.block_table))
        self.host_pool.free(seq.host_block_table)
        seq.host_block_table = []

    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
        # Swapped and new work come in only when nothing had to be preempted this step.
        while not preempted and self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                break
            self.swapped.pop(0)
            self._swap_in(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.sort_key)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        while not preempted and not self.swapped and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if s.is_schedulable), None)
            if seq is None:  # every waiting sequence's grammar is still compiling
                break
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                if not self.running and not scheduled:
                    # Even an empty pool can't hold this sequence's next chunk: shrink the chunk.
                    num_new = self._largest_chunk(seq, num_new)
                    if num_new == 0:
                        raise RuntimeError("KV cache too small for a single block of a sequence")
                else:
                    self.block_manager.free(seq)  # give back prefix-cache hits while waiting
                    break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.sort_key)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return scheduled

    def _largest_chunk(self, seq: Sequence, num_new: int) -> int:
        free_tokens = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_manager.block_size
        return max(0, min(num_new, free_tokens - seq.num_computed_tokens))
