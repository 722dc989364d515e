"""Continuous batching: which sequences run this step and how many tokens each computes.

Running sequences go first (decodes and unfinished prefill chunks), then waiting ones, in the
policy's order (vLLM's --scheduling-policy): "fcfs" by arrival, "priority" by (priority, arrival),
within a token budget and a sequence cap. A long prompt is split into chunks so it never stalls
running decodes. When blocks run out, the last running sequence in that order (the latest
arrival; with "priority", the least urgent, as vLLM's priority scheduler) is preempted and
recomputed later.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus


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
                 policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.sort_key = _priority_key if policy == "priority" else _arrival_key
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []  # kept sorted by sort_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

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
        # New work is admitted only when nothing had to be preempted this step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
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
            self.waiting.pop(0)
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.sort_key)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return scheduled

    def _largest_chunk(self, seq: Sequence, num_new: int) -> int:
        free_tokens = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_manager.block_size
        return max(0, min(num_new, free_tokens - seq.num_computed_tokens))
