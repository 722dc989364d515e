"""End to end on the Triton kernels (the interpreter on a CPU), the experts through
kernels/fused_moe.fused_experts_triton: Mixtral's greedy tokens equal transformers', with a
chunked prefill and batched decode."""

from __future__ import annotations

import random

import pytest

import nanoserve.kernels as kernels
import nanoserve.kernels.fused_moe as fused_moe
from nanoserve import LLM, SamplingParams

pytest.importorskip("transformers", reason="the checkpoints are written with transformers")

from tests.engine.hf_oracle import hf_greedy  # noqa: E402
from tests.models.moe_checkpoints import write_moe_checkpoint  # noqa: E402
from tests.models.test_families import load_hf  # noqa: E402

NUM_TOKENS = 4


def test_mixtral_on_triton_kernels_matches_transformers(tmp_path, monkeypatch):
    model_dir = write_moe_checkpoint(tmp_path / "mixtral", "mixtral")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 40)]
    expected = [hf_greedy(load_hf(model_dir), prompt, NUM_TOKENS) for prompt in prompts]
    launches = []
    real = fused_moe.fused_experts_triton
    monkeypatch.setattr(
        fused_moe, "fused_experts_triton", lambda *a, **k: launches.append(1) or real(*a, **k)
    )
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    try:
        llm = LLM(
            model=str(model_dir), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=32
        )
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.reset_kernel_choice()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert launches  # the experts ran on the Triton kernel
