"""Qwen2.5-VL against transformers on a random tiny checkpoint, in fp32: the processor's
pixel values, grids and expanded prompt, the weights under both namings, the image embeddings
(window attention, 2D rotary, the merger), M-RoPE positions against get_rope_index, greedy
tokens for one image, two images of different sizes and text only; chunked prefill through an
image, a prefix-cache hit and preemption by recompute giving the same tokens; a chat request
through the `openai` client with a data: URL."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.input_processor import image_prompt_builder
from nanoserve.errors import InvalidRequestError
from nanoserve.models.config import ModelConfig
from nanoserve.models.registry import build_model, check_pipeline_support, check_vision_support
from nanoserve.multimodal.image import ImageLimits
from nanoserve.multimodal.inputs import PromptImage
from nanoserve.multimodal.mrope import mrope_positions, rope_shift
from nanoserve.multimodal.qwen_processor import QwenVLImageProcessor
from tests.multimodal.qwen_vl_checkpoint import MAX_PIXELS, transformers_processor
from tests.multimodal.test_preprocessing import data_url, random_image

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# 150x100 -> 8x10 patches (20 tokens); 60x130 -> 10x4 patches (10 tokens, taller than wide)
IMAGES = [random_image(150, 100, "RGB", 31), random_image(60, 130, "RGBA", 32)]


def chat_text(processor, images: int, question: str = "What is in the picture?") -> str:
    parts = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": parts}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


@pytest.fixture(scope="module")
def hf_processor(qwen_vl_dir):
    return transformers_processor(qwen_vl_dir)


@pytest.fixture(scope="module")
def hf_model(qwen_vl_dir):
    import transformers as hf

    model = hf.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_dir, dtype=torch.float32)
    return model.eval()


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=str(model_dir), dtype="float32", limit_mm_per_prompt={"image": 2}, **kwargs)


@pytest.fixture(scope="module")
def llm(qwen_vl_dir):
    return make_llm(qwen_vl_dir)


def hf_greedy(hf_model, processor, text: str, images) -> list[int]:
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize(
    "size,mode",
    [((150, 100), "RGB"), ((60, 130), "RGBA"), ((20, 30), "L"), ((400, 300), "RGB")],
    ids=["landscape", "portrait", "below-min-pixels", "above-max-pixels"],
)
def test_processor_equals_transformers(qwen_vl_dir, hf_processor, size, mode):
    image = random_image(*size, mode, seed=size[0] + size[1])
    expected = hf_processor.image_processor(images=[image], return_tensors="pt")
    ours = QwenVLImageProcessor.from_dir(qwen_vl_dir, 14, 2, 2).preprocess(image)
    assert ours.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == expected["pixel_values"].dtype == torch.float32
    assert torch.equal(ours.pixel_values, expected["pixel_values"])
    t, h, w = ours.grid_thw
    assert ours.num_tokens == t * h * w // 4 and h * w * 14 * 14 <= MAX_PIXELS


def test_prompt_expansion_equals_transformers(llm, hf_processor):
    text = chat_text(hf_processor, 2)
    expected = hf_processor(text=text, images=IMAGES)["input_ids"][0]
    prompt = {"prompt": text, "multi_modal_data": {"image": IMAGES}}
    out = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(expected)


# transformers 5's save_pretrained writes 4.x's names (model.*, visual.*): rewritten to the
# names of 5.x's modules (model.language_model.*, model.visual.*).
NEW_NAMES = [("model.", "model.language_model."), ("visual.", "model.visual.")]


def test_weights_load_under_each_naming(qwen_vl_dir, tmp_path):
    renamed = {}
    for name, tensor in load_file(qwen_vl_dir / "model.safetensors").items():
        for old, new in NEW_NAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    assert any(n.startswith("model.visual.") for n in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(qwen_vl_dir / "config.json", tmp_path / "config.json")
    config = ModelConfig.from_dir(qwen_vl_dir)
    saved = build_model(config, torch.float32, torch.device("cpu"), qwen_vl_dir).state_dict()
    other = build_model(config, torch.float32, torch.device("cpu"), tmp_path).state_dict()
    assert saved.keys() == other.keys()
    for name in saved:
        assert torch.equal(saved[name], other[name]), name


def test_image_embeddings_equal_transformers(qwen_vl_dir, hf_model, hf_processor):
    config = ModelConfig.from_dir(qwen_vl_dir)
    model = build_model(config, torch.float32, torch.device("cpu"), qwen_vl_dir)
    processor = QwenVLImageProcessor.from_dir(qwen_vl_dir, 14, 2, 2)
    processed = [processor.preprocess(image) for image in IMAGES]
    inputs = hf_processor.image_processor(images=IMAGES, return_tensors="pt")
    with torch.no_grad():
        ours = model.embed_image_list(
            [p.pixel_values for p in processed], [p.grid_thw for p in processed]
        )
        theirs = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output
    assert [o.shape[0] for o in ours] == [p.num_tokens for p in processed] == [20, 10]
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)


def test_mrope_positions_equal_get_rope_index(qwen_vl_dir, hf_model, hf_processor):
    """Every range of the prompt (a chunk, a cache hit's remainder) gets the positions
    transformers gives the whole prompt; a generated token's is its index + the rope delta."""
    text = chat_text(hf_processor, 2)
    inputs = hf_processor(text=text, images=IMAGES, return_tensors="pt")
    expected, delta = hf_model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    expected = expected[:, 0]
    config = ModelConfig.from_dir(qwen_vl_dir)
    builder = image_prompt_builder(config.vision, qwen_vl_dir, ImageLimits(max_images=2))
    token_ids, images = builder.expand(
        hf_processor.tokenizer(text)["input_ids"], IMAGES, "image_url"
    )
    assert token_ids == inputs["input_ids"][0].tolist()
    assert all(isinstance(image, PromptImage) for image in images)
    length = len(token_ids)
    assert torch.equal(mrope_positions(images, 0, length), expected)
    for start, end in [(0, 7), (7, 30), (30, length), (25, 26)]:
        assert torch.equal(mrope_positions(images, start, end), expected[:, start:end])
    assert rope_shift(images, length) == int(delta)


@pytest.mark.parametrize("images", [1, 2, 0], ids=["one-image", "two-images", "text-only"])
def test_greedy_tokens_equal_transformers(llm, hf_model, hf_processor, images):
    text = chat_text(hf_processor, images)
    expected = hf_greedy(hf_model, hf_processor, text, IMAGES[:images])
    prompt = {"prompt": text, "multi_modal_data": {"image": IMAGES[:images]}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert len(expected) > 3  # not a lone end-of-sequence token
    assert out.outputs[0].token_ids == expected


def test_chat_with_a_data_url_equals_transformers(llm, hf_model, hf_processor):
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[1]), "detail": "high"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    text = chat_text(hf_processor, 1, "What is this?")
    expected = hf_greedy(hf_model, hf_processor, text, IMAGES[1:])
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text
    assert out.outputs[0].token_ids == expected


def test_chunked_prefill_and_prefix_cache_through_images(llm, qwen_vl_dir, hf_processor):
    """5-token chunks cut both images' tokens; a second request with the same images reuses
    the cached blocks (those of its images' tokens included) and gives the same tokens."""
    prompt = {"prompt": chat_text(hf_processor, 2), "multi_modal_data": {"image": IMAGES}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    whole = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    chunked_llm = make_llm(
        qwen_vl_dir, max_num_batched_tokens=5, block_size=8, enable_prefix_caching=True
    )
    first = chunked_llm.generate(prompt, params, use_tqdm=False)[0]
    again = chunked_llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == whole
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 8
    assert again.outputs[0].token_ids == whole


def test_preemption_by_recompute_keeps_the_positions(llm, qwen_vl_dir, hf_processor):
    text = chat_text(hf_processor, 2)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": IMAGES}},
        {"prompt": text, "multi_modal_data": {"image": IMAGES[::-1]}},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    small = make_llm(qwen_vl_dir, num_kv_blocks=15, block_size=16, enable_prefix_caching=False)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_openai_client_with_a_data_url(qwen_vl_dir, hf_model, hf_processor):
    from tests.server.conftest import ServerHandle

    text = chat_text(hf_processor, 1, "What is this?")
    expected = hf_processor.tokenizer.decode(
        hf_greedy(hf_model, hf_processor, text, IMAGES[:1]), skip_special_tokens=True
    )
    handle = ServerHandle(qwen_vl_dir, engine_kwargs={"dtype": "float32", "num_kv_blocks": 64})
    try:
        client = handle.client()
        part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0]), "detail": "auto"}}
        response = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}
            ],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
    finally:
        handle.close()
    assert response.choices[0].message.content == expected
    num_prompt = len(hf_processor(text=text, images=IMAGES[:1])["input_ids"][0])
    assert response.usage.prompt_tokens == num_prompt  # the image's 20 tokens counted


