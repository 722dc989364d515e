"""Speculative decoding, the engine's side: the proposer --speculative-config asks for, the
proposals asked of it before each step, and what verification leaves behind (the KV of kept
proposals, the acceptance counts). The proposers and the verification: engine/spec_decode/."""

from __future__ import annotations

from collections.abc import Callable

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.seq_inputs import sampling_input
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode.draft import DraftProposer
from nanoserve.engine.spec_decode.metrics import SpecDecodingStats
from nanoserve.engine.spec_decode.ngram import NgramProposer
from nanoserve.engine.startup import resolve_model_dir
from nanoserve.engine.step_input import SamplingInput
from nanoserve.layers.sampler import SamplerOutput, SamplingBatch
from nanoserve.models.config import ModelConfig


class Speculation:
    """--speculative-config: the proposer and the acceptance counts, with what the engine's
    proposals and verifications need of it."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        runner: ModelRunner,
        max_model_len: int,
        rows_batch: Callable[[list[SamplingInput]], SamplingBatch | None],
        block_managers: list[BlockManager],
    ) -> None:
        self.proposer = make_proposer(config, model_config, runner)
        self.stats = SpecDecodingStats(config.speculative.num_speculative_tokens)
        self.max_model_len, self.vocab_size = max_model_len, model_config.vocab_size
        self.block_managers = block_managers
        self.rows_batch = rows_batch  # the sampler's batch over the given rows

    def seqs_batch(self, seqs: list[Sequence]) -> SamplingBatch | None:
        """The sampler's batch for a draft's rows, one per sequence."""
        return self.rows_batch([sampling_input(seq) for seq in seqs])

    def propose(self, running: list[Sequence]) -> None:
        propose(self.proposer, running, self.max_model_len, self.seqs_batch, self.vocab_size)

    def after_verification(self, seqs: list[Sequence], result: SamplerOutput | None) -> None:
        after_verification(seqs, result, self.stats, self.block_managers)

    def drop(self, seq: Sequence) -> None:
        """A finished or aborted sequence: its proposer state (a draft's blocks) goes."""
        self.proposer.drop(seq)


def make_proposer(
    config: EngineConfig, model_config: ModelConfig, runner: ModelRunner
) -> NgramProposer | DraftProposer:
    """N-gram lookup, or a draft model on a KV pool of its own holding as many tokens as the
    target's."""
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    return DraftProposer(
        config,
        resolve_model_dir(spec.model),
        model_config,
        runner.num_kv_blocks,
        runner.device,
        spec.num_speculative_tokens,
    )


def propose(
    proposer: NgramProposer | DraftProposer,
    running: list[Sequence],
    max_model_len: int,
    rows_batch: Callable[[list[Sequence]], SamplingBatch | None],
    vocab_size: int,
) -> None:
    """Speculative decoding: the tokens each running decode proposes for this step (the
    scheduler cuts them to its budget). None for a sequence whose next rows the sampler
    would process differently from one position to the next (penalties counting the
    proposals, min_tokens still masking EOS), or that still scores its prompt. A constrained
    sequence's proposal is cut where its grammar refuses it (engine/spec_decode/grammar.py)."""
    wanted = []
    for seq in running:
        params = seq.params
        seq.clear_proposal()
        # Room for the proposal and the token verification adds after it.
        limit = min(proposer.k, max_model_len - seq.num_tokens - 1)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
        if (
            limit <= 0
            or seq.num_computed_tokens != seq.num_tokens - 1
            or seq.num_computed_tokens < seq.num_prompt_tokens
            or seq.needs_prompt_logprobs
            or seq.num_output_tokens < params.min_tokens
            or params.repetition_penalty != 1.0
            or params.frequency_penalty
            or params.presence_penalty
        ):
            continue
        wanted.append((seq, limit))
    proposer.propose_for(wanted, rows_batch, vocab_size)


def after_verification(
    seqs: list[Sequence],
    result: SamplerOutput | None,
    spec_stats: SpecDecodingStats,
    block_managers: list[BlockManager],
) -> None:
    """Verified sequences keep the KV of their kept proposals (every token but the one
    emitted last is computed now), give back the blocks of rejected ones, and register
    only blocks of kept tokens in the prefix cache."""
    for seq, emitted in zip(seqs, result.spec if result is not None and result.spec else ()):
        spec_stats.observe(len(seq.proposal.token_ids), len(emitted) - 1)
    for seq in seqs:
        if not seq.is_finished:
            seq.num_computed_tokens = seq.num_tokens - 1
            manager = block_managers[seq.virtual_engine]
            manager.trim(seq)
            manager.register_full_blocks(seq)
        seq.clear_proposal()
