"""`--model text.gguf --mmproj mmproj.gguf` (llama-server's pair) against transformers: a random
tiny LLaVA-1.5 checkpoint whose weights are float16 values, converted in the test to the two
files llama.cpp's converters write (tests/multimodal/llava_gguf.py: F16 matrices, so the files
hold the checkpoint exactly), served in fp32: image embeddings, greedy tokens and the prompt's
ids equal to LlavaForConditionalGeneration's on the Hugging Face checkpoint; llama.cpp's media
marker where the vocabulary has no "<image>"; each malformed or mismatched mmproj one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM
from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.reader import GGUFImportError
from nanoserve.models.registry import build_model
from nanoserve.multimodal.processor import ClipImageProcessor
from tests.multimodal.llava_checkpoint import transformers_processor, write_random_llava
from tests.multimodal.llava_gguf import write_mmproj_gguf, write_text_gguf
from tests.multimodal.test_llava import GREEDY, IMAGES, ONE_IMAGE, TWO_IMAGES, hf_greedy
from tests.multimodal.test_preprocessing import data_url


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_random_llava(tmp_path_factory.mktemp("llava-f16") / "hf", seed=3, f16_exact=True)


@pytest.fixture(scope="module")
def text_gguf(hf_dir):
    return write_text_gguf(hf_dir, hf_dir.parent / "text.gguf")


@pytest.fixture(scope="module")
def mmproj(hf_dir):
    return write_mmproj_gguf(hf_dir, hf_dir.parent / "mmproj.gguf")


@pytest.fixture(scope="module")
def hf_llava(hf_dir):
    import transformers as hf

    return hf.LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(text_gguf, mmproj):
    return LLM(
        model=str(text_gguf),
        mmproj=str(mmproj),
        dtype="float32",
        num_kv_blocks=64,
        limit_mm_per_prompt={"image": 2},
    )


def hf_image_features(hf_llava, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        features = hf_llava.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-2, vision_feature_select_strategy="default"
        )
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        features = torch.stack(list(features))
    return features


@pytest.mark.parametrize(
    "names,feature_layer_key",
    [("converter", False), ("gguf-py", True)],
    ids=["converter-names", "gguf-py-names+feature-layer"],
)
def test_image_embeddings_equal_transformers(
    hf_dir, text_gguf, hf_llava, tmp_path, names, feature_layer_key
):
    """fc1 as the converter names it (ffn_down) and as gguf-py does (ffn_up); the feature layer
    from the stored layers or from clip.vision.feature_layer; a post-norm in the file unused,
    as transformers' LLaVA never applies it."""
    post_norm = {"v.post_ln.weight": np.full(32, 3.0, np.float32)}  # kept by old conversions
    path = write_mmproj_gguf(
        hf_dir,
        tmp_path / "mmproj.gguf",
        names=names,
        feature_layer_key=feature_layer_key,
        extra=post_norm if feature_layer_key else None,
    )
    config = ModelConfig.from_dir(text_gguf, None, str(path))
    assert config.vision.num_layers_used == 1 and config.mmproj_file == path.resolve()
    model = build_model(config, torch.float32, torch.device("cpu"), text_gguf)
    processor = ClipImageProcessor.from_dir(hf_dir, config.vision.image_size)
    pixels = torch.stack([processor.pixel_values(image) for image in IMAGES])
    with torch.no_grad():
        ours = model.embed_images(pixels)
    theirs = hf_image_features(hf_llava, pixels).reshape(ours.shape)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the language model's weights are the checkpoint's too
    reference = hf_llava.model.language_model.layers[1].self_attn.q_proj.weight
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[:64], reference)


