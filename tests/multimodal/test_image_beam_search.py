"""`LLM.beam_search` with images (vLLM's prompt dict with multi_modal_data) against transformers'
generate(num_beams=...) with the image's pixel values, fp32: the same beams in the same order
with the same scores; every beam's requests reuse the one encoding of the image."""

from __future__ import annotations

import pytest
import torch

from nanoserve.beam_search import BeamSearchParams
from tests.multimodal.llava_checkpoint import transformers_processor
from tests.multimodal.test_llava import IMAGES, ONE_IMAGE, TWO_IMAGES, hf_llava, make_llm  # noqa: F401

MAX_TOKENS = 6


def hf_beams(model, processor, text: str, images, width: int) -> list[tuple[list[int], float]]:
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            early_stopping=False,
            eos_token_id=None,
            pad_token_id=-1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    num_prompt = inputs["input_ids"].shape[1]
    return [
        (row[num_prompt:], score)
        for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist())
    ]


@pytest.mark.parametrize("width", [2, 3])
def test_beams_with_images_equal_transformers(llava_dir, hf_llava, width):  # noqa: F811
    llm = make_llm(llava_dir, num_kv_blocks=128)
    processor = transformers_processor(llava_dir)
    prompts = [
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[0]}},
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
    ]
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.beam_search(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_beams(
            hf_llava, processor, prompt["prompt"], prompt["multi_modal_data"]["image"], width
        )
        num_prompt = len(result.sequences[0].tokens) - MAX_TOKENS
        got = [(beam.tokens[num_prompt:], beam.score) for beam in result.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, ours), (_, theirs) in zip(got, expected):
            assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-4)
    # two distinct images in all, each encoded once for every beam of every step
    assert llm.llm_engine.runner.encoder_cache.num_encoded_images == 2
