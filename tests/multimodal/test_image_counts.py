"""Counting images on a real LLaVA server, against transformers' LlavaProcessor as the oracle:
/tokenize with image parts gives the processor's input ids (each image's tokens expanded, with
continue_final_message too), /metrics and the stats line count the images and their tokens,
--max-image-bytes and --max-image-pixels refuse one past their value and accept their value,
and a chat continuing an assistant message after an image gives transformers' greedy tokens."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch
from PIL import Image

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.stat_logger import LoggingStatLogger
from nanoserve.engine.stats import EngineStats
from tests.multimodal.llava_checkpoint import transformers_processor
from tests.multimodal.test_images_api import image_message
from tests.multimodal.test_llava import MAX_TOKENS, hf_greedy, make_llm
from tests.multimodal.test_preprocessing import data_url, random_image
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.server.test_vllm_metrics import scrape, value

IMAGE = random_image(80, 64, "RGB", 41)
OTHER = random_image(64, 80, "RGB", 42)


def png_size(image: Image.Image) -> int:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return len(buffer.getvalue())


# Limits at exactly IMAGE's bytes and OTHER's pixels: what the tests send passes, one more is
# refused (OTHER's PNG is no larger than IMAGE's: both are 80 x 64 of noise).
MAX_BYTES = max(png_size(IMAGE), png_size(OTHER))
MAX_PIXELS = 80 * 64


@pytest.fixture(scope="module")
def server(llava_dir):
    handle = ServerHandle(
        llava_dir,
        engine_kwargs={
            "dtype": "float32",
            "num_kv_blocks": 64,
            "limit_mm_per_prompt": {"image": 2},
            "max_image_bytes": MAX_BYTES,
            "max_image_pixels": MAX_PIXELS,
        },
    )
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def processor(llava_dir):
    return transformers_processor(llava_dir)


def hf_messages(messages: list[dict]) -> list[dict]:
    """Our OpenAI-shaped messages as transformers' processor template reads them."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image"} if part["type"] == "image_url" else part for part in content
            ]
        else:
            content = [{"type": "text", "text": content}]
        out.append({"role": message["role"], "content": content})
    return out


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http_request(port, "POST", path, json.dumps(body))
    return status, json.loads(raw)


def two_images() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": data_url(OTHER)}},
                {"type": "text", "text": "Compare them."},
            ],
        }
    ]


CONTINUED = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
            {"type": "text", "text": "What is in the picture?"},
        ],
    },
    {"role": "assistant", "content": "The picture shows"},
]


@pytest.mark.parametrize(
    "messages, images, continued",
    [
        (image_message(data_url(IMAGE)), [IMAGE], False),
        (two_images(), [IMAGE, OTHER], False),
        (CONTINUED, [IMAGE], True),
    ],
    ids=["one", "two", "continue-final-message"],
)
def test_tokenize_counts_image_tokens_as_the_processor(
    server, processor, messages, images, continued
):
    text = processor.apply_chat_template(
        hf_messages(messages),
        add_generation_prompt=not continued,
        continue_final_message=continued,
    )
    expected = processor(text=text, images=images)["input_ids"][0]
    expected = expected.tolist() if hasattr(expected, "tolist") else list(expected)
    status, body = post(
        server.port,
        "/tokenize",
        {
            "messages": messages,
            "add_generation_prompt": not continued,
            "continue_final_message": continued,
            "add_special_tokens": False,
        },
    )
    assert status == 200, body
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert expected.count(image_token) == 16 * len(images)  # the oracle expanded them too


def test_tokenize_refuses_images_past_the_limit(server):
    messages = image_message(data_url(IMAGE), count=3)
    status, body = post(server.port, "/tokenize", {"messages": messages})
    assert status == 400, body
    assert "At most 2 image(s)" in body["error"]["message"]


def test_metrics_count_prompt_images_and_their_tokens(server, processor):
    _, before = scrape(server.port)
    client = server.client()
    model = client.models.list().data[0].id
    prompt_tokens = 0
    for messages, images in (
        (image_message(data_url(IMAGE)), [IMAGE]),
        (two_images(), [IMAGE, OTHER]),
    ):
        response = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=2
        )
        text = processor.apply_chat_template(hf_messages(messages), add_generation_prompt=True)
        expected = len(processor(text=text, images=images)["input_ids"][0])
        assert response.usage.prompt_tokens == expected  # image tokens included, as vLLM
        prompt_tokens += expected
    _, after = scrape(server.port)

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    assert grew("nanoserve:prompt_images_total") == 3
    assert grew("nanoserve:prompt_image_tokens_total") == 3 * 16
    assert grew("vllm:prompt_tokens_total") == prompt_tokens


