"""LLaVA-1.5 against transformers on a random tiny checkpoint, in fp32: its weights under both
transformers' naming, the image embeddings, greedy tokens for prompts with one and two images
(offline generate and chat), chunked prefill through an image, the encoder cache, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.errors import InvalidRequestError
from nanoserve.models.config import ModelConfig
from nanoserve.models.registry import build_model, check_pipeline_support, check_vision_support
from nanoserve.multimodal.processor import ClipImageProcessor
from tests.multimodal.llava_checkpoint import IMAGE_SIZE, transformers_processor
from tests.multimodal.test_preprocessing import random_image

MAX_TOKENS = 12
ONE_IMAGE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO_IMAGES = "USER: <image>\nand <image>\nCompare them. ASSISTANT:"
IMAGES = [random_image(70, 56, "RGB", 11), random_image(56, 90, "RGBA", 12)]


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    import transformers as hf

    return hf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def make_llm(llava_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=str(llava_dir), dtype="float32", limit_mm_per_prompt={"image": 2}, **kwargs)


@pytest.fixture(scope="module")
def llm(llava_dir):
    return make_llm(llava_dir)


def hf_greedy(hf_model, processor, text: str, images) -> list[int]:
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


# transformers 5's save_pretrained writes language_model.model.*, vision_tower.encoder.*, ...:
# rewritten to the names of transformers 4.x's checkpoints (llava-hf on the hub) and of 4.52+.
LEGACY_NAMES = [("vision_tower.", "vision_tower.vision_model.")]
NEW_NAMES = [
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
]


@pytest.mark.parametrize("renames", [LEGACY_NAMES, NEW_NAMES], ids=["4.x", "4.52+"])
def test_weights_load_under_each_naming(llava_dir, tmp_path, renames):
    renamed = {}
    for name, tensor in load_file(llava_dir / "model.safetensors").items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(llava_dir / "config.json", tmp_path / "config.json")
    config = ModelConfig.from_dir(llava_dir)
    saved = build_model(config, torch.float32, torch.device("cpu"), llava_dir).state_dict()
    other = build_model(config, torch.float32, torch.device("cpu"), tmp_path).state_dict()
    assert saved.keys() == other.keys()
    for name in saved:
        assert torch.equal(saved[name], other[name]), name


def test_image_embeddings_equal_transformers(llava_dir, hf_llava):
    config = ModelConfig.from_dir(llava_dir)
    assert config.vision.image_seq_length == (IMAGE_SIZE // 14) ** 2
    model = build_model(config, torch.float32, torch.device("cpu"), llava_dir)
    processor = ClipImageProcessor.from_dir(llava_dir, IMAGE_SIZE)
    pixels = torch.stack([processor.pixel_values(image) for image in IMAGES])
    with torch.no_grad():
        ours = model.embed_images(pixels)
        theirs = hf_llava.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-2, vision_feature_select_strategy="default"
        )
    theirs = getattr(theirs, "pooler_output", theirs)
    theirs = torch.stack(list(theirs)) if isinstance(theirs, (list, tuple)) else theirs
    theirs = theirs.reshape(ours.shape)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text,images", [(ONE_IMAGE, IMAGES[:1]), (TWO_IMAGES, IMAGES)])
def test_greedy_tokens_equal_transformers(llm, llava_dir, hf_llava, text, images):
    expected = hf_greedy(hf_llava, transformers_processor(llava_dir), text, images)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert len(expected) > 3  # not a lone end-of-sequence token
    assert out.outputs[0].token_ids == expected
    # the prompt's image placeholders were expanded as LlavaProcessor expands them
    processor = transformers_processor(llava_dir)
    assert out.prompt_token_ids == list(processor(text=text, images=images)["input_ids"][0])


def test_chat_equals_transformers_chat_template(llm, llava_dir, hf_llava):
    """A text turn (string content), then an image part: the template reads parts, as
    transformers' apply_chat_template renders them."""
    from tests.multimodal.test_preprocessing import data_url

    image_part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[1]), "detail": "auto"}}
    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [image_part, {"type": "text", "text": "What is this?"}]},
    ]
    processor = transformers_processor(llava_dir)
    hf_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    assert "Hello." in text and "<image>" in text
    # the data: URL's PNG decodes to the same pixels as the image itself
    expected = hf_greedy(hf_llava, processor, text, [IMAGES[1]])
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text
    assert out.outputs[0].token_ids == expected


