"""Content checks with the real SmolLM2-135M-Instruct behind the server."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerHandle


@pytest.fixture(scope="module")
def smol_server(smollm2_dir):
    handle = ServerHandle(smollm2_dir, engine_kwargs={"dtype": "float32"})
    yield handle
    handle.close()


def test_chat_answers_and_streams_the_same_text(smol_server):
    client = smol_server.client()
    model = smol_server.engine.served_model_name
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    answer = result.choices[0].message.content
    assert "Paris" in answer
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens


def test_completion_stop_string_and_generation_defaults(smol_server):
    client = smol_server.client()
    model = smol_server.engine.served_model_name
    result = client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"]
    )
    text = result.choices[0].text
    assert text.startswith(" 5, 6,") and " 7" not in text
    assert result.choices[0].finish_reason == "stop" and result.choices[0].stop_reason == " 7"
