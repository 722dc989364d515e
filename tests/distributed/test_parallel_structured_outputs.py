"""Structured outputs under tensor and pipeline parallelism: only rank 0 samples (the LM head's
shards are gathered to it; the last pipeline stage sends it the logits of a constrained batch,
never only its argmax), so the bitmask is applied there once and the other ranks follow the
tokens it sends. --tp 2 and --pp 2 give the single-rank constrained tokens, which match the
grammar."""

from __future__ import annotations

import re

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers import random_prompts

REGEX = r"[a-z]{2,8}( [a-z]{2,8}){2,5}\."


def constrained_outputs(model_dir, prompts, **engine_args):
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 1.0,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        )
        for i in range(len(prompts))
    ]
    with LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]


def test_tp2_and_pp2_constrained_equal_one_rank(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 300, seed=5)]
    reference = constrained_outputs(tiny_llama_dir, prompts)
    assert constrained_outputs(tiny_llama_dir, prompts, tensor_parallel_size=2) == reference
    assert constrained_outputs(tiny_llama_dir, prompts, pipeline_parallel_size=2) == reference
    for _, text in reference:
        assert re.fullmatch(REGEX, text), text
