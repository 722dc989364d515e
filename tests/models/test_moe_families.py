"""Mixtral, Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE (top-8 of 8), OLMoE and gpt-oss
(expert biases, clamped SwiGLU, attention sinks, sliding windows, YaRN) against
transformers in fp32: greedy tokens equal and prompt logprobs close, alone and batched, with
chunked prefill and with the prefix cache; prompts whose tokens crowd onto some experts and
leave others without a token. In bf16 on the CPU's GEMM a prompt's tokens do not depend on its
batch, and the fused CPU decode step leaves MoE models to the modules."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.models.config import ModelConfig
from tests.engine.hf_oracle import hf_greedy
from tests.helpers import random_prompts
from tests.models.moe_checkpoints import MOE_FAMILIES, NUM_EXPERTS, write_moe_checkpoint
from tests.models.test_families import load_hf

NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def generate_ids(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe_dir(request, tmp_path_factory):
    return request.param, write_moe_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param
    )


def expert_loads(hf_model, prompt) -> list[torch.Tensor]:
    """Per sparse layer, how many of the prompt's tokens transformers routes to each expert."""
    with torch.inference_mode():
        out = hf_model(input_ids=torch.tensor([prompt]), output_router_logits=True)
    top_k = hf_model.config.num_experts_per_tok
    return [
        torch.bincount(logits.topk(top_k, dim=-1).indices.reshape(-1), minlength=NUM_EXPERTS)
        for logits in out.router_logits
        if logits is not None
    ]


def test_greedy_matches_transformers(moe_dir):
    family, model_dir = moe_dir
    hf_model = load_hf(model_dir)
    vocab = hf_model.config.vocab_size
    prompts = random_prompts(2, vocab, seed=5, min_len=4, max_len=12)
    prompts += random_prompts(2, vocab, seed=6, min_len=40, max_len=70)
    loads = expert_loads(hf_model, prompts[0])
    assert all(load.max() >= 2 for load in loads)  # tokens that share an expert
    if MOE_FAMILIES[family] < NUM_EXPERTS:
        assert all(
            (load == 0).any() for load in expert_loads(hf_model, prompts[0][:2])
        )  # idle experts
    expected = [hf_greedy(hf_model, prompt, NUM_TOKENS) for prompt in prompts]
    # max_num_batched_tokens=32: the long prompts are prefilled in chunks.
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    assert generate_ids(llm, prompts) == expected, family
    # Again, one at a time: the prompts' blocks now come from the prefix cache.
    block_manager = llm.llm_engine.schedulers[0].block_manager
    hits_before = block_manager.prefix_cache_hits
    for prompt, tokens in zip(prompts[2:], expected[2:]):
        assert generate_ids(llm, [prompt]) == [tokens]
    assert block_manager.prefix_cache_hits >= hits_before + 32


def test_prompt_logprobs_close_to_transformers(moe_dir):
    family, model_dir = moe_dir
    hf_model = load_hf(model_dir)
    prompt = random_prompts(1, hf_model.config.vocab_size, seed=9, min_len=30, max_len=30)[0]
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs
    with torch.inference_mode():
        reference = hf_model(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for position in range(1, len(prompt)):
        top = reference[position - 1].topk(3)
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(got[position][token].logprob - value) < 1e-3, (family, position)


def test_config_reads_each_family(moe_dir):
    family, model_dir = moe_dir
    moe = ModelConfig.from_dir(model_dir).moe
    assert (moe.num_experts, moe.top_k) == (NUM_EXPERTS, MOE_FAMILIES[family])
    assert moe.renormalize == (family in ("mixtral", "qwen3_moe", "gpt_oss"))
    assert moe.shared_expert_intermediate_size == (48 if family == "qwen2_moe" else 0)
    assert [moe.is_sparse(i) for i in range(2)] == (
        [True, False] if family == "qwen2_moe" else [True, True]
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_bf16_tokens_do_not_depend_on_the_batch_and_decode_is_not_fused(family, tmp_path):
    model_dir = write_moe_checkpoint(tmp_path / family, family)
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.runner
    assert runner.fused_decode is None  # models/cpu_decode.py takes Llama's layers only
    experts = [layer.mlp.experts for layer in runner.model.model.layers]
    if cpu_ops.available():  # every expert on kernels/cpu/gemm*.cpp: prompt rows need no padding
        assert (
            all(e.expert_weights.operands() != (None, None) for e in experts)
            and not runner.pad_prompt_rows
        )
    prompts = random_prompts(4, 300, seed=12, min_len=5, max_len=40)
    batched = generate_ids(llm, prompts)
    assert [generate_ids(llm, [p])[0] for p in prompts] == batched


def test_gpt_oss_config_as_openai_writes_it(tmp_path):
    """OpenAI's gpt-oss config.json: experts_per_token beside (or instead of) num_experts_per_tok,
    no swiglu_alpha, a top-level rope_theta with a yarn rope_scaling."""
    import json

    raw = {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "experts_per_token": 4,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_dir(tmp_path)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.renormalize) == (8, 4, True)
    assert (config.moe.swiglu_alpha, config.moe.swiglu_limit) == (1.702, 7.0)
    assert config.rope_theta == 150000 and config.rope_scaling["rope_type"] == "yarn"
    assert [config.layer_window(i) for i in range(2)] == [128, None]


def test_bad_moe_config_is_one_line(tmp_path):
    import json

    raw = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 5,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_experts_per_tok in 1..num_experts") as error:
        ModelConfig.from_dir(tmp_path)
    assert "\n" not in str(error.value)


def test_reference_kernels_run_the_loop_over_experts(tmp_path, monkeypatch):
    """NANOSERVE_KERNELS=reference: every kernel, the experts too, on the torch references."""
    import nanoserve.kernels as kernels
    import nanoserve.kernels.fused_moe as fused_moe

    model_dir = write_moe_checkpoint(tmp_path / "olmoe", "olmoe")
    prompts = random_prompts(2, 300, seed=14, min_len=5, max_len=20)
    expected = [hf_greedy(load_hf(model_dir), prompt, NUM_TOKENS) for prompt in prompts]
    calls = []
    real = fused_moe.fused_experts_reference
    monkeypatch.setattr(
        fused_moe, "fused_experts_reference", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.setattr(fused_moe, "fused_experts_grouped", None)  # must not be reached
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    kernels.reset_kernel_choice()
    try:
        llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=32)
        assert generate_ids(llm, prompts) == expected
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.reset_kernel_choice()
    assert calls
