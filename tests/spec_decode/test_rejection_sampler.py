"""The rejection sampler keeps the target distribution: chi-square tests over many draws with
fixed seeds (deterministic: the same draws every run), with a control showing the test has the
power to reject a sampler that does not (always keeping the proposal)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.spec_decode.rejection_sampler import SpecSequence, rejection_sample

VOCAB = 6
TRIALS = 6000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    statistic = float(((counts.double() - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    return float(
        1
        - torch.special.gammainc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(statistic / 2, dtype=torch.float64),
        )
    )


def emitted_counts(
    target: torch.Tensor, draft: torch.Tensor | None, k: int, keep_all: bool = False
):
    """Per position 0 and 1: how often each token was emitted there, over TRIALS sequences whose
    target is the same distribution at every position (so every emitted token should follow it)."""
    generator = torch.Generator().manual_seed(1234)
    proposal_dist = draft if draft is not None else torch.full((VOCAB,), 1 / VOCAB)
    counts = torch.zeros(2, VOCAB, dtype=torch.long)
    for _ in range(TRIALS):
        drafts = torch.multinomial(proposal_dist, k, replacement=True, generator=generator).tolist()
        if keep_all:
            emitted = drafts + [int(torch.multinomial(target, 1, generator=generator))]
        else:
            seq = SpecSequence(drafts, greedy=False, generator=generator)
            draft_rows = None if draft is None else draft.expand(k, VOCAB)
            emitted = rejection_sample(target.expand(k + 1, VOCAB), [seq], draft_rows)[0]
        for position, token in enumerate(emitted[:2]):
            counts[position, token] += 1
    return counts


@pytest.fixture
def distributions():
    generator = torch.Generator().manual_seed(7)
    target = torch.randn(VOCAB, generator=generator).mul(1.5).softmax(-1)
    draft = torch.randn(VOCAB, generator=generator).mul(1.5).softmax(-1)
    return target, draft


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-model", "ngram"])
def test_emitted_tokens_follow_the_target(distributions, k, with_draft_probs):
    target, draft = distributions
    counts = emitted_counts(target, draft if with_draft_probs else None, k)
    assert counts[0].sum() == TRIALS
    for position in range(2 if k > 1 else 1):
        assert chi_square_p_value(counts[position], target) > 1e-3, counts[position]


def test_the_chi_square_test_rejects_keeping_every_proposal(distributions):
    target, draft = distributions
    counts = emitted_counts(target, draft, 1, keep_all=True)
    assert chi_square_p_value(counts[0], target) < 1e-6


def test_greedy_keeps_proposals_while_they_equal_the_argmax():
    rows = torch.zeros(4, VOCAB)
    best = [2, 5, 1, 3]
    rows[torch.arange(4), best] = 1.0
    seqs = [
        SpecSequence([2, 5, 1], greedy=True),
        SpecSequence([2, 4, 1], greedy=True),
        SpecSequence([0, 5, 1], greedy=True),
    ]
    got = rejection_sample(torch.cat([rows, rows, rows]), seqs)
    assert got == [[2, 5, 1, 3], [2, 5], [2]]


def test_no_proposal_is_a_plain_draw_and_rows_are_checked():
    rows = torch.zeros(1, VOCAB)
    rows[0, 4] = 1.0
    assert rejection_sample(rows, [SpecSequence([], greedy=False)]) == [[4]]
    with pytest.raises(ValueError):
        rejection_sample(torch.zeros(3, VOCAB), [SpecSequence([1], greedy=True)])


def test_seeded_sequences_do_not_depend_on_their_neighbours(distributions):
    target, _ = distributions

    def run(neighbours: int) -> list[int]:
        seqs = [
            SpecSequence([1, 2], greedy=False, generator=torch.Generator().manual_seed(s))
            for s in range(neighbours)
        ]
        seqs.append(SpecSequence([3, 0], greedy=False, generator=torch.Generator().manual_seed(99)))
        return rejection_sample(target.expand(3 * len(seqs), VOCAB), seqs)[-1]

    assert run(0) == run(5)
