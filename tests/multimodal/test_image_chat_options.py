"""Chat options with an image on a real server, against transformers (fp32, greedy): `n > 1`
with `logprobs` (each token's logprob equal to transformers' log-softmax), streamed through the
`openai` client; an image sent to a text-only model is a 400 naming the part."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.multimodal.llava_checkpoint import transformers_processor
from tests.multimodal.test_images_api import IMAGE, image_message, llava_server  # noqa: F401
from tests.multimodal.test_llava import MAX_TOKENS, hf_greedy
from tests.multimodal.test_preprocessing import data_url
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

QUESTION = "Describe it."


@pytest.fixture(scope="module")
def oracle(llava_dir):
    """transformers' greedy tokens for the image message, and each one's log-probability."""
    import transformers as hf

    model = hf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    model.eval()
    processor = transformers_processor(llava_dir)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
    )
    tokens = hf_greedy(model, processor, text, [IMAGE])
    inputs = processor(text=text, images=[IMAGE], return_tensors="pt")
    num_prompt = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=inputs["pixel_values"],
        ).logits[0]
    logprobs = torch.log_softmax(logits[num_prompt - 1 : -1], dim=-1)
    chosen = [logprobs[i, token].item() for i, token in enumerate(tokens)]
    return processor.tokenizer, tokens, chosen


def test_n_and_logprobs_with_an_image(llava_server, oracle):  # noqa: F811
    tokenizer, tokens, chosen = oracle
    client = llava_server.client()
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=image_message(data_url(IMAGE), QUESTION),
        temperature=0,
        max_tokens=MAX_TOKENS,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(response.choices) == 2
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    for choice in response.choices:
        assert choice.message.content == expected
        entries = choice.logprobs.content
        # the end-of-sequence token, when reached, is scored but not in the text
        assert len(entries) == len(tokens)
        got = [entry.logprob for entry in entries]
        assert got == pytest.approx(chosen, abs=1e-4)
        for entry in entries:  # greedy: the chosen token is the most likely
            assert entry.top_logprobs[0].logprob == entry.logprob
            assert entry.top_logprobs[1].logprob <= entry.logprob


def test_streamed_n_with_an_image(llava_server, oracle):  # noqa: F811
    tokenizer, tokens, _ = oracle
    client = llava_server.client()
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=image_message(data_url(IMAGE), QUESTION),
        temperature=0,
        max_tokens=MAX_TOKENS,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    assert texts == {0: expected, 1: expected}
    assert chunks[-1].usage.completion_tokens == 2 * len(tokens)


def test_text_only_model_names_the_image_part(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 32})
    try:
        messages = image_message(data_url(IMAGE))
        body = json.dumps({"messages": messages, "max_tokens": 2})
        status, _, raw = http_request(handle.port, "POST", "/v1/chat/completions", body)
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == 400
        assert error["param"] == "messages[0].content[0]"
        assert "image_url" in error["message"]
        with pytest.raises(openai.BadRequestError):
            handle.client().chat.completions.create(
                model=handle.client().models.list().data[0].id, messages=messages, max_tokens=2
            )
    finally:
        handle.close()


def test_an_image_pil_part_over_http_is_a_400_naming_it(llava_server):  # noqa: F811
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": "cat.png"}]}]
    body = json.dumps({"messages": messages, "max_tokens": 2})
    status, _, raw = http_request(llava_server.port, "POST", "/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert status == 400
    assert error["param"] == "messages[0].content[0].image_pil"
    assert "PIL image" in error["message"]
