"""Images over the OpenAI chat API on a real server: the `openai` client with a data: URL gives
transformers' greedy answer; each limit and refusal is a 400 naming its field."""

from __future__ import annotations

import json

import openai
import pytest
from PIL import Image

from tests.multimodal.llava_checkpoint import transformers_processor
from tests.multimodal.test_llava import MAX_TOKENS, hf_greedy
from tests.multimodal.test_preprocessing import data_url, random_image
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

IMAGE = random_image(80, 64, "RGB", 21)


@pytest.fixture(scope="module")
def llava_server(llava_dir):
    handle = ServerHandle(llava_dir, engine_kwargs={"dtype": "float32", "num_kv_blocks": 64})
    yield handle
    handle.close()


def image_message(url: str, text: str = "What is this?", count: int = 1) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}}] * count
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_openai_client_with_a_data_url(llava_server, llava_dir):
    import torch
    import transformers as hf

    hf_model = hf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    processor = transformers_processor(llava_dir)
    text = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}],
            }
        ],
        add_generation_prompt=True,
    )
    expected = processor.tokenizer.decode(
        hf_greedy(hf_model.eval(), processor, text, [IMAGE]), skip_special_tokens=True
    )
    response = llava_server.client().chat.completions.create(
        model=llava_server.client().models.list().data[0].id,
        messages=image_message(data_url(IMAGE)),
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert response.choices[0].message.content == expected
    num_prompt = len(processor(text=text, images=[IMAGE])["input_ids"][0])
    assert response.usage.prompt_tokens == num_prompt  # the image's tokens counted
    chunks = list(
        llava_server.client().chat.completions.create(
            model=response.model,
            messages=image_message(data_url(IMAGE)),
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].usage.prompt_tokens == num_prompt


def post_chat(port: int, messages: list[dict]) -> tuple[int, dict]:
    body = json.dumps({"messages": messages, "max_tokens": 2})
    status, _, raw = http_request(port, "POST", "/v1/chat/completions", body)
    return status, json.loads(raw)


@pytest.mark.parametrize(
    "messages,param,message",
    [
        (image_message(data_url(IMAGE), count=2), "image_url", "At most 1 image"),
        (
            image_message("http://127.0.0.1:9/cat.png"),  # loopback: refused, not fetched
            "messages[0].content[0].image_url.url",
            "not a public address",
        ),
        (
            image_message(data_url(Image.new("L", (4100, 4100)))),
            "messages[0].content[0].image_url.url",
            "pixels",
        ),
        (
            image_message("data:image/png;base64,AAAA"),
            "messages[0].content[0].image_url.url",
            "decoded",
        ),
    ],
)
def test_limits_are_400s_naming_the_field(llava_server, messages, param, message):
    status, body = post_chat(llava_server.port, messages)
    assert status == 400, body
    assert body["error"]["param"] == param
    assert message in body["error"]["message"]


def test_text_only_model_refuses_an_image_part(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 32})
    try:
        status, body = post_chat(handle.port, image_message(data_url(IMAGE)))
        assert status == 400
        assert "image_url" in body["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            handle.client().chat.completions.create(
                model=handle.client().models.list().data[0].id,
                messages=image_message(data_url(IMAGE)),
                max_tokens=2,
            )
    finally:
        handle.close()
