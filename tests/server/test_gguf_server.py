"""`nanoserve serve --model FILE.gguf`: the default model's own Q4_1 file served as it is (its
blocks, its tokenizer and chat template from the metadata), answered over HTTP to the openai
client."""
from __future__ import annotations

import signal

import pytest

from tests.server.test_cli_server import start

openai = pytest.importorskip("openai")


def test_serve_the_gguf_file_and_chat(smollm2_gguf):
    process, port = start(smollm2_gguf, "--max-model-len", "512", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        [model] = [m.id for m in client.models.list().data]
        assert model == str(smollm2_gguf)  # vLLM names a model by its --model argument
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        result = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert "Paris" in result.choices[0].message.content
        assert result.usage.prompt_tokens > 10  # the chat template from the file's metadata was applied
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
