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
outputs) is passed over until it is ready, as is one whose LoRA adapter would make more distinct
adapters run at once than --max-loras allows (it waits until one of theirs finishes).

`schedule()` returns one `SchedulerOutput` (vLLM's name): the sequences and how many tokens each
computes, the block copies to make before the forward pass, and which virtual engine planned it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.swap import HostBlockPool, SwapPlan


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the sequence has computed every token it holds (those still on the
        device with --async-scheduling included), so it samples."""
        seq = self.seq
        return (
            seq.num_computed_tokens + self.num_new_tokens
            == seq.num_tokens + seq.num_output_placeholders
        )


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. `swap_plan`: the copies the model runner makes before the forward pass
    (blocks freed by a swap-out this step may be overwritten by it). `virtual_engine`: the
    scheduler that made it (pipeline parallelism; else 0), whose share of the pool its block
    ids index."""

    scheduled_seqs: list[ScheduledSequence] = field(default_factory=list)
    swap_plan: SwapPlan = field(default_factory=SwapPlan)
    virtual_engine: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled_seqs)

    @property
    def request_ids(self) -> list[str]:
        """The requests with a sequence in the step, each once, in order."""
        return list(dict.fromkeys(item.seq.request_id for item in self.scheduled_seqs))


def _arrival_key(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival_order, seq.index)


