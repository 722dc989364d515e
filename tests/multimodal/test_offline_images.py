"""vLLM's offline API with images: a list of prompts in one `LLM.generate` call (one PIL image,
a list, token ids, none) and a list of conversations in one `LLM.chat` call each give what each
gives alone (each alone is checked against transformers in test_llava.py); bad image inputs are
one-line ValueErrors, as vLLM raises them, and leave nothing behind in the engine; vLLM's
image_pil chat parts; prompt logprobs with an image against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from tests.multimodal.test_llava import (  # noqa: F401 (hf_llava: a fixture)
    GREEDY,
    IMAGES,
    ONE_IMAGE,
    TWO_IMAGES,
    hf_llava,
    make_llm,
)
from tests.multimodal.test_preprocessing import data_url


@pytest.fixture(scope="module")
def llm(llava_dir):
    return make_llm(llava_dir)


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_a_list_of_prompts_gives_what_each_gives_alone(llm):
    image_ids = llm.llm_engine.tokenizer.encode(ONE_IMAGE, add_special_tokens=False)
    prompts = [
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[1]}},
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
        "USER: no image here. ASSISTANT:",
        {"prompt_token_ids": image_ids, "multi_modal_data": {"image": [IMAGES[0]]}},
    ]
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [llm.generate(prompt, GREEDY, use_tqdm=False)[0] for prompt in prompts]
    assert tokens(together) == tokens(alone)
    assert [o.prompt_token_ids for o in together] == [o.prompt_token_ids for o in alone]


def test_a_list_of_conversations_gives_what_each_gives_alone(llm):
    def conversation(image, text: str) -> list[dict]:
        part = {"type": "image_url", "image_url": {"url": data_url(image)}}
        return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]

    conversations = [
        conversation(IMAGES[0], "What is it?"),
        [{"role": "user", "content": "No image."}],
        conversation(IMAGES[1], "And this one?"),
    ]
    together = llm.chat(conversations, GREEDY, use_tqdm=False)
    alone = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in conversations]
    assert len(together) == 3
    assert tokens(together) == tokens(alone)


@pytest.mark.parametrize(
    "multi_modal_data,message",
    [
        ({"image": "cat.png"}, "PIL images, got str"),
        ({"image": np.zeros((56, 56, 3), np.uint8)}, "PIL images, got ndarray"),
        ([IMAGES[0]], "multi_modal_data is a dict"),
        ({"video": IMAGES[0]}, "only 'image'"),
        ({"image": IMAGES}, "placeholder"),
    ],
    ids=["path", "array", "list", "video", "two-for-one"],
)
def test_bad_images_are_one_line_value_errors_that_leave_nothing(llm, multi_modal_data, message):
    good = {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[0]}}
    bad = {"prompt": ONE_IMAGE, "multi_modal_data": multi_modal_data}
    with pytest.raises(ValueError, match=message) as error:
        llm.generate([good, bad], GREEDY, use_tqdm=False)
    assert "\n" not in str(error.value)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_managers[0].num_used_blocks == 0
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_takes_vllms_image_pil_parts(llm):
    """`{"type": "image_pil", "image_pil": image}` (vLLM's LLM.chat part) reads as the same
    image sent as a PNG data: URL, mixed with image_url parts in their order."""

    def message(*parts) -> list[dict]:
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare."}]}]

    def pil(image) -> dict:
        return {"type": "image_pil", "image_pil": image}

    def url(image) -> dict:
        return {"type": "image_url", "image_url": {"url": data_url(image)}}

    by_pil = llm.chat(message(pil(IMAGES[0]), url(IMAGES[1])), GREEDY, use_tqdm=False)[0]
    by_url = llm.chat(message(url(IMAGES[0]), url(IMAGES[1])), GREEDY, use_tqdm=False)[0]
    assert by_pil.prompt_token_ids == by_url.prompt_token_ids
    assert by_pil.outputs[0].token_ids == by_url.outputs[0].token_ids
    swapped = llm.chat(message(pil(IMAGES[1]), url(IMAGES[0])), GREEDY, use_tqdm=False)[0]
    assert swapped.outputs[0].token_ids != by_pil.outputs[0].token_ids
    with pytest.raises(ValueError, match="image_pil part holds a PIL image, got str") as error:
        llm.chat(message(pil("cat.png")), GREEDY, use_tqdm=False)
    assert error.value.param == "messages[0].content[0].image_pil"


def test_prompt_logprobs_with_an_image_equal_transformers(llm, llava_dir, hf_llava):  # noqa: F811
    """Every prompt position's logprob, the image tokens' included (the cache is skipped)."""
    import torch

    from nanoserve import SamplingParams
    from tests.multimodal.llava_checkpoint import transformers_processor

    prompt = {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[1]}}
    llm.generate(prompt, GREEDY, use_tqdm=False)  # its blocks cached first
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    inputs = transformers_processor(llava_dir)(
        text=ONE_IMAGE, images=[IMAGES[1]], return_tensors="pt"
    )
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_llava(**inputs).logits[0], dim=-1)
    ids = inputs["input_ids"][0].tolist()
    assert out.prompt_token_ids == ids and out.prompt_logprobs[0] is None
    expected = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    got = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert got == pytest.approx(expected, abs=1e-4)
