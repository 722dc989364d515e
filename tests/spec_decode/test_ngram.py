"""The n-gram proposer against exact expected proposals and a brute-force oracle."""

from __future__ import annotations

import random

import pytest

from nanoserve.engine.spec_decode.ngram import NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n first; for that n, the latest earlier occurrence; what followed it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # "5 6 7" occurs at 0 (followed by 8 9 10) and at 5 (followed by 11 12): the latest wins.
    assert proposer.propose([5, 6, 7, 8, 9, 5, 6, 7, 11, 12, 5, 6, 7]) == [11, 12, 5]
    # Only a 1-gram matches: "4" followed by 1.
    assert proposer.propose([4, 1, 2, 3, 4]) == [1, 2, 3]
    # A longer match beats a later shorter one: "2 3" at 1 (then 9); "3" alone at 5 (then 7).
    assert proposer.propose([1, 2, 3, 9, 0, 3, 7, 2, 3]) == [9, 0, 3]


def test_nothing_to_look_up_proposes_nothing():
    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    assert proposer.propose(list(range(100))) == []
    assert proposer.propose([7, 7]) == []  # the suffix itself is not an earlier occurrence
    assert proposer.propose([]) == []


def test_proposal_is_cut_by_max_tokens_and_by_the_sequence_end():
    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    assert proposer.propose([1, 2, 3, 1, 2], max_tokens=1) == [3]
    assert proposer.propose([1, 2, 3, 1, 2], max_tokens=0) == []
    assert proposer.propose([1, 2, 1, 2]) == [1, 2]  # only two tokens follow the match


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_on_random_sequences(seed):
    rng = random.Random(seed)
    k, min_n, max_n = rng.randint(1, 5), rng.randint(1, 3), rng.randint(3, 5)
    proposer = NgramProposer(k, min_n, max_n)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 60))]
        assert proposer.propose(tokens) == brute_force(tokens, k, min_n, max_n), tokens


@pytest.mark.parametrize("args", [(0, 1, 2), (2, 0, 2), (2, 3, 2)])
def test_bad_settings_are_refused(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)
