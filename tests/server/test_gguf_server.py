"""`nanoserve serve --model FILE.gguf`: the default model's own Q4_1 file served as it is (its
blocks, its tokenizer and chat template from the metadata), answering the openai client."""

from __future__ import annotations

import signal

import pytest

from nanoserve.tokenizer import Tokenizer
from tests.server.test_cli_server import start

openai = pytest.importorskip("openai")


def test_serve_the_gguf_file(smollm2_gguf, smollm2_dir):
    process, port = start(smollm2_gguf, "--max-model-len", "512", "--dtype", "float32")
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300
        )
        [model] = [m.id for m in client.models.list().data]
        assert model == str(smollm2_gguf)  # vLLM names a model by its --model argument
        result = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=6, temperature=0
        )
        assert result.choices[0].text.startswith(" Paris")
        # Chat: the template and tokenizer from the file's metadata, as the bf16 import has them.
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        imported = Tokenizer.from_pretrained(smollm2_dir)
        assert chat.usage.prompt_tokens == len(
            imported.encode(imported.apply_chat_template(messages))
        )
        assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
