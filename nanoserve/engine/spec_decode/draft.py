"""Draft-model proposals: a smaller model with the same vocabulary, run by the same engine on a
KV pool of its own, proposes k tokens per sequence each step; the target verifies them.

Each running sequence has a shadow in the draft (its own block table and computed count over a
copy of the sequence's tokens). A step first feeds each shadow what it has not computed (the
whole prompt the first time; afterwards the tokens the last verification kept and the one it
added), then decodes k - 1 more times, all shadows in one batch each time. A greedy sequence's
proposals are the draft's argmax; a sampled one's are drawn from the draft's distribution after
the request's own processing (bias, temperature, top-k / top-p / min-p), whose rows go to the
rejection sampler as q. After verification the shadow keeps the KV of the proposals that were
kept (its tokens are re-synchronised at the next step: what diverged is recomputed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import ScheduledSequence
from nanoserve.engine.seq_inputs import step_inputs
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode.grammar import bitmask_rows
from nanoserve.kernels import apply_token_bitmask
from nanoserve.layers.sampler import SamplingBatch, processed_logits, sampling_probs
from nanoserve.models.config import ModelConfig


class DraftProposer:
    def __init__(
        self,
        config: EngineConfig,
        draft_dir: Path,
        target: ModelConfig,
        num_blocks: int,
        device: torch.device,
        num_speculative_tokens: int,
    ):
        from nanoserve.engine.model_runner import ModelRunner

        draft_config = ModelConfig.from_dir(draft_dir)
        if draft_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model's vocabulary ({draft_config.vocab_size}) is "
                f"not the target's ({target.vocab_size}); they must share a tokenizer"
            )
        runner_config = dataclasses.replace(
            config,
            model=str(draft_dir),
            speculative_config=None,
            num_kv_blocks=num_blocks,
            preemption_mode="recompute",
            tokenizer=None,
            quantization=None,
            enable_lora=False,
        )
        self.runner = ModelRunner(runner_config, draft_config, draft_dir, device=device)
        self.blocks = BlockManager(
            self.runner.num_kv_blocks, config.block_size, enable_prefix_caching=False
        )
        self.k = num_speculative_tokens
        self.shadows: dict[int, Sequence] = {}

    def drop(self, seq: Sequence) -> None:
        """The sequence left the engine (finished or aborted): free its shadow's blocks."""
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def _shadow(self, seq: Sequence) -> Sequence:
        """The sequence's shadow, its tokens re-synchronised: a shadow holds the sequence's tokens
        and its own last proposals, so they agree up to where the last verification diverged."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(
                seq.seq_id,
                seq.request_id,
                seq.index,
                [],
                seq.num_prompt_tokens,
                seq.params,
                seq.priority,
                seq.arrival_order,
            )
            self.shadows[seq.seq_id] = shadow
        same = min(len(shadow.token_ids), len(seq.token_ids))
        start = max(0, same - self.k - 2)  # everything before it agrees by construction
        while start < same and shadow.token_ids[start] == seq.token_ids[start]:
            start += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, start)
        return shadow

    @torch.inference_mode()
    def propose_for(
        self,
        wanted: list[tuple[Sequence, int]],
        batch_for: Callable[[list[Sequence]], SamplingBatch],
        vocab_size: int,
    ) -> None:
        """Set each sequence's proposal: its token ids, at most `limit` (with draft_probs for
        sampled sequences, a bitmask for constrained ones); a sequence whose shadow
        doesn't fit the draft's pool proposes nothing this step. A constrained sequence's draft
        picks under its grammar's mask at each position (the matcher walked along the proposal,
        then rolled back), and stops where the grammar completes."""
        active: list[tuple[Sequence, Sequence, int]] = []
        for seq, limit in wanted:
            shadow = self._shadow(seq)
            todo = shadow.num_tokens - shadow.num_computed_tokens
            if not self.blocks.can_allocate(shadow, todo + limit):
                self.drop(seq)
                continue
            self.blocks.allocate(
                shadow, todo + limit
            )  # every position this step feeds, reserved now
            active.append((seq, shadow, limit))
            seq.proposal.token_ids, seq.proposal.draft_probs = (
                [],
                ([] if seq.params.temperature != 0 else None),
            )
            if seq.grammar is not None:
                seq.proposal.bitmask = bitmask_rows(limit + 1, vocab_size)
        stopped: set[int] = set()  # constrained sequences whose grammar completed
        for step in range(max((limit for _, _, limit in active), default=0)):
            batch = [
                (seq, shadow)
                for seq, shadow, limit in active
                if step < limit and seq.seq_id not in stopped
            ]
            if not batch:
                break
            scheduled = [
                ScheduledSequence(shadow, shadow.num_tokens - shadow.num_computed_tokens)
                for _, shadow in batch
            ]
            model_input = self.runner.prepare(step_inputs(scheduled))
            logits = self.runner.forward(model_input)  # one row per shadow (its last token's), in
            order = {  # the runner's order (a shadow has its sequence's seq_id)
                item.seq_id: row for row, item in enumerate(model_input.sampling_inputs)
            }
            seqs = [seq for seq, _ in batch]
            for seq in seqs:  # constrained: the grammar's state after `step` proposed tokens
                if seq.grammar is not None:
                    seq.grammar.matcher.fill_next_token_bitmask(seq.proposal.bitmask, step)
            tokens = self._pick(
                logits[[order[shadow.seq_id] for _, shadow in batch]].float(),
                seqs,
                step,
                batch_for(seqs),
            )
            for (seq, shadow), item, token in zip(batch, scheduled, tokens):
                shadow.num_computed_tokens += item.num_new_tokens
                seq.proposal.token_ids.append(token)
                shadow.token_ids.append(token)
                if seq.grammar is not None:
                    seq.grammar.matcher.accept_token(token)  # allowed by the mask
                    if seq.grammar.is_terminated:
                        stopped.add(seq.seq_id)
        for seq, _, _ in active:
            if seq.proposal.draft_probs is not None:
                seq.proposal.draft_probs = (
                    torch.cat(seq.proposal.draft_probs) if seq.proposal.draft_probs else None
                )
            if seq.grammar is not None:  # the row after the proposal, then the matcher back
                count, matcher = len(seq.proposal.token_ids), seq.grammar.matcher
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(seq.proposal.bitmask, count)
                if count:
                    matcher.rollback(count)
                seq.proposal.bitmask = seq.proposal.bitmask[: count + 1]

    @staticmethod
    def _pick(
        logits: torch.Tensor, seqs: list[Sequence], step: int, batch: SamplingBatch
    ) -> list[int]:
        """Each row's draft token: the sampler's processing of the row (layers/sampler.py, under a
        constrained sequence's bitmask), then the argmax for greedy requests, else a draw whose
        distribution is kept as q."""
        for row, seq in enumerate(seqs):
            if seq.grammar is not None:
                apply_token_bitmask(
                    logits,
                    seq.proposal.bitmask[step : step + 1].to(logits.device),
                    torch.tensor([row], device=logits.device),
                )
        processed = processed_logits(logits, batch)
        probs = processed if batch.all_greedy else sampling_probs(processed, batch)
        tokens = []
        for row, seq in enumerate(seqs):
            if seq.params.temperature == 0:
                tokens.append(int(processed[row].argmax()))
                continue
            seq.proposal.draft_probs.append(probs[row : row + 1])
            noise = torch.empty_like(probs[row]).exponential_(
                generator=seq.generator or batch.default_generator
            )
            tokens.append(int((probs[row] / noise).argmax()))
        return tokens