@pytest.mark.parametrize(
    "image, message",
    [
        # noise in four channels: the same pixels, more bytes
        (random_image(80, 64, "RGBA", 43), "(--max-image-bytes)"),
        # one row more of one colour: few bytes, one row of pixels too many
        (Image.new("RGB", (80, 65), (10, 200, 30)), "(--max-image-pixels)"),
    ],
)
def test_image_limit_flags_are_400s_naming_the_field(server, image, message):
    status, body = post(
        server.port,
        "/v1/chat/completions",
        {"messages": image_message(data_url(image)), "max_tokens": 1},
    )
    assert status == 400, body
    assert body["error"]["param"] == "messages[0].content[0].image_url.url"
    assert message in body["error"]["message"]


def test_image_limit_flags_and_kwargs():
    import argparse

    from nanoserve.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(
        parser.parse_args(["--max-image-bytes", "1000", "--max-image-pixels", "4096"])
    )
    limits = config.image_limits
    assert (limits.max_images, limits.max_bytes, limits.max_pixels) == (1, 1000, 4096)
    default = engine_config_from_args(parser.parse_args([])).image_limits
    assert (default.max_bytes, default.max_pixels) == (20 * 1024 * 1024, 4096 * 4096)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="max_image_pixels must be an integer >= 1"):
            EngineConfig(max_image_pixels=bad)


def test_llm_takes_the_limits_as_kwargs(llava_dir):
    from nanoserve.errors import InvalidRequestError

    llm = make_llm(llava_dir, num_kv_blocks=16, max_image_pixels=80 * 64 - 1)
    with pytest.raises(InvalidRequestError, match="max-image-pixels") as error:
        llm.chat(image_message(data_url(IMAGE)), SamplingParams(max_tokens=1))
    assert error.value.param == "messages[0].content[0].image_url.url"
    with pytest.raises(InvalidRequestError, match="max-image-pixels"):  # a PIL image offline
        llm.generate(
            {"prompt": "USER: <image>\nHi ASSISTANT:", "multi_modal_data": {"image": IMAGE}}
        )
    stats = llm.llm_engine.stats()
    assert (stats.prompt_images_total, stats.prompt_image_tokens_total) == (0, 0)


def test_continue_final_message_after_an_image_answers_as_transformers(
    server, processor, llava_dir
):
    import transformers as hf

    hf_model = hf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    text = processor.apply_chat_template(
        hf_messages(CONTINUED), add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("ASSISTANT: The picture shows")
    expected = hf_greedy(hf_model.eval(), processor, text, [IMAGE])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm = make_llm(llava_dir, num_kv_blocks=16)
    offline = llm.chat(CONTINUED, greedy, add_generation_prompt=False, continue_final_message=True)
    assert list(offline[0].outputs[0].token_ids) == expected
    response = server.client().chat.completions.create(
        model=server.client().models.list().data[0].id,
        messages=CONTINUED,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert response.choices[0].message.content == processor.tokenizer.decode(
        expected, skip_special_tokens=True
    )


def test_stats_line_names_image_tokens_when_any(caplog):
    def stats(prompt: int, images: int, image_tokens: int) -> EngineStats:
        return EngineStats(
            num_running=1,
            num_waiting=0,
            kv_cache_usage=0.0,
            num_preemptions_total=0,
            prefix_cache_queries_total=0,
            prefix_cache_hits_total=0,
            prompt_tokens_total=prompt,
            generation_tokens_total=0,
            prompt_images_total=images,
            prompt_image_tokens_total=image_tokens,
        )

    logger = LoggingStatLogger(stats(0, 0, 0), now=0.0)
    with caplog.at_level(logging.INFO, logger="nanoserve.stats"):
        logger.log(stats(700, 3, 576 * 3 - 100), now=10.0)  # the interval's images
        logger.log(stats(800, 3, 576 * 3 - 100), now=20.0)  # text only
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoserve.stats"]
    assert len(lines) == 2
    assert "Prompt image tokens: 1628 (3 images)" in lines[0]
    assert "Avg prompt throughput: 70.0 tokens/s" in lines[0]
    assert "image" not in lines[1]