def test_q8_0_mmproj_is_dequantized(hf_dir, text_gguf, tmp_path):
    """A block-type tower: each matrix holds the gguf package's dequantization of its blocks."""
    import gguf
    from safetensors import safe_open

    path = write_mmproj_gguf(hf_dir, tmp_path / "mmproj-q8_0.gguf", matrix_type="Q8_0")
    config = ModelConfig.from_dir(text_gguf, None, str(path))
    model = build_model(config, torch.float32, torch.device("cpu"), text_gguf)
    with safe_open(hf_dir / "model.safetensors", framework="pt") as checkpoint:
        fc1 = checkpoint.get_tensor("vision_tower.encoder.layers.0.mlp.fc1.weight").float()
        linear_2 = checkpoint.get_tensor("multi_modal_projector.linear_2.weight").float()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for ours, weight in (
        (model.vision_tower.vision_model.encoder.layers[0].mlp.fc1.weight, fc1),
        (model.multi_modal_projector.linear_2.weight, linear_2),
    ):
        blocks = gguf.quants.quantize(weight.numpy(), q8_0)
        expected = torch.from_numpy(gguf.quants.dequantize(blocks, q8_0)).reshape(weight.shape)
        assert torch.equal(ours, expected)
        assert not torch.equal(ours, weight)  # (the blocks did round)


@pytest.mark.parametrize("text,images", [(ONE_IMAGE, IMAGES[:1]), (TWO_IMAGES, IMAGES)])
def test_greedy_tokens_equal_transformers(llm, hf_dir, hf_llava, text, images):
    processor = transformers_processor(hf_dir)
    expected = hf_greedy(hf_llava, processor, text, images)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert len(expected) > 3
    assert out.outputs[0].token_ids == expected
    assert out.prompt_token_ids == list(processor(text=text, images=images)["input_ids"][0])


def test_chat_uses_the_text_files_template(llm, hf_dir, hf_llava):
    """The chat template comes from the text GGUF's metadata (LLaVA's, which reads parts)."""
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    processor = transformers_processor(hf_dir)
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text
    assert out.outputs[0].token_ids == hf_greedy(hf_llava, processor, text, [IMAGES[1]])


def test_media_marker_where_the_vocabulary_has_no_image_token(hf_dir, hf_llava, mmproj):
    """A text model converted from the original LLaVA weights has no "<image>" token: the
    placeholder is llama.cpp's "<__media__>", in prompts and where a string template puts an
    image part; the image's positions hold an id inside the vocabulary."""
    from tests.conftest import CHATML_TEMPLATE

    text_gguf = write_text_gguf(hf_dir, hf_dir.parent / "text-no-image.gguf", True)
    llm = LLM(model=str(text_gguf), mmproj=str(mmproj), dtype="float32", num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.image_placeholder == "<__media__>"
    prompt = ONE_IMAGE.replace("<image>", "<__media__>")
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)[0]
    expected = hf_greedy(hf_llava, transformers_processor(hf_dir), ONE_IMAGE, IMAGES[:1])
    assert out.outputs[0].token_ids == expected
    assert max(out.prompt_token_ids) < llm.llm_engine.model_config.vocab_size
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=CHATML_TEMPLATE)[0]
    assert "Look:\n<__media__>" in chat.prompt
    assert len(chat.outputs[0].token_ids) > 0


REFUSALS = [
    ({"overrides": {"clip.projector_type": "ldp"}}, "projector type 'ldp' is not supported"),
    ({"drop": ("mm.2.weight",)}, "lacks tensor mm.2.weight"),
    (
        {"replace": {"mm.2.weight": np.zeros((48, 64)), "mm.2.bias": np.zeros(48)}},
        "projector's output is 48 features, but the text model's hidden size is 64",
    ),
    (
        {"overrides": {"clip.vision.image_grid_pinpoints": [336, 672]}},
        r"LLaVA-NeXT \(1.6\) image tiling",
    ),
    ({"overrides": {"clip.vision.feature_layer": [1, 2]}}, "only one feature layer"),
    ({"overrides": {"clip.vision.image_mean": [0.5]}}, "image_mean must be 3 numbers"),
    (  # a corrupt count: refused before a tower of that size is built
        {"overrides": {"clip.vision.block_count": 1 << 30}},
        "runs 1073741824 vision layers .* lacks v.blk.1073741823.attn_q.weight",
    ),
    (
        {"overrides": {"clip.vision.image_size": 1 << 20, "clip.vision.patch_size": 1 << 18}},
        r"tensor v.patch_embd.weight has shape \(14, 14, 3, 32\), not \(262144, 262144, 3, 32\)",
    ),
    (
        {"overrides": {"clip.vision.feed_forward_length": 1 << 30}},
        "tensor v.blk.0.ffn_up.weight has shape .* feed_forward_length 1073741824",
    ),
    ({"overrides": {"clip.vision.embedding_length": None}}, "lacks clip.vision.embedding_length"),
    ({"drop": ("v.blk.0.attn_q.bias",)}, r"lacks 1 tensor\(s\).*qkv_proj.bias \(its q part\)"),
    (
        {"replace": {"v.blk.0.attn_out.weight": np.zeros((16, 32), np.float16)}},
        r"tensor v.blk.0.attn_out.weight has shape \(16, 32\)",
    ),
    (  # (mlp_norm's, Yi-VL's projector, under an "mlp" header)
        {"extra": {"mm.1.weight": np.ones(64, np.float32)}},
        "tensor mm.1.weight is not part of a CLIP tower",
    ),
    ({"drop": ("v.blk.0.ln2.weight",)}, r"lacks 1 tensor\(s\).*layers.0.layer_norm2.weight"),
]