def _priority_key(seq: Sequence) -> tuple[int, int, int]:
    return (seq.priority, seq.arrival_order, seq.index)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        host_pool: HostBlockPool | None = None,
        virtual_engine: int = 0,
        max_loras: int = 0,
        whole_prompts: bool = False,
        max_model_len: int | None = None,
    ):
        """`host_pool`: preempt by swapping into it (None: by recompute). `virtual_engine`: which
        share of the pool `block_manager` hands out (pipeline parallelism). `max_loras`: distinct
        LoRA adapters among the running sequences at most (0: LoRA is off). `whole_prompts`:
        never split a prompt (encoder models' bidirectional attention); one longer than the
        token budget runs alone in its step. `max_model_len`: the longest a sequence gets (with
        --async-scheduling, one whose tokens still on the device reach it, or its max_tokens, is
        finished: it is not scheduled again)."""
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
        self.virtual_engine = virtual_engine
        self.max_loras = max_loras
        self.whole_prompts = whole_prompts
        self.max_model_len = max_model_len
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

    def _preempt(self, seq: Sequence, plan: SwapPlan) -> None:
        self.running.remove(seq)
        seq.clear_proposal()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        num_blocks = len(seq.block_table)
        if self.host_pool is not None and num_blocks and self.host_pool.can_allocate(num_blocks):
            self._swap_out(seq, plan)
            return
        self.block_manager.free(seq)
        self.add(seq)

    def _swap_out(self, seq: Sequence, plan: SwapPlan) -> None:
        seq.host_block_table = self.host_pool.allocate(len(seq.block_table))
        plan.swap_out.extend(zip(seq.block_table, seq.host_block_table))
        num_computed = seq.num_computed_tokens
        self.block_manager.free(seq)  # cached blocks stay findable; the copy is made first
        seq.num_computed_tokens = num_computed
        seq.status = SequenceStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=self.sort_key)
        self.num_swap_outs += 1

    def _swap_in(self, seq: Sequence, num_new: int, plan: SwapPlan) -> None:
        """Fresh device blocks for everything the sequence held and its next chunk; its full
        blocks are hashed and registered again after the step, as newly computed ones."""
        self.block_manager.allocate(seq, num_new)
        plan.swap_in.extend(zip(seq.host_block_table, seq.block_table))
        self.host_pool.free(seq.host_block_table)
        seq.host_block_table = []

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(virtual_engine=self.virtual_engine)
        budget, preempted = self._schedule_running(output, self.max_num_batched_tokens)
        # Swapped and new work come in only when nothing had to be preempted this step.
        if not preempted:
            budget = self._schedule_swapped(output, budget)
            if not self.swapped:
                self._schedule_waiting(output, budget)
        return output

    def _start_running(self, seq: Sequence, num_new: int, output: SchedulerOutput) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self.sort_key)
        output.scheduled_seqs.append(ScheduledSequence(seq, num_new))

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Running sequences' next tokens, preempting from the back of the queue when blocks run
        out. Returns the budget left and whether anything was preempted."""
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_output_placeholders and self._reaches_its_length(seq):
                continue  # its last token is on the device: collecting it finishes the sequence
            num_new = self._num_new_running(seq, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, output.swap_plan)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                output.scheduled_seqs.append(ScheduledSequence(seq, num_new))
                budget -= num_new
        return budget, preempted

    def _num_new_running(self, seq: Sequence, budget: int) -> int:
        """A running sequence's tokens this step: what it has not computed, and its proposed
        tokens (speculative decoding) as far as the budget and the free blocks allow: a proposal
        is cut, never the cause of a preemption."""
        num_tokens = seq.num_tokens + seq.num_output_placeholders
        num_new = min(num_tokens - seq.num_computed_tokens + len(seq.proposal.token_ids), budget)
        if seq.proposal.token_ids:
            del seq.proposal.token_ids[max(0, num_new - 1) :]
            if not self.block_manager.can_allocate(seq, num_new):
                seq.clear_proposal()
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        return num_new

    def _reaches_its_length(self, seq: Sequence) -> bool:
        """Its tokens, those still on the device included, reach its max_tokens or the model's
        length (output_processor.check_stop's "length"), so it finishes whatever they are."""
        if self.max_model_len is None:
            return False
        num_output = seq.num_output_tokens + seq.num_output_placeholders
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return True
        return seq.num_tokens + seq.num_output_placeholders >= self.max_model_len

    def _schedule_swapped(self, output: SchedulerOutput, budget: int) -> int:
        """Swapped-out sequences back in, in order, while their blocks fit."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not seq.is_schedulable or not self._lora_fits(seq, self._running_loras()):
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                break
            self.swapped.pop(0)
            self._swap_in(seq, num_new, output.swap_plan)
            self._start_running(seq, num_new, output)
            budget -= num_new
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Waiting sequences admitted in order (prefix-cache hits matched first) while the
        budget, the sequence cap and the pool allow."""
        loras = self._running_loras()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next(
                (s for s in self.waiting if s.is_schedulable and self._lora_fits(s, loras)), None
            )
            if (
                seq is None
            ):  # every waiting sequence's grammar is still compiling, or its adapter waits
                break
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.whole_prompts and num_new < seq.num_tokens - seq.num_computed_tokens:
                if output.scheduled_seqs or self.running:
                    break  # it runs next step, first
                num_new = seq.num_tokens - seq.num_computed_tokens
            if not self.block_manager.can_allocate(seq, num_new):
                if not self.running and not output.scheduled_seqs:
                    # Even an empty pool can't hold this sequence's next chunk: shrink the chunk.
                    num_new = self._largest_chunk(seq, num_new)
                    if num_new == 0:
                        raise RuntimeError("KV cache too small for a single block of a sequence")
                else:
                    self.block_manager.free(seq)  # give back prefix-cache hits while waiting
                    break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, num_new)
            self._start_running(seq, num_new, output)
            budget -= num_new
            if seq.lora_id:
                loras.add(seq.lora_id)

    def _running_loras(self) -> set[int]:
        return {seq.lora_id for seq in self.running if seq.lora_id} if self.max_loras else set()

    def _lora_fits(self, seq: Sequence, running: set[int]) -> bool:
        """Running `seq` keeps the distinct adapters within max_loras."""
        return not seq.lora_id or seq.lora_id in running or len(running) < self.max_loras

    def _largest_chunk(self, seq: Sequence, num_new: int) -> int:
        free_tokens = (
            len(seq.block_table) + self.block_manager.num_free_blocks
        ) * self.block_manager.block_size
        return max(0, min(num_new, free_tokens - seq.num_computed_tokens))
