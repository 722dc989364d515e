"""Qwen2.5-VL preempted by swap (--preemption-mode swap), whole prompts and 8-token chunks, and
by recompute with an encoder cache of one image: the same greedy tokens as unpreempted (its
M-RoPE positions and image rows as they were), every preemption a swap in swap mode."""

from __future__ import annotations

import pytest

from nanoserve import SamplingParams
from tests.multimodal.test_qwen2_5_vl import IMAGES, chat_text, hf_processor, make_llm  # noqa: F401

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(hf_processor):  # noqa: F811
    text = chat_text(hf_processor, 2)
    return [
        {"prompt": text, "multi_modal_data": {"image": IMAGES}},
        {"prompt": text, "multi_modal_data": {"image": IMAGES[::-1]}},
    ]


@pytest.fixture(scope="module")
def expected(qwen_vl_dir, prompts) -> list[list[int]]:
    llm = make_llm(qwen_vl_dir, enable_prefix_caching=False)
    tokens = [llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.llm_engine.stats().num_preemptions_total == 0
    return tokens


@pytest.mark.parametrize("mode,chunk", [("swap", None), ("swap", 8), ("recompute", 8)], ids=str)
def test_preempted_qwen_vl_gives_the_unpreempted_tokens(
    qwen_vl_dir, prompts, expected, mode, chunk
):
    extra = {"max_num_batched_tokens": chunk} if chunk else {}
    if mode == "swap":
        extra |= {"preemption_mode": "swap", "num_swap_blocks": 64}
    llm = make_llm(
        qwen_vl_dir, num_kv_blocks=15, block_size=16, enable_prefix_caching=False, **extra
    )
    cache = llm.llm_engine.runner.encoder_cache
    cache.max_entries = 1  # an image is evicted whenever the other one is encoded
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions_total > 0
    if mode == "swap":
        assert stats.num_swap_outs_total == stats.num_preemptions_total
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.block_managers[0].num_used_blocks == 0
