"""Issue 19's promises on quantized GGUF models (and compressed-tensors and GPTQ checkpoints, on the same kernels): a prompt's greedy tokens and their logprob bits do
not depend on how its prompt was computed (cold, fully or partly from the prefix cache, chunked
at odd boundaries) nor on the other requests in its batch. The quantized GEMMs
(kernels/quant.py) sum each output in one order whatever the rows, as the bf16 GEMM does; with
the torch reference instead, prompt rows are padded into fixed tiles (as for oneDNN) and decode
rows are one GEMM of the batch's size, so the batch test needs the CPU kernels."""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.linear import LinearBase
from tests.gguf_models import write_quantized_gguf

NUM_TOKENS = 16
GREEDY_WITH_LOGPROB = SamplingParams(
    temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0
)
PROMPT_LENGTHS = {"long": 300, "short": 40}
SMOLLM2_SHAPE = dict(
    hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536, num_layers=2
)


@pytest.fixture(
    scope="module",
    params=[
        "q4_1",
        "q4_k_m",
        "llama_cpp_q4_k_m",
        "llama_cpp_q5_k_m",
        "compressed-tensors-w8a8",
        "gptq-4bit-g128",
        "fp8-block128",
    ],
)
def gguf_file(request, tmp_path_factory):
    """A GGUF file, or a compressed-tensors checkpoint (the same kernels, models/compressed_tensors.py).
    q4_k_m: Q4_K in every layer needs inputs in blocks of 256. llama_cpp_q4_k_m on SmolLM2's
    shapes is what llama.cpp's quantizer writes for it: Q5_0 but for ffn_down (Q4_K, Q6_K) and
    layer 1's V (Q8_0); its Q5_K_M: Q5_1 but for ffn_down (Q5_K, Q6_K) and layer 1's V."""
    if request.param.startswith("compressed-tensors"):
        ct_models = pytest.importorskip("tests.compressed_tensors_models")
        pytest.importorskip("compressed_tensors")
        return ct_models.write_compressed_llama(
            tmp_path_factory.mktemp("ct"), "w8a8-channel", seed=19, **SMOLLM2_SHAPE
        )
    if request.param.startswith("gptq"):  # symmetric int4: the Q4_0 kernel format
        from tests.gptq_awq_models import write_quantized_llama

        return write_quantized_llama(
            tmp_path_factory.mktemp("gptq"), request.param, seed=19, **SMOLLM2_SHAPE
        )
    if request.param.startswith("fp8"):  # FP8 weights: kernels/cpu/gemm_fp8.cpp
        from tests.fp8_models import write_fp8_llama

        return write_fp8_llama(
            tmp_path_factory.mktemp("fp8"), request.param, seed=19, **SMOLLM2_SHAPE
        )
    shape = {} if request.param == "q4_k_m" else SMOLLM2_SHAPE
    return write_quantized_gguf(
        tmp_path_factory.mktemp(request.param), request.param, seed=19, **shape
    )


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(19)
    return {
        name: [rng.randrange(3, 250) for _ in range(length)]
        for name, length in PROMPT_LENGTHS.items()
    }


def build(path, *, caching: bool, budget: int = 2048) -> LLM:
    return LLM(
        model=str(path),
        dtype="bfloat16",
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        num_kv_blocks=256,
        block_size=16,
        device="cpu",
    )


def run(llm: LLM, prompt: list[int]):
    completion = llm.generate([{"prompt_token_ids": prompt}], GREEDY_WITH_LOGPROB, use_tqdm=False)[
        0
    ].outputs[0]
    logprobs = [
        step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)
    ]
    return list(completion.token_ids), logprobs


@pytest.fixture(scope="module")
def cold(gguf_file, prompts):
    llm = build(gguf_file, caching=False)
    return {name: run(llm, prompt) for name, prompt in prompts.items()}


def test_cached_and_chunked_prompts_same_as_cold(gguf_file, prompts, cold):
    llm = build(gguf_file, caching=True)
    for name, prompt in prompts.items():
        run(llm, prompt[: len(prompt) - 7] + [5, 6, 7])  # a donor sharing all but the last 7 tokens
        assert run(llm, prompt) == cold[name], f"{name}: partly cached"
        assert run(llm, prompt) == cold[name], f"{name}: fully cached"
    for budget in (16, 39, 299):
        llm = build(gguf_file, caching=False, budget=budget)
        for name, prompt in prompts.items():
            assert run(llm, prompt) == cold[name], f"{name}: chunked by {budget}"


def test_decode_rows_do_not_depend_on_the_batch(gguf_file, prompts, cold):
    llm = build(gguf_file, caching=False)
    model = llm.llm_engine.runner.model
    weights = [
        w
        for m in model.modules()
        if isinstance(m, (LinearBase, ParallelLMHead)) and m.weight_form.quantized
        for w in m.weight_form.parts
    ]
    if any(w.packed is None for w in weights):
        pytest.skip(
            "the CPU quantized kernels don't take these layers here: decode rows are one torch "
            "GEMM of the batch's size"
        )
    rng = random.Random(7)
    fillers = [
        {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randrange(5, 120))]}
        for _ in range(24)
    ]
    filler_params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(1, 2 * NUM_TOKENS), ignore_eos=True)
        for _ in fillers
    ]
    batch = [{"prompt_token_ids": p} for p in prompts.values()] + fillers
    outputs = llm.generate(
        batch, [GREEDY_WITH_LOGPROB] * len(prompts) + filler_params, use_tqdm=False
    )
    for name, output in zip(prompts, outputs):
        completion = output.outputs[0]
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)
        ]
        assert (list(completion.token_ids), logprobs) == cold[name], (
            f"{name} among {len(batch) - 1} others"
        )
