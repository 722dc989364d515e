"""--async-scheduling with images (engine/async_scheduling.py): Qwen2.5-VL's image rows and
M-RoPE positions, then decode rows whose token is still on the device, give the tokens of the
engine without the flag, for a batch of one-image, two-image and text-only chats."""

from __future__ import annotations

from nanoserve import LLM, SamplingParams
from tests.multimodal.test_preprocessing import data_url, random_image

IMAGES = [random_image(150, 100, "RGB", 41), random_image(60, 130, "RGBA", 42)]


def chat(images: list, question: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


def test_qwen_vl_tokens_equal_without_the_flag(qwen_vl_dir):
    conversations = [
        chat(IMAGES[:1], "What is in the picture?"),
        chat(IMAGES, "Compare them."),
        chat([], "Say something."),
    ]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 15)]
    tokens = []
    for flag in (False, True):
        llm = LLM(
            model=str(qwen_vl_dir),
            dtype="float32",
            num_kv_blocks=64,
            limit_mm_per_prompt={"image": 2},
            async_scheduling=flag,
        )
        outputs = llm.chat(conversations, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        if flag:
            assert llm.llm_engine.async_scheduling.log.num_overlapped >= 14
    assert tokens[0] == tokens[1]
    assert [len(t) for t in tokens[1]] == [12, 7, 15]