@pytest.mark.parametrize("change,message", REFUSALS)
def test_malformed_or_mismatched_mmproj_is_one_line(hf_dir, text_gguf, tmp_path, change, message):
    path = write_mmproj_gguf(hf_dir, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFImportError, match=message) as error:
        LLM(model=str(text_gguf), mmproj=str(path), dtype="float32", num_kv_blocks=16)
    assert "\n" not in str(error.value) and "bad.gguf" in str(error.value)


def test_mmproj_goes_with_a_gguf_text_model(hf_dir, text_gguf, mmproj, tmp_path):
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF text model"):
        ModelConfig.from_dir(hf_dir, None, str(mmproj))
    with pytest.raises(GGUFImportError, match="not an mmproj file"):
        ModelConfig.from_dir(text_gguf, None, str(text_gguf))
    with pytest.raises(GGUFImportError, match="no such file"):
        ModelConfig.from_dir(text_gguf, None, str(tmp_path / "missing.gguf"))


def test_serve_flag_is_llama_servers(text_gguf, mmproj):
    import argparse

    from nanoserve.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(text_gguf), "--mmproj", str(mmproj)])
    assert engine_config_from_args(args).mmproj == str(mmproj)


def test_openai_client_against_the_gguf_pair(text_gguf, mmproj, hf_dir, hf_llava):
    """`nanoserve serve --model text.gguf --mmproj mmproj.gguf` on a real socket: the `openai`
    client's answer to a data: URL image is transformers'."""
    from tests.server.conftest import ServerHandle

    processor = transformers_processor(hf_dir)
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    expected = hf_greedy(hf_llava, processor, text, [IMAGES[0]])
    server = ServerHandle(
        text_gguf, engine_kwargs={"mmproj": str(mmproj), "dtype": "float32", "num_kv_blocks": 64}
    )
    try:
        client = server.client()
        part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}
        response = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}
            ],
            temperature=0,
            max_tokens=len(expected),
        )
        expected_text = processor.tokenizer.decode(expected, skip_special_tokens=True)
        assert expected_text.strip()
        assert response.choices[0].message.content == expected_text
        assert response.usage.prompt_tokens == len(
            processor(text=text, images=[IMAGES[0]])["input_ids"][0]
        )
    finally:
        server.close()


def test_tensor_parallel_gguf_pair_equals_transformers(text_gguf, mmproj, hf_dir, hf_llava):
    """--tp 2 (gloo, rank 1 a child process): rank 1 reads the text file's half and no tower."""
    expected = hf_greedy(hf_llava, transformers_processor(hf_dir), ONE_IMAGE, IMAGES[:1])
    with LLM(
        model=str(text_gguf),
        mmproj=str(mmproj),
        dtype="float32",
        num_kv_blocks=64,
        tensor_parallel_size=2,
    ) as llm:
        prompt = {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[0]}}
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        rank_bytes = list(llm.llm_engine.runner.rank_weight_bytes)
    assert out.outputs[0].token_ids == expected
    assert rank_bytes[0] > rank_bytes[1]  # the tower and projector on rank 0 only
