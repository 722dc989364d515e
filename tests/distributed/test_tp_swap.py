"""Preemption by swapping with tensor parallelism (CPU, gloo): every rank copies its own shard of
the pool out and back in, so --tp 2 over a far too small pool gives a roomy --tp 1's tokens."""

from __future__ import annotations

from nanoserve import LLM, SamplingParams
from tests.engine.test_swap_preemption import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def generate(model_dir, prompts, **engine_args):
    with LLM(
        model=str(model_dir), dtype="float32", max_num_batched_tokens=256, **engine_args
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.stats()
        host_pool = llm.llm_engine.host_pool
        return [o.outputs[0].token_ids for o in outputs], stats, host_pool


def test_tp2_swap_equals_roomy_tp1(tiny_llama_dir):
    prompts = random_prompts(24, 300, seed=31)
    reference, _, _ = generate(tiny_llama_dir, prompts, num_kv_blocks=512)
    swapped, stats, host_pool = generate(
        tiny_llama_dir,
        prompts,
        num_kv_blocks=24,
        tensor_parallel_size=2,
        preemption_mode="swap",
        num_swap_blocks=128,
    )
    assert swapped == reference
    assert (
        stats.num_swap_outs_total > 0 and stats.num_preemptions_total == stats.num_swap_outs_total
    )
    assert host_pool.num_used_blocks == 0 and stats.kv_cache_usage == 0


def test_tp2_fp8_pool_with_swap_equals_tp1(tiny_llama_dir):
    """--kv-cache-dtype fp8: each rank's shard of the pool is fp8 (its own heads' K/V), swapped as
    bytes; --tp 2 over a small pool gives a roomy --tp 1 fp8 pool's tokens."""
    prompts = random_prompts(16, 300, seed=32)
    reference, _, _ = generate(tiny_llama_dir, prompts, num_kv_blocks=512, kv_cache_dtype="fp8")
    swapped, stats, _ = generate(
        tiny_llama_dir,
        prompts,
        num_kv_blocks=24,
        tensor_parallel_size=2,
        preemption_mode="swap",
        num_swap_blocks=128,
        kv_cache_dtype="fp8",
    )
    assert swapped == reference
    assert stats.num_swap_outs_total > 0
