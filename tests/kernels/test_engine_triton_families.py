"""End to end on the Triton kernels (the interpreter on a CPU): Gemma 2 (sliding-window and
global layers, soft-capped scores) gives transformers' greedy tokens, with prompts shorter and
longer than the window, a chunked prefill and batched decode. One family only: the
interpreter is slow, and the other families' differences from Llama are torch code."""

from __future__ import annotations

import random

import pytest

import nanoserve.kernels as kernels
from nanoserve import LLM, SamplingParams

pytest.importorskip("transformers", reason="the checkpoints are written with transformers")

from tests.engine.hf_oracle import hf_greedy  # noqa: E402
from tests.models.family_checkpoints import WINDOW, write_random_checkpoint  # noqa: E402
from tests.models.test_families import load_hf  # noqa: E402

NUM_TOKENS = 4


@pytest.mark.parametrize("family", ["gemma2"])
def test_family_on_triton_kernels_matches_transformers(family, tmp_path, monkeypatch):
    model_dir = write_random_checkpoint(tmp_path / family, family)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, WINDOW + 9)]
    expected = [hf_greedy(load_hf(model_dir), prompt, NUM_TOKENS) for prompt in prompts]
    launches = []
    real = kernels.paged_attention_triton
    monkeypatch.setattr(
        kernels,
        "paged_attention_triton",
        lambda *a, **k: launches.append(k.get("sliding_window")) or real(*a, **k),
    )
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert WINDOW in launches
