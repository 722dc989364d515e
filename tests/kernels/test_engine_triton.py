"""End to end: the engine with NANOSERVE_KERNELS=triton (the interpreter on a CPU) produces the
same greedy tokens as with the torch references, on a tiny random Llama (GQA, head_dim 16),
through chunked prefill, a cached prefix and batched decode."""

from __future__ import annotations

import random

import pytest

import nanoserve.kernels as kernels
from nanoserve import LLM, SamplingParams
from nanoserve.kernels import reset_kernel_choice

NUM_TOKENS = 8


def _generate(tiny_llama_dir, prompts, monkeypatch, kernels: str) -> list[list[int]]:
    monkeypatch.setenv("NANOSERVE_KERNELS", kernels)
    reset_kernel_choice()
    # A small pool: the interpreter copies every tensor argument per launch. A small token budget
    # splits the longest prompt into prefill chunks.
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=48,
        max_num_batched_tokens=40,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # A second request that shares the long prompt's first blocks: a cached prefix.
    again = llm.generate(
        [{"prompt_token_ids": prompts[-1][:35] + [7, 8, 9]}], params, use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outputs + again]


pytest.importorskip("transformers", reason="the tiny_llama_dir fixture writes with transformers")


def test_engine_greedy_tokens_same_with_triton_kernels(tiny_llama_dir, monkeypatch):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 19, 57)]
    reference = _generate(tiny_llama_dir, prompts, monkeypatch, "reference")
    launches = []
    for name in (
        "paged_attention_triton",
        "store_kvcache_triton",
        "rms_norm_triton",
        "fused_add_rms_norm_triton",
        "apply_rotary_triton",
    ):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels,
            name,
            lambda *a, _real=real, _name=name, **k: launches.append(_name) or _real(*a, **k),
        )
    triton = _generate(tiny_llama_dir, prompts, monkeypatch, "triton")
    assert len(set(launches)) == 5, f"not every op ran on Triton: {sorted(set(launches))}"
    assert all(len(tokens) == NUM_TOKENS for tokens in reference)
    assert triton == reference