def test_refusals(llm, qwen_vl_dir, hf_processor):
    """An aspect ratio the processor cannot resize and a placeholder count that does not match
    are 400s naming the field; pipeline parallelism is refused at start (tensor parallelism is
    taken: test_qwen2_5_vl_tensor_parallel.py)."""
    text = chat_text(hf_processor, 1)
    thin = random_image(4, 900, "RGB", 5)
    with pytest.raises(InvalidRequestError, match="aspect ratio") as error:
        llm.generate({"prompt": text, "multi_modal_data": {"image": thin}}, GREEDY)
    assert error.value.param == "image_url"
    with pytest.raises(InvalidRequestError, match="placeholder") as error:
        llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES}}, GREEDY)
    config = ModelConfig.from_dir(qwen_vl_dir)
    check_vision_support(config, 2)
    with pytest.raises(ValueError, match="pipeline-parallel-size"):
        check_pipeline_support(config, 2)


def test_encoder_cache_keeps_each_images_rows_within_its_budget(qwen_vl_dir):
    """Images of 20 and 10 rows: a 25-row budget keeps the last one only; a cached image is
    not encoded again, a dropped one is."""
    from nanoserve.engine.image_step import EncoderCache
    from nanoserve.engine.step_input import ImageSlice
    from nanoserve.multimodal.processor import pixel_hash

    config = ModelConfig.from_dir(qwen_vl_dir)
    model = build_model(config, torch.float32, torch.device("cpu"), qwen_vl_dir)
    processor = QwenVLImageProcessor.from_dir(qwen_vl_dir, 14, 2, 2)
    slices = []
    for image in IMAGES:
        done = processor.preprocess(image)
        image_hash = pixel_hash(done.pixel_values, done.grid_thw)
        slices.append(ImageSlice(image_hash, done.pixel_values, 0, 0, 1, done.grid_thw))
    cache = EncoderCache(model.embed_image_list, torch.device("cpu"), max_rows=25)
    with torch.no_grad():
        first = cache.embeddings(slices[:1])[slices[0].image_hash]
        assert first.shape[0] == 20 and cache.num_rows == 20
        cache.embeddings(slices[:1])
        assert cache.num_encoded_images == 1
        assert cache.embeddings(slices[1:])[slices[1].image_hash].shape[0] == 10
        assert list(cache.entries) == [slices[1].image_hash] and cache.num_rows == 10
        again = cache.embeddings(slices[:1])[slices[0].image_hash]
    assert cache.num_encoded_images == 3
    assert torch.equal(again, first)


def test_string_content_template_gets_the_vision_tokens(qwen_vl_dir):
    """A template that reads content as a string (ChatML's) gets Qwen's whole image
    placeholder, vision start and end included, where the part was."""
    from nanoserve.engine.startup import open_model
    from tests.conftest import CHATML_TEMPLATE

    tokenizer = open_model(EngineConfig(model=str(qwen_vl_dir))).tokenizer
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "See"}, part]}]
    text = tokenizer.apply_chat_template(messages, chat_template=CHATML_TEMPLATE)
    assert "See\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>" in text
