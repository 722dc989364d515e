"""The input processor beside the engine (engine/input_processor.py): what add_request does
before a request reaches a scheduler, run without loading any weights: the engine's checks
with vLLM's messages, tokenizing, and the request's sequences."""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.input_processor import InputProcessor
from nanoserve.engine.startup import open_model
from nanoserve.errors import InvalidRequestError
from nanoserve.inputs import TokensPrompt
from nanoserve.lora.request import LoRARequest
from nanoserve.outputs import RequestOutputKind
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir) -> InputProcessor:
    config = EngineConfig(model=str(tiny_llama_dir), max_n_sequences=4, max_logprobs=-1)
    return InputProcessor(config, open_model(config), MAX_MODEL_LEN, torch.device("cpu"))


def test_a_text_prompt_is_tokenized_and_its_params_checked(inputs):
    text, token_ids, params, _ = inputs.generation_inputs(
        "hello world", SamplingParams(logprobs=-1)
    )
    assert text == "hello world" and token_ids == inputs.tokenizer.encode("hello world")
    assert params.logprobs == inputs.model_config.vocab_size  # -1: the whole vocabulary


def test_the_request_has_its_n_sequences(inputs):
    params = SamplingParams(n=3, seed=7, prompt_logprobs=1, max_tokens=4)
    lora = LoRARequest("adapter", 5, "/adapters/a")
    request = inputs.make_request(
        "r1", None, [1, 2, 3], params, 0, 12.5, RequestOutputKind.DELTA, lora, None
    )
    assert [seq.index for seq in request.seqs] == [0, 1, 2]
    assert len({seq.seq_id for seq in request.seqs}) == 3
    assert all(seq.lora_id == 5 and seq.generator is not None for seq in request.seqs)
    assert request.seqs[0].prompt_logprobs == [None] and request.seqs[1].prompt_logprobs is None
    assert request.metrics.arrival_time == 12.5 and request.lora_request is lora


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        (TokensPrompt(prompt_token_ids=[]), SamplingParams(), "the prompt is empty"),
        (TokensPrompt(prompt_token_ids=[10**6]), SamplingParams(), "out of vocabulary"),
        (TokensPrompt(prompt_token_ids=[1] * 40), SamplingParams(), "maximum context length"),
        (TokensPrompt(prompt_token_ids=[1] * 8), SamplingParams(max_tokens=30), "'max_tokens'"),
        (TokensPrompt(prompt_token_ids=[1]), SamplingParams(n=5), "max_n_sequences"),
        ("x" * 10**6, SamplingParams(), "characters of input"),
    ],
)
def test_refusals_carry_vllms_messages(inputs, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        inputs.generation_inputs(prompt, params)


def test_request_wide_checks(inputs):
    with pytest.raises(InvalidRequestError, match="Priority scheduling is not enabled"):
        inputs.check_request(SamplingParams(), 1, None)
    with pytest.raises(InvalidRequestError, match="generating models only"):
        inputs.check_request(PoolingParams(), 0, LoRARequest("a", 1, "/a"))
    with pytest.raises(InvalidRequestError, match="does not embed"):
        inputs.pooling_request("r2", "hello", PoolingParams(), 0, None)
    inputs.check_request(SamplingParams(), 0, None)  # a plain request passes
