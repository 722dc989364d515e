"""LLaVA under tensor parallelism on the CPU (gloo, rank 1 a real child process): greedy tokens
under --tp 2 equal --tp 1's and transformers' for prompts with images, chunked prefill cutting
through them; the vision encoder runs on rank 0 only, once per image (counted), and rank 1 holds
none of its weights; a served request through the openai client."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM
from tests.multimodal.llava_checkpoint import transformers_processor
from tests.multimodal.test_llava import GREEDY, IMAGES, MAX_TOKENS, ONE_IMAGE, TWO_IMAGES, hf_greedy
from tests.multimodal.test_preprocessing import data_url
from tests.server.conftest import ServerHandle

PROMPTS = [
    {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[:1]}},
    {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
    # the first image again, in another prompt: its embeddings come from the encoder cache
    {"prompt": "USER: <image>\nDescribe it. ASSISTANT:", "multi_modal_data": {"image": IMAGES[0]}},
]


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    import transformers as hf

    return hf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def run(llava_dir, **engine_args) -> tuple[list[list[int]], int, list[int], int]:
    """Greedy tokens of PROMPTS; the images rank 0 encoded, each rank's weight bytes and the
    vision tower's and projector's bytes (0 when the engine's rank 0 holds none)."""
    with LLM(
        model=str(llava_dir),
        dtype="float32",
        num_kv_blocks=64,
        limit_mm_per_prompt={"image": 2},
        **engine_args,
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runner = llm.llm_engine.runner
        model = runner.model
        vision_bytes = sum(
            p.numel() * p.element_size()
            for module in (model.vision_tower, model.multi_modal_projector)
            for p in module.parameters()
        )
        return (
            [o.outputs[0].token_ids for o in outputs],
            runner.encoder_cache.num_encoded_images,
            list(runner.rank_weight_bytes),
            vision_bytes,
        )


def test_tp2_equals_tp1_and_transformers_encoding_each_image_once_on_rank_0(llava_dir, hf_llava):
    processor = transformers_processor(llava_dir)
    expected = [
        hf_greedy(hf_llava, processor, p["prompt"], p["multi_modal_data"]["image"]) for p in PROMPTS
    ]
    assert all(len(tokens) > 3 for tokens in expected)  # not a lone end-of-sequence token
    tp1, tp1_encoded, (tp1_bytes,), vision_bytes = run(llava_dir)
    # 6-token chunks: each image's 16 rows reach rank 1 in pieces, over several steps
    tp2, tp2_encoded, rank_bytes, _ = run(
        llava_dir, tensor_parallel_size=2, max_num_batched_tokens=6
    )
    assert tp1 == expected
    assert tp2 == tp1
    assert tp1_encoded == tp2_encoded == 2  # two distinct images in three prompts
    # rank 0 holds the whole vision tower and projector beside its half of the language model;
    # rank 1 only its half (the norms are on both)
    assert vision_bytes > 0
    assert rank_bytes[0] - rank_bytes[1] == vision_bytes
    assert rank_bytes[1] < 0.6 * (tp1_bytes - vision_bytes)


def test_openai_client_against_a_tp2_server(llava_dir, hf_llava):
    processor = transformers_processor(llava_dir)
    image = IMAGES[1]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
        add_generation_prompt=True,
    )
    expected = processor.tokenizer.decode(
        hf_greedy(hf_llava, processor, text, [image]), skip_special_tokens=True
    )
    handle = ServerHandle(
        llava_dir,
        engine_kwargs={"dtype": "float32", "num_kv_blocks": 64, "tensor_parallel_size": 2},
    )
    try:
        client = handle.client()
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": "What?"},
                ],
            }
        ]
        model = client.models.list().data[0].id
        for stream in (False, True):
            reply = client.chat.completions.create(
                model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=stream
            )
            if stream:
                content = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            else:
                content = reply.choices[0].message.content
            assert content == expected
        assert handle.engine.runner.world_size == 2
        assert handle.engine.runner.encoder_cache.num_encoded_images == 1  # two requests
    finally:
        handle.close()  # rank 1 stopped, the process group left
