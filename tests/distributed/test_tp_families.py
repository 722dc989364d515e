"""Tensor parallelism (gloo on CPU, 2 ranks) for the new families and windowed Mistral: greedy tokens equal
transformers' for prompts shorter and longer than the sliding window, and each rank holds
about half the weights (Phi-3's fused qkv_proj / gate_up_proj split by heads and rows)."""

from __future__ import annotations

import pytest

from tests.distributed.test_tensor_parallel import greedy_ids
from tests.engine.hf_oracle import hf_greedy
from tests.helpers import random_prompts
from tests.models.family_checkpoints import WINDOW, write_random_checkpoint
from tests.models.test_families import load_hf


@pytest.mark.parametrize("family", ["qwen3", "phi3", "phi4-mini", "gemma2", "gemma3", "mistral"])
def test_tp2_matches_transformers_and_splits_weights(family, tmp_path):
    model_dir = write_random_checkpoint(tmp_path / family, family)
    hf_model = load_hf(model_dir)
    prompts = random_prompts(1, 300, seed=31, min_len=6, max_len=WINDOW - 4)
    prompts += random_prompts(1, 300, seed=32, min_len=2 * WINDOW, max_len=3 * WINDOW)
    expected = [hf_greedy(hf_model, prompt, 16) for prompt in prompts]
    full_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    out, rank_bytes = greedy_ids(
        model_dir,
        [{"prompt_token_ids": p} for p in prompts],
        num_kv_blocks=32,
        tensor_parallel_size=2,
    )
    assert out == expected
    assert len(rank_bytes) == 2
    for rank_total in rank_bytes:  # norms replicated, everything else split in two
        assert rank_total <= 0.6 * full_bytes, (rank_total, full_bytes)
