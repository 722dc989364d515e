"""End to end on the Triton kernels (the interpreter on a CPU), the experts through
kernels/fused_moe.fused_experts_triton: Mixtral's greedy tokens equal transformers', with a
chunked prefill and batched decode."""

from __future__ import annotations

import random

import pytest
import torch

import nanoserve.kernels as kernels
import nanoserve.kernels.fused_moe as fused_moe
from nanoserve import LLM, SamplingParams

pytest.importorskip("transformers", reason="the checkpoints are written with transformers")

from tests.engine.hf_oracle import hf_greedy  # noqa: E402
from tests.models.moe_checkpoints import write_moe_checkpoint  # noqa: E402
from tests.models.test_families import load_hf  # noqa: E402

NUM_TOKENS = 4


def test_mixtral_on_triton_kernels_matches_transformers(tmp_path, monkeypatch):
    model_dir = write_moe_checkpoint(tmp_path / "mixtral", "mixtral")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 40)]
    expected = [hf_greedy(load_hf(model_dir), prompt, NUM_TOKENS) for prompt in prompts]
    launches = []
    real = fused_moe.fused_experts_triton
    monkeypatch.setattr(
        fused_moe, "fused_experts_triton", lambda *a, **k: launches.append(1) or real(*a, **k)
    )
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    try:
        llm = LLM(
            model=str(model_dir), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=32
        )
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.reset_kernel_choice()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert launches  # the experts ran on the Triton kernel


def _greedy_under(choice: str, path, monkeypatch):
    """(the LLM, greedy tokens and their logprobs) with NANOSERVE_KERNELS=`choice` from load on."""
    monkeypatch.setenv("NANOSERVE_KERNELS", choice)
    kernels.reset_kernel_choice()
    try:
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=32)
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
        prompts = [{"prompt_token_ids": p} for p in ([5, 9, 17, 33, 2], list(range(40, 61)))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.reset_kernel_choice()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    return llm, tokens, logprobs


def test_gguf_moe_experts_stay_in_their_blocks_for_the_triton_kernel(tmp_path, monkeypatch):
    """A Mixtral GGUF file (Q4_0 experts, top-2) loaded for the Triton kernels (as on CUDA; the
    interpreter here): each layer's gate/up and down experts held as the file's blocks
    (ExpertBlocks, no float copy), their bytes the file's expert tensors' bytes, and the tokens
    and logprobs of the reference path (the loop over the same experts dequantized)."""
    import gguf

    from nanoserve.layers.fused_moe import FusedMoE
    from tests.gguf_models import write_moe_gguf

    path = write_moe_gguf(tmp_path, "mixtral", "q4_0", seed=3)
    launches = []
    real = fused_moe.fused_experts_triton
    monkeypatch.setattr(
        fused_moe, "fused_experts_triton", lambda *a, **k: launches.append(1) or real(*a, **k)
    )
    llm, tokens, logprobs = _greedy_under("triton", path, monkeypatch)
    assert launches
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers
    for moe in layers:
        weights = moe.expert_weights
        assert weights.held_form("w13") == weights.held_form("w2") == "blocks"
        assert moe.w13_weight.is_meta and moe.w2_weight.is_meta
        assert weights.cpu_table is None
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps." in t.name)
    assert sum(moe.kernel_bytes() for moe in layers) == file_bytes
    # The reference's linear layers as the Triton GEMM computes them (fp32, no int8 activations:
    # kernels/quant_triton.py; the CPU kernel's int8 rounding is not the arithmetic compared here).
    from nanoserve.kernels import quant

    def exact(x, w, bias):
        out = x.float() @ quant.dequantize_weight(w).T
        return (out if bias is None else out + bias.float()).to(x.dtype)

    monkeypatch.setattr(quant, "pack_for_cpu", lambda weight: None)
    monkeypatch.setattr(quant, "reference_gemm", exact)
    _, ref_tokens, ref_logprobs = _greedy_under("reference", path, monkeypatch)
    assert tokens == ref_tokens
    for ours, theirs in zip(logprobs, ref_logprobs):
        assert all(abs(a - b) < 1e-3 for a, b in zip(ours, theirs))


def test_mxfp4_experts_stay_in_blocks_for_the_triton_kernel(tmp_path, monkeypatch):
    """Loaded for the Triton kernels (as on CUDA; the interpreter here), each layer's experts are
    one ExpertBlocks a matrix holding the checkpoint's own bytes (codes as nibbles, an E8M0 byte
    per 32) and exactly transformers' dequantized values; the logprobs are transformers' on them
    (no activation rounding on this path)."""
    from safetensors.torch import load_file

    from nanoserve.models.gpt_oss import deinterleave
    from tests.helpers import random_prompts
    from tests.models.test_mxfp4 import _prompt_logprobs, write_mxfp4_checkpoint

    pytest.importorskip("transformers.integrations.mxfp4")
    _, quant_dir, oracle_dir = write_mxfp4_checkpoint(tmp_path)
    oracle = load_hf(oracle_dir)
    stored = load_file(quant_dir / "model.safetensors")
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    try:
        llm = LLM(
            model=str(quant_dir), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=16
        )
        prompt = random_prompts(1, oracle.config.vocab_size, seed=23, min_len=12, max_len=12)[0]
        got = _prompt_logprobs(llm, prompt)
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.reset_kernel_choice()
    for index, layer in enumerate(llm.llm_engine.runner.model.model.layers):
        experts, weights = layer.mlp.experts, layer.mlp.experts.expert_weights
        assert weights.held_form("w13") == weights.held_form("w2") == "blocks"
        assert experts.w13_weight.is_meta and experts.w2_weight.is_meta
        file_bytes = sum(
            t.numel() * t.element_size()
            for name, t in stored.items()
            if name.startswith(f"model.layers.{index}.") and name.endswith(("_blocks", "_scales"))
        )
        assert experts.kernel_bytes() == file_bytes
        theirs = oracle.model.layers[index].mlp.experts
        w13, w2 = (blocks.dequantized() for blocks in weights.operands())
        assert torch.equal(w13, deinterleave(theirs.gate_up_proj.detach()).transpose(1, 2))
        assert torch.equal(w2, theirs.down_proj.detach().transpose(1, 2))
    with torch.inference_mode():
        reference = oracle(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for position in range(1, len(prompt)):
        token = prompt[position]
        assert abs(got[position][token].logprob - float(reference[position - 1, token])) < 1e-3
