"""The engine on the real SmolLM2-135M-Instruct (imported from its GGUF) against transformers."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy, load_hf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=1024, max_model_len=2048)


def test_chat_answers_paris(llm):
    params = SamplingParams(temperature=0, max_tokens=32)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_greedy_matches_transformers_float32(llm, smollm2_dir):
    hf = load_hf(smollm2_dir)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert output.outputs[0].token_ids == hf_greedy(hf, output.prompt_token_ids, 32), prompt
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids)


def test_alone_equals_inside_batch_of_64(llm):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS) % 2) for i in range(64)]
    batched = llm.generate(batch, params, use_tqdm=False)
    for i in range(len(PROMPTS)):
        alone = llm.generate([batch[i]], params, use_tqdm=False)[0]
        assert batched[i].outputs[0].token_ids == alone.outputs[0].token_ids
    for i, output in enumerate(batched):
        assert output.prompt == batch[i] and len(output.outputs[0].token_ids) == 32
