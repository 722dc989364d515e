"""Tensor and pipeline parallelism on a quantized GGUF model (CPU, gloo): the same greedy tokens
as one rank. Column-parallel layers take whole block rows, row-parallel layers whole blocks of
each row (models/gguf/weights.py), the tied Q8_0 head its vocabulary rows."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.gguf_models import write_quantized_gguf
from tests.helpers import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy_ids(path, prompts, **engine_args):
    with LLM(
        model=str(path), dtype="float32", num_kv_blocks=128, device="cpu", **engine_args
    ) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], list(
            llm.llm_engine.runner.rank_weight_bytes
        )


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(4, 300, seed=28)]


@pytest.mark.parametrize(
    "preset,tp,arch",
    [
        ("q4_1", 2, "llama"),
        ("q8_0", 4, "llama"),
        ("llama_cpp_q5_k_m", 2, "llama"),
        ("q4_1", 2, "qwen2"),
    ],
)
def test_tensor_parallel_equals_one_rank(tmp_path, prompts, preset, tp, arch):
    # tp 4 with 2 KV heads: each KV head's block rows on two ranks. llama_cpp_q5_k_m: o_proj's
    # Q5_1 rows split into blocks of 32, layer 0's ffn_down Q5_K rows (512) into one 256-block
    # each; layer 1's QKV is Q5_1 q and k beside a Q8_0 v. qwen2: the Q/K/V biases split with
    # their rows.
    path = write_quantized_gguf(tmp_path, preset, seed=5, arch=arch)
    ref, (full_bytes,) = greedy_ids(path, prompts)
    out, rank_bytes = greedy_ids(path, prompts, tensor_parallel_size=tp)
    assert out == ref
    assert len(rank_bytes) == tp and all(b < full_bytes for b in rank_bytes)


def test_pipeline_parallel_equals_one_stage(tmp_path, prompts):
    path = write_quantized_gguf(tmp_path, "q4_k_m", seed=5)
    ref, _ = greedy_ids(path, prompts)
    out, _ = greedy_ids(path, prompts, pipeline_parallel_size=2)
    assert out == ref
