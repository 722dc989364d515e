"""`--model text.gguf --mmproj mmproj.gguf` for Qwen2.5-VL against transformers: a random tiny
Qwen2.5-VL checkpoint (Qwen2.5-VL's 112-pixel windows: full and clipped 4x4-token windows) whose
weights are float16 values, converted in the test to the two files llama.cpp's converter writes
(tests/multimodal/qwen_vl_gguf.py: a "qwen2vl" text file with its M-RoPE sections, a
"qwen2.5vl_merger" mmproj), served in fp32: the processor's pixels, image embeddings, greedy
tokens and prompt ids equal to Qwen2_5_VLForConditionalGeneration's on the checkpoint, for one
image, two images of different sizes, text only, a chat request and the `openai` client on a
real socket; a Q8_0 tower dequantized; the file's pixel bounds; the text file alone serves as a
Qwen2; each malformed or mismatched file one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM
from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.mmproj import mmproj_image_processor
from nanoserve.models.gguf.reader import GGUFImportError
from nanoserve.models.registry import build_model
from tests.multimodal.llava_checkpoint import write_random_llava
from tests.multimodal.llava_gguf import write_mmproj_gguf, write_text_gguf
from tests.multimodal.qwen_vl_checkpoint import transformers_processor, write_random_qwen_vl
from tests.multimodal.qwen_vl_gguf import write_qwen_mmproj_gguf, write_qwen_text_gguf
from tests.multimodal.test_preprocessing import data_url
from tests.multimodal.test_qwen2_5_vl import GREEDY, IMAGES, chat_text, hf_greedy


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen-vl-f16") / "hf"
    return write_random_qwen_vl(out, seed=7, f16_exact=True, window_size=112)


@pytest.fixture(scope="module")
def text_gguf(hf_dir):
    return write_qwen_text_gguf(hf_dir, hf_dir.parent / "text.gguf")


@pytest.fixture(scope="module")
def mmproj(hf_dir):
    return write_qwen_mmproj_gguf(hf_dir, hf_dir.parent / "mmproj.gguf")


@pytest.fixture(scope="module")
def hf_processor(hf_dir):
    return transformers_processor(hf_dir)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    import transformers as hf

    model = hf.Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(text_gguf, mmproj):
    return LLM(
        model=str(text_gguf),
        mmproj=str(mmproj),
        dtype="float32",
        num_kv_blocks=64,
        limit_mm_per_prompt={"image": 2},
    )


def test_pixels_and_image_embeddings_equal_transformers(
    hf_dir, text_gguf, mmproj, hf_model, hf_processor
):
    config = ModelConfig.from_dir(text_gguf, None, str(mmproj))
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert config.vision.mrope_section == (2, 3, 3)
    assert config.vision.fullatt_block_indexes == (1,) and config.vision.window_size == 112
    model = build_model(config, torch.float32, torch.device("cpu"), text_gguf)
    processor = mmproj_image_processor(mmproj)
    processed = [processor.preprocess(image) for image in IMAGES]
    inputs = hf_processor.image_processor(images=IMAGES, return_tensors="pt")
    assert torch.equal(torch.cat([p.pixel_values for p in processed]), inputs["pixel_values"])
    with torch.no_grad():
        ours = model.embed_image_list(
            [p.pixel_values for p in processed], [p.grid_thw for p in processed]
        )
        theirs = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output
    assert [o.shape[0] for o in ours] == [20, 10]
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    # the weights are the checkpoint's exactly (F16 files of float16 values)
    state = hf_model.state_dict()
    prefix = "model.visual." if "model.visual.merger.mlp.2.weight" in state else "visual."
    for name in ("patch_embed.proj.weight", "blocks.1.attn.qkv.bias", "merger.mlp.0.weight"):
        assert torch.equal(model.visual.get_parameter(name), state[prefix + name])


def test_q8_0_mmproj_is_dequantized(hf_dir, text_gguf, tmp_path):
    """A block-type tower: each matrix holds the gguf package's dequantization of its blocks
    (Q/K/V each quantized alone, as the converter splits them before quantizing)."""
    import gguf
    from safetensors import safe_open

    path = write_qwen_mmproj_gguf(hf_dir, tmp_path / "mmproj-q8_0.gguf", matrix_type="Q8_0")
    config = ModelConfig.from_dir(text_gguf, None, str(path))
    model = build_model(config, torch.float32, torch.device("cpu"), text_gguf)
    with safe_open(hf_dir / "model.safetensors", framework="pt") as checkpoint:
        names = [n for n in checkpoint.keys() if n.endswith("blocks.0.attn.qkv.weight")]  # noqa: SIM118
        qkv = checkpoint.get_tensor(names[0]).float()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    parts = []
    for part in qkv.chunk(3):
        blocks = gguf.quants.quantize(part.numpy(), q8_0)
        parts.append(torch.from_numpy(gguf.quants.dequantize(blocks, q8_0)).reshape(part.shape))
    ours = model.visual.blocks[0].attn.qkv.weight
    assert torch.equal(ours, torch.cat(parts))
    assert not torch.equal(ours, qkv)  # (the blocks did round)


def test_pixel_bounds_from_the_file(hf_dir, text_gguf, tmp_path):
    """clip.vision.image_min_pixels / image_max_pixels, where a file has them, bound the resize
    as min_pixels / max_pixels bound transformers'."""
    import transformers as hf

    from tests.multimodal.test_preprocessing import random_image

    bounds = {
        "clip.vision.image_min_pixels": 28 * 28 * 2,
        "clip.vision.image_max_pixels": 28 * 28 * 6,
    }
    path = write_qwen_mmproj_gguf(hf_dir, tmp_path / "bounded.gguf", overrides=bounds)
    image = random_image(400, 300, "RGB", 5)
    ours = mmproj_image_processor(path).preprocess(image)
    theirs = hf.Qwen2VLImageProcessorPil.from_pretrained(
        hf_dir, min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 6
    )(images=[image], return_tensors="pt")
    assert ours.grid_thw == tuple(theirs["image_grid_thw"][0].tolist())
    assert ours.num_tokens <= 6
    assert torch.equal(ours.pixel_values, theirs["pixel_values"])


