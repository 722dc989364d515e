"""Preemption with images, against the same requests run in a roomy pool (greedy, fp32): by swap
(the swapped-out request resumes with its images' rows as they were, mid-prompt included) and by
recompute while the encoder cache holds a single image, so a preempted request's images are
encoded again from the pixel values it keeps; the encoder cache shared across requests and the
turns of a conversation (runs of the vision encoder counted)."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.multimodal.test_llava import TWO_IMAGES, make_llm
from tests.multimodal.test_preprocessing import data_url, random_image

POOL = [random_image(56 + 5 * i, 64 - 3 * i, "RGB", 300 + i) for i in range(4)]
# Four requests of 2 images each: 32 image tokens + 32 of text, then 40 output tokens: 7 blocks
# of 16 each; 10 blocks hold one of them at a time.
PROMPTS = [
    {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [POOL[i], POOL[(i + 1) % 4]]}}
    for i in range(4)
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SMALL = dict(num_kv_blocks=10, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def expected(llava_dir) -> list[list[int]]:
    """Each request alone in a roomy pool: no preemption, each image encoded once."""
    llm = make_llm(llava_dir, enable_prefix_caching=False)
    tokens = [llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert llm.llm_engine.stats().num_preemptions_total == 0
    assert llm.llm_engine.runner.encoder_cache.num_encoded_images == len(POOL)
    return tokens


def assert_no_blocks_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.block_managers[0].num_used_blocks == 0
    if engine.host_pool is not None:
        assert engine.host_pool.num_used_blocks == 0


def one_image_encoder_cache(llm: LLM):
    cache = llm.llm_engine.runner.encoder_cache
    cache.max_entries = 1
    return cache


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prompts", "8-token-chunks"])
def test_swap_resumes_with_the_images_rows(llava_dir, expected, chunk):
    """Swapped out and in (with 8-token chunks: mid-prompt, inside an image's tokens): the same
    tokens as unpreempted, every preemption a swap."""
    extra = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = make_llm(llava_dir, preemption_mode="swap", num_swap_blocks=64, **SMALL, **extra)
    scheduler = llm.llm_engine.schedulers[0]
    swapped_at = []  # (tokens computed, prompt tokens) of each sequence swapped out
    swap_out = scheduler._swap_out

    def recording_swap_out(seq, plan):
        swapped_at.append((seq.num_computed_tokens, seq.num_prompt_tokens))
        swap_out(seq, plan)

    scheduler._swap_out = recording_swap_out
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    if chunk:
        assert any(computed < prompt for computed, prompt in swapped_at)
    stats = llm.llm_engine.stats()
    assert stats.num_swap_outs_total > 0
    assert stats.num_preemptions_total == stats.num_swap_outs_total
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_reencode_evicted_images(llava_dir, expected, mode):
    """An encoder cache of one image: a request whose image was evicted while it was preempted
    (or between its prompt's chunks) has it encoded again from its own pixel values."""
    swap = {"preemption_mode": "swap", "num_swap_blocks": 64} if mode == "swap" else {}
    llm = make_llm(llava_dir, max_num_batched_tokens=8, **SMALL, **swap)
    cache = one_image_encoder_cache(llm)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions_total > 0
    assert cache.num_encoded_images > len(POOL)  # evicted images were encoded again
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_blocks_held(llm)


def conversation(image, turns: list[tuple[str, str | None]]) -> list[dict]:
    """The image in the first user message; (user text, assistant reply) per turn."""
    messages = []
    for i, (user, reply) in enumerate(turns):
        content = [{"type": "text", "text": user}]
        if i == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
        messages.append({"role": "user", "content": content})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    return messages


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_second_turn_does_not_encode_the_image_again(llava_dir, prefix_caching):
    llm = make_llm(llava_dir, enable_prefix_caching=prefix_caching)
    cache = llm.llm_engine.runner.encoder_cache
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = llm.chat(conversation(POOL[0], [("What is it?", None)]), params, use_tqdm=False)[0]
    assert cache.num_encoded_images == 1
    turns = [("What is it?", first.outputs[0].text), ("And its colour?", None)]
    second = llm.chat(conversation(POOL[0], turns), params, use_tqdm=False)[0]
    assert cache.num_encoded_images == 1  # the same image: its embeddings were kept
    # the oracle: the second turn alone, in a fresh engine
    fresh = make_llm(llava_dir, enable_prefix_caching=False)
    alone = fresh.chat(conversation(POOL[0], turns), params, use_tqdm=False)[0]
    assert second.prompt_token_ids == alone.prompt_token_ids
    assert second.outputs[0].token_ids == alone.outputs[0].token_ids


def test_evicted_image_is_encoded_again_with_the_same_tokens(llava_dir):
    llm = make_llm(llava_dir, enable_prefix_caching=False)
    cache = one_image_encoder_cache(llm)
    first, second = (
        {"prompt": TWO_IMAGES.replace("<image>\nand ", ""), "multi_modal_data": {"image": image}}
        for image in POOL[:2]
    )
    before = llm.generate(first, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate(second, PARAMS, use_tqdm=False)  # evicts the first image
    assert cache.num_encoded_images == 2 and len(cache.entries) == 1
    again = llm.generate(first, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert cache.num_encoded_images == 3
    assert again == before


def test_swap_with_the_prefix_cache_and_repeated_images(llava_dir, expected):
    """The requests again, in reverse order: the last ones' blocks are still in the prefix cache
    (found by image) when they come first; swapped out and in (swapped-in blocks registered
    again), the tokens unchanged."""
    llm = make_llm(
        llava_dir, preemption_mode="swap", num_swap_blocks=128, num_kv_blocks=20, block_size=8
    )
    first = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    before = llm.llm_engine.stats()
    again = llm.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)
    after = llm.llm_engine.stats()
    assert after.num_swap_outs_total > before.num_swap_outs_total > 0
    assert after.prefix_cache_hits_total > before.prefix_cache_hits_total
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected[::-1]
    assert_no_blocks_held(llm)
