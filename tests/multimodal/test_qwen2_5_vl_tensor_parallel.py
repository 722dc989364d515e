"""Qwen2.5-VL under tensor parallelism on the CPU (gloo, rank 1 a real child process): greedy
tokens under --tp 2 equal --tp 1's and transformers' for one image, two images of different
sizes (5-token chunks cutting through both, so rank 1 gets the M-RoPE positions of image rows
and the shifted positions of the text after them) and text only; the vision tower runs on rank
0 only, once per image (counted), and rank 1 holds none of its weights; a served request
through the openai client, and closing that server stops rank 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nanoserve import LLM
from tests.multimodal.test_preprocessing import data_url
from tests.multimodal.test_qwen2_5_vl import GREEDY, IMAGES, MAX_TOKENS, chat_text, hf_greedy
from tests.server.conftest import ServerHandle


@pytest.fixture(scope="module")
def hf_processor(qwen_vl_dir):
    from tests.multimodal.qwen_vl_checkpoint import transformers_processor

    return transformers_processor(qwen_vl_dir)


@pytest.fixture(scope="module")
def hf_model(qwen_vl_dir):
    import transformers as hf

    model = hf.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_dir, dtype=torch.float32)
    return model.eval()


def prompts(processor) -> list[dict]:
    """One image, two of different sizes (the first again: from the encoder cache), text only."""
    return [
        {"prompt": chat_text(processor, count), "multi_modal_data": {"image": IMAGES[:count]}}
        for count in (1, 2, 0)
    ]


def run(model_dir, processor, **engine_args) -> tuple[list[list[int]], int, list[int], int]:
    """Greedy tokens of the prompts; the images rank 0 encoded, each rank's weight bytes and
    the vision tower's bytes on rank 0."""
    with LLM(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=64,
        limit_mm_per_prompt={"image": 2},
        **engine_args,
    ) as llm:
        outputs = llm.generate(prompts(processor), GREEDY, use_tqdm=False)
        runner = llm.llm_engine.runner
        vision_bytes = sum(p.numel() * p.element_size() for p in runner.model.visual.parameters())
        return (
            [o.outputs[0].token_ids for o in outputs],
            runner.encoder_cache.num_encoded_images,
            list(runner.rank_weight_bytes),
            vision_bytes,
        )


def test_tp2_equals_tp1_and_transformers_encoding_each_image_once_on_rank_0(
    qwen_vl_dir, hf_model, hf_processor
):
    expected = [
        hf_greedy(hf_model, hf_processor, p["prompt"], p["multi_modal_data"]["image"])
        for p in prompts(hf_processor)
    ]
    assert all(len(tokens) > 3 for tokens in expected)  # not a lone end-of-sequence token
    tp1, tp1_encoded, (tp1_bytes,), vision_bytes = run(qwen_vl_dir, hf_processor)
    # 5-token chunks: the images' 20 and 10 rows reach rank 1 in pieces, over several steps,
    # and some chunks hold only the text after an image (shifted 1D positions, no M-RoPE rows)
    tp2, tp2_encoded, rank_bytes, _ = run(
        qwen_vl_dir, hf_processor, tensor_parallel_size=2, max_num_batched_tokens=5
    )
    assert tp1 == expected
    assert tp2 == tp1
    assert tp1_encoded == tp2_encoded == 2  # two distinct images in three prompts
    # rank 0 holds the whole vision tower beside its half of the language model; rank 1 only
    # its half (the norms are on both)
    assert vision_bytes > 0
    assert rank_bytes[0] - rank_bytes[1] == vision_bytes
    assert rank_bytes[1] < 0.6 * (tp1_bytes - vision_bytes)


def test_openai_client_against_a_tp2_server_whose_close_stops_rank_1(
    qwen_vl_dir, hf_model, hf_processor
):
    text = chat_text(hf_processor, 1, "What is this?")
    expected = hf_processor.tokenizer.decode(
        hf_greedy(hf_model, hf_processor, text, IMAGES[1:]), skip_special_tokens=True
    )
    handle = ServerHandle(
        qwen_vl_dir,
        engine_kwargs={"dtype": "float32", "num_kv_blocks": 64, "tensor_parallel_size": 2},
    )
    engine = handle.engine
    workers = engine.ranks.workers
    try:
        client = handle.client()
        part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
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
        assert engine.runner.world_size == 2
        assert engine.runner.encoder_cache.num_encoded_images == 1  # two requests
    finally:
        handle.close()
    # rank 1 left its step loop when told to (exit code 0, not killed) and rank 0 left the
    # process group: a later engine in this process starts its own
    assert [process.exitcode for process in workers.processes] == [0]
    assert not dist.is_initialized() and engine.ranks.workers is None