def test_chunked_prefill_through_images_equals_unchunked(llm, llava_dir):
    """6-token chunks cut each image's 16 tokens into pieces."""
    prompt = {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}}
    whole = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    chunked_llm = make_llm(llava_dir, max_num_batched_tokens=6, enable_prefix_caching=False)
    chunked = chunked_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert chunked == whole


def test_encoder_runs_once_per_image(llava_dir):
    llm = make_llm(llava_dir, enable_prefix_caching=False)
    cache = llm.llm_engine.runner.encoder_cache
    prompts = [
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[0]}},
        {
            "prompt": "USER: <image>\nDescribe it. ASSISTANT:",
            "multi_modal_data": {"image": IMAGES[0]},
        },
    ]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert cache.num_encoded_images == 1  # one image, two requests
    llm.generate(
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[1]}}, GREEDY, use_tqdm=False
    )
    assert cache.num_encoded_images == 2


def test_preemption_by_recompute_keeps_the_images(llava_dir, llm):
    """So few KV blocks that the two requests cannot both run: one is preempted and recomputed."""
    prompts = [
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES[::-1]}},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    small = make_llm(llava_dir, num_kv_blocks=8, block_size=16, enable_prefix_caching=False)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_image_count_placeholders_and_text_only_refusals(llm, tiny_llama_dir):
    three = {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES + IMAGES[:1]}}
    with pytest.raises(InvalidRequestError, match="At most 2 image") as error:
        llm.generate(three, GREEDY, use_tqdm=False)
    assert error.value.param == "image_url"
    with pytest.raises(InvalidRequestError, match="placeholder") as error:
        llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES}}, GREEDY)
    assert error.value.param == "image_url"
    text_only = LLM(model=str(tiny_llama_dir), num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="text-only") as error:
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    assert error.value.param == "image_url"


def test_pipeline_parallel_and_draft_models_are_refused(llava_dir, tiny_llama_dir):
    check_vision_support(ModelConfig.from_dir(llava_dir), 2)  # tp: test_llava_tensor_parallel.py
    with pytest.raises(ValueError, match="pipeline-parallel-size"):
        check_pipeline_support(ModelConfig.from_dir(llava_dir), 2)
    draft = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft model"):
        LLM(model=str(llava_dir), num_kv_blocks=16, speculative_config=draft)


def test_limit_flag_is_checked():
    from nanoserve.config import EngineConfig

    assert EngineConfig(limit_mm_per_prompt=json.dumps({"image": 3})).max_images_per_prompt == 3
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        EngineConfig(limit_mm_per_prompt={"video": 1})
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        EngineConfig(limit_mm_per_prompt={"image": -1})


def test_string_content_template_gets_the_placeholder_where_the_part_was(llava_dir):
    """A template that reads content as a string (ChatML's) gets the image's placeholder text
    in place of the part; a text-only model's tokenizer refuses the part."""
    from nanoserve.engine.startup import load_tokenizer
    from tests.conftest import CHATML_TEMPLATE

    tokenizer = load_tokenizer(None, llava_dir)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "See"}, part]}]
    with pytest.raises(ValueError, match="image_url"):
        tokenizer.apply_chat_template(messages, chat_template=CHATML_TEMPLATE)
    tokenizer.image_placeholder = "<image>"
    text = tokenizer.apply_chat_template(messages, chat_template=CHATML_TEMPLATE)
    plain = tokenizer.apply_chat_template(
        [{"role": "user", "content": "See\n<image>"}], chat_template=CHATML_TEMPLATE
    )
    assert text == plain
