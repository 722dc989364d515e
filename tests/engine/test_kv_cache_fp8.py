"""--kv-cache-dtype fp8 / fp8_e5m2 through the engine on the CPU: twice the blocks in the same
memory; the C++ path (fused decode step, prompt kernels) against the torch reference path in fp32,
where both follow kernels/kv_dtype.py's rule; the fused decode step against the modules' path bit
for bit; the same answer however a prompt was computed (prefix cache, chunked prefill) and with
swap preemption; the flag from the command line, and a value we don't have refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.choice import reset_kernel_choice
from nanoserve.kernels.cpu import ops as cpu_ops
from tests.conftest import write_random_llama
from tests.engine.test_cpu_decode import generate as generate_fused_or_modules
from tests.test_cli import run_cli

FP8 = ["fp8", "fp8_e5m2"]
SHAPE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, num_layers=2)
NUM_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("kv-fp8-llama"), seed=8, **SHAPE)


def prompts_for(llm: LLM, lengths=(5, 40, 90, 17, 130), seed=3) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def answers(llm: LLM, prompts, params=GREEDY):
    """(token ids, each sampled token's logprob) per prompt."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (c.token_ids, [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
        for c in (o.outputs[0] for o in outputs)
    ]


@pytest.mark.parametrize("kv", FP8)
def test_fp8_pool_holds_twice_the_blocks_in_the_same_memory(model_dir, kv):
    common = dict(model=str(model_dir), dtype="bfloat16", kv_cache_memory=0.01, device="cpu")
    bf16 = LLM(**common).llm_engine
    fp8 = LLM(kv_cache_dtype=kv, **common).llm_engine
    expected = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    assert fp8.runner.kv_dtype == expected
    assert all(
        layer.self_attn.attn.key_cache.dtype == expected for layer in fp8.runner.model.model.layers
    )
    assert fp8.block_managers[0].num_blocks == 2 * bf16.block_managers[0].num_blocks


@pytest.mark.parametrize("kv", FP8)
def test_kernels_match_the_torch_reference_path_in_fp32(model_dir, kv, monkeypatch):
    """fp32 activations: the C++ kernels (rotary + fp8 store, decode and prompt attention over
    widened chunks) and the torch references (to_cache, then attention on the values read back)
    store the same bytes from nearly the same K/V, so greedy tokens agree and logprobs are close."""
    llm = LLM(
        model=str(model_dir), dtype="float32", kv_cache_dtype=kv, num_kv_blocks=128, device="cpu"
    )
    prompts = prompts_for(llm)
    kernels = answers(llm, prompts)
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    reset_kernel_choice()
    try:
        reference = answers(
            LLM(
                model=str(model_dir),
                dtype="float32",
                kv_cache_dtype=kv,
                num_kv_blocks=128,
                device="cpu",
            ),
            prompts,
        )
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        reset_kernel_choice()
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(kernels, reference):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-3)


@pytest.mark.skipif(
    not cpu_ops.gemm_available(), reason="the fused decode path needs the CPU kernels"
)
@pytest.mark.parametrize("kv", FP8)
def test_fused_decode_over_fp8_gives_the_modules_bits(model_dir, kv, cpu_isa):
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        kv_cache_dtype=kv,
        max_num_batched_tokens=64,
        num_kv_blocks=128,
        device="cpu",
    )
    assert llm.llm_engine.runner.fused_decode is not None
    fused, calls = generate_fused_or_modules(llm, fused=True)
    modules, _ = generate_fused_or_modules(llm, fused=False)
    assert sum(calls) >= 10 and not all(calls)
    assert fused == modules


@pytest.mark.parametrize("kv", FP8)
def test_same_answer_cold_cached_and_chunked(model_dir, kv, cpu_isa):
    """A prompt computed whole with prefix caching off, then again after a donor prompt shared a
    mid-block prefix, and split by a small chunked-prefill budget: the same tokens and logprobs."""

    def build(caching: bool, budget: int = 2048) -> LLM:
        return LLM(
            model=str(model_dir),
            dtype="bfloat16",
            kv_cache_dtype=kv,
            enable_prefix_caching=caching,
            max_num_batched_tokens=budget,
            num_kv_blocks=256,
            device="cpu",
        )

    cold_llm = build(caching=False)
    prompt = prompts_for(cold_llm, lengths=(150,), seed=9)[0]
    cold = answers(cold_llm, [prompt])
    cached_llm = build(caching=True)
    donor = prompt[:100] + [prompt[100] + 1 if prompt[100] > 3 else 4] + prompt[101:120]
    answers(cached_llm, [donor])
    output = cached_llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert output.num_cached_tokens == 96  # the donor's six whole blocks
    assert answers(cached_llm, [prompt]) == cold  # now the whole prompt's blocks but the last
    cached = output.outputs[0]
    assert (
        cached.token_ids,
        [s[t].logprob for s, t in zip(cached.logprobs, cached.token_ids)],
    ) == cold[0]
    assert answers(build(caching=False, budget=39), [prompt]) == cold


@pytest.mark.parametrize("kv", FP8)
def test_swap_preemption_over_fp8(model_dir, kv):
    roomy = LLM(
        model=str(model_dir),
        dtype="float32",
        kv_cache_dtype=kv,
        num_kv_blocks=512,
        max_num_batched_tokens=256,
        device="cpu",
    )
    small = LLM(
        model=str(model_dir),
        dtype="float32",
        kv_cache_dtype=kv,
        num_kv_blocks=48,
        max_num_batched_tokens=256,
        preemption_mode="swap",
        num_swap_blocks=256,
        device="cpu",
    )
    prompts = prompts_for(roomy, lengths=[20 + (7 * i) % 21 for i in range(40)], seed=4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    got = [
        o.outputs[0].token_ids
        for o in small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert got == expected
    assert small.llm_engine.runner.swapper.blocks_swapped_out > 0


def test_the_flag_on_the_command_line(model_dir):
    result = run_cli(
        "generate",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "fp8",
        "--max-tokens",
        "8",
        "Hello",
    )
    assert result.returncode == 0, result.stderr
    result = run_cli("serve", "--kv-cache-dtype", "int8")
    assert result.returncode == 2
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"
    ):
        LLM(model=str(model_dir), kv_cache_dtype="fp4")


def test_served_with_an_fp8_pool_as_offline(model_dir):
    """`nanoserve serve --kv-cache-dtype fp8_e5m2` over real sockets with the openai client: the
    tokens the offline engine on the same pool gives."""
    import openai

    from tests.server.test_cli_server import start

    prompt = "The quick brown fox"
    offline = LLM(
        model=str(model_dir), dtype="float32", kv_cache_dtype="fp8_e5m2", device="cpu"
    ).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    process, port = start(model_dir, "--dtype", "float32", "--kv-cache-dtype", "fp8_e5m2")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        served = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert served.choices[0].text == offline.outputs[0].text
        assert served.usage.completion_tokens == 12
    finally:
        process.terminate()
        process.wait(timeout=60)
