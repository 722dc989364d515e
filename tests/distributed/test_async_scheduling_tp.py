"""--async-scheduling with tensor parallelism on the CPU (gloo): rank 0 writes the token the step
before sampled into the step's input ids before it sends them, so every rank runs the same
step; the tokens are those of --tp 1 without the flag."""

from __future__ import annotations

from nanoserve import LLM, SamplingParams
from tests.helpers import random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_tp2_with_async_scheduling_equals_tp1(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 300, seed=23)]
    outputs = []
    for extra in ({}, {"tensor_parallel_size": 2, "async_scheduling": True}):
        with LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, **extra) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)])
            if extra:
                assert llm.llm_engine.async_scheduling.log.num_overlapped >= 11
    assert outputs[0] == outputs[1]