@pytest.mark.parametrize("images", [1, 2, 0], ids=["one-image", "two-images", "text-only"])
def test_greedy_tokens_equal_transformers(llm, hf_model, hf_processor, images):
    text = chat_text(hf_processor, images)
    expected = hf_greedy(hf_model, hf_processor, text, IMAGES[:images])
    prompt = {"prompt": text, "multi_modal_data": {"image": IMAGES[:images]}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert len(expected) > 3  # not a lone end-of-sequence token
    assert out.outputs[0].token_ids == expected
    reference = hf_processor(text=text, images=IMAGES[:images] or None)["input_ids"][0]
    assert out.prompt_token_ids == list(reference)


def test_chat_uses_the_text_files_template(llm, hf_model, hf_processor):
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    text = chat_text(hf_processor, 1, "What is this?")
    expected = hf_greedy(hf_model, hf_processor, text, IMAGES[1:])
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text
    assert out.outputs[0].token_ids == expected


def test_text_file_alone_serves_as_qwen2(text_gguf, hf_model, hf_processor):
    """Without --mmproj a "qwen2vl" file is a Qwen2: M-RoPE over text is plain RoPE."""
    assert ModelConfig.from_dir(text_gguf).architecture == "Qwen2ForCausalLM"
    text = chat_text(hf_processor, 0)
    expected = hf_greedy(hf_model, hf_processor, text, [])
    llm = LLM(model=str(text_gguf), dtype="float32", num_kv_blocks=16)
    assert llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


REFUSALS = [
    (
        {"overrides": {"clip.projector_type": "qwen2vl_merger"}},
        "projector type 'qwen2vl_merger' is not supported",
    ),
    ({"overrides": {"clip.use_silu": None}}, "without clip.use_silu"),
    ({"overrides": {"clip.vision.n_wa_pattern": None}}, "lacks clip.vision.n_wa_pattern"),
    ({"drop": ("v.patch_embd.weight.1",)}, "lacks tensor v.patch_embd.weight.1 .*two frames"),
    (
        {"replace": {"mm.2.weight": np.zeros((48, 128)), "mm.2.bias": np.zeros(48)}},
        "projector's output is 48 features, but the text model's hidden size is 64",
    ),
    (
        {"overrides": {"clip.vision.block_count": 1 << 30}},
        "lacks tensor v.blk.1073741823.attn_q.weight",
    ),
    (
        {"overrides": {"clip.vision.feed_forward_length": 1 << 30}},
        "tensor v.blk.0.ffn_gate.weight has shape",
    ),
    ({"overrides": {"clip.vision.image_std": [0.5]}}, "image_std must be 3 numbers"),
    (
        {"overrides": {"clip.vision.image_min_pixels": 1000, "clip.vision.image_max_pixels": 10}},
        "image_min_pixels 1000 is above image_max_pixels 10",
    ),
    ({"drop": ("v.blk.1.attn_k.bias",)}, r"lacks 1 tensor\(s\).*qkv.bias \(its k part\)"),
    (
        {"drop": ("v.blk.1.ffn_up.weight",)},
        r"lacks 1 tensor\(s\).*blocks.1.mlp.gate_up_proj.weight \(its up part\)",
    ),
    ({"drop": ("v.post_ln.weight",)}, "lacks tensor v.post_ln.weight"),
    (
        {"replace": {"v.blk.0.attn_out.weight": np.zeros((16, 32), np.float16)}},
        r"tensor v.blk.0.attn_out.weight has shape \(16, 32\)",
    ),
    (
        {"extra": {"v.blk.0.attn_norm.weight": np.ones(32, np.float32)}},
        "tensor v.blk.0.attn_norm.weight is not part of a Qwen2.5-VL tower",
    ),
]


@pytest.mark.parametrize("change,message", REFUSALS)
def test_malformed_mmproj_is_one_line(hf_dir, text_gguf, tmp_path, change, message):
    path = write_qwen_mmproj_gguf(hf_dir, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFImportError, match=message) as error:
        LLM(model=str(text_gguf), mmproj=str(path), dtype="float32", num_kv_blocks=16)
    assert "\n" not in str(error.value) and "bad.gguf" in str(error.value)


@pytest.mark.parametrize(
    "sections,message",
    [
        ([2, 3, 4, 0], r"\[2, 3, 4, 0\] does not cover half of the head dimension 16"),
        ([2, 3, 3, 1], "a fourth section is not supported"),
    ],
)
def test_malformed_text_sections_are_one_line(hf_dir, tmp_path, sections, message):
    path = write_qwen_text_gguf(hf_dir, tmp_path / "text.gguf", sections)
    with pytest.raises(GGUFImportError, match=message) as error:
        ModelConfig.from_dir(path)
    assert "\n" not in str(error.value)


def test_mismatched_pairs_are_one_line(text_gguf, mmproj, tmp_path):
    """A Qwen2.5-VL mmproj beside a LLaVA's "llama" text file, and a LLaVA mmproj beside the
    "qwen2vl" one."""
    llava = write_random_llava(tmp_path / "llava", seed=1)
    llava_text = write_text_gguf(llava, tmp_path / "llava-text.gguf")
    with pytest.raises(GGUFImportError, match="goes with a 'qwen2vl' one"):
        ModelConfig.from_dir(llava_text, None, str(mmproj))
    llava_mmproj = write_mmproj_gguf(llava, tmp_path / "llava-mmproj.gguf")
    with pytest.raises(GGUFImportError, match="the text model is a 'qwen2vl' GGUF file"):
        ModelConfig.from_dir(text_gguf, None, str(llava_mmproj))


def test_openai_client_against_the_gguf_pair(text_gguf, mmproj, hf_model, hf_processor):
    """`nanoserve serve --model text.gguf --mmproj mmproj.gguf` on a real socket: the `openai`
    client's answer to a data: URL image is transformers'."""
    from tests.server.conftest import ServerHandle

    text = chat_text(hf_processor, 1, "What is this?")
    expected = hf_greedy(hf_model, hf_processor, text, IMAGES[:1])
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
        expected_text = hf_processor.tokenizer.decode(expected, skip_special_tokens=True)
        assert expected_text.strip()
        assert response.choices[0].message.content == expected_text
        assert response.usage.prompt_tokens == len(
            hf_processor(text=text, images=IMAGES[:1])["input_ids"][0]
        )
    finally:
        server.close()


def test_tensor_parallel_gguf_pair_equals_transformers(text_gguf, mmproj, hf_model, hf_processor):
    """--tp 2 (gloo, rank 1 a child process): rank 1 reads its half of the text file and no
    tower; two images of different sizes, their M-RoPE rows sent to rank 1 with the step."""
    text = chat_text(hf_processor, 2)
    expected = hf_greedy(hf_model, hf_processor, text, IMAGES[:2])
    with LLM(
        model=str(text_gguf),
        mmproj=str(mmproj),
        dtype="float32",
        num_kv_blocks=64,
        limit_mm_per_prompt={"image": 2},
        tensor_parallel_size=2,
    ) as llm:
        prompt = {"prompt": text, "multi_modal_data": {"image": IMAGES[:2]}}
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        rank_bytes = list(llm.llm_engine.runner.rank_weight_bytes)
    assert out.outputs[0].token_ids == expected
    assert rank_bytes[0] > rank_bytes[1]  # the tower and merger on rank 0 only
