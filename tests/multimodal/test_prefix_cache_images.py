"""The prefix cache with images (hypothesis): prompts of the same text with different images
(whose image tokens are the same ids) never share a block, so every request gives the tokens it
gives alone with the cache off; one with the same image and text does hit the cache."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.models.config import ModelConfig
from tests.multimodal.test_preprocessing import random_image

POOL = [random_image(56 + 7 * i, 60, "RGB", 100 + i) for i in range(3)]
TEXTS = ["USER: <image>\nWhat is it? ASSISTANT:", "USER: <image>\n<image>\nSame? ASSISTANT:"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make(llava_dir, cache: bool) -> LLM:
    # 8-token blocks: whole blocks of image tokens, the same ids whatever the image.
    return LLM(
        model=str(llava_dir),
        dtype="float32",
        num_kv_blocks=96,
        block_size=8,
        enable_prefix_caching=cache,
        limit_mm_per_prompt={"image": 2},
    )


@pytest.fixture(scope="module")
def engines(llava_dir):
    return make(llava_dir, True), make(llava_dir, False), {}


def prompt(text: int, images: tuple[int, ...]) -> dict:
    count = TEXTS[text].count("<image>")
    return {"prompt": TEXTS[text], "multi_modal_data": {"image": [POOL[i] for i in images[:count]]}}


@settings(max_examples=12)
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.tuples(st.integers(0, 2), st.integers(0, 2))),
        min_size=1,
        max_size=4,
    )
)
def test_mixed_images_match_running_alone_without_cache(engines, batch):
    cached, plain, alone = engines
    outputs = cached.generate([prompt(*item) for item in batch], PARAMS, use_tqdm=False)
    for item, output in zip(batch, outputs, strict=True):
        key = (item[0], item[1][: TEXTS[item[0]].count("<image>")])
        if key not in alone:
            alone[key] = plain.generate(prompt(*item), PARAMS, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == alone[key].outputs[0].token_ids


def test_same_image_hits_and_other_image_misses(llava_dir):
    llm = make(llava_dir, True)
    first = llm.generate(prompt(0, (0, 0)), PARAMS, use_tqdm=False)[0]
    again = llm.generate(prompt(0, (0, 0)), PARAMS, use_tqdm=False)[0]
    other = llm.generate(prompt(0, (1, 1)), PARAMS, use_tqdm=False)[0]
    num_prompt = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (num_prompt - 1) // 8 * 8
    # the blocks before the image are shared; none from the image's first token on
    image_token = ModelConfig.from_dir(llava_dir).vision.image_token_id
    image_start = first.prompt_token_ids.index(image_token)
    assert other.num_cached_tokens == image_start // 8 * 8 < again.num_cached_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
